"""The plan of one bucketed call (`Plan`, frozen): what it adds to the inputs, which the hooks and
`output.strip_output` read; and what the call learns as it runs (`CallRun`, the hooks write it).

`planning.plan_call` makes the plan from the call's decision (`decision.choose_side`).
"""

from dataclasses import dataclass, field
from typing import Any

from .settings import CallSettings


# Per-token model inputs that are padded along with the prompt, and their fill value. Position ids of masked
# positions are 0, as upstream fills them.
PER_TOKEN_KWARGS = {"attention_mask": 0, "position_ids": 0, "token_type_ids": 0, "mm_token_type_ids": 0}


@dataclass(frozen=True)
class RightPadding:
    """What only a right-padded call needs (`padding_side.py` chose the right): the `_prefill` hook pads its prompt."""

    bucket: int  # the length the prompt's new tokens are padded to, after their end
    past_length: int = 0  # the tokens the cache held before the call
    ragged: bool = False  # rows of different lengths, each padded after its own end


@dataclass
class CallRun:
    """What a bucketed call learns as it runs: written by the hooks, read by later hooks and by steps 6 to 8."""

    recompile_limit: int | None = None  # torch's limit once the call's graphs are accounted for
    expected_graphs: Any = None  # with a compiled forward: what the call expects to compile (`budget.CallGraphs`)
    static_cache_length: int | None = None  # slots of the call's static cache, once it is made
    # Whether upstream compiles the forward itself (`transformers_api.valid_auto_compile`), and whether the call's forwards are
    # compiled at all (that, or the user's compiled forward): decided once the cache is made (`None` until then).
    auto_compile: bool | None = None
    compiled: bool | None = None
    windowed_cache: Any = None  # the static cache whose full-attention layers read windows (`kvcache/windows.py`)
    reads_windows: bool = False  # whether its full-attention layers read windows (`windows.has_windows`)
    decoding: bool = False  # whether the last forward prepared was a decode step (`hooks._before_forward`)
    # How each layer of the call's static cache lays out the keys it reads (`kvcache.attention_keys.key_layouts`), for the
    # attentions `output.strip_output` returns; `None`: no static cache.
    key_layouts: tuple | None = None
    # The windows the call's decode steps (1-token forwards) read (`None`: a cache without windows), for the budget.
    decode_windows_read: set = field(default_factory=set)


@dataclass(frozen=True, eq=False)  # one call's plan: compared by identity
class Plan:
    """What one bucketed `generate` call does to its inputs, read by the hooks while the call runs."""

    model: Any
    settings: CallSettings
    prompt_length: int  # tokens in the prompt as the user passed it (their own padding included)
    # Tokens in the prompt upstream `generate` sees: the bucket on the left; on the right the prompt as passed (the
    # `_prefill` hook pads it to `right.bucket`).
    padded_length: int
    added_id_columns: int  # columns added to `input_ids` (0 when the prompt is only `inputs_embeds`, or on the right)
    batch_size: int = 1  # prompts the user passed
    padded_batch: int = 1  # prompts generated from, dummy rows of `prefill_batch_buckets` included
    rows: int = 1  # output rows the user gets: batch * max(num_beams, num_return_sequences)
    padded_rows: int = 1  # output rows generated, dummy rows of `prefill_batch_buckets` included
    right: RightPadding | None = None  # `None`: padded on the left (columns in front, masked)
    run: CallRun = field(default_factory=CallRun)  # what the call learns as it runs

    @property
    def side(self) -> str:
        """`"left"` or `"right"`, for messages and `GraphBudget`."""
        return "left" if self.right is None else "right"

    @property
    def prompt_slots(self) -> int:
        """The cache slots prefill fills: the padded prompt, or on the right the cached tokens plus the bucket."""
        return self.padded_length if self.right is None else self.right.past_length + self.right.bucket

    @property
    def added_positions(self) -> int:
        """Positions added in front of the sequence the model sees."""
        return self.padded_length - self.prompt_length

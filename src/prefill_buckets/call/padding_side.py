"""Which side a call's bucket padding goes: the one rule (`RULE`, `rule_side`), from the call's settings and arguments.

Right padding puts the pad tokens after the prompt: prefill runs the prompt with no attention mask (causal SDPA, as
upstream runs an unpadded prompt), the first new token comes from the logits at the prompt's last position, and
decode starts at the prompt's length, overwriting the pad slots of the static cache one by one (the causal mask hides
those not yet written). Rows of different lengths (a batch the tokenizer padded on the left) are padded each after its
own end, and decode masks each row's pad slots (`prefill_right.py`). That is exact only where every layer can forget
the pads and each row's positions follow its tokens. Where it is not, the call is left-padded (masked), as before.

The rule is data: `RULE`, its cases in the order they are checked, the first that applies deciding. This table is
made from it (`rule_table`), and the docs' What runs exactly page (`reference.md`) shows the same one (a test
checks it):

{rule_table}

With `"auto"` (the default) the rule picks; an explicit `"right"` where the rule says left logs the reason, once, and
pads on the left: never silently wrong.

The rule is one part of the call's one decision (`decision.choose_side`): before it, the calls padding can't serve on
either side; after it, what left padding needs besides (a model that can take it, `side_assumptions.SIDE_ASSUMPTIONS`,
and room in the cache). Where neither side is exact the call runs unpadded, exact, and the package logs why, once.
"""

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch

from ..config import PREFILL_PADDING_SIDE
from ..upstream import candidates, transformers_api
from ..upstream.transformers_api import forward_takes
from .resolved import CallSettings
from .side_assumptions import (
    cache_has_sliding_layers,
    cache_layers_reason,
    peft_row_arguments,
    side_assumption_broken,
)


# Model inputs the right-padded prefill knows: the prompt, its all-ones mask, and the cache.
_RIGHT_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "cache", "past_key_values")


@dataclass(frozen=True)
class PaddingSide:
    """How one call is padded, and why (`decision.choose_side`)."""

    side: str  # "left", "right", or "unpadded" (the call runs upstream's unpadded path, exact)
    reason: str
    bucket: int | None = None  # right: the bucket of the new tokens (the prompt, less what the cache holds)
    past_length: int = 0  # right: the tokens the cache already holds
    padded_length: int | None = None  # left: the length the prompt is padded to in front
    padded_batch: int | None = None  # the rows the batch is padded to with dummy rows (`prefill_batch_buckets`)
    finished_rows_pad_id: int | None = None  # the id rows that finish early are fed, when not `pad_token_id`


def rule_side(call: "RuleFacts") -> PaddingSide:
    """The side of the first case of `RULE` that applies to the call (see the module docstring for the rule)."""
    case = next(case for case in RULE if case.condition is None or case.condition(call))
    reason = case.reason.format(call=call)
    if case.side == "right":
        return PaddingSide("right", reason, bucket=call.bucket, past_length=call.past_length)
    return PaddingSide(case.side, reason)


class RuleFacts:
    """
    What the rule reads of one call (a `ResolvedCall`), each derived fact read once, when a case first asks (so only
    after the cases before it did not apply).
    """

    def __init__(self, call):
        self.call = call
        self.model, self.settings, self.passed = call.model, call.settings, call.passed
        self.arguments, self.model_kwargs = call.arguments, call.model_kwargs
        self.cache, self.prompt, self.continued = call.cache, call.prompt, call.continued
        self.prompt_length, self.rows, self.past_length = call.prompt_length, call.rows, call.past_length

    @cached_property
    def other_inputs(self) -> list[str]:
        kwargs = self.model_kwargs
        return sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _RIGHT_INPUTS)

    @cached_property
    def bucket(self) -> int:
        """The bucket of the new tokens: the prompt, less what the cache holds."""
        return self.settings.policy.bucket(self.prompt_length - self.past_length)

    @cached_property
    def slots(self) -> int:
        """The cache slots the right-padded prompt fills: the cached tokens, then the bucket."""
        return self.past_length + self.bucket

    @cached_property
    def decodes_candidates(self) -> bool:
        """Assisted or prompt-lookup decoding: upstream checks candidates (`_assisted_decoding`), no prefill step."""
        return (
            self.arguments.get("assistant_model") is not None
            or self.settings.prompt_lookup_num_tokens is not None
            or self.settings.assistant_early_exit is not None
            or self.settings.use_mtp
        )

    @cached_property
    def drafter_padding_changes(self) -> str | None:
        """The drafter padding would change (`candidates.drafter_padding_changes`), in words, or `None`."""
        tokenizers = all(self.model_kwargs.get(name) is not None for name in ("tokenizer", "assistant_tokenizer"))
        return candidates.drafter_padding_changes(self.settings, self.arguments.get("assistant_model"), tokenizers)

    @cached_property
    def embeds_only(self) -> bool:
        """Whether the prompt is `inputs_embeds` alone: no ids, or ids of no tokens (then they hold only new tokens)."""
        input_ids = self.call.input_ids
        return self.call.inputs_embeds is not None and (input_ids is None or input_ids.shape[1] == 0)

    @cached_property
    def sliding_static_cache(self) -> bool:
        """Whether the call runs on a static cache (passed in, or for `generate` to make) with sliding-window layers."""
        if self.cache is not None and not transformers_api.is_static_cache(self.cache):
            return False
        if self.cache is None and transformers_api.is_dynamic(self.settings.cache_implementation):
            return False
        return cache_has_sliding_layers(self.model, self.cache, self.slots)

    @cached_property
    def peft_row_arguments(self) -> dict[str, bool]:
        """What PEFT passes the layers per row during this call (`side_assumptions.PEFT_ROW_ARGUMENTS`)."""
        return peft_row_arguments(self.model)

    @cached_property
    def peft_from_the_end(self) -> str | None:
        """The first of those that counts positions from each forward's end (aLoRA's `alora_offsets`), or `None`."""
        return next((name for name, from_the_end in self.peft_row_arguments.items() if from_the_end), None)

    @cached_property
    def model_name(self) -> str:
        return type(self.model).__name__

    @cached_property
    def attention(self) -> str | None:
        return transformers_api.attention_implementation(self.model.config)

    @cached_property
    def cache_slots(self) -> int:
        return transformers_api.static_cache_slots(self.cache)

    @cached_property
    def right_broken(self) -> str | None:
        return side_assumption_broken(self.model, "right")

    @cached_property
    def layers_reason(self) -> str | None:
        return cache_layers_reason(self.model, self.cache, self.slots)

    @cached_property
    def ragged_reason(self) -> str | None:
        return _ragged_reason(
            self.model, self.settings, self.model_kwargs, self.prompt, self.past_length, self.cache, self.slots
        )


@dataclass(frozen=True)
class Case:
    """One case of the rule: a call for which `condition` holds is padded on `side`, and says `reason`."""

    case: str  # when it applies, in words (the table's first column)
    side: str  # "left" or "right"
    why: str  # in words (the table's third column)
    # True when the case applies (read after the cases before it did not); `None` for the last case, which takes every
    # call the others leave.
    condition: Callable[["RuleFacts"], object] | None
    reason: str  # what the call says, with its figures: `reason.format(call=call)`


# The rule, in the order its cases are checked: the first that applies decides. The module docstring's table is made
# from it, and `tests/generation/test_padding_rule.py` checks the docs' page's.
RULE = (
    Case(
        f'`{PREFILL_PADDING_SIDE}="left"`',
        "left",
        "asked for",
        lambda call: call.settings.padding_side == "left",
        f"`{PREFILL_PADDING_SIDE}='left'`",
    ),
    Case(
        "a model that can't take right padding (`SIDE_ASSUMPTIONS`: not causal, ALiBi from the mask, Doge)",
        "left",
        "the pads after the prompt would reach its real tokens",
        lambda call: call.right_broken is not None,
        "{call.right_broken}",
    ),
    Case(
        "assisted decoding (`assistant_model`, `assistant_early_exit`, `use_mtp`) or prompt lookup",
        "left",
        "upstream runs the prompt with the first candidates, not through its prefill step",
        lambda call: call.decodes_candidates,
        "assisted and prompt-lookup decoding run the prompt together with the first candidates",
    ),
    Case(
        "chunked prefill (`prefill_chunk_size`)",
        "left",
        "a bucket is one forward; the chunk size bounds each forward",
        lambda call: call.settings.prefill_chunk_size is not None,
        "chunked prefill (`prefill_chunk_size`) bounds each forward's length, and a bucket is one forward",
    ),
    Case(
        "no cache (`use_cache=False`)",
        "left",
        "not compiled: there is no graph to share",
        lambda call: not call.settings.use_cache,
        "there is no cache (`use_cache=False`) to write the prompt into",
    ),
    Case(
        "`output_hidden_states`, `output_attentions`",
        "left",
        "per-position prefill outputs, which the left path strips",
        lambda call: call.settings.output_hidden_states or call.settings.output_attentions,
        "`output_hidden_states` and `output_attentions` return the prefill's per-position outputs",
    ),
    Case(
        "attention other than sdpa and eager (flash, flex)",
        "left",
        "with a static cache they need the 2D mask",
        lambda call: call.attention not in ("sdpa", "eager"),
        "`{call.attention}` attention needs the attention mask with a static cache (right: sdpa and eager)",
    ),
    Case(
        "a forward without `logits_to_keep`",
        "left",
        "it would compute logits for every pad position",
        lambda call: not forward_takes(call.model, "logits_to_keep"),
        "`{call.model_name}.forward` takes no `logits_to_keep`: it would compute every pad's logits",
    ),
    Case(
        "other per-token or multimodal inputs",
        "left",
        "not padded on the right",
        lambda call: call.other_inputs,
        "the input `{call.other_inputs[0]}` is not padded on the right",
    ),
    Case(
        "PEFT's activated LoRA (`alora_offsets`, which its hooks pass the layers)",
        "left",
        "the offsets count from each forward's last token",
        lambda call: call.peft_from_the_end is not None,
        "PEFT passes the layers `{call.peft_from_the_end}`, which count from each forward's last token: after the "
        "prompt, those would be pads",
    ),
    Case(
        "a prompt that is not a `[batch, length]` tensor",
        "left",
        "the left path raises the error",
        lambda call: call.prompt is not None and (call.prompt.ndim < 2 or call.prompt.shape[1] == 0),
        "the prompt is not a [batch, length] tensor",
    ),
    Case(
        "a dynamic cache (or an offloaded one, or `'hybrid'`, which it makes dynamic) for `generate` to make",
        "left",
        "not compiled: there is no graph to share",
        lambda call: call.cache is None and transformers_api.is_dynamic(call.settings.cache_implementation),
        "the cache is not a static cache (a dynamic cache is not compiled: no graph to share)",
    ),
    Case(
        "a cache passed in that is not a `StaticCache`",
        "left",
        "not compiled: there is no graph to share",
        lambda call: call.cache is not None and not transformers_api.is_static_cache(call.cache),
        "the cache passed in is a `{call.cache.__class__.__name__}`, not a `StaticCache`",
    ),
    Case(
        "a cache filled by a left-padded call, or with dummy rows (`prefill_batch_buckets`)",
        "left",
        "the prompt must line up with the padding in the cache, and the batch with its rows",
        lambda call: (
            call.cache is not None
            and call.continued is not None
            and (call.continued.columns > 0 or call.continued.padded_rows != call.rows)
        ),
        "the cache holds a left-padded call's tokens or dummy rows, and the prompt must line up with them",
    ),
    Case(
        "a cache filled by rows of different lengths",
        "left",
        "the prompt must line up with the padding in the cache (pass the first call's mask, then ones)",
        lambda call: call.cache is not None and call.past_length and call.passed.ragged_rows is not None,
        "the cache holds rows of different lengths, each at the start of its slots: a mask lines them up",
    ),
    Case(
        "`inputs_embeds` continuing from a cache",
        "left",
        "not padded on the right",
        lambda call: (
            call.cache is not None and call.past_length and call.model_kwargs.get("inputs_embeds") is not None
        ),
        "`inputs_embeds` continuing from a cache are not padded on the right",
    ),
    Case(
        "a cache that already holds the whole prompt",
        "left",
        "no new token to pad",
        lambda call: call.prompt_length - call.past_length < 1,
        "the cache already holds the whole prompt",
    ),
    Case(
        "pad positions past `max_position_embeddings`",
        "left",
        "the model has no such positions",
        lambda call: call.settings.max_positions is not None and call.slots > call.settings.max_positions,
        "the pad positions would pass `max_position_embeddings={call.settings.max_positions}`",
    ),
    Case(
        "recurrent or convolutional layers (Mamba, Jamba, LFM2), chunked attention, or a sliding window shorter than "
        "the cached tokens plus the bucket",
        "left",
        "the pads would run through their state; the ring buffer would keep pads and drop real tokens",
        lambda call: call.layers_reason is not None,
        "{call.layers_reason}",
    ),
    Case(
        "a `max_cache_len` shorter than the cached tokens plus the bucket",
        "left",
        "no room for the pads",
        lambda call: (
            call.cache is None and call.settings.max_cache_len is not None and call.settings.max_cache_len < call.slots
        ),
        "`max_cache_len={call.settings.max_cache_len}` is shorter than the {call.slots} slots the padded prompt fills",
    ),
    Case(
        "a cache passed in shorter than the cached tokens plus the bucket",
        "left",
        "no room for the pads",
        lambda call: call.cache is not None and call.cache_slots < call.slots,
        "the cache passed in has {call.cache_slots} slots, fewer than the {call.slots} needed",
    ),
    Case(
        "rows of different lengths padded on the right, with zeros between a row's tokens, an empty row, or a mask "
        "other than 0/1 `[batch, length]`; or with a sliding window, continuing from a cache, or a forward without "
        "`position_ids`",
        "left",
        "upstream reads a short right-padded row's first token at a pad position: only its mask reproduces that; the "
        "window counts slots, not positions; cached rows line up through the mask; positions must follow each row",
        lambda call: call.ragged_reason is not None,
        "{call.ragged_reason}",
    ),
    Case(
        "everything else: a static cache, attention layers, sdpa or eager attention, none of the cases above",
        "right",
        "exact",
        None,
        "exact",
    ),
)


def rule_table() -> str:
    """`RULE` as a markdown table, `| case | side | why |`, as the module docstring and the docs show it."""
    rows = [f"| {case.case} | {case.side} | {case.why} |" for case in RULE]
    return "\n".join(["| case | side | why |", "| --- | --- | --- |", *rows])


def _ragged_reason(
    model, settings: CallSettings, model_kwargs: dict, prompt, past_length: int, cache, slots: int
) -> str | None:
    """
    Why rows of different lengths (zeros in the attention mask, passed or inferred from pad tokens as upstream infers
    it) can't be right-padded each after its own end, or `None` when they can (or the rows are all one length).
    """
    mask = model_kwargs.get("attention_mask")
    if mask is None and isinstance(prompt, torch.Tensor) and prompt.dtype in (torch.long, torch.int):
        if settings.pad_token_is_inferable and bool((prompt == settings.pad_token_id).any()):
            mask = prompt.ne(settings.pad_token_id)  # upstream's inferred mask
    if not isinstance(mask, torch.Tensor) or bool(mask.all()):
        return None
    if mask.ndim != 2 or prompt is None or mask.shape != prompt.shape[:2]:
        return "the attention mask is not a [batch, length] mask of the prompt"
    if past_length:
        return "rows of different lengths continuing from a cache need the mask to line them up with the cached rows"
    if not bool(((mask == 0) | (mask == 1)).all()):
        return "the attention mask holds values other than 0 and 1"
    mask = mask.long()
    if not bool(mask.any(dim=-1).all()):
        return "a row of the batch has no token (its attention mask is all zeros)"
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):  # left padding: each row's zeros, then its ones
        if bool((mask[:, 1:] <= mask[:, :-1]).all()):
            return (
                "the batch is padded on the right: upstream reads a short row's first new token at a pad position, "
                "which only its mask reproduces (decoder-only batches are padded on the left)"
            )
        return "the attention mask has zeros between a row's tokens"
    if not forward_takes(model, "position_ids"):
        return f"`{type(model).__name__}.forward` takes no `position_ids`: each row's positions must follow its tokens"
    if cache_has_sliding_layers(model, cache, slots):
        return "a sliding window counts cache slots, and a short row's pads would sit after its tokens, not before"
    return None


__doc__ = __doc__.replace("{rule_table}", rule_table())

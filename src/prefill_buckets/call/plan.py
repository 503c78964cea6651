"""Step 4 of a bucketed call: the frozen `Plan` of what it adds to the inputs (`plan_call`), which the hooks and
`views.strip_output` read, and what the call learns as it runs (`CallRun`, the hooks write it).

On the left the prompt gets masked columns in front; on the right it goes on as passed, and the `_prefill` hook
(`prefill_right.py`) pads it after its end. Dummy rows pad the batch to its batch bucket, finished from the first step.
The user's dicts and tensors are never modified.
"""

from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils import logging

from ..config import PREFILL_BUCKETS
from .resolved import CallSettings, ResolvedCall, bos_prompt, inferred_mask
from .views import DummyRowsFinished, PromptStrippingStreamer


logger = logging.get_logger(__name__)

# Per-token model inputs that are padded along with the prompt, and their fill value. Position ids of masked
# positions are 0, as upstream fills them.
PER_TOKEN_KWARGS = {"attention_mask": 0, "position_ids": 0, "token_type_ids": 0, "mm_token_type_ids": 0}


@dataclass(frozen=True)
class PaddingSide:
    """How one call is padded, and why (`decision.choose_side`)."""

    side: str  # "left", "right", or "unpadded" (the call runs upstream's unpadded path, exact)
    reason: str
    bucket: int | None = None  # right: the bucket of the new tokens (the prompt, less what the cache holds)
    padded_length: int | None = None  # left: the length the prompt is padded to in front
    padded_batch: int | None = None  # the rows the batch is padded to with dummy rows (`prefill_batch_buckets`)
    finished_rows_pad_id: int | None = None  # the id rows that finish early are fed, when not `pad_token_id`


@dataclass(frozen=True)
class RightPadding:
    """What only a right-padded call needs (`decision.py` chose the right): the `_prefill` hook pads its prompt."""

    bucket: int  # the length the prompt's new tokens are padded to, after their end (each row's: `call.ragged`)


@dataclass
class CallRun:
    """What a bucketed call learns as it runs: written by the hooks, read by later hooks and by steps 6 to 8."""

    recompile_limit: int | None = None  # torch's limit once the call's graphs are accounted for
    expected_graphs: Any = None  # with a compiled forward: what the call expects to compile (`budget.CallGraphs`)
    # The tokens of the prefill it expects to compile (`Plan.prefill_tokens`), once its static cache is made; else 0.
    prefill_tokens: int = 0
    static_cache_length: int | None = None  # slots of the call's static cache, once it is made
    # Whether upstream compiles the forward itself, and whether the forwards are compiled at all (by upstream or the
    # user): decided in the cache step (`None` until then). Eager forwards get upstream's inputs as they are.
    auto_compile: bool | None = None
    compiled: bool | None = None
    auto_compile_asked: tuple = ()  # upstream's verdict on auto-compiling, and the config and cache it was asked of
    fullgraph: bool = False  # without `fullgraph=True`, graph breaks start frames the budget leaves room for
    # Whether the prefill is shape-generic (one graph, its length symbolic, for every bucket); and the tokens of a
    # first forward into the empty cache, which reads its own tokens' slots (`windows.QUERY_WINDOW`).
    generic_prefill: bool = False
    query_window_tokens: int | None = None
    windowed_cache: Any = None  # the static cache whose full-attention layers read windows (`kvcache/windows.py`)
    reads_windows: bool = False  # whether its full-attention layers read windows (`windows.has_windows`)
    decoding: bool = False  # whether the last forward prepared was a decode step (`hooks._before_forward`)
    generation_config_handed: bool = False  # whether upstream `generate` got the prepared config
    key_layouts: tuple | None = None  # how the static cache's layers lay out the keys they read, for the attentions
    decode_windows_read: set = field(default_factory=set)  # the windows the decode steps read, for the budget
    # The static cache made for the call, kept for the next call (`kvcache.sizing.keep_cache`) and reset up to the
    # slots it wrote; the length upstream made it for (0: another step made it), and whether it was allocated before
    # the first forward (else it is not kept).
    made_cache: Any = None
    made_cache_slots: int = 0
    allocated_early: bool = False


@dataclass(frozen=True, eq=False)  # one call's plan: compared by identity
class Plan:
    """What one bucketed `generate` call does to its inputs, read by the hooks while the call runs."""

    call: ResolvedCall  # the call, as step 1 resolved it: its model, settings, rows and cache are read there
    # Tokens in the prompt upstream `generate` sees: the bucket on the left; on the right the prompt as passed (the
    # `_prefill` hook pads it to `right.bucket`).
    padded_length: int
    added_id_columns: int  # columns added to `input_ids` (0 when the prompt is only `inputs_embeds`, or on the right)
    padded_batch: int = 1  # prompts generated from, dummy rows of `prefill_batch_buckets` included
    padded_rows: int = 1  # output rows generated, dummy rows of `prefill_batch_buckets` included
    right: RightPadding | None = None  # `None`: padded on the left (columns in front, masked)
    run: CallRun = field(default_factory=CallRun)  # what the call learns as it runs

    @property
    def model(self):
        return self.call.model

    @property
    def settings(self) -> CallSettings:
        return self.call.settings

    @property
    def prompt_length(self) -> int:
        """Tokens in the prompt as the user passed it (their own padding included)."""
        return self.call.prompt_length

    @property
    def side(self) -> str:
        """`"left"` or `"right"`, for messages and `GraphBudget`."""
        return "left" if self.right is None else "right"

    @property
    def prompt_slots(self) -> int:
        """The cache slots prefill fills: the padded prompt, or on the right the cached tokens plus the bucket."""
        return self.padded_length if self.right is None else self.call.past_length + self.right.bucket

    @property
    def prefill_tokens(self) -> int:
        """The tokens prefill runs: the slots it fills, less those the cache passed in holds."""
        return self.prompt_slots - self.call.past_length

    @property
    def added_positions(self) -> int:
        """Positions added in front of the sequence the model sees."""
        return self.padded_length - self.prompt_length


def plan_call(call: ResolvedCall, side: PaddingSide) -> tuple[Plan, dict, dict]:
    """
    The plan of a call padded as `side` says, and the arguments upstream `generate` runs with: the prompt padded in
    front (left) or passed on as it is (right), then the batch padded with dummy rows. Raises `ValueError` for inputs
    padding can't serve.
    """
    if side.side == "right":
        plan, arguments, model_kwargs = _plan_right(call, side)
    else:
        plan, arguments, model_kwargs = _pad_prompt(call, side.padded_length)
    if side.padded_batch is not None and side.padded_batch > call.rows:
        plan, arguments, model_kwargs = _pad_rows(plan, arguments, model_kwargs, side.padded_batch)
    if side.finished_rows_pad_id is not None:
        # Dummy rows are finished: fed an id in the vocabulary. The config is the call's own (`hooks.py` hands it on).
        call.settings.generation_config.pad_token_id = side.finished_rows_pad_id
    return plan, arguments, model_kwargs


def _pad_prompt(call: ResolvedCall, padded_length: int):
    """Left-pads the prompt and every per-token input to `padded_length`. Returns the plan and new call arguments."""
    model, settings = call.model, call.settings
    arguments = dict(call.arguments)
    model_kwargs = dict(call.model_kwargs)  # the user's dict and tensors are never modified
    arguments.pop("inputs", None)
    model_kwargs.pop("input_ids", None)
    input_ids, inputs_embeds = call.input_ids, call.inputs_embeds
    prompt_length = call.prompt_length
    if input_ids is None and inputs_embeds is None:  # upstream starts from a lone BOS token: one token, one bucket
        input_ids = bos_prompt(model, settings, model_kwargs)
    added_positions = padded_length - prompt_length
    fill_token_id = settings.fill_token_id if added_positions else None  # a prompt that fits its bucket needs none

    if model_kwargs.get("attention_mask") is None:
        # The mask upstream infers for ids passed without one (for the prompt the call passes, its `rows_mask`), or
        # all ones where it infers none.
        mask_source = input_ids if input_ids is not None and input_ids.shape[1] == prompt_length else None
        mask = None
        if mask_source is not None:
            mask = call.rows_mask if mask_source is call.prompt else inferred_mask(settings, mask_source)
            if mask_source.shape[0] > 1 and not settings.pad_token_is_inferable:
                # Upstream warns about this itself, but only when no mask is passed: this call passes one.
                logger.warning_once(
                    "The attention mask is not set with a batched input, and can't be inferred from `input_ids` "
                    "because the pad token is not set or is the eos token, so every prompt token is attended (as "
                    "upstream `generate` does). If the batch is padded, pass its `attention_mask`."
                )
        if mask is None:
            source = mask_source if mask_source is not None else inputs_embeds
            mask = torch.ones(source.shape[0], prompt_length, dtype=torch.long, device=source.device)
        model_kwargs["attention_mask"] = mask

    added_id_columns = 0
    if input_ids is not None:
        if input_ids.shape[1] == prompt_length:
            added_id_columns = added_positions
            input_ids = left_pad(input_ids, added_positions, fill_token_id)
        elif input_ids.shape[1] != 0:
            raise ValueError(
                f"`input_ids` ({input_ids.shape[1]} tokens) and `inputs_embeds` ({prompt_length} positions) must have "
                f"the same length to be padded with `{PREFILL_BUCKETS}`; pass `inputs_embeds` alone."
            )
        model_kwargs["input_ids"] = input_ids
    if inputs_embeds is not None and added_positions:
        fill = fill_embedding(model.get_input_embeddings(), fill_token_id, inputs_embeds)
        model_kwargs["inputs_embeds"] = left_pad(inputs_embeds, added_positions, fill, dim=1)

    for key, fill in PER_TOKEN_KWARGS.items():
        value = model_kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.shape[-1] == prompt_length:
            model_kwargs[key] = left_pad(value, added_positions, fill)
    ragged = call.passed.ragged_rows if call.continued is not None else None
    if ragged is not None:
        model_kwargs["attention_mask"] = _line_up_with_ragged_rows(model_kwargs["attention_mask"], ragged)

    streamer = arguments.get("streamer")
    if streamer is not None and added_id_columns > 0:
        arguments["streamer"] = PromptStrippingStreamer(streamer, added_id_columns)

    plan = Plan(call, padded_length, added_id_columns, padded_batch=call.rows, padded_rows=call.output_rows)
    return plan, arguments, model_kwargs


def _line_up_with_ragged_rows(attention_mask: torch.Tensor, ragged: torch.Tensor) -> torch.Tensor:
    """
    The mask of a call that continues from a cache a ragged right-padded call filled (`ragged`: that call's mask,
    `[rows, S]`), in the cache's layout: the first S columns hide each row's slots after its prompt tokens, which sit
    at the start. Raises `ValueError` unless those columns are the mask that call was given.
    """
    width = ragged.shape[1]
    head = attention_mask[:, :width]
    if attention_mask.ndim != 2 or head.shape != ragged.shape or not torch.equal(head.to(ragged), ragged):
        raise ValueError(
            f"The cache passed in was filled by a call whose rows have different lengths (right-padded, each row's "
            f"tokens at the start of its slots). Its first {width} columns must be masked as that call's were: pass "
            "its `attention_mask` followed by ones for the tokens it generated (and a mask for the new ones)."
        )
    slots = torch.arange(width, device=attention_mask.device)
    lined_up = (slots < ragged.to(attention_mask.device).long().sum(-1)[:, None]).to(attention_mask.dtype)
    return torch.cat([lined_up, attention_mask[:, width:]], dim=1)


def _plan_right(call: ResolvedCall, side: PaddingSide) -> tuple:
    """
    The plan of a right-padded call: the prompt goes to upstream unpadded, and the `_prefill` hook pads it to
    `side.bucket`. Returns the plan and the call arguments.
    """
    arguments, model_kwargs = call.arguments, dict(call.model_kwargs)
    if call.input_ids is None and call.inputs_embeds is None:  # upstream would start from a lone BOS token: as left
        model_kwargs["input_ids"] = bos_prompt(call.model, call.settings, model_kwargs)
    if call.rows_mask is not None:  # passed, or inferred from pad tokens as upstream infers it
        model_kwargs["attention_mask"] = call.rows_mask
    right = RightPadding(bucket=side.bucket)
    plan = Plan(call, call.prompt_length, 0, padded_batch=call.rows, padded_rows=call.output_rows, right=right)
    return plan, arguments, model_kwargs


def _pad_rows(plan: Plan, arguments: dict, model_kwargs: dict, padded_batch: int):
    """
    Appends dummy rows up to `padded_batch`: one unmasked pad token each on the left (a fully masked row gives NaNs),
    all unmasked on the right; finished from the first step (`views.DummyRowsFinished`), dropped by `strip_output`.
    """
    model, settings = plan.model, plan.settings
    if plan.right is not None and arguments.get("inputs") is not None:
        arguments = dict(arguments)
        model_kwargs = dict(model_kwargs, input_ids=arguments.pop("inputs"))
    input_ids = model_kwargs.get("input_ids")
    prompt = model_kwargs["inputs_embeds"] if model_kwargs.get("inputs_embeds") is not None else input_ids
    batch_size, user_rows = plan.call.rows, plan.call.output_rows  # the user's prompts, and the rows made of them

    extra = padded_batch - batch_size
    fill_token_id = settings.fill_token_id
    length = plan.padded_length
    model_kwargs = dict(model_kwargs)
    dummy_mask = torch.zeros(extra, length, dtype=torch.long, device=prompt.device)
    dummy_mask[:, -1] = 1
    if plan.right is not None:
        dummy_mask.fill_(1)
        if model_kwargs.get("attention_mask") is None:  # else upstream could infer a mask from the pad tokens
            model_kwargs["attention_mask"] = torch.ones(batch_size, length, dtype=torch.long, device=prompt.device)
    if input_ids is not None and input_ids.shape[1] > 0:
        dummy = torch.full((extra, input_ids.shape[1]), fill_token_id, dtype=input_ids.dtype, device=input_ids.device)
        model_kwargs["input_ids"] = torch.cat([input_ids, dummy])
    elif input_ids is not None:
        model_kwargs["input_ids"] = input_ids.new_empty(padded_batch, 0)
    if model_kwargs.get("inputs_embeds") is not None:
        embeds = model_kwargs["inputs_embeds"]
        fill = fill_embedding(model.get_input_embeddings(), fill_token_id, embeds)
        model_kwargs["inputs_embeds"] = torch.cat([embeds, fill.expand(extra, *embeds.shape[1:])])
    for key in PER_TOKEN_KWARGS:
        value = model_kwargs.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if key == "attention_mask":
            model_kwargs[key] = torch.cat([value, dummy_mask.to(value.dtype)])
        else:
            row_dim = 0 if value.ndim == 2 else 1  # multimodal rope position ids are [3, batch, length]
            shape = list(value.shape)
            shape[row_dim] = extra
            model_kwargs[key] = torch.cat([value, value.new_zeros(shape)], dim=row_dim)

    criteria = StoppingCriteriaList(arguments.get("stopping_criteria") or [])
    criteria.append(DummyRowsFinished(first_dummy_row=user_rows))
    arguments = dict(arguments, stopping_criteria=criteria)
    plan = replace(plan, padded_rows=padded_batch * settings.rows_per_prompt, padded_batch=padded_batch)
    if isinstance(arguments.get("streamer"), PromptStrippingStreamer):
        arguments["streamer"].rows = user_rows
    elif arguments.get("streamer") is not None:
        arguments["streamer"] = PromptStrippingStreamer(arguments["streamer"], 0, rows=user_rows)
    return plan, arguments, model_kwargs


def left_pad(tensor: torch.Tensor, pad: int, value: float | torch.Tensor, dim: int = -1) -> torch.Tensor:
    """
    Prepends `pad` entries of `value` along `dim` (ids `[B, S]`; embeddings `[B, S, H]` with `dim=1`). A tensor `value`
    broadcasts over the new slice: an embedding `[H]` fills `[B, pad, H]`.
    """
    if pad == 0:
        return tensor
    dim = dim % tensor.ndim
    shape = list(tensor.shape)
    shape[dim] = pad
    if isinstance(value, torch.Tensor):
        filler = value.to(device=tensor.device, dtype=tensor.dtype).expand(shape)
    else:
        filler = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor], dim=dim)


def fill_embedding(embedding: torch.nn.Module, token_id: int, like: torch.Tensor) -> torch.Tensor:
    """
    What a pad position of `inputs_embeds` holds: the input embedding (`model.get_input_embeddings()`) of `token_id`,
    `[H]`, detached, in the dtype and on the device of the embeddings `like` (`[B, S, H]`) it pads, as the user's are.
    """
    return embedding.weight[token_id].detach().to(device=like.device, dtype=like.dtype)

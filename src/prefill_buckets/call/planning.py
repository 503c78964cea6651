"""The plan of a bucketed call (`plan_call`): the prompt padded to its bucket, and the batch to its batch bucket.

On the left the prompt gets columns in front (masked); a right-padded call (`padding_side.py`) passes the prompt on
as it is, and the `_prefill` hook (`prefill_right.py`) pads it after its end. Dummy rows pad the batch.

Pure input rewriting, of a call whose padding is decided (`decision.choose_side`: the side, the padded length, the
padded batch, every check made): the user's dicts and tensors are never modified, new ones are returned with a `Plan`
that says what was added, which the hooks and `output.strip_output` read.
"""

import torch
from transformers.utils import logging

from ..config import PREFILL_BUCKETS
from .batch_rows import pad_rows
from .padding import fill_embedding, left_pad
from .padding_side import PaddingSide
from .plan import PER_TOKEN_KWARGS, Plan, RightPadding
from .resolved import ResolvedCall
from .settings import CallSettings, bos_prompt
from .views import PromptStrippingStreamer


logger = logging.get_logger(__name__)


def plan_call(call: ResolvedCall, side: PaddingSide) -> tuple[Plan, dict, dict]:
    """
    The plan of a bucketed call padded as `side` says (`side.side`: `"left"` or `"right"`), and the arguments
    upstream `generate` runs with. On the left the prompt and its per-token inputs are padded in front to
    `side.padded_length`; on the right they go on as passed, and the `_prefill` hook pads them. Then the batch is
    padded to `side.padded_batch`, and rows that finish early fed `side.finished_rows_pad_id`.

    Raises `ValueError` for inputs padding can't serve.
    """
    if side.side == "right":
        plan, arguments, model_kwargs = _plan_right(call, side)
    else:
        plan, arguments, model_kwargs = _pad_prompt(call, side.padded_length)
    if side.padded_batch is not None and side.padded_batch > plan.batch_size:
        plan, arguments, model_kwargs = pad_rows(plan, arguments, model_kwargs, side.padded_batch)
    if side.finished_rows_pad_id is not None:
        model_kwargs["pad_token_id"] = (
            side.finished_rows_pad_id
        )  # dummy rows are finished: fed an id in the vocabulary
    return plan, arguments, model_kwargs


def _default_attention_mask(settings: CallSettings, input_ids: torch.Tensor) -> torch.Tensor:
    """The mask upstream infers when none is passed: pad tokens are masked, unless the pad token is also eos."""
    if settings.pad_token_is_inferable and (input_ids == settings.pad_token_id).any():
        return input_ids.ne(settings.pad_token_id).long()
    return torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)


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
    fill_token_id = settings.fill_token_id

    if model_kwargs.get("attention_mask") is None:
        mask_source = input_ids if input_ids is not None and input_ids.shape[1] == prompt_length else None
        if mask_source is not None:
            model_kwargs["attention_mask"] = _default_attention_mask(settings, mask_source)
            if mask_source.shape[0] > 1 and not settings.pad_token_is_inferable:
                # Upstream warns about this itself, but only when no mask is passed: this call passes one.
                logger.warning_once(
                    "The attention mask is not set with a batched input, and can't be inferred from `input_ids` "
                    "because the pad token is not set or is the eos token, so every prompt token is attended (as "
                    "upstream `generate` does). If the batch is padded, pass its `attention_mask`."
                )
        else:
            batch_size = inputs_embeds.shape[0]
            model_kwargs["attention_mask"] = torch.ones(
                batch_size, prompt_length, dtype=torch.long, device=inputs_embeds.device
            )

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
    if inputs_embeds is not None:
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

    batch_size = (model_kwargs["inputs_embeds"] if inputs_embeds is not None else input_ids).shape[0]
    rows = batch_size * settings.rows_per_prompt
    plan = Plan(
        model,
        settings,
        prompt_length=prompt_length,
        padded_length=padded_length,
        added_id_columns=added_id_columns,
        batch_size=batch_size,
        padded_batch=batch_size,
        rows=rows,
        padded_rows=rows,
    )
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
    settings = call.settings
    arguments, model_kwargs = call.arguments, dict(call.model_kwargs)
    input_ids, inputs_embeds = call.input_ids, call.inputs_embeds
    if input_ids is None and inputs_embeds is None:  # upstream would start from a lone BOS token: made here, as left
        input_ids = model_kwargs["input_ids"] = bos_prompt(call.model, settings, model_kwargs)
    prompt = inputs_embeds if inputs_embeds is not None else input_ids
    prompt_length, batch_size = prompt.shape[1], prompt.shape[0]
    mask = model_kwargs.get("attention_mask")
    if mask is None and inputs_embeds is None and settings.pad_token_is_inferable:
        if bool((input_ids == settings.pad_token_id).any()):
            mask = model_kwargs["attention_mask"] = _default_attention_mask(settings, input_ids)  # as upstream infers
    rows = batch_size * settings.rows_per_prompt
    plan = Plan(
        call.model,
        settings,
        prompt_length=prompt_length,
        padded_length=prompt_length,
        added_id_columns=0,
        batch_size=batch_size,
        padded_batch=batch_size,
        rows=rows,
        padded_rows=rows,
        right=RightPadding(
            bucket=side.bucket,
            past_length=side.past_length,
            ragged=isinstance(mask, torch.Tensor) and not bool(mask.all()),
        ),
    )
    return plan, arguments, model_kwargs

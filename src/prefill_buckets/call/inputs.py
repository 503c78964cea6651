"""The plan of a bucketed call (`plan_call`): the prompt padded to its bucket, and the batch to its batch bucket.

On the left the prompt gets columns in front (masked); a right-padded call (`padding_side.py`) passes the prompt on
as it is, and the `_prefill` hook (`prefill_right.py`) pads it after its end. Dummy rows pad the batch.

Pure input rewriting: the user's dicts and tensors are never modified, new ones are returned with a `Plan` that says
what was added, which the hooks and `output.strip_output` read.
"""

import torch
from transformers.utils import logging

from ..config import PREFILL_BATCH_BUCKETS, PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF
from .batch_rows import check_pad_token_id, pad_rows
from .cache import PassedCache, unpadded_for_room
from .padding import fill_embedding, left_pad
from .plan import PER_TOKEN_KWARGS, Plan, RightPadding, RunsUnpadded
from .settings import CallSettings, bos_prompt
from .views import PromptStrippingStreamer


logger = logging.get_logger(__name__)


def plan_call(
    model, settings: CallSettings, side, arguments: dict, model_kwargs: dict, passed: PassedCache | None = None
) -> tuple[Plan, dict, dict]:
    """
    The plan of a bucketed call padded on `side` (a `padding_side.PaddingSide`), and the arguments upstream
    `generate` runs with (`passed`: the cache the call passes, as `generate` read it). On the left the prompt and its per-token inputs are padded in front to the bucket; on the
    right they go on as passed, and the `_prefill` hook pads them. Then the batch is padded to its batch bucket, and
    the pad id checked against the rows that can finish early.

    Raises `RunsUnpadded` when the padded call doesn't fit the cache it would write (`cache.unpadded_for_room`), and
    `ValueError` for inputs padding can't serve.
    """
    passed = passed if passed is not None else PassedCache(model_kwargs)
    continues = passed.continued
    if side.side == "right":
        plan, arguments, model_kwargs = _plan_right(model, settings, arguments, model_kwargs, side)
    else:
        plan, padded_arguments, padded_kwargs = _pad_prompt(model, settings, arguments, model_kwargs, passed)
        reason = unpadded_for_room(plan, model_kwargs)
        if reason is not None:
            raise RunsUnpadded(reason)
        arguments, model_kwargs = padded_arguments, padded_kwargs
    if settings.batch_policy is not None and continues is None:  # a cache's rows are fixed when it is filled
        plan, arguments, model_kwargs = pad_rows(plan, arguments, model_kwargs)
    model_kwargs.update(check_pad_token_id(plan, arguments))
    return plan, arguments, model_kwargs


def capped_bucket(settings: CallSettings, prompt_length: int, warn: bool = True) -> int:
    """
    The bucket of a prompt, but never more positions than the model has (`max_position_embeddings`), unless the
    prompt itself is longer: then it is not padded at all. With `warn`, logs what happened to a prompt outside the
    buckets, one warning per call (`warn_long_prompt`).
    """
    padded_length = settings.policy.bucket(prompt_length)
    max_positions = settings.max_positions
    if max_positions is not None and padded_length > max_positions:
        capped = max(prompt_length, max_positions)
        if warn:
            warn_long_prompt(settings, prompt_length, capped, uncapped=padded_length)
        return capped
    if warn:
        warn_long_prompt(settings, prompt_length, padded_length)
    return padded_length


def warn_long_prompt(settings: CallSettings, prompt_length: int, padded_length: int, uncapped: int | None = None):
    """
    The one warning for a prompt outside the buckets, saying what was done with it; nothing for a prompt inside them.

    - longer than `max_position_embeddings`: not padded, so each such length is a graph of its own;
    - its bucket (`uncapped`) longer than `max_position_embeddings`: padded to that instead. Every such prompt gets
      that one length, so the text names no prompt, and it is logged once;
    - longer than the largest listed bucket: padded to a multiple of it, a graph per such length.
    """
    policy, max_positions = settings.policy, settings.max_positions
    if uncapped is not None and padded_length == prompt_length and prompt_length > max_positions:
        logger.warning_once(
            f"A prompt of {prompt_length} tokens is longer than the model's `max_position_embeddings` "
            f"({max_positions}), so it is not padded: it runs at its own length, and each such length compiles a new "
            "graph. The model was not built for sequences this long."
        )
    elif uncapped is not None:
        logger.warning_once(
            f"Buckets longer than the model's `max_position_embeddings` ({max_positions}) have more positions than the "
            f"model has, so a prompt of at most {max_positions} tokens whose bucket is longer ({policy}) is padded to "
            f"{max_positions} instead: those prompts share one length, and its compiled graph. Make {max_positions} "
            "your largest bucket to say so."
        )
    elif policy.exceeds_buckets(prompt_length):
        multiple = policy.pad_to_multiple_of or policy.largest_bucket
        logger.warning_once(
            f"A prompt of {prompt_length} tokens is longer than the largest of `{PREFILL_BUCKETS}` "
            f"({policy.largest_bucket}), so it is padded to {padded_length}, the next multiple of {multiple}. Each such "
            f"length compiles a new graph: add a larger bucket, or set `{PREFILL_PAD_TO_MULTIPLE_OF}` to choose the "
            "length for long prompts."
        )


def check_ids_in_vocabulary(settings: CallSettings, input_ids: torch.Tensor) -> None:
    """Raises `ValueError` for an id the embedding can't look up (an index error on CPU, a device assert on CUDA)."""
    vocab_size = settings.vocab_size
    if vocab_size is None:
        return
    low, high = (int(v) for v in torch.aminmax(input_ids))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(
            f"`input_ids` holds the id {bad}, outside the model's vocabulary (valid ids: 0 to {vocab_size - 1}). If "
            "those positions are padding, fill them with a `pad_token_id` in the vocabulary and mask them with "
            "`attention_mask`."
        )


def _default_attention_mask(settings: CallSettings, input_ids: torch.Tensor) -> torch.Tensor:
    """The mask upstream infers when none is passed: pad tokens are masked, unless the pad token is also eos."""
    if settings.pad_token_is_inferable and (input_ids == settings.pad_token_id).any():
        return input_ids.ne(settings.pad_token_id).long()
    return torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)


def _pad_prompt(model, settings: CallSettings, arguments: dict, model_kwargs: dict, passed: PassedCache):
    """Left-pads the prompt and every per-token input to the bucket. Returns the plan and new call arguments."""
    arguments = dict(arguments)
    model_kwargs = dict(model_kwargs)  # the user's dict and tensors are never modified

    input_ids = arguments.pop("inputs", None)
    if input_ids is None:
        input_ids = model_kwargs.pop("input_ids", None)
    inputs_embeds = model_kwargs.get("inputs_embeds")

    if inputs_embeds is not None:
        prompt_length = inputs_embeds.shape[1]
    elif input_ids is not None:
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.long, torch.int):
            raise ValueError(
                f"`{PREFILL_BUCKETS}` pads `input_ids` of shape [batch, length] with an integer dtype, but got shape "
                f"{tuple(input_ids.shape)} and dtype {input_ids.dtype}."
            )
        prompt_length = input_ids.shape[1]
    else:  # upstream starts from a lone BOS token: one token, one bucket
        input_ids = bos_prompt(model, settings, model_kwargs)
        prompt_length = 1
    if prompt_length == 0:
        raise ValueError(
            f"The prompt is empty (0 tokens). `{PREFILL_BUCKETS}` pads a prompt up to a bucket, so it needs at least "
            "one token: start the prompt with the BOS token."
        )

    continued = passed.continued
    if continued is not None:
        # Continuing from a cache a bucketed call filled: its first positions are padding, so the prompt (the whole
        # conversation so far) gets the same padding in front.
        added_positions, padded_batch = continued
        batch_size = (inputs_embeds if inputs_embeds is not None else input_ids).shape[0]
        if padded_batch != batch_size:
            raise ValueError(
                f"The cache passed in was filled by a call padded to {padded_batch} rows with `{PREFILL_BATCH_BUCKETS}`"
                f", but this call has {batch_size}. Continue from a cache with the batch it was filled with: pass "
                f"`{PREFILL_BATCH_BUCKETS}=None` to the call that fills it."
            )
        padded_length = prompt_length + added_positions
    else:
        padded_length = capped_bucket(settings, prompt_length)
    added_positions = padded_length - prompt_length
    fill_token_id = settings.fill_token_id
    if input_ids is not None and input_ids.numel() > 0:
        check_ids_in_vocabulary(settings, input_ids)

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
    ragged = passed.ragged_rows if continued is not None else None
    if ragged is not None:
        model_kwargs["attention_mask"] = _line_up_with_ragged_rows(model_kwargs["attention_mask"], ragged)

    streamer = arguments.get("streamer")
    if streamer is not None and added_id_columns > 0:
        arguments["streamer"] = PromptStrippingStreamer(streamer, added_id_columns)

    batch_size = (model_kwargs["inputs_embeds"] if inputs_embeds is not None else input_ids).shape[0]
    plan = Plan(
        model,
        settings,
        prompt_length=prompt_length,
        padded_length=padded_length,
        added_id_columns=added_id_columns,
        batch_size=batch_size,
        padded_batch=batch_size,
    )
    plan.rows = plan.padded_rows = batch_size * settings.rows_per_prompt
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


def _plan_right(model, settings: CallSettings, arguments: dict, model_kwargs: dict, side) -> tuple:
    """
    The plan of a right-padded call (`side`, a `padding_side.PaddingSide`): the prompt goes to upstream unpadded,
    and the `_prefill` hook pads it to `side.bucket`. Returns the plan and the call arguments.
    """
    model_kwargs = dict(model_kwargs)
    input_ids = arguments.get("inputs")
    input_ids = input_ids if input_ids is not None else model_kwargs.get("input_ids")
    inputs_embeds = model_kwargs.get("inputs_embeds")
    if input_ids is None and inputs_embeds is None:  # upstream would start from a lone BOS token: made here, as left
        input_ids = model_kwargs["input_ids"] = bos_prompt(model, settings, model_kwargs)
    if inputs_embeds is None and input_ids.dtype in (torch.long, torch.int):
        check_ids_in_vocabulary(settings, input_ids)
    prompt = inputs_embeds if inputs_embeds is not None else input_ids
    prompt_length, batch_size = prompt.shape[1], prompt.shape[0]
    warn_long_prompt(settings, prompt_length - side.past_length, side.bucket)
    mask = model_kwargs.get("attention_mask")
    if mask is None and inputs_embeds is None and settings.pad_token_is_inferable:
        if bool((input_ids == settings.pad_token_id).any()):
            mask = model_kwargs["attention_mask"] = _default_attention_mask(settings, input_ids)  # as upstream infers
    plan = Plan(
        model,
        settings,
        prompt_length=prompt_length,
        padded_length=prompt_length,
        added_id_columns=0,
        batch_size=batch_size,
        padded_batch=batch_size,
        right=RightPadding(
            bucket=side.bucket,
            past_length=side.past_length,
            ragged=isinstance(mask, torch.Tensor) and not bool(mask.all()),
        ),
    )
    plan.rows = plan.padded_rows = batch_size * settings.rows_per_prompt
    return plan, arguments, model_kwargs

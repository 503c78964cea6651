"""Padding a call's inputs: the prompt to its bucket (columns in front), and the batch to its batch bucket (rows).

A right-padded call (`padding_side.py`) passes the prompt on unpadded (`plan_right`): the `_prefill` hook
(`prefill_right.py`) pads it.

Pure input rewriting: the user's dicts and tensors are never modified, new ones are returned with a `Plan` that says
what was added, which the hooks and `output.strip_output` read.
"""

from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils import logging

from .cache import continued_padding, passed_cache, ragged_rows_mask
from .config import PREFILL_BATCH_BUCKETS, PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF
from .padding import left_pad
from .settings import CallSettings
from .views import DummyRowsFinished, PromptStrippingStreamer


logger = logging.get_logger(__name__)

# Per-token model inputs that are padded along with the prompt, and their fill value. Position ids of masked
# positions are 0, as upstream fills them.
PER_TOKEN_KWARGS = {"attention_mask": 0, "position_ids": 0, "token_type_ids": 0, "mm_token_type_ids": 0}


@dataclass
class Plan:
    """What one bucketed `generate` call does to its inputs, read by the hooks while the call runs."""

    model: Any
    settings: CallSettings
    prompt_length: int  # tokens in the prompt as the user passed it (their own padding included)
    padded_length: int  # the bucket
    added_id_columns: int  # columns added to `input_ids` (0 when the prompt is only `inputs_embeds`)
    batch_size: int = 1  # prompts the user passed
    padded_batch: int = 1  # prompts generated from, dummy rows of `prefill_batch_buckets` included
    rows: int = 1  # output rows the user gets: batch * max(num_beams, num_return_sequences)
    padded_rows: int = 1  # output rows generated, dummy rows of `prefill_batch_buckets` included
    recompile_limit: int | None = None  # torch's limit once the call's graphs are accounted for
    expected_graphs: Any = None  # with a compiled forward: what the call expects to compile (`budget.CallGraphs`)
    static_cache_length: int | None = None  # slots of the call's static cache, once it is made
    side: str = "left"  # "right": upstream sees the unpadded prompt, the `_prefill` hook pads it after the prompt
    bucket: int | None = None  # right: the length the new tokens are padded to
    past_length: int = 0  # right: the tokens the cache held before the call
    ragged: bool = False  # right: rows of different lengths, each padded after its own end
    windowed_cache: Any = None  # the static cache whose full-attention layers read windows (`windows.py`)

    @property
    def prompt_slots(self) -> int:
        """The cache slots prefill fills: the padded prompt, or on the right the cached tokens plus the bucket."""
        return self.past_length + self.bucket if self.side == "right" else self.padded_length

    @property
    def added_positions(self) -> int:
        """Positions added in front of the sequence the model sees."""
        return self.padded_length - self.prompt_length


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


def check_pad_token_id(plan: Plan, arguments: dict) -> dict:
    """
    Checks the pad id against the rows that finish early, and returns the generation kwargs the call needs for it.

    Upstream fills a row that finishes before the others with `pad_token_id` and feeds it back to the model, so a pad
    id outside the vocabulary fails at the embedding (an index error on CPU, a device assert on CUDA). Raises
    `ValueError` when one of the user's rows can finish early: there is more than one (and no beam search, which does
    not feed finished beams), and an eos id in the vocabulary, `stop_strings` or the user's own stopping criteria
    could finish it. The dummy rows of `prefill_batch_buckets` are finished from the first step, so they would be fed
    the pad id too: when no user row can finish early, the call fills finished rows with an id in the vocabulary
    instead (`{"pad_token_id": ...}`). No user row is ever filled, so the output is the same.
    """
    settings = plan.settings
    pad_token_id = settings.pad_token_id
    if pad_token_id is None or settings.vocab_size is None or settings.in_vocabulary(pad_token_id):
        return {}
    if settings.num_beams > 1:
        return {}
    user_criteria = [c for c in arguments.get("stopping_criteria") or () if not isinstance(c, DummyRowsFinished)]
    can_finish_early = [
        reason
        for reason, present in (
            (
                f"the eos ids {list(settings.eos_token_ids)} are in it",
                any(map(settings.in_vocabulary, settings.eos_token_ids)),
            ),
            ("`stop_strings` is set", bool(settings.stop_strings)),
            ("`stopping_criteria` are passed", bool(user_criteria)),
        )
        if present
    ]
    if plan.rows > 1 and can_finish_early:
        raise ValueError(
            f"`pad_token_id` is {pad_token_id}, outside the model's vocabulary (valid ids: 0 to "
            f"{settings.vocab_size - 1}). This call generates {plan.rows} rows and a row can finish before the others "
            f"({', '.join(can_finish_early)}): it is then filled with `pad_token_id` and fed back to the model, which "
            "can't look it up. Set `pad_token_id` to an id in the vocabulary (the eos token id is the usual choice)."
        )
    if plan.padded_rows > plan.rows:
        return {"pad_token_id": settings.fill_token_id}
    return {}


def _default_attention_mask(settings: CallSettings, input_ids: torch.Tensor) -> torch.Tensor:
    """The mask upstream infers when none is passed: pad tokens are masked, unless the pad token is also eos."""
    if settings.pad_token_is_inferable and (input_ids == settings.pad_token_id).any():
        return input_ids.ne(settings.pad_token_id).long()
    return torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)


def pad_inputs(model, settings: CallSettings, arguments: dict, model_kwargs: dict):
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
    else:
        # Upstream starts from a lone BOS token: one token, one bucket.
        if settings.bos_token_id is None:
            raise ValueError("`bos_token_id` has to be defined when no `input_ids` are provided.")
        batch_size = next((v.shape[0] for v in model_kwargs.values() if isinstance(v, torch.Tensor)), 1)
        input_ids = torch.full((batch_size, 1), settings.bos_token_id, dtype=torch.long, device=model.device)
        prompt_length = 1
    if prompt_length == 0:
        raise ValueError(
            f"The prompt is empty (0 tokens). `{PREFILL_BUCKETS}` pads a prompt up to a bucket, so it needs at least "
            "one token: start the prompt with the BOS token."
        )

    continued = continued_padding(model_kwargs)
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
        fill_embedding = model.get_input_embeddings().weight[fill_token_id].detach()
        model_kwargs["inputs_embeds"] = left_pad(inputs_embeds, added_positions, fill_embedding, dim=1)

    for key, fill in PER_TOKEN_KWARGS.items():
        value = model_kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.shape[-1] == prompt_length:
            model_kwargs[key] = left_pad(value, added_positions, fill)
    ragged = ragged_rows_mask(passed_cache(model_kwargs)) if continued is not None else None
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


def plan_right(model, settings: CallSettings, arguments: dict, model_kwargs: dict, side) -> tuple:
    """
    The plan of a right-padded call (`side`, a `padding_side.PaddingSide`): the prompt goes to upstream unpadded,
    and the `_prefill` hook pads it to `side.bucket`. Returns the plan and the call arguments.
    """
    model_kwargs = dict(model_kwargs)
    input_ids = arguments.get("inputs")
    input_ids = input_ids if input_ids is not None else model_kwargs.get("input_ids")
    inputs_embeds = model_kwargs.get("inputs_embeds")
    if input_ids is None and inputs_embeds is None:  # upstream would start from a lone BOS token: made here, as left
        if settings.bos_token_id is None:
            raise ValueError("`bos_token_id` has to be defined when no `input_ids` are provided.")
        rows = next((v.shape[0] for v in model_kwargs.values() if isinstance(v, torch.Tensor)), 1)
        input_ids = torch.full((rows, 1), settings.bos_token_id, dtype=torch.long, device=model.device)
        model_kwargs["input_ids"] = input_ids
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
        side="right",
        bucket=side.bucket,
        past_length=side.past_length,
        ragged=isinstance(mask, torch.Tensor) and not bool(mask.all()),
    )
    plan.rows = plan.padded_rows = batch_size * settings.rows_per_prompt
    return plan, arguments, model_kwargs


def pad_rows(plan: Plan, arguments: dict, model_kwargs: dict):
    """
    Appends dummy rows up to the batch bucket: one unmasked pad token each (a fully masked row would give NaNs), no
    other inputs; on the right, a row of unmasked pad tokens as long as the prompt (all rows one length). A stopping criterion marks them finished from the first step, so they never keep generation going,
    and `output.strip_output` drops them.
    """
    model, settings = plan.model, plan.settings
    if plan.side == "right" and arguments.get("inputs") is not None:
        arguments = dict(arguments)
        model_kwargs = dict(model_kwargs, input_ids=arguments.pop("inputs"))
    input_ids = model_kwargs.get("input_ids")
    prompt = model_kwargs["inputs_embeds"] if model_kwargs.get("inputs_embeds") is not None else input_ids
    batch_size = prompt.shape[0]
    padded_batch = settings.batch_policy.bucket(batch_size)
    expand = settings.rows_per_prompt
    if padded_batch == batch_size:
        return plan, arguments, model_kwargs
    known = {"input_ids", "inputs_embeds", *PER_TOKEN_KWARGS}
    per_row = sorted(
        k
        for k, v in model_kwargs.items()
        if isinstance(v, torch.Tensor) and k not in known and v.shape[:1] == (batch_size,)
    )
    if settings.num_beams > 1 or per_row:
        reason = "beam search ranks rows together" if not per_row else f"it can't pad the per-row input {per_row[0]!r}"
        logger.warning_once(f"`{PREFILL_BATCH_BUCKETS}` is not applied to this call: {reason}.")
        return plan, arguments, model_kwargs
    if arguments.get("negative_prompt_ids") is not None:
        logger.warning_once(
            f"`{PREFILL_BATCH_BUCKETS}` is not applied to this call: it can't pad `negative_prompt_ids`."
        )
        return plan, arguments, model_kwargs

    extra = padded_batch - batch_size
    fill_token_id = settings.fill_token_id
    length = plan.padded_length
    model_kwargs = dict(model_kwargs)
    dummy_mask = torch.zeros(extra, length, dtype=torch.long, device=prompt.device)
    dummy_mask[:, -1] = 1
    if plan.side == "right":
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
        fill_embedding = model.get_input_embeddings().weight[fill_token_id].detach().to(embeds.dtype)
        model_kwargs["inputs_embeds"] = torch.cat([embeds, fill_embedding.expand(extra, *embeds.shape[1:])])
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
    criteria.append(DummyRowsFinished(first_dummy_row=batch_size * expand))
    arguments = dict(arguments, stopping_criteria=criteria)
    plan.padded_rows = padded_batch * expand
    plan.padded_batch = padded_batch
    if isinstance(arguments.get("streamer"), PromptStrippingStreamer):
        arguments["streamer"].rows = batch_size * expand
    elif arguments.get("streamer") is not None:
        arguments["streamer"] = PromptStrippingStreamer(arguments["streamer"], 0, rows=batch_size * expand)
    return plan, arguments, model_kwargs

"""`generate` with bucketed prefill: resolve the fields -> pick the bucket -> left-pad -> upstream generate -> strip.

Upstream `generate` does all the real work. Three of its steps need to see through the padding, and are hooked on
the model instance for the duration of one call (see `_bucketed_call`):

- `_prepare_generated_length`: `max_length` / `min_length` are resolved against the *unpadded* prompt, then shifted
  by the padding, so they keep their meaning.
- `_prepare_cache_for_generation`: a static cache without `max_cache_len` gets a bucketed length, so calls with
  different prompt lengths share one cache shape (and so one decode graph).
- `prepare_inputs_for_generation`: a prompt that exactly fits its bucket has no padding, and upstream uses that twice
  to skip the mask: it drops an all-ones 2D attention mask before prefill, and with SDPA and a static cache it
  builds no 4D mask for an unpadded prefill (`is_causal` instead). Either way the prompt would reach the model
  without a mask, a different graph from every padded prompt in its bucket. The hook puts the all-ones mask back
  and, while upstream builds the 4D mask, turns off the SDPA skip (`masking_utils._ignore_causal_mask_sdpa`), so
  every prompt in a bucket reaches the model with one signature.
"""

import contextlib
import contextvars
import copy
import functools
import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from packaging import version
from transformers import GenerationConfig, masking_utils
from transformers.generation import logits_process
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.generation.utils import GenerationMixin
from transformers.utils import ModelOutput, logging

from .buckets import BucketPolicy
from .compilation import EagerFallback, compiled_forward, compiled_wrapper_forward, graph_budget, is_compiled_wrapper
from .config import (
    FIELDS,
    PREFILL_BATCH_BUCKETS,
    PREFILL_BUCKETS,
    PREFILL_PAD_TO_MULTIPLE_OF,
    batch_policy_from_fields,
    policy_from_fields,
)
from .padding import left_pad, strip_left


logger = logging.get_logger(__name__)

# Captured at import, before `enable()` can replace it.
UPSTREAM_GENERATE = GenerationMixin.generate
_UPSTREAM_SIGNATURE = inspect.signature(UPSTREAM_GENERATE)

# Per-token model inputs that are padded along with the prompt, and their fill value. Position ids of masked
# positions are 0, as upstream fills them.
_PER_TOKEN_KWARGS = {"attention_mask": 0, "position_ids": 0, "token_type_ids": 0, "mm_token_type_ids": 0}
_CACHE_KWARGS = ("cache", "past_key_values")


@dataclass
class _Plan:
    """What one bucketed `generate` call does to its inputs, read by the hooks while the call runs."""

    model: Any
    policy: BucketPolicy
    prompt_length: int  # tokens in the prompt as the user passed it (their own padding included)
    padded_length: int  # the bucket
    ids_pad: int  # columns added to `input_ids` (0 when the prompt is only `inputs_embeds`)
    batch_size: int = 1  # prompts the user passed
    padded_batch: int = 1  # prompts generated from, dummy rows of `prefill_batch_buckets` included
    rows: int = 1  # output rows the user gets: batch * max(num_beams, num_return_sequences)
    padded_rows: int = 1  # output rows generated, dummy rows of `prefill_batch_buckets` included
    recompile_limit: int | None = None  # torch's limit once the call's graphs are accounted for

    @property
    def pad(self) -> int:
        return self.padded_length - self.prompt_length


_ACTIVE_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("prefill_buckets_plan", default=None)


def resolve_fields(model, generation_config: GenerationConfig | None, field_kwargs: dict) -> dict[str, Any]:
    """
    The fields' values for one call, with upstream's priority: `generate` kwargs > the `generation_config` argument
    > `model.generation_config`. A kwarg explicitly set to `None` turns the field off for the call.
    """
    values = {}
    for field in FIELDS:
        if field in field_kwargs:
            values[field] = field_kwargs[field]
            continue
        value = getattr(generation_config, field, None) if generation_config is not None else None
        if value is None:
            value = getattr(getattr(model, "generation_config", None), field, None)
        values[field] = value
    return values


def resolve_policy(model, generation_config: GenerationConfig | None, field_kwargs: dict) -> BucketPolicy | None:
    """The prompt-length `BucketPolicy` for one call (see `resolve_fields`), or `None` when no field is set."""
    return policy_from_fields(**resolve_fields(model, generation_config, field_kwargs))


def generate(model, *args, **kwargs):
    r"""
    [`~generation.GenerationMixin.generate`] with bucketed prefill, without patching transformers.

    Takes exactly the arguments of `model.generate`, plus the fields `prefill_pad_to_multiple_of`,
    `prefill_buckets` and `prefill_batch_buckets` (as keyword arguments or on `generation_config`). When none is set,
    this is upstream `generate`, unchanged. When one is set, the prompt is left-padded to its bucket with masked pad
    tokens (and the batch, with `prefill_batch_buckets`, to its bucket with dummy rows), upstream `generate` runs on
    the padded inputs, and the padding is stripped again: the returned sequences have the shape and ids of an
    unpadded run, and `max_new_tokens`, `max_length` and `min_length` mean what they mean without padding.

    Args:
        model ([`PreTrainedModel`]):
            A decoder-only model with a language modeling head, or the `torch.compile(model)` wrapper of one.
        args (*optional*):
            The positional arguments of `model.generate`.
        kwargs (*optional*):
            The keyword arguments of `model.generate`, and the bucket fields.

    Returns:
        What `model.generate` returns, with the padding removed from `sequences` and from the per-position outputs
        (prefill `hidden_states`, the query axis of prefill `attentions`, and any key axis that spans the padded
        sequence), and the dummy rows removed from every output. A returned cache holds the padded prompt: a later
        bucketed call that continues from it (multi-turn chat) pads the conversation the same way.

    Example:

    ```python
    >>> import prefill_buckets
    >>> from transformers import GenerationConfig

    >>> config = GenerationConfig(cache_implementation="static", max_new_tokens=8, do_sample=False)
    >>> out = prefill_buckets.generate(model, **inputs, generation_config=config, prefill_buckets=[16, 64])
    >>> out.shape[1] == inputs["input_ids"].shape[1] + 8
    True
    ```
    """
    wrapper = model if is_compiled_wrapper(model) else None
    model = getattr(model, "_orig_mod", model)  # an `OptimizedModule` hands `generate` to the module it wraps
    bound = _UPSTREAM_SIGNATURE.bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self")
    model_kwargs = arguments.pop("kwargs", {})
    field_kwargs = {field: model_kwargs.pop(field) for field in FIELDS if field in model_kwargs}
    generation_config = arguments.get("generation_config")

    active = _ACTIVE_PLAN.get()
    if active is not None and active.model is model:
        # Re-entered from inside a bucketed call (a model whose own `generate` calls ours): already padded.
        return UPSTREAM_GENERATE(model, **arguments, **model_kwargs)

    fields = resolve_fields(model, generation_config, field_kwargs)
    policy = policy_from_fields(**fields)
    continues = _continued_padding(model_kwargs)
    if policy is None and continues is not None:
        # The cache holds a bucketed call's padding: the prompt must get it too, bucket fields or not.
        policy = BucketPolicy(pad_to_multiple_of=1)
    if policy is None:
        record = _warn_unbucketed(model, wrapper, generation_config, arguments, model_kwargs)
        output = UPSTREAM_GENERATE(model, **arguments, **model_kwargs)
        if record is not None:
            record()
        return output

    skip_reason = _unsupported_reason(model, arguments, model_kwargs)
    if skip_reason is not None:
        logger.warning_once(
            f"The prefill bucket fields ({', '.join(f'`{f}`' for f in FIELDS)}) are ignored for this call: {skip_reason}"
        )
        return UPSTREAM_GENERATE(model, **arguments, **model_kwargs)

    plan, arguments, model_kwargs = _pad_inputs(model, policy, generation_config, arguments, model_kwargs)
    batch_policy = batch_policy_from_fields(**fields)
    if batch_policy is not None and continues is None:  # a cache's rows are fixed when it is filled
        plan, arguments, model_kwargs = _pad_rows(plan, batch_policy, generation_config, arguments, model_kwargs)
    else:
        plan.rows = plan.padded_rows = plan.batch_size * _rows_per_prompt(model, generation_config, model_kwargs)
    _check_pad_token_id(model, generation_config, model_kwargs, plan)
    with compiled_wrapper_forward(wrapper) if wrapper is not None else contextlib.nullcontext(), _bucketed_call(plan):
        output = UPSTREAM_GENERATE(model, **arguments, **model_kwargs)
    padding = (plan.pad, plan.padded_batch)
    for cache in (_passed_cache(model_kwargs), _passed_cache(output) if isinstance(output, ModelOutput) else None):
        if cache is not None:
            cache.__dict__[_CACHE_PADDING] = padding
    return _strip_output(output, plan)


def _unsupported_reason(model, arguments: dict, model_kwargs: dict) -> str | None:
    """Why this call runs unpadded, or raises for the cases padding can't serve; `None` when it can be bucketed."""
    if model.config.is_encoder_decoder:
        raise ValueError(
            f"The prefill bucket fields ({', '.join(f'`{f}`' for f in FIELDS)}) support decoder-only models, but "
            f"{type(model).__name__} is an encoder-decoder model. Its prompt goes to the encoder: pad it there with "
            "the tokenizer's `pad_to_multiple_of` (any side, with the attention mask), and unset the fields."
        )
    if arguments.get("custom_generate") is not None:
        return "`custom_generate` replaces the generation loop."
    if model_kwargs.get("cache_implementation") == "paged":
        return "`cache_implementation='paged'` switches to continuous batching, which schedules its own shapes."
    cache = _passed_cache(model_kwargs)
    cached_tokens = _cache_seq_length(cache) if cache is not None else 0
    if cached_tokens is None:
        return (
            "the cache passed in has only recurrent (linear-attention) layers, which don't tell how many tokens they "
            "hold, so the prompt can't be lined up with them. Let `generate` create the cache."
        )
    if cached_tokens > 0 and _CACHE_PADDING not in cache.__dict__:
        return (
            "the cache passed in already holds tokens from an unpadded call, so the prompt can't be padded in front "
            "of them. The call runs unpadded (exact output), and this prompt length may compile a new graph."
        )
    if "attention_mask" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no `attention_mask`, so padding could not be masked."
    return None


# Set on a cache filled by a bucketed call: `(columns added in front, batch size with dummy rows)`. A later call that
# continues from the cache (multi-turn chat) pads its prompt by the same columns, so cache and prompt line up.
_CACHE_PADDING = "_prefill_buckets_padding"


def _passed_cache(model_kwargs: dict):
    cache = next((model_kwargs[key] for key in _CACHE_KWARGS if model_kwargs.get(key) is not None), None)
    return cache if hasattr(cache, "get_seq_length") else None


def _cache_seq_length(cache) -> int | None:
    """The tokens a cache holds, or `None` when it can't tell (only recurrent layers, as in Mamba's cache)."""
    try:
        return int(cache.get_seq_length())  # a 0-d tensor for a static cache
    except ValueError:
        return None


def _continued_padding(model_kwargs: dict) -> tuple[int, int] | None:
    """`(pad, padded batch)` when the call continues from a cache that a bucketed call filled, else `None`."""
    cache = _passed_cache(model_kwargs)
    if cache is None or not _cache_seq_length(cache):
        return None
    return cache.__dict__.get(_CACHE_PADDING)


def _warn_unbucketed(model, wrapper, generation_config, arguments: dict, model_kwargs: dict):
    """
    The advice for a call without buckets: upstream runs unchanged, this only says what it will cost. Returns a
    function to call after the call (it records the shapes the call compiled for), or `None`.
    """
    if wrapper is not None and compiled_forward(model) is None:
        logger.warning_once(
            "`generate` was called on the `torch.compile(model)` wrapper (an `OptimizedModule`), which hands "
            "`generate` to the module it wraps: every forward of this call runs eagerly, and no compiled graph is "
            f"used. Set `{PREFILL_BUCKETS}` (the call then runs through the wrapper's compiled forward, with one graph "
            "per bucket), or compile in place with `model.compile(...)`."
        )
    compiled = compiled_forward(model)
    if compiled is None:
        return None
    cache = next((model_kwargs[key] for key in _CACHE_KWARGS if model_kwargs.get(key) is not None), None)
    static = type(cache).__name__ == "StaticCache" or (
        cache is None
        and _resolved(model, generation_config, model_kwargs, "cache_implementation")
        in ALL_STATIC_CACHE_IMPLEMENTATIONS
    )
    prompt = arguments.get("inputs")
    prompt = prompt if prompt is not None else model_kwargs.get("input_ids", model_kwargs.get("inputs_embeds"))
    if not static or not isinstance(prompt, torch.Tensor) or prompt.ndim < 2:
        return None
    lengths = model.__dict__.setdefault("_prefill_buckets_prompt_lengths", set())
    lengths.add(prompt.shape[1])
    if len(lengths) == 2:
        logger.warning_once(
            f"The model's forward is compiled ({compiled}) and generates with a static cache, so each new prompt "
            f"length recompiles it. Set `{PREFILL_BUCKETS}` (for example 'pow2') or `{PREFILL_PAD_TO_MULTIPLE_OF}`, "
            "or pad with the tokenizer's `pad_to_multiple_of` and `padding_side='left'`."
        )
    rows = prompt.shape[0] * max(
        _resolved(model, generation_config, model_kwargs, "num_beams") or 1,
        _resolved(model, generation_config, model_kwargs, "num_return_sequences") or 1,
    )

    def record():
        # Unbucketed graphs share the compiled function's recompile limit with bucketed ones: count them too.
        budget = graph_budget(model)
        budget.add(rows, prompt.shape[1], getattr(model, "_previous_max_cache_length", -1))
        limit = torch._dynamo.config.recompile_limit
        if budget.graphs + 1 >= limit and not budget.warned_near_limit:
            budget.warned_near_limit = True
            logger.warning(
                f"The compiled forward has needed {budget.graphs} graphs (one prefill graph per prompt length, and "
                f"decode graphs per cache length), and torch's `torch._dynamo.config.recompile_limit` is {limit}: "
                f"past it, torch silently runs the forward eagerly. Set `{PREFILL_BUCKETS}` to bound the graphs."
            )

    return record


def _resolved(model, generation_config, model_kwargs, name):
    """A generation field with upstream's priority (kwargs > `generation_config` > `model.generation_config`)."""
    if model_kwargs.get(name) is not None:
        return model_kwargs[name]
    if generation_config is not None and getattr(generation_config, name, None) is not None:
        return getattr(generation_config, name)
    return getattr(model.generation_config, name, None)


def _rows_per_prompt(model, generation_config, model_kwargs) -> int:
    return max(
        _resolved(model, generation_config, model_kwargs, "num_beams") or 1,
        _resolved(model, generation_config, model_kwargs, "num_return_sequences") or 1,
    )


def _resolved_token_id(model, generation_config, model_kwargs, name):
    """A special token id (or list of ids) as plain ints."""
    value = _resolved(model, generation_config, model_kwargs, name)
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return value


def _pad_token_id(model, generation_config, model_kwargs) -> int:
    """The id that fills the added positions. They are masked, so any id in the vocabulary gives the same output."""
    vocab_size = model.get_input_embeddings().num_embeddings
    pad_token_id = _resolved_token_id(model, generation_config, model_kwargs, "pad_token_id")
    eos_token_id = _resolved_token_id(model, generation_config, model_kwargs, "eos_token_id")
    candidates = [pad_token_id, *(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]), 0]
    return next(c for c in candidates if isinstance(c, int) and 0 <= c < vocab_size)


def _vocabulary_size(model) -> int | None:
    embeddings = model.get_input_embeddings()
    size = getattr(embeddings, "num_embeddings", None)
    return size if isinstance(size, int) else None


def _check_ids_in_vocabulary(model, input_ids: torch.Tensor) -> None:
    """Raises `ValueError` for an id the embedding can't look up (an index error on CPU, a device assert on CUDA)."""
    vocab_size = _vocabulary_size(model)
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


def _check_pad_token_id(model, generation_config, model_kwargs, plan: "_Plan") -> None:
    """
    Raises `ValueError` when finished rows would be fed a pad id the embedding can't look up. Upstream fills rows
    that stop early with `pad_token_id` and feeds it back to the model; dummy rows of `prefill_batch_buckets` stop
    at once. With one row (or beam search) nothing is fed, and the id is never used.
    """
    pad_token_id = _resolved_token_id(model, generation_config, model_kwargs, "pad_token_id")
    vocab_size = _vocabulary_size(model)
    if not isinstance(pad_token_id, int) or vocab_size is None or 0 <= pad_token_id < vocab_size:
        return
    if plan.padded_rows > 1 and (_resolved(model, generation_config, model_kwargs, "num_beams") or 1) == 1:
        raise ValueError(
            f"`pad_token_id` is {pad_token_id}, outside the model's vocabulary (valid ids: 0 to {vocab_size - 1}). "
            f"This call generates {plan.padded_rows} rows: a row that finishes before the others is filled with "
            "`pad_token_id` and fed back to the model, which can't look it up. Set `pad_token_id` to an id in the "
            "vocabulary (the eos token id is the usual choice)."
        )


def _max_positions(model) -> int | None:
    """The model's `max_position_embeddings`, when its config states one."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    max_positions = getattr(config, "max_position_embeddings", None)
    return max_positions if isinstance(max_positions, int) and not isinstance(max_positions, bool) else None


def _capped_bucket(model, policy: BucketPolicy, prompt_length: int) -> int:
    """
    The bucket of a prompt, but never more positions than the model has (`max_position_embeddings`), unless the
    prompt itself is longer: then it is not padded at all.
    """
    padded_length = policy.bucket(prompt_length)
    max_positions = _max_positions(model)
    if max_positions is not None and padded_length > max_positions:
        capped = max(prompt_length, max_positions)
        logger.warning_once(
            f"The bucket of a {prompt_length}-token prompt is {padded_length}, more positions than the model has "
            f"(`max_position_embeddings={max_positions}`), so it is padded to {capped} instead. Prompts this long "
            f"share that length, and its compiled graph; make {max_positions} your largest bucket to say so."
        )
        padded_length = capped
    return padded_length


def _pad_token_is_inferable(model, generation_config, model_kwargs) -> bool:
    """Whether pad tokens in `input_ids` tell the padding, as upstream infers it: a pad token that is not eos."""
    pad_token_id = _resolved_token_id(model, generation_config, model_kwargs, "pad_token_id")
    eos_token_id = _resolved_token_id(model, generation_config, model_kwargs, "eos_token_id")
    eos_ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
    return pad_token_id is not None and pad_token_id not in eos_ids


def _default_attention_mask(model, generation_config, model_kwargs, input_ids: torch.Tensor) -> torch.Tensor:
    """The mask upstream infers when none is passed: pad tokens are masked, unless the pad token is also eos."""
    if _pad_token_is_inferable(model, generation_config, model_kwargs):
        pad_token_id = _resolved_token_id(model, generation_config, model_kwargs, "pad_token_id")
        if (input_ids == pad_token_id).any():
            return input_ids.ne(pad_token_id).long()
    return torch.ones(input_ids.shape[:2], dtype=torch.long, device=input_ids.device)


def _pad_inputs(model, policy: BucketPolicy, generation_config, arguments: dict, model_kwargs: dict):
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
        bos_token_id = _resolved_token_id(model, generation_config, model_kwargs, "bos_token_id")
        if bos_token_id is None:
            raise ValueError("`bos_token_id` has to be defined when no `input_ids` are provided.")
        batch_size = next((v.shape[0] for v in model_kwargs.values() if isinstance(v, torch.Tensor)), 1)
        input_ids = torch.full((batch_size, 1), bos_token_id, dtype=torch.long, device=model.device)
        prompt_length = 1
    if prompt_length == 0:
        raise ValueError(
            f"The prompt is empty (0 tokens). `{PREFILL_BUCKETS}` pads a prompt up to a bucket, so it needs at least "
            "one token: start the prompt with the BOS token."
        )

    continued = _continued_padding(model_kwargs)
    if continued is not None:
        # Continuing from a cache a bucketed call filled: its first `pad` slots are padding, so the prompt (the
        # whole conversation so far) gets the same padding in front.
        pad, padded_batch = continued
        batch_size = (inputs_embeds if inputs_embeds is not None else input_ids).shape[0]
        if padded_batch != batch_size:
            raise ValueError(
                f"The cache passed in was filled by a call padded to {padded_batch} rows with `{PREFILL_BATCH_BUCKETS}`"
                f", but this call has {batch_size}. Continue from a cache with the batch it was filled with: pass "
                f"`{PREFILL_BATCH_BUCKETS}=None` to the call that fills it."
            )
        padded_length = prompt_length + pad
    else:
        padded_length = _capped_bucket(model, policy, prompt_length)
    if continued is None and policy.exceeds_buckets(prompt_length):
        logger.warning_once(
            f"A prompt of {prompt_length} tokens is longer than the largest of `{PREFILL_BUCKETS}` "
            f"({policy.largest_bucket}), so it is padded to {padded_length}. Each such length compiles a new graph: "
            f"add a larger bucket, or set `{PREFILL_PAD_TO_MULTIPLE_OF}` to choose the length for long prompts."
        )
    pad = padded_length - prompt_length
    pad_token_id = _pad_token_id(model, generation_config, model_kwargs)
    if input_ids is not None and input_ids.numel() > 0:
        _check_ids_in_vocabulary(model, input_ids)

    if model_kwargs.get("attention_mask") is None:
        mask_source = input_ids if input_ids is not None and input_ids.shape[1] == prompt_length else None
        if mask_source is not None:
            model_kwargs["attention_mask"] = _default_attention_mask(
                model, generation_config, model_kwargs, mask_source
            )
            if mask_source.shape[0] > 1 and not _pad_token_is_inferable(model, generation_config, model_kwargs):
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

    ids_pad = 0
    if input_ids is not None:
        if input_ids.shape[1] == prompt_length:
            ids_pad = pad
            input_ids = left_pad(input_ids, pad, pad_token_id)
        elif input_ids.shape[1] != 0:
            raise ValueError(
                f"`input_ids` ({input_ids.shape[1]} tokens) and `inputs_embeds` ({prompt_length} positions) must have "
                f"the same length to be padded with `{PREFILL_BUCKETS}`; pass `inputs_embeds` alone."
            )
        model_kwargs["input_ids"] = input_ids
    if inputs_embeds is not None:
        pad_embedding = model.get_input_embeddings().weight[pad_token_id].detach()
        model_kwargs["inputs_embeds"] = left_pad(inputs_embeds, pad, pad_embedding, dim=1)

    for key, fill in _PER_TOKEN_KWARGS.items():
        value = model_kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.shape[-1] == prompt_length:
            model_kwargs[key] = left_pad(value, pad, fill)

    streamer = arguments.get("streamer")
    if streamer is not None and ids_pad > 0:
        arguments["streamer"] = _PromptStrippingStreamer(streamer, ids_pad)

    batch_size = (model_kwargs["inputs_embeds"] if inputs_embeds is not None else input_ids).shape[0]
    plan = _Plan(
        model,
        policy,
        prompt_length=prompt_length,
        padded_length=padded_length,
        ids_pad=ids_pad,
        batch_size=batch_size,
        padded_batch=batch_size,
    )
    return plan, arguments, model_kwargs


def _pad_rows(plan: _Plan, batch_policy: BucketPolicy, generation_config, arguments: dict, model_kwargs: dict):
    """
    Appends dummy rows up to the batch bucket: one unmasked pad token each (a fully masked row would give NaNs), no
    other inputs. A stopping criterion marks them finished from the first step, so they never keep generation going,
    and `_strip_output` drops them.
    """
    model = plan.model
    input_ids = model_kwargs.get("input_ids")
    prompt = model_kwargs["inputs_embeds"] if model_kwargs.get("inputs_embeds") is not None else input_ids
    batch_size = prompt.shape[0]
    padded_batch = batch_policy.bucket(batch_size)
    expand = _rows_per_prompt(model, generation_config, model_kwargs)
    plan.rows = plan.padded_rows = batch_size * expand
    if padded_batch == batch_size:
        return plan, arguments, model_kwargs
    known = {"input_ids", "inputs_embeds", *_PER_TOKEN_KWARGS}
    per_row = sorted(
        k
        for k, v in model_kwargs.items()
        if isinstance(v, torch.Tensor) and k not in known and v.shape[:1] == (batch_size,)
    )
    if (_resolved(model, generation_config, model_kwargs, "num_beams") or 1) > 1 or per_row:
        reason = "beam search ranks rows together" if not per_row else f"it can't pad the per-row input {per_row[0]!r}"
        logger.warning_once(f"`{PREFILL_BATCH_BUCKETS}` is not applied to this call: {reason}.")
        return plan, arguments, model_kwargs
    if arguments.get("negative_prompt_ids") is not None:
        logger.warning_once(
            f"`{PREFILL_BATCH_BUCKETS}` is not applied to this call: it can't pad `negative_prompt_ids`."
        )
        return plan, arguments, model_kwargs

    extra = padded_batch - batch_size
    pad_token_id = _pad_token_id(model, generation_config, model_kwargs)
    length = plan.padded_length
    model_kwargs = dict(model_kwargs)
    dummy_mask = torch.zeros(extra, length, dtype=torch.long, device=prompt.device)
    dummy_mask[:, -1] = 1
    if input_ids is not None and input_ids.shape[1] > 0:
        dummy = torch.full((extra, input_ids.shape[1]), pad_token_id, dtype=input_ids.dtype, device=input_ids.device)
        model_kwargs["input_ids"] = torch.cat([input_ids, dummy])
    elif input_ids is not None:
        model_kwargs["input_ids"] = input_ids.new_empty(padded_batch, 0)
    if model_kwargs.get("inputs_embeds") is not None:
        embeds = model_kwargs["inputs_embeds"]
        pad_embedding = model.get_input_embeddings().weight[pad_token_id].detach().to(embeds.dtype)
        model_kwargs["inputs_embeds"] = torch.cat([embeds, pad_embedding.expand(extra, *embeds.shape[1:])])
    for key in _PER_TOKEN_KWARGS:
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
    criteria.append(_DummyRowsFinished(first_dummy_row=batch_size * expand))
    arguments = dict(arguments, stopping_criteria=criteria)
    plan.padded_rows = padded_batch * expand
    plan.padded_batch = padded_batch
    if isinstance(arguments.get("streamer"), _PromptStrippingStreamer):
        arguments["streamer"].rows = batch_size * expand
    elif arguments.get("streamer") is not None:
        arguments["streamer"] = _PromptStrippingStreamer(arguments["streamer"], 0, rows=batch_size * expand)
    return plan, arguments, model_kwargs


class _DummyRowsFinished(StoppingCriteria):
    """Reports the dummy rows added by `prefill_batch_buckets` as finished, from the first step on."""

    def __init__(self, first_dummy_row: int):
        self.first_dummy_row = first_dummy_row

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        finished[self.first_dummy_row :] = True
        return finished


class _PromptStrippingStreamer(BaseStreamer):
    """Hands the wrapped streamer the prompt without the added columns, and every value without dummy rows."""

    def __init__(self, streamer: BaseStreamer, pad: int, rows: int | None = None):
        self.streamer = streamer
        self.pad = pad
        self.rows = rows  # the user's rows, when `prefill_batch_buckets` added dummy ones after them
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            value = strip_left(value, self.pad)
        if self.rows is not None:
            value = value[: self.rows]
        self.streamer.put(value)

    def end(self):
        self.streamer.end()

    def __getattr__(self, name):
        return getattr(self.streamer, name)


# ---------------------------------------------------------------------------------------------------------------
# Hooks on the model instance, live while a bucketed call runs
# ---------------------------------------------------------------------------------------------------------------

_hook_lock = threading.Lock()
_hook_users: dict[int, int] = {}  # id(model) -> calls in flight that rely on its hooks
_fallbacks: dict[int, dict[str, Any]] = {}  # id(model) -> compiled callables wrapped in an `EagerFallback`
_sdpa_skip: dict[str, Any] = {}  # "original": upstream's `_ignore_causal_mask_sdpa` while any bucketed call runs


def _hook_prepare_generated_length(original, model):
    @functools.wraps(original)
    def hooked(
        generation_config,
        has_default_max_length,
        has_default_min_length,
        model_input_name,
        input_ids_length,
        inputs_tensor,
    ):
        plan = _ACTIVE_PLAN.get()
        if plan is None or plan.model is not model:
            return original(
                generation_config,
                has_default_max_length,
                has_default_min_length,
                model_input_name,
                input_ids_length,
                inputs_tensor,
            )
        # Resolve the lengths as upstream would for the unpadded prompt, then move them by the added columns.
        unpadded_ids_length = input_ids_length - plan.ids_pad
        generation_config = original(
            generation_config,
            has_default_max_length,
            has_default_min_length,
            model_input_name,
            unpadded_ids_length,
            strip_left(inputs_tensor, plan.pad, dim=1),
        )
        if unpadded_ids_length >= generation_config.max_length:
            # Upstream's own check, made here so that it names the lengths the user passed.
            raise ValueError(
                f"Input length of input_ids is {unpadded_ids_length}, but `max_length` is set to "
                f"{generation_config.max_length}. This can lead to unexpected behavior. You should consider "
                "increasing `max_length` or, better yet, setting `max_new_tokens`."
            )
        generation_config.max_length += plan.ids_pad
        if generation_config.min_length is not None:
            generation_config.min_length += plan.ids_pad
        return generation_config

    return hooked


def _hook_prepare_cache_for_generation(original, model):
    @functools.wraps(original)
    def hooked(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length):
        plan = _ACTIVE_PLAN.get()
        if plan is None or plan.model is not model:
            return original(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        passed_cache = _passed_cache(model_kwargs)  # `cache` from transformers 5.24 on, `past_key_values` before
        creates_static = (
            passed_cache is None and generation_config.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS
        )
        if not (creates_static or getattr(passed_cache, "is_compileable", False)):
            return original(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        # `generation_config` is upstream's private copy: what the user passed is untouched.
        sized_here = creates_static and generation_config.max_cache_len is None
        if sized_here:
            # The cache the model already has, when this call fits in it (one decode graph, as after `precompile`),
            # else the next geometric size: a few cache lengths, so a few decode graphs, for any mix of prompts.
            previous = getattr(model, "_previous_max_cache_length", -1)
            fits = isinstance(previous, int) and previous >= max_cache_length
            generation_config.max_cache_len = previous if fits else plan.policy.cache_length(max_cache_length)
        if generation_config.compile_config is not None:
            # An explicit `compile_config` compiles on every device, CPU included (upstream: CUDA/XPU only).
            generation_config.compile_config._compile_all_devices = True
        result = original(generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
        if sized_here:
            # The cache is made. Unset again, so configs derived from this one (an assistant model's) don't inherit it.
            generation_config.max_cache_len = None
        cache = _passed_cache(model_kwargs)
        # What prefill runs on: the padded prompt, or, continuing from a cache, the tokens the cache lacks.
        prefill = plan.padded_length - (_cache_seq_length(cache) or 0)
        auto_compile = model._valid_auto_compile_criteria(model_kwargs, generation_config)
        if creates_static and (auto_compile or compiled_forward(model) is not None):
            # Allocate the cache now, outside the compiled forward, as upstream does for chunked prefill: tensors
            # allocated inside the first compiled prefill are not static addresses, which CUDA graphs need.
            rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
            _early_initialize(model, cache, rows)
        if (
            auto_compile
            and generation_config.prefill_chunk_size is None
            and (_CHUNKED_PREFILL_RESUMES or prefill == plan.padded_length)
        ):
            # Upstream compiles decode only and runs prefill eagerly, since prefill shapes are unbounded. Here they
            # are the buckets: one chunk of the whole padded prompt sends prefill through the same compiled call.
            generation_config.prefill_chunk_size = prefill
        chunk = generation_config.prefill_chunk_size
        if chunk is not None and prefill % chunk:
            logger.warning_once(
                f"`prefill_chunk_size={chunk}` does not divide the padded prompt length {prefill}, so the last chunk "
                f"has its own shape, and its own compiled graph. Set `{PREFILL_PAD_TO_MULTIPLE_OF}` to a multiple of "
                f"{chunk}: then every chunk of every prompt shares one prefill graph."
            )
        if auto_compile or compiled_forward(model) is not None:
            rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
            cache_length = cache.get_max_length() if hasattr(cache, "get_max_length") else -1
            # Chunked prefill runs a graph per chunk shape: the chunk, and a shorter last chunk if any.
            shapes = {prefill} if chunk is None else {min(chunk, prefill), prefill % chunk}
            for prefill_length in shapes - {0}:
                _account_graphs(model, rows, prefill_length, cache_length)
        plan.recompile_limit = torch._dynamo.config.recompile_limit
        return result

    return hooked


# Before transformers 5.21, chunked prefill feeds the whole `input_ids` from position 0, even when the cache already
# holds their start: a call continuing from a cache must then prefill in one (eager) forward.
_CHUNKED_PREFILL_RESUMES = version.parse(transformers.__version__).release >= (5, 21)


def _early_initialize(model, cache, rows: int) -> None:
    """Allocates a lazily initialized static cache for `rows` rows, when the model's layout allows it."""
    shape = model._get_static_cache_init_shape() if hasattr(model, "_get_static_cache_init_shape") else None
    if shape is None or not hasattr(cache, "early_initialization"):
        return
    num_heads, head_dim = shape
    declared = _attention_kv_heads(model)
    if declared and set(num_heads if isinstance(num_heads, list) else [num_heads]) != declared:
        # The config misstates the key/value heads (multi-query Falcon: 1, whatever `num_kv_heads` says). Leave the
        # cache to initialize from the first keys it gets: exact, at the cost of one more graph on the first call.
        return
    cache.early_initialization(
        batch_size=rows, num_heads=num_heads, head_dim=head_dim, dtype=model.dtype, device=model.device
    )


def _attention_kv_heads(model) -> set[int]:
    """The key/value head counts the attention modules hold themselves, where they do (cached on the model)."""
    heads = model.__dict__.get("_prefill_buckets_kv_heads")
    if heads is None:
        heads = set()
        for module in model.modules():
            for name in ("num_key_value_heads", "num_kv_heads"):
                value = module.__dict__.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and module is not model:
                    heads.add(value)
        object.__setattr__(model, "_prefill_buckets_kv_heads", heads)
    return heads


def _account_graphs(model, rows: int, prefill_length: int, cache_length: int) -> None:
    """Keeps torch's recompile limit above the graphs this workload has needed, and says so when it raises it."""
    budget = graph_budget(model)
    if not budget.add(rows, prefill_length, cache_length):
        return
    limit = torch._dynamo.config.recompile_limit
    if budget.graphs > limit:
        raised = max(budget.graphs, 2 * limit)
        torch._dynamo.config.recompile_limit = raised
        logger.warning_once(
            f"Prefill buckets have needed {budget.graphs} compiled graphs so far ({len(budget.prefill)} prefill, "
            f"{len(budget.decode)} decode shapes), more than torch's `torch._dynamo.config.recompile_limit` "
            f"({limit}), past which torch silently runs the forward eagerly. Raised the limit to {raised}. To need "
            "fewer graphs: pin `max_cache_len` (one decode graph per batch size), use fewer buckets, or call "
            "`prefill_buckets.precompile` to compile them all up front."
        )


def _hook_prepare_inputs_for_generation(original, model):
    @functools.wraps(original)
    def hooked(input_ids, *args, **kwargs):
        plan = _ACTIVE_PLAN.get()
        if plan is not None and plan.model is model and kwargs.get("attention_mask") is None:
            # Upstream dropped an all-ones mask. Put it back, with the length upstream would have carried: the
            # tokens already in the cache plus the ones this forward adds.
            cache = next((kwargs[key] for key in _CACHE_KWARGS if kwargs.get(key) is not None), None)
            past_length = (_cache_seq_length(cache) or 0) if cache is not None else 0
            next_sequence_length = kwargs.get("next_sequence_length")
            inputs_embeds = kwargs.get("inputs_embeds")
            if next_sequence_length is not None:  # decode: the new tokens are the last ones of `input_ids`
                total_length = past_length + next_sequence_length
            elif inputs_embeds is not None and kwargs.get("is_first_iteration"):
                total_length = inputs_embeds.shape[1]
            elif input_ids.shape[1] > past_length:  # the whole sequence so far
                total_length = input_ids.shape[1]
            else:  # a later chunk of chunked prefill: only the chunk's ids
                total_length = past_length + input_ids.shape[1]
            kwargs["attention_mask"] = torch.ones(
                input_ids.shape[0], total_length, dtype=torch.long, device=input_ids.device
            )
        if plan is None or plan.model is not model:
            return original(input_ids, *args, **kwargs)
        if plan.recompile_limit is not None and torch._dynamo.config.recompile_limit < plan.recompile_limit:
            # transformers < 5.23 sets the limit to 64 before every chunked prefill, which a bucketed call with
            # `compile_config` runs: never below what this workload needs (or what the user set).
            torch._dynamo.config.recompile_limit = plan.recompile_limit
        token = _MATERIALIZE_SDPA_MASK.set(True)
        try:
            model_inputs = original(input_ids, *args, **kwargs)
        finally:
            _MATERIALIZE_SDPA_MASK.reset(token)
        _materialize_recurrent_masks(model_inputs, kwargs.get("attention_mask"))
        # Chunked prefill slices per-token inputs out of the whole prompt's: views whose strides depend on the prompt
        # length, which a compiled forward guards on. Fresh copies give every chunk of every prompt one signature.
        for key in _PER_TOKEN_KWARGS:
            value = model_inputs.get(key)
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and key != "attention_mask":
                model_inputs[key] = value.clone(memory_format=torch.contiguous_format)
        return model_inputs

    return hooked


def _recurrent_mask_keys() -> tuple[str, ...]:
    """The layer types whose mask is a recurrent layers' 2D padding mask (Mamba, linear attention, convolutions)."""
    recurrent = getattr(masking_utils, "create_recurrent_attention_mask", None)
    mapping = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    return tuple(key for key, function in mapping.items() if recurrent is not None and function is recurrent)


def _materialize_recurrent_masks(model_inputs: dict, attention_mask) -> None:
    """
    A hybrid model's masks come as a dict per layer type. For recurrent layers upstream gives `None` when the 2D
    mask is all ones (an exact-fit prompt), and the padding mask otherwise: two graphs per bucket. Putting the
    all-ones mask in gives exact fits the signature of the padded prompts in their bucket; multiplying by ones
    changes nothing.
    """
    masks = model_inputs.get("attention_mask")
    if not isinstance(masks, dict) or not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
        return
    tokens = model_inputs.get("input_ids")
    if tokens is None:
        tokens = model_inputs.get("inputs_embeds")
    if tokens is None or tokens.shape[1] <= 1:  # decode steps never get a recurrent mask
        return
    for key in _recurrent_mask_keys():
        if key in masks and masks[key] is None:
            masks[key] = attention_mask[:, -tokens.shape[1] :].contiguous()


# True while a bucketed call builds its 4D masks: the mask is then always a tensor, never SDPA's `is_causal` skip.
_MATERIALIZE_SDPA_MASK: contextvars.ContextVar[bool] = contextvars.ContextVar("prefill_buckets_mask", default=False)


def _hook_ignore_causal_mask_sdpa(original):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        # Inside a compiled forward (a model building its own mask), stay out of the graph: upstream's rule applies.
        if not torch.compiler.is_compiling() and _MATERIALIZE_SDPA_MASK.get():
            return False
        return original(*args, **kwargs)

    return hooked


# Processors that count the sequence length against values `_prepare_generated_length` moved by the padding (or that
# upstream set up with the padded prompt length): they must see the padded ids. Every other processor and stopping
# criterion reads token content (n-grams, prefixes, bad words, the user's own), and sees the ids without padding.
_PADDED_VIEW = tuple(
    getattr(logits_process, name)
    for name in (
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "ExponentialDecayLengthPenalty",
        "ForcedEOSTokenLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor",
    )
    if hasattr(logits_process, name)
) + (MaxLengthCriteria,)


class _UnpaddedProcessor(LogitsProcessor):
    """Runs a logits processor on the ids without the added columns."""

    def __init__(self, processor, pad: int):
        self.processor = processor
        self.pad = pad

    def __call__(self, input_ids, scores):
        return self.processor(input_ids[:, self.pad :], scores)

    def __getattr__(self, name):
        return getattr(self.processor, name)


class _UnpaddedCriterion(StoppingCriteria):
    """Runs a stopping criterion on the ids without the added columns."""

    def __init__(self, criterion, pad: int):
        self.criterion = criterion
        self.pad = pad

    def __call__(self, input_ids, scores, **kwargs):
        return self.criterion(input_ids[:, self.pad :], scores, **kwargs)

    def __getattr__(self, name):
        return getattr(self.criterion, name)


def _skips_left_padding(processor, user_processors) -> bool:
    """
    Whether upstream built `processor` to skip the left padding itself: from transformers 5.23 on, its repetition
    penalty gets `prompt_ignore_length` from the (padded) attention mask, so it must see the ids that mask spans.
    """
    ignore_length = getattr(processor, "prompt_ignore_length", None)
    return isinstance(ignore_length, torch.Tensor) and id(processor) not in user_processors


def _hook_get_logits_processor(original, model):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        processors = original(*args, **kwargs)
        plan = _ACTIVE_PLAN.get()
        if plan is None or plan.model is not model or plan.ids_pad == 0:
            return processors
        user_processors = {id(p) for p in kwargs.get("logits_processor") or ()}
        wrapped = LogitsProcessorList()
        for processor in processors:
            plain = len(inspect.signature(processor.__call__).parameters) == 2  # extra arguments: leave it be
            padded_view = isinstance(processor, _PADDED_VIEW) or _skips_left_padding(processor, user_processors)
            if plain and not padded_view:
                processor = _UnpaddedProcessor(processor, plan.ids_pad)
            wrapped.append(processor)
        return wrapped

    return hooked


def _padded_criterion(criterion, pad: int):
    if not isinstance(criterion, _PADDED_VIEW):
        return _UnpaddedCriterion(criterion, pad)
    if isinstance(criterion, MaxLengthCriteria) and criterion.max_position_embeddings is not None:
        # It warns once the sequence passes the model's positions; the added columns take none of them.
        criterion = copy.copy(criterion)
        criterion.max_position_embeddings += pad
    return criterion


def _hook_get_stopping_criteria(original, model):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        criteria = original(*args, **kwargs)
        plan = _ACTIVE_PLAN.get()
        if plan is None or plan.model is not model or plan.ids_pad == 0:
            return criteria
        return StoppingCriteriaList(_padded_criterion(c, plan.ids_pad) for c in criteria)

    return hooked


class _UnpaddedPromptLookup:
    """Runs prompt-lookup decoding's n-gram search on the ids without the added columns, as an unpadded run does."""

    def __init__(self, generator, pad: int):
        self.generator = generator
        self.pad = pad
        generator.max_length -= pad  # compared with the length of the ids it sees

    def get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = self.generator.get_candidates(input_ids[:, self.pad :], *args, **kwargs)
        return torch.cat([input_ids[:, : self.pad], candidates], dim=1), logits

    def update_candidate_strategy(self, input_ids, *args, **kwargs):
        return self.generator.update_candidate_strategy(input_ids[:, self.pad :], *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.generator, name)


def _hook_get_candidate_generator(original, model):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        generator = original(*args, **kwargs)
        plan = _ACTIVE_PLAN.get()
        if plan is None or plan.model is not model or plan.ids_pad == 0:
            return generator
        # Its candidates come from the ids' content: with the padding in front, a match could start in it. An
        # assistant model's candidates come from a forward with the attention mask, which hides the padding.
        if type(generator).__name__ == "PromptLookupCandidateGenerator":
            return _UnpaddedPromptLookup(generator, plan.ids_pad)
        return generator

    return hooked


def _hook_get_compiled_call(original, model):
    @functools.wraps(original)
    def hooked(*args, **kwargs):
        compiled = original(*args, **kwargs)
        plan = _ACTIVE_PLAN.get()
        if plan is None or plan.model is not model or compiled == model.__call__:
            return compiled
        return EagerFallback(model, compiled, model.__call__)

    return hooked


_HOOKS = {
    "_prepare_generated_length": _hook_prepare_generated_length,
    "_prepare_cache_for_generation": _hook_prepare_cache_for_generation,
    "prepare_inputs_for_generation": _hook_prepare_inputs_for_generation,
    "_get_logits_processor": _hook_get_logits_processor,
    "_get_stopping_criteria": _hook_get_stopping_criteria,
    "get_compiled_call": _hook_get_compiled_call,
    "_get_candidate_generator": _hook_get_candidate_generator,
}


def _install_fallbacks(model) -> dict[str, Any]:
    """
    Wraps the user's compiled forward (`model.compile()`, or a compiled `forward`) in an `EagerFallback` for the
    duration of bucketed calls. Returns what was replaced, for `_remove_fallbacks`.
    """
    replaced = {}
    impl = model.__dict__.get("_compiled_call_impl")
    if impl is not None and not isinstance(impl, EagerFallback):
        replaced["_compiled_call_impl"] = impl
        object.__setattr__(model, "_compiled_call_impl", EagerFallback(model, impl, model._call_impl))
    forward = model.__dict__.get("forward")
    if hasattr(forward, "_torchdynamo_orig_callable") and not isinstance(forward, EagerFallback):
        replaced["forward"] = forward
        object.__setattr__(model, "forward", EagerFallback(model, forward, forward._torchdynamo_orig_callable))
    return replaced


def _remove_fallbacks(model, replaced: dict[str, Any]) -> None:
    for name, original in replaced.items():
        current = model.__dict__.get(name)
        if isinstance(current, EagerFallback) and current.compiled is original:  # else the user has set another
            object.__setattr__(model, name, original)


@contextlib.contextmanager
def _bucketed_call(plan: _Plan):
    """
    Makes `plan` the active plan of this thread (and task) and installs the hooks on the model instance while any
    bucketed call on it runs. The hooks act only for the model and the context whose plan is active, so concurrent
    calls, on one model or several, don't see each other's plans.
    """
    model = plan.model
    with _hook_lock:
        first_for_model = id(model) not in _hook_users
        if first_for_model:
            overridden = [name for name in _HOOKS if name in model.__dict__]
            if overridden:
                raise RuntimeError(
                    f"`{type(model).__name__}` has `{overridden[0]}` set on the instance, which prefill buckets need to "
                    "hook for the duration of the call. Set it on a subclass instead."
                )
        if not _hook_users:
            _sdpa_skip["original"] = masking_utils._ignore_causal_mask_sdpa
            masking_utils._ignore_causal_mask_sdpa = _hook_ignore_causal_mask_sdpa(_sdpa_skip["original"])
        if first_for_model:
            for name, make_hook in _HOOKS.items():
                if hasattr(model, name):
                    object.__setattr__(model, name, make_hook(getattr(model, name), model))
            _fallbacks[id(model)] = _install_fallbacks(model)
        _hook_users[id(model)] = _hook_users.get(id(model), 0) + 1
    token = _ACTIVE_PLAN.set(plan)
    try:
        yield
    finally:
        _ACTIVE_PLAN.reset(token)
        with _hook_lock:
            _hook_users[id(model)] -= 1
            if _hook_users[id(model)] == 0:
                del _hook_users[id(model)]
                for name in _HOOKS:
                    model.__dict__.pop(name, None)
                _remove_fallbacks(model, _fallbacks.pop(id(model)))
            if not _hook_users:
                masking_utils._ignore_causal_mask_sdpa = _sdpa_skip.pop("original")


# ---------------------------------------------------------------------------------------------------------------
# Taking the padding off the output
# ---------------------------------------------------------------------------------------------------------------


def _strip_output(output, plan: _Plan):
    """Removes the added columns and dummy rows from what `generate` returns (a tensor, or a `ModelOutput`)."""
    if plan.padded_rows > plan.rows:
        output = _take_rows(output, plan.rows)
    if isinstance(output, torch.Tensor):
        return strip_left(output, plan.ids_pad)
    if not isinstance(output, ModelOutput):
        return output
    sequences = output.get("sequences")
    if sequences is not None:
        output["sequences"] = strip_left(sequences, plan.ids_pad)
    padded_total = plan.padded_length  # sequence length the model has seen, at the current step
    if output.get("hidden_states") is not None:
        steps = list(output["hidden_states"])
        if steps:  # prefill: [B, S, H] per layer, S spans the padded prompt
            steps[0] = tuple(_strip_if(h, 1, plan.padded_length, plan.pad) for h in steps[0])
        output["hidden_states"] = tuple(steps)
    if output.get("attentions") is not None:
        steps = []
        for step, layers in enumerate(output["attentions"]):
            seen = padded_total + step
            new_layers = []
            for attention in layers:  # [B, heads, query, key]
                if step == 0:
                    attention = _strip_if(attention, -2, plan.padded_length, plan.pad)
                new_layers.append(_strip_if(attention, -1, seen, plan.pad))
            steps.append(tuple(new_layers))
        output["attentions"] = tuple(steps)
    return output


def _take_rows(value, rows: int):
    """The first `rows` rows of every tensor in `value` (a tensor, nested tuples, or a `ModelOutput`; not the cache)."""
    if isinstance(value, torch.Tensor):
        return value[:rows]
    if isinstance(value, ModelOutput):
        for key in list(value.keys()):
            if key not in _CACHE_KWARGS:
                value[key] = _take_rows(value[key], rows)
        return value
    if isinstance(value, tuple):
        return tuple(_take_rows(item, rows) for item in value)
    return value


def _strip_if(tensor, dim: int, padded_size: int, pad: int):
    """Strips `pad` from `dim` when that axis spans the padded sequence, as a dynamic cache's key axis does."""
    if tensor is None or tensor.shape[dim] != padded_size:
        return tensor
    return strip_left(tensor, pad, dim=dim)

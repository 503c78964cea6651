"""`generate` with bucketed prefill: resolve -> plan and pad -> upstream generate, hooked -> strip.

Upstream `generate` does all the real work. The data flow of one bucketed call:

1. `settings.resolve_settings`: the bucket fields and the generation values padding depends on, resolved once.
2. `padding_side.choose_side`: right or left padding for this call, and why (the one rule).
   `inputs.pad_inputs` / `inputs.pad_rows`: the prompt padded to its bucket, the batch to its batch bucket; a `Plan`
   says what was added. On the right (`inputs.plan_right`) the prompt stays unpadded: the `_prefill` hook pads it.
3. `hooks.bucketed_call`: upstream `generate` runs on the padded inputs, with the steps that must see through the
   padding hooked on the model instance for the duration of the call.
4. `output.strip_output`: the added columns and rows come off what the user gets back.

Steps 1 and 2 run inside `distributed.ranks_agree`: under tensor parallelism the ranks compare their calls and share
what the checks raised before any rank goes on, so no rank raises alone while the others wait in a collective.

A call without bucket fields is upstream `generate`, unchanged; this module only warns when it will recompile.
"""

import contextlib
import dataclasses
import inspect

import torch
from transformers.utils import ModelOutput, logging

from . import _compat
from .buckets import BucketPolicy
from .budget import check_compiled
from .cache import (
    cache_seq_length,
    continued_padding,
    is_marked,
    mark_padding,
    mark_ragged_rows,
    passed_cache,
    unpadded_for_room,
)
from .compilation import compiled_forward, compiled_wrapper_forward
from .config import BUCKET_FIELDS, FIELDS, PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF
from .distributed import generate_call, ranks_agree
from .hooks import active_plan, bucketed_call
from .inputs import check_pad_token_id, pad_inputs, pad_rows, plan_right
from .output import strip_output
from .padding_side import choose_side
from .settings import CallSettings, resolve_settings
from .state import state_of


logger = logging.get_logger(__name__)

UPSTREAM_GENERATE = _compat.UPSTREAM_GENERATE


def generate(model, *args, **kwargs):
    r"""
    [`~generation.GenerationMixin.generate`] with bucketed prefill, without patching transformers.

    Takes exactly the arguments of `model.generate`, plus the four fields `prefill_pad_to_multiple_of`,
    `prefill_buckets`, `prefill_batch_buckets` and `prefill_padding_side` (as keyword arguments or on
    `generation_config`). When none of the first three is set, this is upstream `generate`, unchanged. When one is set, the prompt is padded to its bucket (and the batch, with
    `prefill_batch_buckets`, to its bucket with dummy rows): on the right, with no mask, where that is exact
    (`prefill_padding_side`, see `padding_side.py`), else on the left with masked pad tokens; upstream `generate`
    runs, and the padding is stripped again: the returned sequences have the shape and ids of an
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
    wrapper = model if _compat.is_compiled_wrapper(model) else None
    model = _compat.unwrap(model)  # an `OptimizedModule` hands `generate` to the module it wraps
    arguments = dict(_compat.UPSTREAM_GENERATE_SIGNATURE.bind(model, *args, **kwargs).arguments)
    arguments.pop("self")
    model_kwargs = arguments.pop("kwargs", {})
    field_kwargs = {field: model_kwargs.pop(field) for field in FIELDS if field in model_kwargs}
    generation_config = arguments.get("generation_config")

    if active_plan(model) is not None:
        # Re-entered from inside a bucketed call (a model whose own `generate` calls ours): already padded.
        return UPSTREAM_GENERATE(model, **arguments, **model_kwargs)

    # Under tensor parallelism every rank must make the same call, and no rank may raise alone while the others wait
    # in a collective: the checks run inside `ranks_agree`, which compares the calls and shares any error.
    continues = continued_padding(model_kwargs)  # read before the call marks the cache
    with ranks_agree(model, *generate_call(model, arguments, model_kwargs, field_kwargs)):
        prepared = _prepare(model, wrapper, arguments, model_kwargs, field_kwargs, generation_config)
    if prepared[0] == "upstream":
        _, arguments, model_kwargs, record = prepared
        output = UPSTREAM_GENERATE(model, **arguments, **model_kwargs)
        if record is not None:
            record()
        return output
    _, plan, arguments, model_kwargs = prepared
    compiled_wrapper = compiled_wrapper_forward(wrapper) if wrapper is not None else contextlib.nullcontext()
    try:
        with compiled_wrapper, bucketed_call(plan):
            output = UPSTREAM_GENERATE(model, **arguments, **model_kwargs)
    finally:
        check_compiled(model, plan.expected_graphs)  # and says so if torch ran some of the call's forwards eagerly
    for cache in (passed_cache(model_kwargs), passed_cache(output) if isinstance(output, ModelOutput) else None):
        # A right-padded call leaves an unpadded cache, unless dummy rows fill it: a later call must bring them.
        if cache is not None and (plan.side == "left" or plan.padded_batch > plan.batch_size or plan.ragged):
            mark_padding(cache, plan.added_positions, plan.padded_batch)
        if cache is not None and continues is None:  # a later call lines its mask up with ragged rows' layout
            mark_ragged_rows(cache, model_kwargs["attention_mask"] if plan.ragged else None)
    return strip_output(output, plan)


def _prepare(model, wrapper, arguments: dict, model_kwargs: dict, field_kwargs: dict, generation_config) -> tuple:
    """
    The checks and padding of a call: `("upstream", arguments, model_kwargs, record)` for a call upstream runs as it
    is (`record`: what to note after it, or `None`), `("bucketed", plan, arguments, model_kwargs)` for a padded one.
    """
    settings = resolve_settings(model, generation_config, field_kwargs, model_kwargs)
    continues = continued_padding(model_kwargs)
    if settings.policy is None and continues is not None:
        # The cache holds a bucketed call's padding: the prompt must get it too, bucket fields or not.
        settings = _with_policy(settings, BucketPolicy(pad_to_multiple_of=1))
    if settings.policy is None:
        return "upstream", arguments, model_kwargs, _warn_unbucketed(model, wrapper, settings, arguments, model_kwargs)

    _compat.check_upstream(type(model))
    skip_reason = _unsupported_reason(model, arguments, model_kwargs)
    side = choose_side(model, settings, arguments, model_kwargs) if skip_reason is None else None
    if skip_reason is None and side.side == "unpadded":
        skip_reason = f"{side.reason}."
    if skip_reason is None and side.side == "left":
        skip_reason = _unpadded_cache_reason(model_kwargs)
    if skip_reason is not None:
        return _unpadded(skip_reason, arguments, model_kwargs)

    if side.side == "right":
        plan, arguments, model_kwargs = plan_right(model, settings, arguments, model_kwargs, side)
    else:
        plan, padded_arguments, padded_kwargs = pad_inputs(model, settings, arguments, model_kwargs)
        room_reason = unpadded_for_room(plan, model_kwargs)
        if room_reason is not None:
            return _unpadded(room_reason, arguments, model_kwargs)
        arguments, model_kwargs = padded_arguments, padded_kwargs
    if settings.batch_policy is not None and continues is None:  # a cache's rows are fixed when it is filled
        plan, arguments, model_kwargs = pad_rows(plan, arguments, model_kwargs)
    model_kwargs.update(check_pad_token_id(plan, arguments))
    return "bucketed", plan, arguments, model_kwargs


def _unpadded(reason: str, arguments: dict, model_kwargs: dict) -> tuple:
    """Upstream's call, as the user made it, after a warning (once) that says why it is not bucketed."""
    logger.warning_once(
        f"The prefill bucket fields ({', '.join(f'`{f}`' for f in BUCKET_FIELDS)}) are ignored for this call: {reason}"
    )
    return "upstream", arguments, model_kwargs, None


def _with_policy(settings: CallSettings, policy: BucketPolicy) -> CallSettings:
    return dataclasses.replace(settings, policy=policy)


def _unsupported_reason(model, arguments: dict, model_kwargs: dict) -> str | None:
    """Why this call runs unpadded, or raises for the cases padding can't serve; `None` when it can be bucketed."""
    if model.config.is_encoder_decoder:
        raise ValueError(
            f"The prefill bucket fields ({', '.join(f'`{f}`' for f in BUCKET_FIELDS)}) support decoder-only models, but "
            f"{type(model).__name__} is an encoder-decoder model. Its prompt goes to the encoder: pad it there with "
            "the tokenizer's `pad_to_multiple_of` (any side, with the attention mask), and unset the fields."
        )
    if arguments.get("custom_generate") is not None:
        return "`custom_generate` replaces the generation loop."
    if model_kwargs.get("cache_implementation") == "paged":
        return (
            "`cache_implementation='paged'` switches to continuous batching, which pads by its own intervals when it "
            "compiles or captures CUDA graphs: each step's query tokens to a multiple of "
            "`ContinuousBatchingConfig.q_padding_interval_size` (64 by default) and its cache reads to "
            "`kv_padding_interval_size`. Set those on the `ContinuousBatchingConfig` instead, or drop "
            "`cache_implementation='paged'` to use the buckets."
        )
    cache = passed_cache(model_kwargs)
    cached_tokens = cache_seq_length(cache) if cache is not None else 0
    if cached_tokens is None:
        return (
            "the cache passed in has only recurrent (linear-attention) layers, which don't tell how many tokens they "
            "hold, so the prompt can't be lined up with them. Let `generate` create the cache."
        )
    if "attention_mask" not in inspect.signature(model.forward).parameters:
        return f"{type(model).__name__}.forward takes no `attention_mask`, so padding could not be masked."
    return None


def _unpadded_cache_reason(model_kwargs: dict) -> str | None:
    """Why a left-padded call runs unpadded: its cache holds tokens of an unpadded call (right padding continues it)."""
    cache = passed_cache(model_kwargs)
    if cache is not None and (cache_seq_length(cache) or 0) > 0 and not is_marked(cache):
        return (
            "the cache passed in already holds tokens from an unpadded call, so the prompt can't be padded in front "
            "of them. The call runs unpadded (exact output), and this prompt length may compile a new graph."
        )
    return None


def _warn_unbucketed(model, wrapper, settings: CallSettings, arguments: dict, model_kwargs: dict):
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
    cache = passed_cache(model_kwargs)
    static = _compat.is_static_cache(cache) or (
        cache is None and settings.cache_implementation in _compat.ALL_STATIC_CACHE_IMPLEMENTATIONS
    )
    prompt = arguments.get("inputs")
    prompt = prompt if prompt is not None else model_kwargs.get("input_ids", model_kwargs.get("inputs_embeds"))
    if not static or not isinstance(prompt, torch.Tensor) or prompt.ndim < 2:
        return None
    state = state_of(model)
    state.unbucketed_prompt_lengths.add(prompt.shape[1])
    if len(state.unbucketed_prompt_lengths) == 2:
        logger.warning_once(
            f"The model's forward is compiled ({compiled}) and generates with a static cache, so each new prompt "
            f"length recompiles it. Set `{PREFILL_BUCKETS}` (for example 'pow2') or `{PREFILL_PAD_TO_MULTIPLE_OF}`, "
            "or pad with the tokenizer's `pad_to_multiple_of` and `padding_side='left'`."
        )
    rows = prompt.shape[0] * settings.rows_per_prompt

    def record():
        state.budget.account_unbucketed(model, rows, prompt.shape[1], _compat.previous_max_cache_length(model))

    return record

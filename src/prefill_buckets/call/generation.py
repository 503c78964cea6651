"""`generate` with bucketed prefill: upstream `generate`, on the padded prompt, with the padding stripped again.

Upstream `generate` does all the real work. One bucketed call, in the steps `generate` numbers:

1. Resolve: the call bound as upstream's `generate` binds it, and the settings it runs with (`settings.py`).
2. Check support: the hooked upstream steps exist (`check_upstream`), and the call is one padding can serve.
3. Choose the side: right or left padding for this call, and why (`padding_side.py`, the one rule).
4. Plan: the prompt padded to its bucket and the batch to its batch bucket; a `Plan` says what was added
   (`inputs.plan_call`).
5. Agree across ranks: steps 1 to 4 run inside `distributed.ranks_agree`, so under tensor parallelism no rank raises
   alone while the others wait in a collective.
6. Run upstream `generate`, with the steps that must see through the padding hooked (`hooks.bucketed_call`).
7. Mark the cache: a later call that continues from it pads its prompt the same way (`cache.record_call`).
8. Strip: the added columns and rows come off what the user gets back (`output.strip_output`).

A call without bucket fields is upstream `generate`, unchanged; this module only warns when it will recompile. A call
that can't be bucketed runs as the user made it, after a warning that says why (`RunsUnpadded`).
"""

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from transformers.utils import ModelOutput, logging

from ..buckets import BucketPolicy
from ..compile.compiled_calls import compiled_forward, compiled_wrapper_forward
from ..config import BUCKET_FIELDS, FIELDS, PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF
from ..distributed import generate_call, ranks_agree
from ..state import state_of
from ..upstream import torch_api, transformers_api
from ..upstream.transformers_api import tensor_parallel_group
from . import support
from .budget import budget_of, check_compiled
from .cache import PassedCache, passed_cache, record_call
from .hook_registry import active_plan
from .hooks import bucketed_call
from .inputs import plan_call
from .output import strip_output
from .padding_side import choose_side
from .plan import Plan, RunsUnpadded
from .settings import CallSettings, call_sets_fields, forward_takes, resolve_settings


logger = logging.get_logger(__name__)

UPSTREAM_GENERATE = transformers_api.UPSTREAM_GENERATE


def generate(model, *args, **kwargs):
    r"""
    [`~generation.GenerationMixin.generate`] with bucketed prefill, without patching transformers.

    Takes exactly the arguments of `model.generate`, plus the four fields `prefill_pad_to_multiple_of`,
    `prefill_buckets`, `prefill_batch_buckets` and `prefill_padding_side` (as keyword arguments or on
    `generation_config`). When none of the first three is set, this is upstream `generate`, unchanged. When one is
    set, the prompt is padded to its bucket (and the batch, with `prefill_batch_buckets`, to its bucket with dummy
    rows): on the right, with no mask, where that is exact (`prefill_padding_side`, see `padding_side.py`), else on
    the left with masked pad tokens; upstream `generate` runs, and the padding is stripped again: the returned
    sequences have the shape and ids of an unpadded run, and `max_new_tokens`, `max_length` and `min_length` mean
    what they mean without padding.

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
        sequence; a static cache's attentions have upstream's key axis on every layer and step), and the dummy rows
        removed from every output. A returned cache records the call's bucket fields and any padding it holds (left
        padding, dummy rows): a later call that continues from it (multi-turn chat) and sets no bucket field of its
        own is bucketed the same way, its prompt lined up with that padding.

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
    # 1. Resolve the call: bound as upstream's `generate` binds it, the bucket fields taken out.
    wrapper = model if torch_api.is_compiled_wrapper(model) else None
    model = torch_api.unwrap(model)  # an `OptimizedModule` hands `generate` to the module it wraps
    arguments, model_kwargs = _bind(model, args, kwargs)
    field_kwargs = {field: model_kwargs.pop(field) for field in FIELDS if field in model_kwargs}
    if active_plan(model) is not None:
        # Re-entered from inside a bucketed call (a model whose own `generate` calls ours): already padded.
        return UPSTREAM_GENERATE(model, **arguments, **model_kwargs)
    passed = PassedCache(model_kwargs)  # read before the call writes the cache's record
    continues = passed.continued

    # 5. Agree across ranks: steps 1 to 4 run inside it, and any error they raise is raised on every rank.
    if tensor_parallel_group(model) is not None:
        agreed = ranks_agree(model, *generate_call(model, arguments, model_kwargs, field_kwargs))
    else:
        agreed = contextlib.nullcontext()  # one process: nothing to agree on, nothing to summarize
    with agreed:
        call = _prepare(model, wrapper, arguments, model_kwargs, field_kwargs, passed)
    if call.plan is None:
        output = UPSTREAM_GENERATE(model, **call.arguments, **call.model_kwargs)
        if call.after is not None:
            call.after()
        return output

    # 6. Run upstream `generate` on the padded inputs, hooked.
    plan = call.plan
    compiled_wrapper = compiled_wrapper_forward(wrapper) if wrapper is not None else contextlib.nullcontext()
    try:
        with compiled_wrapper, bucketed_call(plan):
            output = UPSTREAM_GENERATE(model, **call.arguments, **call.model_kwargs)
    finally:
        # Says so if torch ran some of the call's forwards eagerly, against the limit the call ran under.
        check_compiled(model, plan.expected_graphs, plan.recompile_limit, plan.decode_windows_read)

    # 7. Mark the cache, passed in or returned, for a call that continues from it.
    for cache in (passed_cache(call.model_kwargs), _returned_cache(output)):  # often one cache, twice: idempotent
        if cache is not None:
            record_call(cache, plan, call.model_kwargs.get("attention_mask"), continues=continues is not None)

    # 8. Strip the padding off what the user gets back.
    return strip_output(output, plan)


# `generate`'s parameters after `self`, in order, and those that may come by position.
_PARAMETERS = tuple(
    p for p in transformers_api.UPSTREAM_GENERATE_SIGNATURE.parameters.values() if p.kind != p.VAR_KEYWORD
)[1:]
_NAMED = tuple(p.name for p in _PARAMETERS)
_POSITIONAL = tuple(p.name for p in _PARAMETERS if p.kind == p.POSITIONAL_OR_KEYWORD)


def _bind(model, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """
    The call's arguments as upstream's `generate` signature binds them: `(its named parameters that were passed, in
    their order; the rest of the keyword arguments)`. What only `inspect` can bind, or must reject, goes through it.
    """
    if len(args) > len(_POSITIONAL) or "self" in kwargs or any(name in kwargs for name in _POSITIONAL[: len(args)]):
        arguments = dict(transformers_api.UPSTREAM_GENERATE_SIGNATURE.bind(model, *args, **kwargs).arguments)
        arguments.pop("self")
        return arguments, arguments.pop("kwargs", {})
    passed = dict(zip(_POSITIONAL, args))
    model_kwargs = {}
    for name, value in kwargs.items():
        if name in _NAMED:
            passed[name] = value
        else:
            model_kwargs[name] = value
    return {name: passed[name] for name in _NAMED if name in passed}, model_kwargs


@dataclasses.dataclass
class PreparedCall:
    """What steps 1 to 4 decided: the arguments upstream `generate` runs with, and the plan of a bucketed call."""

    arguments: dict
    model_kwargs: dict
    plan: Plan | None = None  # `None`: upstream's call, as the user made it
    after: Callable[[], None] | None = None  # an unbucketed call: what to record once it ran


def _prepare(
    model, wrapper, arguments: dict, model_kwargs: dict, field_kwargs: dict, passed: PassedCache
) -> PreparedCall:
    """
    Steps 1 to 4 of a call: its settings, its support, its side and its plan (see the module docstring). `passed`:
    the cache the call passes, read once for every step.
    """
    # 1. Resolve the settings the call runs with.
    settings = resolve_settings(model, arguments.get("generation_config"), field_kwargs, model_kwargs)
    recorded = passed.bucketing
    if recorded is not None and not call_sets_fields(arguments.get("generation_config"), field_kwargs):
        # A later turn of a conversation: bucketed as the call that filled the cache was.
        policy, batch_policy, padding_side = recorded
        settings = dataclasses.replace(settings, policy=policy, batch_policy=batch_policy, padding_side=padding_side)
    if settings.policy is None and passed.continued is not None:
        # The cache holds a bucketed call's padding: the prompt must get it too, bucket fields or not.
        settings = dataclasses.replace(settings, policy=BucketPolicy(pad_to_multiple_of=1))
    if settings.policy is None:
        return PreparedCall(
            arguments, model_kwargs, after=_warn_unbucketed(model, wrapper, settings, arguments, model_kwargs, passed)
        )
    try:
        # 2. Check support: the hooked steps of upstream `generate`, and what padding can't serve.
        support.check_upstream(type(model), generate=generate)
        _check_support(model, arguments, model_kwargs, passed)
        # 3. Choose the side.
        side = choose_side(model, settings, arguments, model_kwargs, passed)
        if side.side == "unpadded":
            raise RunsUnpadded(f"{side.reason}.")
        if side.side == "left":
            _check_left_cache(passed)
        # 4. Plan: pad the prompt and the batch.
        plan, padded_arguments, padded_kwargs = plan_call(model, settings, side, arguments, model_kwargs, passed)
    except RunsUnpadded as unpadded:
        logger.warning_once(
            f"The prefill bucket fields ({', '.join(f'`{f}`' for f in BUCKET_FIELDS)}) are ignored for this call: "
            f"{unpadded}"
        )
        return PreparedCall(arguments, model_kwargs)
    return PreparedCall(padded_arguments, padded_kwargs, plan=plan)


def _returned_cache(output):
    return passed_cache(output) if isinstance(output, ModelOutput) else None


def _check_support(model, arguments: dict, model_kwargs: dict, passed: PassedCache) -> None:
    """Raises `ValueError` for a call padding can't serve, and `RunsUnpadded` for one it must not pad."""
    if model.config.is_encoder_decoder:
        raise ValueError(
            f"The prefill bucket fields ({', '.join(f'`{f}`' for f in BUCKET_FIELDS)}) support decoder-only models, but "
            f"{type(model).__name__} is an encoder-decoder model. Its prompt goes to the encoder: pad it there with "
            "the tokenizer's `pad_to_multiple_of` (any side, with the attention mask), and unset the fields."
        )
    if arguments.get("custom_generate") is not None:
        raise RunsUnpadded("`custom_generate` replaces the generation loop.")
    if model_kwargs.get("cache_implementation") == "paged":
        raise RunsUnpadded(
            "`cache_implementation='paged'` switches to continuous batching, which pads by its own intervals when it "
            "compiles or captures CUDA graphs: each step's query tokens to a multiple of "
            "`ContinuousBatchingConfig.q_padding_interval_size` (64 by default) and its cache reads to "
            "`kv_padding_interval_size`. Set those on the `ContinuousBatchingConfig` instead, or drop "
            "`cache_implementation='paged'` to use the buckets."
        )
    if passed.tokens is None:
        raise RunsUnpadded(
            "the cache passed in has only recurrent (linear-attention) layers, which don't tell how many tokens they "
            "hold, so the prompt can't be lined up with them. Let `generate` create the cache."
        )
    if not forward_takes(model, "attention_mask"):
        raise RunsUnpadded(
            f"{type(model).__name__}.forward takes no `attention_mask`, so padding could not be masked."
        )


def _check_left_cache(passed: PassedCache) -> None:
    """Raises `RunsUnpadded` when the cache holds tokens of an unpadded call (right padding continues it, left can't)."""
    if passed.cache is not None and (passed.tokens or 0) > 0 and not passed.holds_padding:
        raise RunsUnpadded(
            "the cache passed in already holds tokens from an unpadded call, so the prompt can't be padded in front "
            "of them. The call runs unpadded (exact output), and this prompt length may compile a new graph."
        )


def _warn_unbucketed(model, wrapper, settings: CallSettings, arguments: dict, model_kwargs: dict, passed: PassedCache):
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
    cache = passed.cache
    static = transformers_api.is_static_cache(cache) or (
        cache is None and settings.cache_implementation in transformers_api.ALL_STATIC_CACHE_IMPLEMENTATIONS
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
            f"length recompiles it, and past torch's `torch._dynamo.config.recompile_limit` ({torch_api.recompile_limit()} "
            f"graphs of the forward) torch runs the rest eagerly. Set `{PREFILL_BUCKETS}` (for example 'pow2-quarters') "
            f"or `{PREFILL_PAD_TO_MULTIPLE_OF}`, or pad with the tokenizer's `pad_to_multiple_of` and "
            "`padding_side='left'`."
        )
    rows = prompt.shape[0] * settings.rows_per_prompt

    def record():
        budget_of(model).account_unbucketed(
            model, rows, prompt.shape[1], transformers_api.previous_max_cache_length(model)
        )

    return record

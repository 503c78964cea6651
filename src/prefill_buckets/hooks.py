"""Hooks on the model instance, live while a bucketed call runs: the steps of upstream `generate` that must see
through the padding.

- `_prepare_generated_length`: `max_length` / `min_length` are resolved against the *unpadded* prompt, then shifted
  by the padding, so they keep their meaning.
- `_prepare_cache_for_generation`: a static cache without `max_cache_len` gets a bucketed length (`cache.py`), so
  calls with different prompt lengths share one cache shape, and so one decode graph.
- `prepare_inputs_for_generation`: a prompt that exactly fits its bucket has no padding, and upstream uses that twice
  to skip the mask: it drops an all-ones 2D attention mask before prefill, and with SDPA it builds no 4D mask for an
  unpadded prefill (`is_causal` instead). Either way the prompt would reach the model without a mask, a different
  graph from every padded prompt in its bucket. The hook puts the all-ones mask back and, while upstream builds the
  4D mask, turns off the SDPA skip (`masking_utils._ignore_causal_mask_sdpa`), so every prompt in a bucket reaches
  the model with one signature.
- `_get_logits_processor`, `_get_stopping_criteria`, `_get_candidate_generator`: what reads token content sees the
  ids without padding (`views.py`).
- `get_compiled_call`: upstream's own compiled forward falls back to eager for a shape its backend fails on; a forward
  of `aot_forward` is not compiled again.
- `_prefill`, on a right-padded call only (`padding_side.py`): one forward of the prompt padded after its end to the
  bucket, with no mask, then the cache's length set to the prompt's (`prefill_right.py`). Upstream, which sees the
  unpadded prompt, does everything else; the hooks above have nothing to undo (`added_id_columns == 0`).

Every hook acts only for the model and the context whose plan is active (`bucketed_call`), so concurrent calls, on
one model or several, don't see each other's plans.
"""

import contextlib
import contextvars
import copy
import functools
import inspect

import torch
from transformers.generation import logits_process
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteriaList
from transformers.utils import logging

from . import _compat
from .aot_compiled import is_aot_forward
from .budget import restore_recompile_limit
from .cache import cache_seq_length, early_initialize, passed_cache, sequence_length, static_cache_length
from .compilation import EagerFallback, compiled_forward
from .config import PREFILL_PAD_TO_MULTIPLE_OF, PREFILL_PADDING_SIDE
from .inputs import PER_TOKEN_KWARGS, Plan
from .padding import strip_left
from .prefill_right import prefill_right
from .state import LOCK, state_of
from .views import UnpaddedCriterion, UnpaddedProcessor, UnpaddedPromptLookup
from .windows import close_windows, has_windows, open_windows, set_window, window_length, windows_between


logger = logging.get_logger(__name__)

_ACTIVE_PLAN: contextvars.ContextVar[Plan | None] = contextvars.ContextVar("prefill_buckets_plan", default=None)
# True while a bucketed call builds its 4D masks: the mask is then always a tensor, never SDPA's `is_causal` skip.
_MATERIALIZE_SDPA_MASK: contextvars.ContextVar[bool] = contextvars.ContextVar("prefill_buckets_mask", default=False)
_sdpa_skip = {"original": None, "users": 0}  # upstream's `_ignore_causal_mask_sdpa` while any bucketed call runs


def active_plan(model) -> Plan | None:
    """The plan of the bucketed call running on `model` in this context, or `None`."""
    plan = _ACTIVE_PLAN.get()
    return plan if plan is not None and plan.model is model else None


def _hook(body):
    """Makes `body(plan, original, *args, **kwargs)` a hook: it runs only while `model` has an active plan."""

    def make(original, model):
        @functools.wraps(original)
        def hooked(*args, **kwargs):
            plan = active_plan(model)
            if plan is None:
                return original(*args, **kwargs)
            return body(plan, original, *args, **kwargs)

        return hooked

    return make


@_hook
def _prepare_generated_length(
    plan,
    original,
    generation_config,
    has_default_max_length,
    has_default_min_length,
    model_input_name,
    input_ids_length,
    inputs_tensor,
):
    # Resolve the lengths as upstream would for the unpadded prompt, then move them by the added columns.
    unpadded_ids_length = input_ids_length - plan.added_id_columns
    generation_config = original(
        generation_config,
        has_default_max_length,
        has_default_min_length,
        model_input_name,
        unpadded_ids_length,
        strip_left(inputs_tensor, plan.added_positions, dim=1),
    )
    if unpadded_ids_length >= generation_config.max_length:
        # Upstream's own check, made here so that it names the lengths the user passed.
        raise ValueError(
            f"Input length of input_ids is {unpadded_ids_length}, but `max_length` is set to "
            f"{generation_config.max_length}. This can lead to unexpected behavior. You should consider "
            "increasing `max_length` or, better yet, setting `max_new_tokens`."
        )
    generation_config.max_length += plan.added_id_columns
    if generation_config.min_length is not None:
        generation_config.min_length += plan.added_id_columns
    return generation_config


@_hook
def _prepare_cache_for_generation(
    plan, original, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
):
    model = plan.model
    cache_args = (generation_config, model_kwargs, generation_mode, batch_size, max_cache_length)
    creates_static = (
        passed_cache(model_kwargs) is None
        and generation_config.cache_implementation in _compat.ALL_STATIC_CACHE_IMPLEMENTATIONS
    )
    if not (creates_static or getattr(passed_cache(model_kwargs), "is_compileable", False)):
        return original(*cache_args)
    # `generation_config` is upstream's private copy: what the user passed is untouched.
    sized_here = creates_static and generation_config.max_cache_len is None
    if sized_here:
        # On the right the bucket is filled on top of the cached tokens: the new tokens' slots come after it, as on the
        # left (more than the `max(bucket, prompt + new tokens)` the call needs, so both sides size caches alike).
        new_slots = max_cache_length - plan.prompt_length
        needed = plan.prompt_slots + new_slots if plan.side == "right" else max_cache_length
        generation_config.max_cache_len = static_cache_length(
            model, plan.settings, needed, prompt_slots=plan.prompt_slots
        )
    if generation_config.compile_config is not None:
        # An explicit `compile_config` compiles on every device, CPU included (upstream: CUDA/XPU only).
        _compat.compile_on_all_devices(generation_config.compile_config)
    result = original(*cache_args)
    if sized_here:
        # The cache is made. Unset again, so configs derived from this one (an assistant model's) don't inherit it.
        generation_config.max_cache_len = None
    cache = passed_cache(model_kwargs)
    cache_length = cache.get_max_length() if hasattr(cache, "get_max_length") else -1
    plan.static_cache_length = cache_length
    if cache is not None and open_windows(cache, getattr(model.config, "_attn_implementation", None)):
        plan.windowed_cache = cache
    # What prefill runs on: the padded prompt, or, continuing from a cache, the tokens the cache lacks.
    cached_tokens = (cache_seq_length(cache) or 0) if cache is not None else 0  # `None`: the model keeps no cache
    prefill = plan.bucket if plan.side == "right" else plan.padded_length - cached_tokens
    auto_compile = _compat.valid_auto_compile(model, model_kwargs, generation_config)
    rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    compiled = auto_compile or compiled_forward(model) is not None
    if creates_static and compiled and cache is not None:
        early_initialize(model, cache, rows)
    if (
        auto_compile
        and plan.side == "left"
        and generation_config.prefill_chunk_size is None
        and (_compat.CHUNKED_PREFILL_RESUMES or prefill == plan.padded_length)
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
    if compiled:
        # A graph per prefill forward's (length, window): one forward, or the chunks and a shorter last chunk; and a
        # decode graph per window the new tokens reach.
        cached = plan.prompt_slots - prefill
        chunks = [prefill] if chunk is None else [min(chunk, prefill - start) for start in range(0, prefill, chunk)]
        shapes, filled = set(), cached
        for length in chunks:
            filled += length
            shapes.add((length, _window_of(plan, filled, cache_length)))
        decode_windows = {None}
        if has_windows(plan.windowed_cache):  # from the first decode step (at least) to the last
            first = (plan.prompt_slots if plan.side == "left" else plan.past_length) + 1
            decode_windows = windows_between(first, max(first, max_cache_length), cache_length)
        plan.expected_graphs = state_of(model).budget.account(
            model, rows, shapes, cache_length, plan.side, decode_windows
        )
    plan.recompile_limit = torch._dynamo.config.recompile_limit
    return result


def _window_of(plan, tokens: int, cache_length: int) -> int | None:
    """The window a forward reads after which the cache holds `tokens` tokens (`None`: no windowed layers)."""
    return window_length(tokens, cache_length) if has_windows(plan.windowed_cache) else None


@_hook
def _prepare_inputs_for_generation(plan, original, input_ids, *args, **kwargs):
    if plan.side == "right":  # decode as upstream decodes an unpadded prompt: its graph is shared with those calls
        restore_recompile_limit(plan.recompile_limit)
        if plan.windowed_cache is not None:
            set_window(plan.windowed_cache, sequence_length(input_ids, kwargs))
        return original(input_ids, *args, **kwargs)
    if kwargs.get("attention_mask") is None:
        # Upstream dropped an all-ones mask. Put it back, with the length upstream would have carried.
        kwargs["attention_mask"] = torch.ones(
            input_ids.shape[0], sequence_length(input_ids, kwargs), dtype=torch.long, device=input_ids.device
        )
    if plan.windowed_cache is not None:  # before upstream builds the 4D mask, which reads the window's length
        set_window(plan.windowed_cache, sequence_length(input_ids, kwargs))
    restore_recompile_limit(plan.recompile_limit)
    token = _MATERIALIZE_SDPA_MASK.set(True)
    try:
        model_inputs = original(input_ids, *args, **kwargs)
    finally:
        _MATERIALIZE_SDPA_MASK.reset(token)
    if "attention_mask" not in model_inputs:
        # `_compat.check_upstream` saw the mask taken (by name, or through `**kwargs` by a method that passes it on),
        # but this model's step dropped it: the pads in front would be attended. Never run that silently.
        raise RuntimeError(
            f"`{type(plan.model).__name__}.prepare_inputs_for_generation` does not pass the attention mask on to the "
            f"model, so a prompt padded on the left would attend to its padding. Set `{PREFILL_PADDING_SIDE}='right'`"
            " where that is exact, or unset the prefill bucket fields for this model."
        )
    _materialize_recurrent_masks(model_inputs, kwargs.get("attention_mask"))
    # Chunked prefill slices per-token inputs out of the whole prompt's: views whose strides depend on the prompt
    # length, which a compiled forward guards on. Fresh copies give every chunk of every prompt one signature.
    for key in PER_TOKEN_KWARGS:
        value = model_inputs.get(key)
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and key != "attention_mask":
            model_inputs[key] = value.clone(memory_format=torch.contiguous_format)
    return model_inputs


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
    for key in _compat.recurrent_mask_keys():
        if key in masks and masks[key] is None:
            masks[key] = attention_mask[:, -tokens.shape[1] :].contiguous()


def _sdpa_mask_skip(original):
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


def _skips_left_padding(processor, user_processors) -> bool:
    """
    Whether upstream built `processor` to skip the left padding itself: from transformers 5.23 on, its repetition
    penalty gets `prompt_ignore_length` from the (padded) attention mask, so it must see the ids that mask spans.
    """
    ignore_length = getattr(processor, "prompt_ignore_length", None)
    return isinstance(ignore_length, torch.Tensor) and id(processor) not in user_processors


@_hook
def _get_logits_processor(plan, original, *args, **kwargs):
    processors = original(*args, **kwargs)
    if plan.added_id_columns == 0:
        return processors
    user_processors = {id(p) for p in kwargs.get("logits_processor") or ()}
    wrapped = LogitsProcessorList()
    for processor in processors:
        plain = len(inspect.signature(processor.__call__).parameters) == 2  # extra arguments: leave it be
        padded_view = isinstance(processor, _PADDED_VIEW) or _skips_left_padding(processor, user_processors)
        if plain and not padded_view:
            processor = UnpaddedProcessor(processor, plan.added_id_columns)
        wrapped.append(processor)
    return wrapped


def _padded_criterion(criterion, added: int):
    if not isinstance(criterion, _PADDED_VIEW):
        return UnpaddedCriterion(criterion, added)
    if isinstance(criterion, MaxLengthCriteria) and criterion.max_position_embeddings is not None:
        # It warns once the sequence passes the model's positions; the added columns take none of them.
        criterion = copy.copy(criterion)
        criterion.max_position_embeddings += added
    return criterion


@_hook
def _get_stopping_criteria(plan, original, *args, **kwargs):
    criteria = original(*args, **kwargs)
    if plan.added_id_columns == 0:
        return criteria
    return StoppingCriteriaList(_padded_criterion(c, plan.added_id_columns) for c in criteria)


@_hook
def _get_candidate_generator(plan, original, *args, **kwargs):
    generator = original(*args, **kwargs)
    # Its candidates come from the ids' content: with the padding in front, a match could start in it. An assistant
    # model's candidates come from a forward with the attention mask, which hides the padding.
    if plan.added_id_columns and _compat.is_prompt_lookup(generator):
        return UnpaddedPromptLookup(generator, plan.added_id_columns)
    return generator


@_hook
def _get_compiled_call(plan, original, compile_config=None, *args, **kwargs):
    model = plan.model
    if is_aot_forward(model):
        # Its graphs are compiled already: compiling `__call__` around them would only trace it again per shape.
        if compile_config is not None:
            logger.warning_once(
                "`compile_config` is not applied: the model's forward is compiled with `aot_forward`, whose graphs "
                "generate runs as they are."
            )
        return model.__call__
    compiled = original(compile_config, *args, **kwargs)
    if compiled == model.__call__:
        return compiled
    return EagerFallback(model, compiled, model.__call__)


HOOKS = {
    "_prefill": _hook(prefill_right),
    "_prepare_generated_length": _prepare_generated_length,
    "_prepare_cache_for_generation": _prepare_cache_for_generation,
    "prepare_inputs_for_generation": _prepare_inputs_for_generation,
    "_get_logits_processor": _get_logits_processor,
    "_get_stopping_criteria": _get_stopping_criteria,
    "get_compiled_call": _get_compiled_call,
    "_get_candidate_generator": _get_candidate_generator,
}


def _install_fallbacks(model) -> dict:
    """
    Wraps the user's compiled forward (`model.compile()`, or a compiled `forward`) in an `EagerFallback` for the
    duration of bucketed calls. Returns what was replaced, for `_remove_fallbacks`.
    """
    replaced = {}
    impl = _compat.compiled_call_impl(model)
    if impl is not None and not isinstance(impl, EagerFallback):
        replaced["_compiled_call_impl"] = impl
        _compat.set_compiled_call_impl(model, EagerFallback(model, impl, model._call_impl))
    forward = model.__dict__.get("forward")
    eager_forward = _compat.eager_callable(forward)
    if eager_forward is not None and not isinstance(forward, EagerFallback):
        replaced["forward"] = forward
        object.__setattr__(model, "forward", EagerFallback(model, forward, eager_forward))
    return replaced


def _remove_fallbacks(model, replaced: dict) -> None:
    for name, original in replaced.items():
        current = model.__dict__.get(name)
        if isinstance(current, EagerFallback) and current.compiled is original:  # else the user has set another
            object.__setattr__(model, name, original)


@contextlib.contextmanager
def bucketed_call(plan: Plan):
    """
    Makes `plan` the active plan of this thread (and task) and installs the hooks on the model instance while any
    bucketed call on it runs; the last call to return removes them.
    """
    model = plan.model
    state = state_of(model)
    with LOCK:
        if state.calls_in_flight == 0:
            overridden = [name for name in HOOKS if name in model.__dict__]
            if overridden:
                raise RuntimeError(
                    f"`{type(model).__name__}` has `{overridden[0]}` set on the instance, which prefill buckets need to "
                    "hook for the duration of the call. Set it on a subclass instead."
                )
            for name, make_hook in HOOKS.items():  # every target exists: `_compat.check_upstream` ran
                object.__setattr__(model, name, make_hook(getattr(model, name), model))
            state.replaced = _install_fallbacks(model)
        if _sdpa_skip["users"] == 0:
            _sdpa_skip["original"] = _compat.get_sdpa_mask_skip()
            _compat.set_sdpa_mask_skip(_sdpa_mask_skip(_sdpa_skip["original"]))
        _sdpa_skip["users"] += 1
        state.calls_in_flight += 1
    token = _ACTIVE_PLAN.set(plan)
    try:
        yield
    finally:
        _ACTIVE_PLAN.reset(token)
        if plan.windowed_cache is not None:
            close_windows(plan.windowed_cache)
        with LOCK:
            state.calls_in_flight -= 1
            if state.calls_in_flight == 0:
                for name in HOOKS:
                    model.__dict__.pop(name, None)
                _remove_fallbacks(model, state.replaced)
                state.replaced = {}
            _sdpa_skip["users"] -= 1
            if _sdpa_skip["users"] == 0:
                _compat.set_sdpa_mask_skip(_sdpa_skip["original"])
                _sdpa_skip["original"] = None

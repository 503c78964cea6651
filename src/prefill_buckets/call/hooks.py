"""The hooks of a bucketed call on the model instance, and their installation: the steps of upstream `generate` that
must see through the padding, each declared with `@hook` (`hook_registry.py`) and listed in `HOOKS`:

- `_prepare_generation_config`: hands upstream the config `resolved.ResolvedCall.settings` prepared once already.
- `_prepare_generated_length`: `max_length` / `min_length` resolved against the unpadded prompt, then shifted.
- `_prepare_cache_for_generation`: a static cache gets a bucketed length (`kvcache/sizing.py`) and windows
  (`kvcache/windows.py`), and the call's graphs are accounted for (`budget.account_call`).
- `_prepare_static_cache`: the cache the last call made, reset, in place of a new one (`kvcache.sizing.reuse_cache`).
- `prepare_inputs_for_generation`: an exact fit keeps its all-ones mask and a 4D SDPA mask, so every prompt in a
  bucket reaches a compiled model with one signature.
- `get_compiled_call`: upstream's compiled forward falls back to eager for a shape its backend fails on.
- `_valid_auto_compile_criteria`: whether upstream compiles the forward, decided once a call.
- `_get_logits_processor`, `_get_stopping_criteria`, `_get_candidate_generator` (`views.py`): what reads token
  content sees the ids without padding.
- `_prefill` (`prefill_right.py`), on a right-padded call only: the prompt padded after its end, in one forward.

Every hook acts only for the model and the context whose plan is active (`bucketed_call`).
"""

import contextlib
import contextvars
import functools

import torch
from transformers.utils import logging

from ..compile.compiled_calls import (
    EagerFallback,
    call_compilation,
    install_fallbacks,
    is_aot_forward,
    mark_prefill_dynamic,
    mark_window_dynamic,
    remove_fallbacks,
)
from ..config import PREFILL_PAD_TO_MULTIPLE_OF, PREFILL_PADDING_SIDE
from ..kvcache.attention_keys import key_layouts
from ..kvcache.record import passed_cache, sequence_length
from ..kvcache.sizing import early_initialize, reuse_cache, static_cache_length
from ..kvcache.windows import close_windows, has_windows, mask_to_window, open_windows, set_window
from ..state import LOCK, PROCESS, state_of
from ..upstream import gate, torch_api, transformers_api, versions
from . import prefill_right, views
from .budget import account_call, restore_recompile_limit, restore_user_recompile_limits, window_of
from .hook_registry import _ACTIVE_PLAN, hook, hook_table, hooked_method, wraps
from .plan import PER_TOKEN_KWARGS


logger = logging.get_logger(__name__)

# True while a bucketed call builds its 4D masks: the mask is then always a tensor, never SDPA's `is_causal` skip.
_MATERIALIZE_SDPA_MASK: contextvars.ContextVar[bool] = contextvars.ContextVar("prefill_buckets_mask", default=False)


@hook("_prepare_generation_config", reads=())
def _prepare_generation_config(plan, step):
    # Handed once: a `generate` that runs inside the call (the model's own) prepares its own config.
    if plan.run.generation_config_handed:
        return step.call()
    plan.run.generation_config_handed = True
    settings = plan.settings
    model_inputs = {name: v for name, v in step.kwargs.items() if name not in settings.generation_kwargs}
    config = settings.generation_config
    for name in ("output_attentions", "output_hidden_states"):  # as upstream's step: inputs of the forward too
        if getattr(config, name):
            model_inputs[name] = getattr(config, name)
    return config, model_inputs


@hook(
    "_prepare_generated_length",
    reads=(
        "generation_config",
        "has_default_max_length",
        "has_default_min_length",
        "model_input_name",
        "input_ids_length",
        "inputs_tensor",
    ),
)
def _prepare_generated_length(plan, step):
    # Resolve the lengths as upstream would for the unpadded prompt, then move them by the added columns.
    unpadded_ids_length = step["input_ids_length"] - plan.added_id_columns
    step["input_ids_length"] = unpadded_ids_length
    step["inputs_tensor"] = views.strip_left(step["inputs_tensor"], plan.added_positions, dim=1)
    generation_config = step.call()
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


@hook(
    "_prepare_cache_for_generation",
    reads=("generation_config", "model_kwargs", "generation_mode", "batch_size", "max_cache_length"),
    positional=True,
)
def _prepare_cache_for_generation(plan, step):
    generation_config, model_kwargs = step["generation_config"], step["model_kwargs"]
    creates_static = plan.call.cache is None and plan.call.static_cache  # `generate` makes the call a static cache
    # Without a static cache there is nothing to size or window; the forwards' compilation is known once the cache is.
    static = creates_static or getattr(passed_cache(model_kwargs), "is_compileable", False)
    # `generation_config` is upstream's private copy: what the user passed is untouched.
    sized_here = creates_static and generation_config.max_cache_len is None
    if sized_here:
        # From the length upstream computed for the padded call. On the right the bucket is filled on top of the cached
        # tokens, the new tokens' slots after it, as on the left (more than the `max(bucket, prompt + new tokens)` it
        # needs: both sides size alike).
        needed = step["max_cache_length"] + (plan.prompt_slots - plan.prompt_length if plan.right is not None else 0)
        generation_config.max_cache_len = static_cache_length(plan.model, plan.settings, needed, plan.prompt_slots)
    if static and generation_config.compile_config is not None:
        # An explicit `compile_config` compiles on every device, CPU included (upstream: CUDA/XPU only).
        transformers_api.compile_on_all_devices(generation_config.compile_config)
    result = step.call()
    if sized_here:
        # The cache is made. Unset again, so configs derived from this one (an assistant model's) don't inherit it.
        generation_config.max_cache_len = None
    # Whether the forwards are compiled (by the user, or by upstream for a compileable cache it makes).
    plan.run.auto_compile, plan.run.compiled, plan.run.fullgraph, plan.run.generic_prefill = call_compilation(
        plan.model, model_kwargs, generation_config
    )
    if not static:
        return result
    cache = passed_cache(model_kwargs)
    if creates_static:
        plan.run.made_cache = cache
    _learn_cache(plan, cache)
    if creates_static and plan.run.compiled and cache is not None:
        plan.run.allocated_early = early_initialize(plan.model, cache, plan.padded_rows)
    # The user's chunks have one length already: a chunked prefill stays static (`generic_prefill` off).
    plan.run.generic_prefill &= generation_config.prefill_chunk_size is None
    _prefill_through_compiled_call(plan, generation_config, cache)
    if plan.run.generic_prefill and plan.call.past_length == 0:
        # The first forward fills the empty cache: it reads its own slots.
        plan.run.query_window_tokens = plan.prefill_tokens
    if plan.run.compiled:
        embeds = model_kwargs.get("inputs_embeds") is not None
        plan.run.prefill_tokens = plan.prefill_tokens
        plan.run.expected_graphs = account_call(
            plan, generation_config.prefill_chunk_size, step["max_cache_length"], embeds
        )
    plan.run.recompile_limit = torch_api.recompile_limit()
    return result


def _learn_cache(plan, cache) -> None:
    """What the call's cache is: its length, whether its layers read windows (opened here), how they lay out keys."""
    plan.run.static_cache_length = cache.get_max_length() if hasattr(cache, "get_max_length") else -1
    if cache is not None and open_windows(cache, transformers_api.attention_implementation(plan.model.config)):
        plan.run.windowed_cache = cache
        plan.run.reads_windows = has_windows(cache)
    if plan.settings.output_attentions or getattr(plan.model.config, "output_attentions", False):
        plan.run.key_layouts = key_layouts(cache)  # read now: the layers' classes change while the call runs


def _prefill_through_compiled_call(plan, generation_config, cache) -> None:
    """
    Sends an auto-compiled call's prefill through the compiled forward as one chunk of upstream's chunked prefill
    (upstream runs prefill eagerly: its shapes are unbounded, here they are the buckets). Warns when a chunk size set
    does not divide the prefill.
    """
    prefill = plan.prefill_tokens
    if (
        plan.run.auto_compile
        and plan.right is None
        and generation_config.prefill_chunk_size is None
        and (versions.CHUNKED_PREFILL_RESUMES or prefill == plan.padded_length)
        and transformers_api.reports_its_length(cache)
    ):
        generation_config.prefill_chunk_size = prefill
    chunk = generation_config.prefill_chunk_size
    if chunk is not None and prefill % chunk:
        logger.warning_once(
            f"`prefill_chunk_size={chunk}` does not divide the padded prompt length {prefill}, so the last chunk "
            f"has its own shape, and its own compiled graph. Set `{PREFILL_PAD_TO_MULTIPLE_OF}` to a multiple of "
            f"{chunk}: then every chunk of every prompt shares one prefill graph."
        )


@hook("_prepare_static_cache", reads=())  # reads upstream's own step's arguments only: an override runs as it is
def _prepare_static_cache(plan, step):
    # The cache the last call made, reset, where it is the one upstream's step would make (`sizing.reuse_cache`).
    if getattr(step.original, "__func__", None) is not transformers_api.UPSTREAM_PREPARE_STATIC_CACHE:
        return step.call()
    slots = max(step["max_cache_len"], transformers_api.previous_max_cache_length(plan.model))  # as upstream's step
    plan.run.made_cache_slots = slots
    reused = reuse_cache(plan.model, step["cache_implementation"], step["batch_size"], slots)
    return reused if reused is not None else step.call()


@hook("_valid_auto_compile_criteria", reads=("model_kwargs", "generation_config"), positional=True)
def _valid_auto_compile_criteria(plan, step):
    # Upstream asks again before it decodes, of the config and cache the cache step asked of: the same verdict.
    config, cache = step["generation_config"], passed_cache(step["model_kwargs"])
    asked = plan.run.auto_compile_asked
    if asked and asked[0] is config and asked[1] is cache:
        return asked[2]
    verdict = step.call()
    plan.run.auto_compile_asked = (config, cache, verdict)
    return verdict


@hook("prepare_inputs_for_generation", reads=("input_ids", "attention_mask", "inputs_embeds"))
def prepare_inputs_for_generation(plan, step):
    input_ids, windowed = step["input_ids"], plan.run.windowed_cache
    # What the cache holds after this forward, for the windows (read from a static cache it syncs: only when needed).
    tokens = sequence_length(input_ids, step.kwargs) if windowed is not None else None
    if plan.right is not None or plan.run.compiled is False:
        # On the right, decode as upstream decodes an unpadded prompt: its graph is shared with those calls. Eager
        # forwards need no one signature per bucket: upstream's inputs as they are (an exact fit runs as upstream's).
        if windowed is not None:
            # On the right the first forward is `prefill_right`'s: these are decode steps.
            set_window(windowed, tokens, query=plan.right is None and tokens == plan.run.query_window_tokens)
        model_inputs = step.call()
        if plan.right is None:
            _check_mask_passed_on(plan, step["attention_mask"], model_inputs)
        _before_forward(plan, model_inputs, tokens, _new_tokens(model_inputs))
        return model_inputs
    attention_mask = step["attention_mask"]
    if attention_mask is None:
        # Upstream dropped an all-ones mask. Put it back, with the length upstream would have carried.
        length = tokens if tokens is not None else sequence_length(input_ids, step.kwargs)
        attention_mask = torch.ones(input_ids.shape[0], length, dtype=torch.long, device=input_ids.device)
        step["attention_mask"] = attention_mask
    if windowed is not None:  # before upstream builds the 4D mask, which reads the window's length
        set_window(windowed, tokens, query=tokens == plan.run.query_window_tokens)
    token = _MATERIALIZE_SDPA_MASK.set(True)
    try:
        model_inputs = step.call()
    finally:
        _MATERIALIZE_SDPA_MASK.reset(token)
    _check_mask_passed_on(plan, attention_mask, model_inputs)
    new = _new_tokens(model_inputs)
    _materialize_recurrent_masks(model_inputs, attention_mask, new)
    _before_forward(plan, model_inputs, tokens, new)
    # Chunked prefill slices per-token inputs out of the whole prompt's: views whose strides depend on the prompt
    # length, which a compiled forward guards on. Fresh copies give every chunk of every prompt one signature.
    for key in PER_TOKEN_KWARGS:
        value = model_inputs.get(key)
        if isinstance(value, torch.Tensor) and value.ndim >= 2 and key != "attention_mask":
            model_inputs[key] = value.clone(memory_format=torch.contiguous_format)
    if plan.run.generic_prefill and new == plan.run.prefill_tokens and new > 1:
        # The forward of the whole prefill: one graph for every bucket (chunks have one length already).
        mark_prefill_dynamic(model_inputs, new, tokens if tokens is not None else new)
    return model_inputs


def _new_tokens(model_inputs: dict) -> int | None:
    """The tokens a forward's inputs add to the cache (`None` where they hold no ids or embeddings)."""
    new_tokens = model_inputs.get("input_ids")
    if new_tokens is None:
        new_tokens = model_inputs.get("inputs_embeds")
    return new_tokens.shape[1] if isinstance(new_tokens, torch.Tensor) and new_tokens.ndim >= 2 else None


def _check_mask_passed_on(plan, attention_mask, model_inputs: dict) -> None:
    """Raises when the model's step dropped a mask that hides tokens (`check_upstream` saw it taken): never silently."""
    if attention_mask is not None and "attention_mask" not in model_inputs and not bool(attention_mask.all()):
        raise RuntimeError(
            f"`{type(plan.model).__name__}.prepare_inputs_for_generation` does not pass the attention mask on to the "
            f"model, so a prompt padded on the left would attend to its padding. Set `{PREFILL_PADDING_SIDE}='right'`"
            " where that is exact, or unset the prefill bucket fields for this model."
        )


def _before_forward(plan, model_inputs: dict, tokens: int | None, new: int | None) -> None:
    """
    Before each forward of `new` tokens, after which the cache holds `tokens` (`None`: no windows): the mask cut to the
    window; if compiled, the call's recompile limit put back (transformers < 5.23's chunked prefill lowers it) before
    every prompt forward and the first decode step, and the window a decode step reads recorded for the budget.
    """
    if tokens is not None:
        mask_to_window(plan.run.windowed_cache, model_inputs, tokens)
    if plan.run.compiled is False:
        return
    decode = new == 1
    if not (decode and plan.run.decoding):
        restore_recompile_limit(plan.run.recompile_limit)
    plan.run.decoding = decode
    if decode:
        window = window_of(plan, tokens, plan.run.static_cache_length)
        plan.run.decode_windows_read.add(window)
        if plan.run.generic_prefill and window is not None:  # one graph for every window (`budget.decode_graphs`)
            mark_window_dynamic(model_inputs, window)


def _materialize_recurrent_masks(model_inputs: dict, attention_mask, new: int | None) -> None:
    """
    A hybrid model's recurrent layers get `None` for an exact fit's all-ones mask, else the padding mask: two graphs
    per bucket. The all-ones mask gives exact fits their bucket's signature (multiplying by ones changes nothing).
    """
    masks = model_inputs.get("attention_mask")
    if not isinstance(masks, dict) or not isinstance(attention_mask, torch.Tensor) or attention_mask.ndim != 2:
        return
    if new is None or new <= 1:  # decode steps never get a recurrent mask
        return
    for key in transformers_api.recurrent_mask_keys():
        if key in masks and masks[key] is None:
            masks[key] = attention_mask[:, -new:].contiguous()


def _sdpa_mask_skip(original):
    def hooked(*args, **kwargs):
        # Inside a compiled forward (a model building its own mask), stay out of the graph: upstream's rule applies.
        # Asked first: dynamo can't trace `ContextVar.get`.
        if not torch.compiler.is_compiling() and _MATERIALIZE_SDPA_MASK.get():
            return False
        return original(*args, **kwargs)

    return wraps(hooked, original)


@hook("get_compiled_call", reads=("compile_config",))
def get_compiled_call(plan, step):
    model = plan.model
    if is_aot_forward(model):
        # Its graphs are compiled already: compiling `__call__` around them would only trace it again per shape.
        if step["compile_config"] is not None:
            logger.warning_once(
                "`compile_config` is not applied: the model's forward is compiled with `aot_forward`, whose graphs "
                "generate runs as they are."
            )
        return model.__call__
    compiled = step.call()
    if compiled == model.__call__:
        return compiled
    return EagerFallback(model, compiled, model.__call__)


# The hooked steps of upstream `generate`, the one table of them: what `bucketed_call` installs, `check_upstream`
# verifies (`hook_targets`) and the module docstring lists.
HOOKS = hook_table(
    _prepare_generation_config,
    _prepare_generated_length,
    _prepare_cache_for_generation,
    _prepare_static_cache,
    views.get_logits_processor,
    views.get_stopping_criteria,
    views.get_candidate_generator,
    get_compiled_call,
    _valid_auto_compile_criteria,
    prepare_inputs_for_generation,
    prefill_right.prefill_right,
)


def hook_targets() -> dict[str, tuple[tuple[str, ...], bool]]:
    """`{target: (reads, positional)}` of every hook in `HOOKS`: what `check_upstream` verifies."""
    return {name: (entry.reads, entry.positional) for name, entry in HOOKS.items()}


# Step 2 of a call, check support: the version gate (`upstream/gate.py`), given these hooks and the verdicts the
# process keeps. `check_upstream(model_class=..., *, generate)`.
check_upstream = functools.partial(gate.check_upstream, hook_targets=hook_targets, verdicts=PROCESS)


def _install(model, state) -> None:
    """Installs the hooks and fallbacks on `model` for its first call in flight (under `LOCK`); raises before any."""
    if state.calls_in_flight == 0:
        overridden = [name for name in HOOKS if name in model.__dict__]
        if overridden:
            raise RuntimeError(
                f"`{type(model).__name__}` has `{overridden[0]}` set on the instance, which prefill buckets need to "
                "hook for the duration of the call. Set it on a subclass instead."
            )
        for name, entry in HOOKS.items():  # every target exists: `check_upstream` ran
            object.__setattr__(model, name, hooked_method(model, state, entry, getattr(model, name)))
        state.replaced = install_fallbacks(model)
    if PROCESS.calls_in_flight == 0:
        PROCESS.sdpa_skip_original = transformers_api.get_sdpa_mask_skip()
        transformers_api.set_sdpa_mask_skip(_sdpa_mask_skip(PROCESS.sdpa_skip_original))
    PROCESS.calls_in_flight += 1
    state.calls_in_flight += 1


def _uninstall(model, state) -> None:
    """Undoes `_install` for one call (under `LOCK`); the last call in flight removes the hooks."""
    state.calls_in_flight -= 1
    if state.calls_in_flight == 0:
        for name in HOOKS:
            model.__dict__.pop(name, None)
        remove_fallbacks(model, state.replaced)
        state.replaced = {}
    PROCESS.calls_in_flight -= 1
    if PROCESS.calls_in_flight == 0:
        transformers_api.set_sdpa_mask_skip(PROCESS.sdpa_skip_original)
        PROCESS.sdpa_skip_original = None
    restore_user_recompile_limits()  # once no call counts on them: the next call raises them for what it needs


@contextlib.contextmanager
def bucketed_call(plan):
    """Makes `plan` this context's active plan, with the hooks installed on its model while any bucketed call runs."""
    model = plan.model
    state = state_of(model)
    installed, token = False, None
    try:
        with LOCK:
            _install(model, state)
            installed = True
        token = _ACTIVE_PLAN.set(plan)
        yield
    finally:
        if token is not None:
            _ACTIVE_PLAN.reset(token)
        if plan.run.windowed_cache is not None:
            close_windows(plan.run.windowed_cache)
        if installed:
            with LOCK:
                _uninstall(model, state)

"""Every private transformers name the package reads or changes, behind an accessor each, and the public ones it relies
on in ways upstream does not promise: the `generate` it wraps, static caches and their layers, masking, tensor
parallelism, the output-capture registry, and what a model says of itself. `checks.upstream_problems` checks them.
"""

import contextlib
import inspect
import sys
import weakref
from typing import Any

import torch
import torch.distributed as dist
import transformers
from transformers import StaticCache, StaticLayer, StaticSlidingWindowLayer, cache_utils, masking_utils
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.generation.utils import GenerationMixin
from transformers.utils import output_capturing as _output_capturing

from . import torch_api


# Re-exported for the package's other modules.
__all__ = ["ALL_STATIC_CACHE_IMPLEMENTATIONS", "StaticLayer", "StaticSlidingWindowLayer"]

# Captured at import, before `enable()` can replace it.
UPSTREAM_GENERATE = GenerationMixin.generate
UPSTREAM_GENERATE_SIGNATURE = inspect.signature(UPSTREAM_GENERATE)
UPSTREAM_PREPARE_STATIC_CACHE = GenerationMixin._prepare_static_cache


def get_sdpa_mask_skip():
    return masking_utils._ignore_causal_mask_sdpa


def set_sdpa_mask_skip(function) -> None:
    masking_utils._ignore_causal_mask_sdpa = function


def attention_implementation(config) -> str | None:
    """The attention implementation a model config says its layers run (`"sdpa"`, `"eager"`, ...), or `None`."""
    return getattr(config, "_attn_implementation", None)


def mark_dequantized(config) -> None:
    """Tells `save_pretrained` that a model whose weights were dequantized while loading is no longer quantized."""
    config._is_quantized = False


def recurrent_mask_keys() -> tuple[str, ...]:
    """The layer types whose mask is a recurrent layers' 2D padding mask (Mamba, linear attention, convolutions)."""
    recurrent = getattr(masking_utils, "create_recurrent_attention_mask", None)  # absent before hybrid masks existed
    mapping = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    return tuple(key for key, function in mapping.items() if recurrent is not None and function is recurrent)


def valid_auto_compile(model, model_kwargs: dict, generation_config) -> bool:
    """Whether upstream `generate` will compile the forward itself (a static cache with `compile_config`, or CUDA)."""
    return model._valid_auto_compile_criteria(model_kwargs, generation_config)


def compile_on_all_devices(compile_config) -> None:
    """Makes upstream auto-compile on every device, CPU included (by default it compiles on CUDA/XPU only)."""
    compile_config._compile_all_devices = True


def static_cache_init_shape(model):
    """`(num_heads, head_dim)` to allocate a static cache before the first forward, or `None` where upstream has no such method."""
    shape_of = getattr(model, "_get_static_cache_init_shape", None)
    try:
        return shape_of() if shape_of is not None else None
    except Exception:  # a config it can't read (5.17, per-layer head sizes): upstream's cache allocates lazily
        return None


def previous_max_cache_length(model) -> int:
    """The largest static cache upstream has made for `model`, which it reuses when a call fits (-1: none yet)."""
    previous = getattr(model, "_previous_max_cache_length", -1)
    return previous if isinstance(previous, int) else -1


def set_previous_max_cache_length(model, length: int) -> None:
    """Records `length` as the largest static cache made for `model`, as upstream's `_prepare_static_cache` does."""
    model._previous_max_cache_length = length


def tensor_parallel_group(model) -> "dist.ProcessGroup | None":
    """
    The process group of `model`'s tensor-parallel ranks, or `None` when `model` is not sharded with tensor parallelism
    (`tp_size` of 1 or unset) or no process group is initialized.
    """
    module = torch_api.unwrap(model)  # the `torch.compile(model)` wrapper
    if (getattr(module, "_tp_size", None) or 1) <= 1:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    mesh = getattr(module, "_device_mesh", None)
    if mesh is None:
        return dist.group.WORLD
    if "tp" in (mesh.mesh_dim_names or ()):
        return mesh["tp"].get_group()
    return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD


# Where `generate` and the forward take the cache: `cache` from transformers 5.24 on; before, `past_key_values`, or
# `cache_params` for a model whose class name contains "mamba" (upstream's `_prepare_cache_for_generation`).
CACHE_KWARGS = ("cache", "past_key_values", "cache_params")


def cache_argument(kwargs: dict) -> tuple[str | None, object]:
    """`(name, value)` of the first of `CACHE_KWARGS` set in a call's keyword arguments, or `(None, None)`."""
    return next(((key, kwargs[key]) for key in CACHE_KWARGS if kwargs.get(key) is not None), (None, None))


def cache_seq_length(cache) -> int | None:
    """The tokens a cache holds, or `None` when it can't tell (only recurrent layers, as in Mamba's cache)."""
    try:
        return int(cache.get_seq_length())  # a 0-d tensor for a static cache
    except ValueError:
        return None


def holds_only_recurrent_layers(cache) -> bool:
    """
    Whether every layer of `cache` is recurrent (Mamba's cache), holding a state and no keys. Read from the layers too:
    5.17's `is_linear` also counts a layer with attention keys beside its state (Falcon-H1, Zamba2, Inkling).
    """
    is_linear = getattr(cache, "is_linear", None)
    if not (bool(is_linear) and all(is_linear)):
        return False
    return not any(isinstance(layer, cache_utils.CacheLayerMixin) for layer in getattr(cache, "layers", ()))


def uncount_recurrent_tokens(cache, tokens: int) -> None:
    """
    Takes `tokens` off the count of a cache of only recurrent layers (`holds_only_recurrent_layers`; 5.25's
    `cumulative_length_linear`, before which they count none): the count upstream slices a later turn's ids by.
    """
    for layer in cache.layers:
        count = getattr(layer, "cumulative_length_linear", None)
        if isinstance(count, torch.Tensor):
            count.sub_(tokens)


def reports_its_length(cache) -> bool:
    """Whether `cache.get_seq_length()` answers (a cache of only recurrent layers raises before transformers 5.25)."""
    return cache is not None and (not holds_only_recurrent_layers(cache) or cache_seq_length(cache) is not None)


def is_static_cache(cache) -> bool:
    return type(cache).__name__ == "StaticCache"


# The static cache layers right padding can rewind (`call/decision.py`): attention layers whose length is a counter.
RIGHT_PADDED_LAYERS = ("StaticLayer", "StaticSlidingWindowLayer")


def lazy_static_cache(model, max_cache_len: int):
    """The static cache `generate` would make for `model`, lazily initialized (no tensors are allocated)."""
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def counts_by_a_recurrent_layer(model) -> bool:
    """
    Whether the static cache `generate` makes for `model` counts its tokens (`get_seq_length`) by its first layer, a
    recurrent one (transformers 5.25), which counts only what the model writes to it. Asked of a throwaway lazy cache.
    """
    try:
        cache = lazy_static_cache(model, 1)
    except Exception:  # a model whose config a static cache can't be built from: `generate` makes none
        return False
    first = cache.layers[0] if cache.layers else None
    count = getattr(first, "cumulative_length_linear", None)
    if not isinstance(count, torch.Tensor) or isinstance(first, cache_utils.CacheLayerMixin):
        return False
    count.add_(1)
    return int(cache.get_seq_length()) == 1


def slot_layers(cache) -> list:
    """A static cache's layers that hold tokens in slots (not linear-attention layers, whose state has a fixed size)."""
    return [layer for layer in cache.layers if hasattr(layer, "max_cache_len")]


def static_cache_slots(cache) -> int:
    """The slots of a static cache's longest layer (`slot_layers`); a cache with none never runs out (`sys.maxsize`)."""
    return max((layer.max_cache_len for layer in slot_layers(cache)), default=sys.maxsize)


def sliding_window_slots(layer) -> int | None:
    """The slots of a sliding-window layer's ring buffer (`min(window, cache length)`), or `None` for another layer."""
    return layer.max_cache_len if hasattr(layer, "cumulative_length_int") else None


def holds_static_storage(layer) -> bool:
    """
    Whether `layer` keeps its tokens in the `[rows, heads, max_cache_len, head_dim]` keys and values that
    `StaticLayer.lazy_initialization` allocates (full-attention or sliding-window static layers, not linear attention).
    """
    return getattr(type(layer), "lazy_initialization", None) is StaticLayer.lazy_initialization


def reset_slots(cache, slots: int) -> None:
    """
    Upstream's reset of a static cache it reuses (each layer's `reset`), on the first `slots` slots only: the others
    hold zeros already. The tensors stay where they are (CUDA graphs read static addresses).
    """
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        written = min(slots, keys.shape[2])  # a sliding-window layer has fewer
        layer.keys, layer.values = keys.narrow(2, 0, written), values.narrow(2, 0, written)
        try:
            layer.reset()
        finally:
            layer.keys, layer.values = keys, values


def set_static_cache_length(cache, length: int) -> None:
    """Every layer of a static cache now holds `length` tokens (the pad slots after them are overwritten), in place."""
    for layer in cache.layers:
        if not hasattr(layer, "cumulative_length"):
            raise RuntimeError(
                f"prefill_buckets can't set the length of a `{type(layer).__name__}` cache layer on transformers "
                f"{transformers.__version__}: it has no `cumulative_length`. Set `prefill_padding_side='left'`."
            )
        if hasattr(layer, "cumulative_length_int"):  # a sliding-window ring buffer keeps a python count too
            layer.cumulative_length_int = length
        layer.cumulative_length.fill_(length)


def _empty_query_offset(layer_idx: int = 0) -> int:
    return 0


@contextlib.contextmanager
def reports_empty(cache):
    """
    While an empty, early-initialized static cache is prefilled, it reports its query offset as the int 0, as a lazy one
    does: a 0-d tensor would make a compiled mask function build a 4D mask where upstream runs SDPA with `is_causal`.
    One module-level function, so dynamo sees the same object on every call.
    """
    cache.__dict__["get_query_offset"] = _empty_query_offset
    try:
        yield
    finally:
        cache.__dict__.pop("get_query_offset", None)


def line_up_output_capture_registry(model) -> None:
    """
    Puts the entries of `model`'s classes first, sorted, in `output_capturing._CAN_RECORD_REGISTRY`. A traced forward
    reads its class's entry by its position among the keys, so an ahead-of-time compiled graph loads in a replica only
    where the position is the same. Reordering a dict keyed by name changes no lookup.
    """
    registry = getattr(_output_capturing, "_CAN_RECORD_REGISTRY", None)
    if not isinstance(registry, dict):
        return
    own = sorted({str(type(module)) for module in model.modules()}.intersection(registry))
    keys = list(registry)
    if keys[: len(own)] == own:
        return
    entries = [(key, registry[key]) for key in own] + [(key, registry[key]) for key in keys if key not in own]
    dict.clear(registry)
    for key, value in entries:  # `dict`'s own: the registry's `__setitem__` takes a model, not its key
        dict.__setitem__(registry, key, value)


# What a model says of itself: its forward's parameters, its vocabulary, its positions.

# The parameters of each function asked about, read once: bound methods by their function (a bound method is new on
# every lookup; its signature has no `self`), other callables by themselves.
_BOUND_PARAMETERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_PARAMETERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def parameters_of(function):
    """`inspect.signature(function).parameters`, read once per function."""
    bound = getattr(function, "__func__", None)
    known, key = (_BOUND_PARAMETERS, bound) if bound is not None else (_PARAMETERS, function)
    with contextlib.suppress(KeyError, TypeError):  # TypeError: a callable that can't be a weak key; read every time
        return known[key]
    parameters = inspect.signature(function).parameters
    with contextlib.suppress(TypeError):
        known[key] = parameters
    return parameters


def forward_takes(model, name: str) -> bool:
    """Whether `model.forward` takes a parameter `name`."""
    return name in parameters_of(model.forward)


def vocabulary_size(model) -> int | None:
    """The number of ids the input embedding can look up, when it tells."""
    size = getattr(model.get_input_embeddings(), "num_embeddings", None)
    return size if isinstance(size, int) else None


# The token ids `generate` itself fills or stops on: the only ids a config names that may fill padding.
_GENERATION_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def reserved_token_ids(config) -> frozenset[int]:
    """
    The ids a model's config and its nested configs give another job than padding: every `*_token_id`,
    `*_token_index` and `*_token_ids` but pad, bos and eos (multimodal placeholders such as `image_token_id`).
    """
    reserved, configs = set(), [config]
    while configs:
        for name, value in vars(configs.pop()).items():
            if isinstance(value, transformers.PretrainedConfig):
                configs.append(value)
            elif name.endswith(("_token_id", "_token_index", "_token_ids")) and name not in _GENERATION_TOKEN_FIELDS:
                values = value if isinstance(value, (list, tuple)) else (value,)
                reserved.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return frozenset(reserved)


def max_positions(model) -> int | None:
    """The model's `max_position_embeddings`, when its config states one."""
    config = model.config
    if _may_nest_a_text_config(config) and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    value = getattr(config, "max_position_embeddings", None)
    positive = isinstance(value, int) and not isinstance(value, bool) and value > 0
    return value if positive else None  # XLNet: -1


# Where `PretrainedConfig.get_text_config()` looks for a text config nested in a composite one.
_TEXT_CONFIG_NAMES = ("text_encoder", "decoder", "generator", "text_config")


def _may_nest_a_text_config(config) -> bool:
    """
    Whether `config.get_text_config()` may return another config than `config` (a composite config, one with an
    attribute it looks under, or its own `get_text_config`): a tenth of the cost of asking it.
    """
    config_class = type(config)
    if getattr(config_class, "sub_configs", None):
        return True
    if getattr(config_class, "get_text_config", None) is not transformers.PretrainedConfig.get_text_config:
        return True
    aliases = getattr(config_class, "attribute_map", None) or {}
    attributes = getattr(config, "__dict__", {})
    return any(name in attributes or name in aliases or hasattr(config_class, name) for name in _TEXT_CONFIG_NAMES)

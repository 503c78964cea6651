"""The length of a bucketed call's static KV cache, and its allocation before the first compiled forward.

The cache-length rule is `static_cache_length`, for a static cache whose `max_cache_len` is not set; the reference's
"Cache sizing" (docs/source/en/usage_reference.md) states it, and why a finished call's cache is kept for the next
(`keep_cache`, `reuse_cache`). `settings` arguments are the call's `call.resolved.CallSettings` (read by attribute:
this package sits below `call/`).
"""

from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from ..buckets import BucketPolicy, round_up
from ..config import PREFILL_BUCKETS
from ..state import LOCK, advice_for, state_of
from ..upstream.torch_api import autocast_enabled
from ..upstream.transformers_api import (
    holds_static_storage,
    is_static_cache,
    lazy_static_cache,
    previous_max_cache_length,
    reset_slots,
    set_previous_max_cache_length,
    sliding_window_slots,
    slot_layers,
    static_cache_init_shape,
    static_cache_slots,
)
from .kv_shapes import held_kv_shapes


logger = logging.get_logger(__name__)


# A static cache's length is a multiple of this (or of `prefill_pad_to_multiple_of`): sizes kernels like.
CACHE_ALIGNMENT = 64
# The first cache of a policy without a largest bucket: prompts of up to 4k tokens with as many new tokens fit it
# without a growth. Windows make its slots cost no time (the Benchmarks page has the figures); its memory is
# SmolLM2-135M, fp32: 377 MB per row.
DEFAULT_CACHE_SLOTS = 8192
# A growth goes straight to the longest sequence the model takes only when that is at most this many slots.
MAX_UNASKED_SLOTS = 16384


def aligned_cache_length(policy: BucketPolicy, slots: int) -> int:
    """`slots` rounded up to a multiple of `CACHE_ALIGNMENT` (or of the policy's `pad_to_multiple_of`)."""
    return round_up(slots, policy.pad_to_multiple_of or CACHE_ALIGNMENT)


# How to allocate the cache once, in the options of who calls (`CallSettings.entry`).
_TO_ALLOCATE_ONCE = {
    "generate": f"Pin `max_cache_len` for your longest prompt, list your largest bucket in `{PREFILL_BUCKETS}`, or call "
    "`prefill_buckets.precompile` with your longest prompt, to allocate the cache once.",
    "precompile": f"Pin `max_cache_len` for your longest prompt, or list your largest bucket in `{PREFILL_BUCKETS}`, to "
    "allocate the cache once.",
    "serve": "Start `prefill-buckets serve` with a `--max-prompt` and `--max-new-tokens` that hold your longest "
    "request, to allocate the cache once.",
}


def static_cache_length(model, settings, needed: int, prompt_slots: int) -> int:
    """The static cache's length for a call that needs `needed` slots, `prompt_slots` of them for the padded prompt."""
    policy = settings.policy
    previous = previous_max_cache_length(model)
    if previous >= needed:
        return previous
    new_slots = needed - prompt_slots
    # Never past the model's positions (a model may hold buffers that long, as GPT-Neo's causal mask), unless the call
    # itself needs more, as it would unbucketed.
    cap = None if settings.max_positions is None else max(needed, settings.max_positions)
    if previous < 0:
        largest = policy.largest_bucket
        first = policy.bucket(largest) + new_slots if largest is not None else DEFAULT_CACHE_SLOTS
        first = aligned_cache_length(policy, max(needed, first))
        first = first if cap is None else min(first, cap)
        if first > DEFAULT_CACHE_SLOTS:
            logger.warning_once(
                f"The static cache gets {first} slots ({_megabytes(model, first)} per row), more than the default of "
                f"{DEFAULT_CACHE_SLOTS}, to hold the largest bucket and the new tokens. Pin `max_cache_len` to choose."
            )
        return first
    grown = cap if cap is not None and cap <= MAX_UNASKED_SLOTS else policy.cache_length(needed)
    grown = grown if cap is None else min(aligned_cache_length(policy, grown), cap)
    logger.warning_once(
        f"A call needs {needed} static cache slots, more than the model's cache of {previous}, so the cache grows to "
        f"{grown} slots ({_megabytes(model, grown)} per row): a compiled model compiles its prefill and decode graphs "
        f"again for the new length. {advice_for(settings.entry, _TO_ALLOCATE_ONCE)}"
    )
    return grown


def _megabytes(model, slots: int) -> str:
    """
    The size per row of a static cache of `slots` slots (sliding layers hold their window), in MB (in KB under 1 MB:
    a tiny model's cache is not "0 MB").
    """
    shape = _init_shape(model)
    if shape is None:
        return "size unknown"
    layers = lazy_static_cache(model, slots).layers
    shapes = _per_layer(shape, layers)
    if shapes is None or not all(isinstance(n, int) for n in (*shapes[0], *shapes[1])):
        return "size unknown"
    item = torch.finfo(model.dtype).bits // 8 if model.dtype.is_floating_point else 4
    size = sum(2 * getattr(layer, "max_cache_len", 0) * h * d * item for layer, h, d in zip(layers, *shapes))
    return f"{size / 2**20:,.0f} MB" if size >= 2**20 else f"{max(1, round(size / 2**10)):,} KB"


def room_reason(settings, cache, holds_padding: bool, prompt_length: int, padded_length: int) -> str | None:
    """
    Why a left-padded call must run unpadded, or `None`: its padded prompt (`padded_length`, with the tokens cached)
    plus the new tokens, less one, against the static `cache` passed in (`None`: none) or a pinned `max_cache_len`.
    A passed cache too short returns the reason, or raises when it holds a bucketed call's padding (`holds_padding`:
    that can't be left out, and the cache can't grow); a pinned length too short only warns (upstream makes a longer
    cache).
    """
    new_tokens = settings.new_tokens(prompt_length)
    needed = padded_length + new_tokens - 1
    what = f"the bucket's {padded_length} positions plus {new_tokens} new tokens, less one"
    if cache is not None and is_static_cache(cache):
        slots = static_cache_slots(cache)
        if slots >= needed or all(sliding_window_slots(layer) is not None for layer in slot_layers(cache)):
            return None  # sliding-window layers drop the tokens past their window: they never run out of slots
        if holds_padding:
            raise ValueError(
                f"The cache passed in has {slots} slots, fewer than the {needed} this call needs ({what}; the cache "
                f"holds a bucketed call's padding, which this prompt is padded by too). A static cache does not grow: "
                "make the first call's `max_cache_len` at least the longest conversation, padded, plus "
                '`max_new_tokens` (the reference\'s "Cache sizing").'
            )
        return (
            f"the cache passed in has {slots} slots, fewer than the {needed} the padded call needs ({what}), so the "
            "call runs unpadded, as upstream runs it (exact output; this prompt length may compile a new graph). Pass "
            "a cache of at least the largest bucket plus `max_new_tokens` to bucket such calls."
        )
    pinned = settings.max_cache_len
    if cache is None and pinned is not None and pinned < needed:
        logger.warning_once(
            f"`max_cache_len={pinned}` is smaller than the {needed} static cache slots this call needs ({what}), so "
            f"upstream makes a {needed}-slot cache for it: exact, but a cache shape of its own, which compiles its own "
            f"graphs. Pin `max_cache_len` to at least the largest bucket of `{PREFILL_BUCKETS}` plus `max_new_tokens`."
        )
    return None


def early_initialize(model, cache, rows: int) -> bool:
    """
    Allocates a lazily initialized static cache for `rows` rows before the first compiled forward (tensors allocated
    inside it are not the static addresses CUDA graphs need), where upstream's predicted shape is what the attention
    modules hold (`held_kv_shapes`) and not under `torch.autocast` (the keys come in its dtype); elsewhere it
    initializes from its first keys, as upstream's does. Returns whether the cache is allocated before its first
    forward (here, or reused), which `keep_cache` asks.
    """
    if not hasattr(cache, "early_initialization"):
        return False
    if all(getattr(layer, "is_initialized", False) for layer in cache.layers):
        return True
    if autocast_enabled():
        return False
    shapes = _early_shapes(model, cache)
    if shapes is None:
        return False
    arguments = {"batch_size": rows, "num_heads": shapes[0], "head_dim": shapes[1]}
    cache.early_initialization(**arguments, dtype=model.dtype, device=model.device)
    return True


@dataclass(frozen=True)
class KeptCache:
    """A static cache a finished call made and did not hand back (`keep_cache`), for the next call to reuse."""

    cache: Any
    slots: int  # the length upstream's `_prepare_static_cache` made it for (its sliding-window layers have fewer)
    written: int  # the slots, from the first, that the call may have written: reset before the cache is reused


def keep_cache(model, cache, slots: int, written: int) -> None:
    """
    Keeps `cache`, a `StaticCache` upstream's `_prepare_static_cache` made for `slots` slots (0: not kept) that a
    finished call allocated as `early_initialize` does and did not hand back, for the next call (`reuse_cache`); it
    wrote at most the first `written` slots. One per model; not an offloaded one, one of other layers, or one the model
    holds itself.
    """
    layers = cache.layers
    if not slots or not is_static_cache(cache) or getattr(cache, "offloading", False) or not layers:
        return
    if not all(holds_static_storage(layer) and layer.is_initialized for layer in layers):
        return
    if id(cache) in {id(value) for value in vars(model).values()}:
        return  # the model keeps the cache object itself (a transformers that reuses it): it is not free
    state_of(model).kept_cache = KeptCache(cache, slots, written)


def reuse_cache(model, cache_implementation: str, batch_size: int, slots: int):
    """
    The cache kept on `model` (`keep_cache`), taken and reset on the slots the last call wrote, when it is the one
    upstream's `_prepare_static_cache` would make (`slots` slots, `batch_size` rows, the model's dtype and device, not
    offloaded), made in the call's `torch.inference_mode()` (torch forbids writing its tensors outside it, and they are
    other graph inputs) and not under `torch.autocast`. Else `None`, and a kept cache that doesn't fit is dropped.
    """
    state = state_of(model)
    with LOCK:  # two calls in flight never take the same cache
        kept, state.kept_cache = state.kept_cache, None
    if kept is None or kept.slots != slots or "offloaded" in cache_implementation or autocast_enabled():
        return None
    cache = kept.cache
    expected = (batch_size, model.dtype, torch.device(model.device), torch.is_inference_mode_enabled())
    for keys in (layer.keys for layer in cache.layers):
        if (keys.shape[0], keys.dtype, keys.device, keys.is_inference()) != expected:
            return None
    reset_slots(cache, kept.written)
    set_previous_max_cache_length(model, slots)  # as upstream's step records the length of the cache it made
    return cache


def allocated_as_early(model, cache) -> bool:
    """
    Whether `cache`, allocated by an eager call's first forward, holds on every layer the keys and values
    `early_initialize` would have allocated (heads, head size, the model's dtype and device): then it is kept as such.
    """
    shapes = _early_shapes(model, cache, allocated=True) if hasattr(cache, "early_initialization") else None
    if shapes is None:
        return False
    dtype, device = model.dtype, torch.device(model.device)
    for layer, heads, dim in zip(cache.layers, *shapes):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if not isinstance(tensor, torch.Tensor) or tensor.ndim != 4 or tensor.shape[1] != heads:
                return False
            if tensor.shape[3] != dim or tensor.dtype != dtype or tensor.device != device:
                return False
    return True


def _init_shape(model):
    """Upstream's `(num_heads, head_dim)` for the model's static cache (each an int or a list per layer), or `None`."""
    state = state_of(model)
    if state.cache_init_shape is None:  # read once per model, as `held_kv_shapes` is, which it must agree with
        state.cache_init_shape = (static_cache_init_shape(model),)
    return state.cache_init_shape[0]


def _early_shapes(model, cache, allocated: bool = False) -> tuple[list, list] | None:
    """
    The heads and head sizes, per layer, early initialization gives `cache`'s layers, when every attention module
    holds them (`held_kv_shapes`) on each layer it allocates (with `allocated`, or has allocated); else `None`.
    """
    shape = _init_shape(model)
    shapes = _per_layer(shape, cache.layers) if shape is not None else None
    if shapes is None:
        return None
    held = held_kv_shapes(model)
    for index, layer in enumerate(cache.layers):
        if not getattr(layer, "supports_early_init", True) or (
            getattr(layer, "is_initialized", False) and not allocated
        ):
            continue
        if held.get(index, held.get(None)) != {(shapes[0][index], shapes[1][index])}:
            return None
    return shapes


def _per_layer(shape, layers) -> tuple[list, list] | None:
    """Upstream's `(num_heads, head_dim)`, each for every layer (an int) or per layer (a list), as a list per layer."""
    heads, dims = (list(value) if isinstance(value, (list, tuple)) else [value] * len(layers) for value in shape)
    return (heads, dims) if len(heads) == len(layers) == len(dims) else None

"""The length of a bucketed call's static KV cache, and its allocation before the first compiled forward.

The cache-length rule, in one place (`static_cache_length`), for a static cache whose `max_cache_len` is not set.
Every forward of a bucketed call reads only a window of the cache (`windows.py`), so a slot costs memory, not time:
the rule allocates once, for the whole workload when it can tell, grows rarely, and never allocates the model's whole
context unasked:

1. The cache the model already has, when the call fits in it (upstream keeps the largest static cache it has made
   on the model): no new graph.
2. The first cache of the model holds every prompt the policy bounds: with a list of buckets, the largest bucket
   plus the new tokens. `"pow2"` and `prefill_pad_to_multiple_of` alone have no largest bucket: the first cache then
   holds `DEFAULT_CACHE_SLOTS` (8,192) slots, or the call, when it needs more.
3. A call that does not fit grows the cache: to the longest sequence the model takes (its `max_position_embeddings`)
   when that is at most `MAX_UNASKED_SLOTS` (16,384) slots, else to the next power of two the call needs, which
   bounds the cache lengths by log2 of the longest sequence. A model that states no maximum grows geometrically too.

Every length is rounded up to a multiple of 64 (or of `prefill_pad_to_multiple_of`), and capped at what the model
takes: never past `max_position_embeddings`, which some models size buffers by (GPT-Neo's causal mask), unless the
call itself needs more slots, as it would unbucketed. `precompile` pins the cache to its longest bucket instead
(`aligned_cache_length`). A cache the user did not ask for that is longer than `DEFAULT_CACHE_SLOTS` logs its size in
bytes when it is made. Pin `max_cache_len` to the largest bucket plus `max_new_tokens` to choose the memory yourself
(`room_reason` checks a call against a pinned or passed cache).

`early_initialize` allocates the cache before the first compiled forward, where the key/value heads and head size each
attention module holds (`held_kv_shapes`, read from its own projections, never the config) agree with the shape
upstream predicts from the config. A config may misstate them (multi-query Falcon and GPT-BigCode, a GPT-NeoX config
with an unused `num_key_value_heads`).

Upstream makes a new static cache for every call, and allocating it costs time in proportion to its slots (fresh
memory is zeroed page by page: about 100 ms for SmolLM2's 8,192 slots on a 2-core CPU, where a prefill of 300 tokens
takes 500 ms), and making the cache object costs time per layer. So the cache is made once per workload, as the
slots-cost-no-time rule assumes: a finished call that made its cache and did not hand it back leaves it on the model
(`keep_cache`; an eager call's where its first forward allocated what `early_initialize` would have), and the next
call that makes a cache of the same shape gets it back (`reuse_cache`, in place of upstream's
`_prepare_static_cache`), reset as upstream resets a cache it reuses, on the slots the last call wrote, so it holds
what a new one would.

`settings` arguments are the call's `call.resolved.CallSettings` (read by attribute: this package sits below `call/`).
"""

from dataclasses import dataclass
from typing import Any

import torch
from transformers.utils import logging

from ..buckets import BucketPolicy, round_up
from ..config import PREFILL_BUCKETS
from ..state import LOCK, state_of
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
    """
    The length of the static cache for a call that needs `needed` slots, `prompt_slots` of them for its (padded)
    prompt and the tokens already cached, the rest for new tokens. See the module docstring for the rule.
    """
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
        _log_unasked(model, first)
        return first
    grown = cap if cap is not None and cap <= MAX_UNASKED_SLOTS else policy.cache_length(needed)
    grown = grown if cap is None else min(aligned_cache_length(policy, grown), cap)
    logger.warning_once(
        f"A call needs {needed} static cache slots, more than the model's cache of {previous}, so the cache grows to "
        f"{grown} slots ({_megabytes(model, grown)} per row): a compiled model compiles its prefill and decode graphs "
        f"again for the new length. {_TO_ALLOCATE_ONCE[settings.entry]}"
    )
    return grown


def _log_unasked(model, slots: int) -> None:
    if slots > DEFAULT_CACHE_SLOTS:
        logger.warning_once(
            f"The static cache gets {slots} slots ({_megabytes(model, slots)} per row), more than the default of "
            f"{DEFAULT_CACHE_SLOTS}, to hold the largest bucket and the new tokens. Pin `max_cache_len` to choose."
        )


def cache_bytes_per_row(model, slots: int) -> int | None:
    """
    The bytes a static cache of `slots` slots takes per batch row (sliding layers hold their window), or `None` when
    the layout can't be told from the config. Head counts and head sizes may be per layer (Gemma 4).
    """
    shape = _init_shape(model)
    if shape is None:
        return None
    num_heads, head_dim = shape
    layers = lazy_static_cache(model, slots).layers
    heads, dims = _per_layer(num_heads, layers), _per_layer(head_dim, layers)
    if not all(isinstance(n, int) for n in (*heads, *dims)) or len(heads) != len(layers) or len(dims) != len(layers):
        return None
    item = torch.finfo(model.dtype).bits // 8 if model.dtype.is_floating_point else 4
    return sum(2 * getattr(layer, "max_cache_len", 0) * h * d * item for layer, h, d in zip(layers, heads, dims))


def _megabytes(model, slots: int) -> str:
    """A cache's size per row, in MB (in KB under 1 MB: a tiny model's cache is not "0 MB")."""
    size = cache_bytes_per_row(model, slots)
    if size is None:
        return "size unknown"
    return f"{size / 2**20:,.0f} MB" if size >= 2**20 else f"{max(1, round(size / 2**10)):,} KB"


def room_reason(settings, cache, holds_padding: bool, prompt_length: int, padded_length: int) -> str | None:
    """
    A left-padded call against the static cache it will write (`cache`: the one passed in, or `None`; `holds_padding`:
    whether a bucketed call left padding in it): its padded prompt of `padded_length` (in a conversation, with the
    tokens the cache holds) plus the new tokens, less one (the last token is never written). Returns why the call must
    run unpadded, or `None` when it is bucketed:

    - a cache passed in with fewer slots, that holds no padding: the call runs unpadded, as upstream runs it (reason);
    - a cache passed in with fewer slots, that holds a bucketed call's padding: `ValueError` naming both lengths (the
      padding in the cache can't be left out, and the cache can't grow);
    - a pinned `max_cache_len` with fewer slots: upstream sizes the cache by what the call needs, so the call runs
      exact in a longer cache, a shape of its own; a warning says so (`None`).
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
    Allocates a lazily initialized static cache for `rows` rows, when the model's layout allows it and the shape
    upstream predicts from the config is the one the attention modules hold (`held_kv_shapes`). Done before the first
    compiled forward, as upstream does for chunked prefill: tensors allocated inside the first compiled prefill are not
    static addresses, which CUDA graphs need. Where the shape can't be confirmed (a config that misstates its
    key/value heads: multi-query Falcon and GPT-BigCode, a GPT-NeoX config given an unused `num_key_value_heads`, a
    decoder whose heads differ from the encoder's), the cache initializes from the first keys it gets, as upstream's
    own lazily allocated cache does: exact, at the cost of one more graph on the first compiled call. Under
    `torch.autocast` too: the keys then come in the autocast dtype, which the model's dtype does not tell.

    Returns whether the cache is allocated before its first forward (here, or already: a cache reused from the last
    call, `reuse_cache`), which `keep_cache` asks: a cache allocated inside the first forward is not kept, so every
    call's first forward sees a cache as upstream's.
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
    Keeps `cache` on `model` for the next call that makes one (`reuse_cache`): a `StaticCache` that upstream's
    `_prepare_static_cache` made for `slots` slots (0: another step made it, not kept) and a finished call allocated
    before its first forward (`early_initialize`) or, eager, in it as early initialization would have
    (`allocated_as_early`), which it did not hand back, and of which it wrote at most the first `written` slots. One
    cache is kept per model (the last call's); a cache the model holds itself, an offloaded one, or one with layers of
    another kind is not.
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
    The cache kept on `model` (`keep_cache`), taken, when it is the one upstream's `_prepare_static_cache` would make
    (a `StaticCache` for `slots` slots, upstream's length, and `batch_size` rows, not offloaded) in the model's dtype
    and on its device, made in the call's mode (outside `torch.inference_mode()` torch forbids writing tensors made
    inside it, and inside it they are other graph inputs than a new cache's, which dynamo compiles again), and not
    under `torch.autocast` (the keys would come in its dtype). Reset as upstream resets a cache it reuses (each
    layer's `reset`), on the slots the last call wrote (the others still hold zeros), so it holds what a new one would.
    Else `None`, and a kept cache that doesn't fit is dropped.
    """
    state = state_of(model)
    with LOCK:  # two calls in flight never take the same cache
        kept, state.kept_cache = state.kept_cache, None
    if kept is None or kept.slots != slots or "offloaded" in cache_implementation or autocast_enabled():
        return None
    cache, inference_mode = kept.cache, torch.is_inference_mode_enabled()
    dtype, device = model.dtype, torch.device(model.device)  # each a walk over the parameters: read once
    for layer in cache.layers:
        keys = layer.keys
        if keys.shape[0] != batch_size or keys.dtype != dtype or keys.device != device:
            return None
        if keys.is_inference() != inference_mode:
            return None
    reset_slots(cache, kept.written)
    set_previous_max_cache_length(model, slots)  # as upstream's step records the length of the cache it made
    return cache


def allocated_as_early(model, cache) -> bool:
    """
    Whether `cache`, allocated by its first forward (an eager call's: upstream allocates a static layer from the first
    keys it gets), holds what `early_initialize` would have allocated: on every layer, keys and values of the heads and
    head size early initialization gives it, in the model's dtype and on its device. Such a cache is kept as one
    allocated early; one of another shape or dtype (a config that misstates its key/value heads, keys computed in
    another dtype) is new every call, as upstream's.
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
    The heads and head sizes, per layer, early initialization gives `cache`'s layers, when they are what every
    attention module holds (`_shape_is_held`; with `allocated`, allocated layers are checked too); else `None`.
    """
    shape = _init_shape(model)
    if shape is None:
        return None
    heads, dims = _per_layer(shape[0], cache.layers), _per_layer(shape[1], cache.layers)
    return (heads, dims) if _shape_is_held(model, cache, heads, dims, allocated) else None


def _per_layer(value, layers) -> list:
    """A head count or head size upstream gives for every layer (an int) or per layer (a list), as a list per layer."""
    return list(value) if isinstance(value, (list, tuple)) else [value] * len(layers)


def _shape_is_held(model, cache, heads: list, dims: list, allocated: bool = False) -> bool:
    """Whether every layer early initialization would allocate (with `allocated`, or has allocated) gets the
    `(heads, head_dim)` its attention holds."""
    layers = cache.layers
    if len(heads) != len(layers) or len(dims) != len(layers):
        return False
    held = held_kv_shapes(model)
    for index, layer in enumerate(layers):
        if not getattr(layer, "supports_early_init", True) or (
            getattr(layer, "is_initialized", False) and not allocated
        ):
            continue
        if held.get(index, held.get(None)) != {(heads[index], dims[index])}:
            return False
    return True

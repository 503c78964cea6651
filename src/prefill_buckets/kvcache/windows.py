"""Attention windows: every forward of a bucketed call reads only the first `W` slots of its static cache.

A full-attention layer of a `StaticCache` becomes a `WindowedStaticLayer` for the call: its `update` returns, and its
mask spans, the smallest window that holds the tokens cached plus the forward's own (`window_length`), not every
slot; the slots past the tokens are masked either way. The window is a plain int attribute, set outside the compiled
graph before each forward (`set_window`): compiled with `dynamic=False`, each `(bucket, window, batch size)` is one
graph; otherwise decode marks the window symbolic, one graph for every window (`budget.decode_graphs`). Sliding-window layers
become rings (`ring.py`). `close_windows` makes every layer upstream's again. The reference's "Cache sizing"
(docs/source/en/usage_reference.md) gives the window lengths and what they cost.
"""

import torch
from transformers.utils import logging

from ..buckets import next_power_of_two, round_up
from ..upstream import checks, transformers_api
from .ring import SlidingWindowRing


logger = logging.get_logger(__name__)


# The shortest window: below it a step's reads are a small fixed cost, and with `dynamic=False` every window is one
# more decode graph.
MIN_WINDOW = 256
# Past 4 * MIN_WINDOW, windows are geometric: this many per doubling of the tokens held.
WINDOWS_PER_OCTAVE = 4


def window_length(tokens: int, slots: int) -> int:
    """
    The window a forward reads when, after it, the cache holds `tokens` tokens of its `slots` slots. Never every slot
    while one is free: a window of every slot is contiguous, which inductor guards on (`64*W != 64*slots`), so it would
    be a graph of its own where every shorter window shares one.
    """
    octave = next_power_of_two(tokens)
    step = max(MIN_WINDOW, octave // (2 * WINDOWS_PER_OCTAVE))
    window = round_up(max(tokens, 1), step)
    if window < slots:
        return window
    return slots if tokens >= slots else slots - 1


def windows_between(first_tokens: int, last_tokens: int, slots: int) -> set[int]:
    """The windows of the forwards after which the cache holds `first_tokens`, ..., `last_tokens` tokens."""
    windows, tokens = set(), first_tokens
    while tokens <= last_tokens:
        window = window_length(tokens, slots)
        windows.add(window)
        tokens = window + 1  # the next window's first token count
    return windows


def decode_warmups(bucket: int, shortest: int, new_tokens: int, slots: int) -> list[tuple[int, int]]:
    """
    `(prompt length, new tokens)` of `precompile`'s warm-up calls that compile the decode graph of every window that
    prompts of `shortest` to `bucket` tokens with `new_tokens` new tokens reach in a cache of `slots` slots: one
    exact-fit call (left-padded prompts decode from `bucket + 1` on), and, for right-padded shorter prompts, a 2-token
    call one token short of each window inside the bucket.
    """
    calls = [(bucket, new_tokens if len(windows_between(bucket + 1, bucket + new_tokens - 1, slots)) > 1 else 2)]
    for window in sorted(windows_between(shortest + 1, bucket, slots) - {window_length(bucket + 1, slots)}):
        if shortest <= window - 1 < bucket:
            calls.append((window - 1, 2))
    return calls


# The window of a forward that fills an empty cache (a shape-generic prefill, `set_window(query=True)`): it reads the
# slots its own tokens take, a size of its inputs, not a number the graph is compiled for, so one graph symbolic in the
# prompt length serves every bucket. Its slots past the tokens hold nothing to read.
QUERY_WINDOW = 0


class WindowedStaticLayer(transformers_api.StaticLayer):
    """A `StaticLayer` whose reads and mask cover its first `window` slots (`None`: every slot; see `QUERY_WINDOW`)."""

    window: int | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # [B, H, slots, D] each
        if self.window is None:
            return keys, values
        window = key_states.shape[-2] if self.window == QUERY_WINDOW else self.window
        return keys[:, :, :window], values[:, :, :window]  # [B, H, W, D]: views, no copy

    def get_mask_sizes(self, query_length, *args, **kwargs):
        kv_length, kv_offset = super().get_mask_sizes(query_length, *args, **kwargs)
        if self.window == QUERY_WINDOW:  # before transformers 5.20 the argument is the cache positions, [S]
            return (query_length.shape[0] if isinstance(query_length, torch.Tensor) else query_length), kv_offset
        return (kv_length if self.window is None else self.window), kv_offset


# The attention implementations whose masks place each slot at `kv_offset + its index`, as rings need.
RING_ATTENTION = ("sdpa", "eager")


def _ring_layers(cache, attention: str | None) -> list:
    """The sliding-window and chunked-attention layers of a static `cache` that become rings for a call."""
    layers = [layer for layer in cache.layers if type(layer) is transformers_api.StaticSlidingWindowLayer]
    if any(transformers_api.sliding_window_slots(layer) is not None and layer not in layers for layer in cache.layers):
        logger.warning_once(
            "Hybrid layers (linear attention with a sliding window) stay upstream's: a compiled forward traces a new "
            "graph at every decode step past their window (upstream's own behaviour); outputs are exact."
        )
    if not layers:
        return []
    problem = checks.sliding_layer_problem()
    if problem is None and attention not in RING_ATTENTION:
        problem = f"`{attention}` attention reads a sliding window's keys from the right (rings: sdpa and eager)"
    if problem is not None:
        logger.warning_once(
            f"The sliding-window layers stay upstream's for this call: {problem}. A compiled forward then traces a "
            "new graph at every decode step past the window (upstream's own behaviour); outputs are exact."
        )
        return []
    return layers


def open_windows(cache, attention: str | None = "sdpa") -> bool:
    """
    Makes the full-attention layers of a static `cache` windowed and its sliding-window layers rings (for a model
    with `attention`, its attention implementation); returns whether it has any. A full-attention layer of at most
    `MIN_WINDOW` slots has one window, all of it: it stays upstream's, and shares its graphs with upstream's calls.
    """
    if not transformers_api.is_static_cache(cache):  # an encoder-decoder's cross-attention must read its whole input
        return False
    full = (transformers_api.StaticLayer, WindowedStaticLayer)
    layers = [layer for layer in cache.layers if type(layer) in full and layer.max_cache_len > MIN_WINDOW]
    for layer in layers:
        layer.__class__ = WindowedStaticLayer
        layer.window = None
    rings = _ring_layers(cache, attention)
    for layer in rings:
        SlidingWindowRing.open(layer)
    return bool(layers or rings)


def windows_read(cache) -> tuple:
    """The window each layer of `cache` reads now (`None`: every slot, or a layer without windows), layer by layer."""
    return tuple(layer.window if type(layer) is WindowedStaticLayer else None for layer in cache.layers)


def has_windows(cache) -> bool:
    """Whether `cache` has windowed full-attention layers: then a forward's graph depends on the window it reads."""
    return cache is not None and any(type(layer) is WindowedStaticLayer for layer in cache.layers)


def set_window(cache, tokens: int, query: bool = False) -> None:
    """
    Before a forward after which `cache` holds `tokens` tokens: its windowed layers read the window that holds them
    (with `query`, a forward that fills the empty cache: the slots of its own tokens, `QUERY_WINDOW`), and its rings
    mask from the position the forward's first slot holds.
    """
    for layer in cache.layers:
        if type(layer) is WindowedStaticLayer:
            layer.window = QUERY_WINDOW if query else window_length(tokens, layer.max_cache_len)
        elif type(layer) is SlidingWindowRing:
            layer.set_tokens(tokens)


def mask_to_window(cache, model_inputs: dict, tokens: int) -> None:
    """
    Cuts a 2D attention mask of `model_inputs` that spans more slots than `cache`'s windowed layers read, after which
    the cache holds `tokens` tokens, to the window (`QUERY_WINDOW`: the forward's own `tokens`): BLOOM pads its 2D
    mask to the cache's `get_max_length()` and builds its ALiBi bias from it, which must match the keys a layer
    returns. The slots cut are past the tokens, masked either way.
    """
    mask = model_inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return
    window = next((layer.window for layer in cache.layers if type(layer) is WindowedStaticLayer), None)
    if window == QUERY_WINDOW:  # the first forward into the empty cache: the keys are its own tokens'
        window = tokens
    if window and mask.shape[-1] > window:
        model_inputs["attention_mask"] = mask[:, :window].contiguous()  # [B, W]: one layout per window


def close_windows(cache) -> None:
    """Makes `cache`'s windowed layers and rings upstream's layers again: they read every slot and count in ints."""
    for layer in cache.layers:
        if type(layer) is WindowedStaticLayer:
            layer.__dict__.pop("window", None)
            layer.__class__ = transformers_api.StaticLayer
        elif type(layer) is SlidingWindowRing:
            SlidingWindowRing.close(layer)

"""Attention windows: every forward of a bucketed call reads only the first `W` slots of its static cache.

Upstream's `StaticLayer.update` writes the new keys and values at the cache position and returns the whole
allocation, and its `get_mask_sizes` returns `max_cache_len`: the mask and the attention of every forward span every
slot, however few tokens the cache holds. In a bucketed call a full-attention layer of a `StaticCache` reads a
*window* instead: the first `W` slots, `W` the smallest window length that holds the tokens cached plus this
forward's tokens (`window_length`). The slots past the tokens are masked either way, so the result is the same; the
cost of a step becomes the tokens held, rounded up to a window, not the slots allocated.

- The cache stays one allocation, and writes go where they go today (`StaticLayer.update` itself).
- `W` is chosen outside the compiled graph, before each forward, from the tokens the forward's 2D attention mask
  covers (`set_window`), and is a plain int attribute of the layer. A compiled forward guards on it: each
  `(bucket, window, batch size)` is one graph, and the window of a decode step changes only when the tokens cross a
  window length (with `dynamic=None`, torch makes it one symbolic size after the second window instead).
- Sliding-window and chunked-attention layers (exactly `StaticSlidingWindowLayer`) become rings for the call
  (`ring.py`): upstream's storage of the window and its layout, written at tensor offsets, so their graphs depend on
  the forward's length, the window and the batch size only, never on the tokens seen. Only with sdpa or eager
  attention, whose masks read the slots' positions (flash attention reads its keys from the right); elsewhere, and
  where `checks.sliding_layer_problem` finds upstream's layer changed, they stay upstream's, and a compiled forward
  retraces at every decode step past the window, as upstream's does. Recurrent, hybrid and cross-attention layers are
  untouched.
- `output_attentions=True` leaves the windows on: `attention_keys.py` puts each layer's weights back at the slots
  upstream's layer returns (zeros where nothing was read), a copy per step after `generate`; windows off would read
  every slot and compile other graphs.
- Outside a bucketed call the layers are upstream's again (`close_windows` restores their class and counts): a cache
  handed back to the user reads every slot, as upstream's does, and continues as upstream's would.

Window lengths (`window_length`): multiples of `MIN_WINDOW` (256) up to 1,024 slots, then `WINDOWS_PER_OCTAVE` (4)
per doubling: 256, 512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, ... A window reads at most 1.25x the tokens
it holds past 1,024, and a 131,072-slot cache has 32 of them.
"""

import torch
from transformers.utils import logging

from ..buckets import next_power_of_two, round_up
from ..upstream import checks, transformers_api
from .ring import SlidingWindowRing


logger = logging.get_logger(__name__)


# The shortest window: below it a step's reads are a small fixed cost, and every window is one more decode graph.
MIN_WINDOW = 256
# Past 4 * MIN_WINDOW, windows are geometric: this many per doubling of the tokens held.
WINDOWS_PER_OCTAVE = 4


def window_length(tokens: int, slots: int) -> int:
    """The window a forward reads when, after it, the cache holds `tokens` tokens of its `slots` slots."""
    octave = next_power_of_two(tokens)
    step = max(MIN_WINDOW, octave // (2 * WINDOWS_PER_OCTAVE))
    return min(round_up(max(tokens, 1), step), slots)


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
    `(prompt length, new tokens)` of the warm-up calls that compile the decode graphs of every window that calls of
    `shortest` to `bucket` tokens, with `new_tokens` new tokens, reach in a cache of `slots` slots (`precompile`).

    Left-padded, every prompt of the bucket decodes from `bucket + 1` tokens on: one exact-fit call with all the new
    tokens reaches its windows. Right-padded, a shorter prompt decodes from its own length on, in windows below: one
    2-token call per window inside the bucket, its prompt one token short of the window (the same prefill graph).
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
    """
    A `StaticLayer` whose reads and mask cover its first `window` slots (every slot while `window` is `None`; the new
    tokens' slots with `QUERY_WINDOW`). A bucketed call gives a `StaticCache`'s full-attention layers this class for
    its duration (`open_windows`).
    """

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


def _windowable(cache) -> list:
    if not transformers_api.is_static_cache(cache):  # an encoder-decoder's cross-attention must read its whole input
        return []
    return [layer for layer in cache.layers if type(layer) in (transformers_api.StaticLayer, WindowedStaticLayer)]


# The attention implementations whose masks place each slot at `kv_offset + its index`, as rings need.
RING_ATTENTION = ("sdpa", "eager")


def _ring_layers(cache, attention: str | None) -> list:
    """The sliding-window and chunked-attention layers of a static `cache` that become rings for a call."""
    if not transformers_api.is_static_cache(cache):
        return []
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
    layers = [layer for layer in _windowable(cache) if layer.max_cache_len > MIN_WINDOW]
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


def mask_to_window(cache, model_inputs: dict) -> None:
    """
    Cuts a 2D attention mask in a forward's inputs (`model_inputs`) that spans more slots of `cache` than its windowed
    layers read to the window: BLOOM's `create_masks_for_generate` (on transformers 5.17, its `prepare_inputs_for_generation`) pads
    its 2D mask to the cache's `get_max_length()` and builds its ALiBi bias from it, which must match the keys a
    layer returns. The mask reaches past the tokens the cache holds only with the zeros of that padding, and a window
    holds every token: the slots cut are past them, and masked either way.
    """
    mask = model_inputs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return
    window = next((layer.window for layer in cache.layers if type(layer) is WindowedStaticLayer), None)
    if window and mask.shape[-1] > window:  # `QUERY_WINDOW`: the mask spans the new tokens only
        model_inputs["attention_mask"] = mask[:, :window].contiguous()  # [B, W]: one layout per window


def close_windows(cache) -> None:
    """Makes `cache`'s windowed layers and rings upstream's layers again: they read every slot and count in ints."""
    for layer in cache.layers:
        if type(layer) is WindowedStaticLayer:
            layer.__dict__.pop("window", None)
            layer.__class__ = transformers_api.StaticLayer
        elif type(layer) is SlidingWindowRing:
            SlidingWindowRing.close(layer)

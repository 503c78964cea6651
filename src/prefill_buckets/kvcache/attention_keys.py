"""The key axis of the attentions a bucketed call returns with a static cache: upstream's, on every layer and step.

A layer's weights `[B, heads, query, keys]` have the slots its forward read as their key axis. A bucketed call's
layers read a window (`windows.py`) or a ring (`ring.py`), every position `added` later than in the unpadded call (the
left padding); upstream's full-attention layer reads every slot, its sliding-window layer the window as
`KeyLayout.read` gives it. `upstream_keys` puts each weight at the slot upstream's layer gives its position, zeros
elsewhere: upstream's weights are 0 there too, masked. A weight tensor whose key axis is not the one its layer reads
is left as it is (with a warning, once).
"""

from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..upstream import transformers_api
from .ring import SlidingWindowRing
from .windows import WindowedStaticLayer, window_length


logger = logging.get_logger(__name__)

FULL, SLIDING, RING = "full", "sliding", "ring"


@dataclass(frozen=True)
class KeyLayout:
    """How one static cache layer lays out the keys its forwards read."""

    kind: str  # FULL (a `StaticLayer`, windowed or not), SLIDING (upstream's sliding-window layer) or RING
    slots: int  # the layer's `max_cache_len`: the cache length, or the sliding window's slots

    def read(self, held: int, new: int) -> tuple[int, int]:
        """
        `(keys, first)` of upstream's layer for a forward of `new` tokens after `held`: the length of the key axis it
        returns and the position its slot 0 holds (slot `j` holds `first + j`). A full-attention layer's keys are
        all its slots; the call's windowed layer reads a prefix of them (`accepts`).
        """
        if self.kind == FULL:
            return self.slots, 0
        if self.kind == RING:
            return self.slots + new, max(0, held - self.slots)
        if held >= self.slots:  # full before this forward
            return self.slots - 1 + new, held - self.slots + 1
        return max(self.slots, held + new), 0

    def accepts(self, keys: int, held: int, new: int) -> bool:
        """Whether `keys` is the key axis this layer returns for that forward (a window, for a full-attention one)."""
        if self.kind == FULL:
            # The slots of the new tokens alone: a shape-generic prefill into an empty cache (`QUERY_WINDOW`).
            return keys in (self.slots, window_length(held + new, self.slots)) or (held == 0 and keys == new)
        return keys == self.read(held, new)[0]


def key_layouts(cache) -> tuple | None:
    """The `KeyLayout` of each layer of a static `cache` (`None` for a layer of another kind), or `None`."""
    if cache is None or not transformers_api.is_static_cache(cache):
        return None
    kinds = {
        transformers_api.StaticLayer: FULL,
        WindowedStaticLayer: FULL,
        SlidingWindowRing: RING,
        transformers_api.StaticSlidingWindowLayer: SLIDING,
    }
    return tuple(
        KeyLayout(kinds[type(layer)], layer.max_cache_len) if type(layer) in kinds else None for layer in cache.layers
    )


def layouts_for(layouts: tuple, attention_layers: int) -> tuple | None:
    """
    The layouts of a step's `attention_layers` weight tensors: one per cache layer, or one per attention layer of the
    cache (a hybrid model's recurrent layers return none). `None` when neither count fits (a warning, once).
    """
    if len(layouts) == attention_layers:
        return layouts
    attention = tuple(layout for layout in layouts if layout is not None)
    if len(attention) == attention_layers:
        return attention
    logger.warning_once(
        f"The attentions have {attention_layers} layers and the static cache {len(layouts)} ({len(attention)} of "
        "attention): their key axes are returned as the call's layers read them."
    )
    return None


def upstream_keys(attention, layout: KeyLayout | None, tokens: int, added: int, cached: int):
    """
    `attention` `[B, heads, query, keys]`, from a forward of a bucketed call after which the cache holds `tokens`
    (the call's count: `added` padding positions in front) and before which it held `cached`, with its key axis as
    upstream's layer would return it in the unpadded call (see the module docstring).
    """
    if attention is None or layout is None:
        return attention
    new = attention.shape[-2]
    if not layout.accepts(attention.shape[-1], cached, new):
        logger.warning_once(
            f"An attention tensor has {attention.shape[-1]} keys where its cache layer reads "
            f"{layout.read(cached, new)[0]}: it is returned as the layer read it."
        )
        return attention
    _, first = layout.read(cached, new)  # a full-attention layer's window is its first slots: 0 too
    # The unpadded call's counts: its cache held the same tokens without the padding (none on a fresh prefill).
    held = cached - added if cached else 0
    upstream = layout if layout.kind != RING else KeyLayout(SLIDING, layout.slots)  # a ring is the call's own
    keys, upstream_first = upstream.read(held, tokens - added - held)
    # Upstream's slot j holds the unpadded position `upstream_first + j`: here `upstream_first + j + added`, slot
    # `upstream_first + j + added - first` of what the call read.
    return place_keys(attention, upstream_first + added - first, keys)


def place_keys(attention, offset: int, keys: int):
    """
    `attention` `[B, heads, query, read]` on a key axis of `keys` slots, slot `j` taking the weight of slot
    `j + offset` of what was read (0 where nothing was). `keys = read - added` and `offset = added` strip the padding.
    """
    if offset == 0 and attention.shape[-1] == keys:
        return attention
    start, stop = max(0, -offset), min(keys, attention.shape[-1] - offset)
    result = attention.new_zeros((*attention.shape[:-1], keys))
    if stop > start:
        result[..., start:stop] = attention[..., start + offset : stop + offset]
    # A query that may attend to no key (one of the user's own pad positions) gets the softmax of a row masked
    # everywhere: the same weight on every key read, `1 / keys` upstream. Any other query's row holds a 0 (a masked
    # slot: a pad, a future position or one past the sliding window) or, attending to every slot read, the weights
    # of distinct scores: only those rows are one value throughout.
    unattended = (attention == attention[..., :1]).all(-1) & (attention[..., 0] > 0)  # [B, heads, query]
    if bool(unattended.any()):
        uniform = torch.tensor(1.0 / keys, dtype=torch.float32).to(attention.dtype)
        result = torch.where(unattended[..., None], uniform.to(result.device), result)
    return result

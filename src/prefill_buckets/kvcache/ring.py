"""The sliding-window (and chunked-attention) layers of a bucketed call's static cache as rings, whose compiled graph
depends on the query length, the window and the batch size only.

Upstream's `StaticSlidingWindowLayer` keeps the last `S` tokens chronologically (slot `j` holds the position
`max(0, held - S) + j`), but its `update` branches on a Python count of the tokens seen, so a compiled forward retraces
at every decode step. `SlidingWindowRing` keeps that storage and layout (a cache goes back to upstream as it is) and
does the same with tensor offsets on the tensor count: a forward of `q` tokens reads `[B, H, S + q, D]`, the `S`
slots then its new tokens, and keeps the last `S` positions. Its mask spans those `S + q` slots from the position in
slot 0, an int set outside the graph before each forward (`set_tokens`); upstream's mask function applies the window
on absolute positions, so the attention is upstream's with masked slots added.
"""

import torch

from ..upstream import transformers_api


class SlidingWindowRing(transformers_api.StaticSlidingWindowLayer):
    """A `StaticSlidingWindowLayer` whose `update` reads no Python count, for a bucketed call (`open_windows`)."""

    # Of the tokens the cache holds after the coming forward, how many are past the window (`set_tokens`): 0 while
    # they all fit, which is the only value a graph that builds its mask in the forward sees. `None`: not told.
    overflow: int | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        window, new = self.max_cache_len, key_states.shape[-2]
        held = self.cumulative_length  # [] the tokens seen before this forward
        start = (held - window).clamp(min=0)  # [] the position in slot 0
        new_start = (held + new - window).clamp(min=0)  # [] the position in slot 0 after this forward
        written = torch.arange(new, device=self.device) + (held - start)  # [q]
        kept = torch.arange(window, device=self.device) + (new_start - start)  # [S]
        # The stored slots, then zeros: room for the new tokens. [B, H, S + q, D]
        keys = torch.cat((self.keys, torch.zeros_like(key_states)), dim=-2)
        values = torch.cat((self.values, torch.zeros_like(value_states)), dim=-2)
        try:
            keys.index_copy_(2, written, key_states)
            values.index_copy_(2, written, value_states)
        except NotImplementedError:  # devices without `index_copy_` (MPS), as upstream's layers fall back
            keys[:, :, written] = key_states
            values[:, :, written] = value_states
        # Into the storage itself (its static address), with no copy in between. [B, H, S, D]
        torch.index_select(keys, 2, kept, out=self.keys)
        torch.index_select(values, 2, kept, out=self.values)
        self.cumulative_length.add_(new)
        return keys, values

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        """The slots the coming forward reads, `S + query_length`, and the position of the first."""
        window = self.max_cache_len
        overflow = self.overflow
        if overflow is None:  # no `set_tokens` before this forward: count, outside a compiled graph
            overflow = max(0, int(self.cumulative_length) + query_length - window)
        return window + query_length, max(0, overflow - query_length)

    def get_seq_length(self):
        """The tokens seen, as a 0-d tensor (upstream's `StaticLayer` reads): a compiled forward guards on no value."""
        return self.cumulative_length if self.is_initialized else 0

    def set_tokens(self, tokens: int) -> None:
        """Before a forward after which the cache holds `tokens` tokens."""
        self.overflow = max(0, tokens - self.max_cache_len)

    @classmethod
    def open(cls, layer) -> None:
        """Makes an upstream `StaticSlidingWindowLayer` a ring; upstream's count moves to the tensor it reads."""
        layer.__class__ = cls
        layer.overflow = None
        # Upstream stops updating the tensor once the window is full (it reads it only before).
        layer.cumulative_length.fill_(layer.cumulative_length_int)

    @staticmethod
    def close(layer) -> None:
        """Makes a ring upstream's `StaticSlidingWindowLayer` again, with the count upstream reads."""
        layer.__dict__.pop("overflow", None)
        layer.cumulative_length_int = int(layer.cumulative_length)
        layer.__class__ = transformers_api.StaticSlidingWindowLayer

"""The record of a filled KV cache: what a later call that continues from it (multi-turn chat) must line up with.

Every bucketed call writes a `CacheRecord` on the cache it filled (`record_call`): the padding it left (columns in
front, dummy rows), the mask of ragged right-padded rows, and the bucket fields it ran with. The next call reads it
through `PassedCache` (`call/resolved.py`), which reads each fact of the passed cache once per call.
"""

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import torch

from ..upstream.transformers_api import (
    cache_argument,
    cache_seq_length,
    holds_only_recurrent_layers,
    uncount_recurrent_tokens,
)


# Where a bucketed call leaves its `CacheRecord` on the cache it filled.
_CACHE_RECORD = "_prefill_buckets_record"


def passed_cache(model_kwargs: dict):
    """The cache passed to (or returned by) `generate`, or to a forward, when it is a cache object."""
    _, cache = cache_argument(model_kwargs)
    return cache if hasattr(cache, "get_seq_length") else None


class CachePadding(NamedTuple):
    """The padding a bucketed call left in the cache it filled, which a later call that continues from it repeats."""

    columns: int  # positions added in front of every row (left padding)
    rows: int  # the rows the call generated (its prompts, times `num_return_sequences`): a later call's prompts
    padded_rows: int  # the rows the cache holds: `rows`, then the dummy rows of `prefill_batch_buckets`


@dataclass(frozen=True)
class CacheRecord:
    """What the bucketed calls that filled a cache left in it, for a later call that continues from it."""

    # The padding a later call with the same rows repeats, so cache and prompt line up; `None`: the cache holds what an
    # unpadded call would (a right-padded call of rows of one length).
    padding: CachePadding | None
    # A right-padded call of rows of different lengths: its attention mask `[rows, S]`, as the user passed it
    # (left-padded). Row i's `L_i` prompt tokens sit in slots `0..L_i-1`, its generated tokens in the slots of their
    # columns: a later call lines its mask up with that.
    ragged_rows: torch.Tensor | None = None
    # The bucket fields the call ran with (`ResolvedCall.bucketing`), which a later call that sets none continues with.
    bucketing: tuple | None = None


_UNREAD = object()


def cache_record(cache, tokens=_UNREAD) -> CacheRecord | None:
    """
    The record of the bucketed calls that filled `cache`, or `None`; a reset cache (no tokens) loses its record.
    `tokens`: what `cache_seq_length(cache)` returns, when the caller has read it already.
    """
    if cache is None or _CACHE_RECORD not in cache.__dict__:
        return None
    if (cache_seq_length(cache) if tokens is _UNREAD else tokens) == 0:
        del cache.__dict__[_CACHE_RECORD]
        return None
    return cache.__dict__[_CACHE_RECORD]


class PassedCache:
    """The cache a call passes to `generate` (`None`: none), and what the call's steps ask of it, each read once."""

    def __init__(self, model_kwargs: dict):
        self.cache = passed_cache(model_kwargs)

    @cached_property
    def tokens(self) -> int | None:
        """The tokens the cache holds (`cache_seq_length`; `None`: it can't tell); 0 when no cache is passed."""
        return cache_seq_length(self.cache) if self.cache is not None else 0

    @cached_property
    def recurrent_only(self) -> bool:
        """Whether every layer of the cache is recurrent (`holds_only_recurrent_layers`); `False` when none is passed."""
        return self.cache is not None and holds_only_recurrent_layers(self.cache)

    @cached_property
    def rows(self) -> int | None:
        """The rows the cache holds (its first layer with keys; `None`: none holds keys yet, or no cache is passed)."""
        for layer in getattr(self.cache, "layers", ()):
            keys = getattr(layer, "keys", None)
            if isinstance(keys, torch.Tensor) and keys.ndim >= 2:
                return keys.shape[0]
        return None

    @cached_property
    def record(self) -> CacheRecord | None:
        """The record the bucketed calls that filled it left (`cache_record`)."""
        if self.cache is None or _CACHE_RECORD not in self.cache.__dict__:
            return None
        return cache_record(self.cache, self.tokens)

    @property
    def continued(self) -> CachePadding | None:
        """The padding the cache holds from a bucketed call, which the call must continue, else `None`."""
        return self.record.padding if self.record is not None else None

    @property
    def bucketing(self) -> tuple | None:
        """The bucket fields of the bucketed call that filled the cache, or `None`."""
        return self.record.bucketing if self.record is not None else None

    @property
    def ragged_rows(self) -> torch.Tensor | None:
        """The attention mask of the ragged right-padded call that filled the cache, or `None`."""
        return self.record.ragged_rows if self.record is not None else None


def record_call(cache, plan, attention_mask, continues: bool) -> None:
    """
    Writes the record of the bucketed call `plan` that filled `cache` (`continues`: from the tokens it held); a
    continuation keeps the ragged rows the cache was first filled with.
    """
    previous = cache.__dict__.get(_CACHE_RECORD)
    right = plan.right
    padding = previous.padding if previous is not None else None
    if right is None or plan.padded_batch > plan.call.rows or plan.call.ragged:
        padding = CachePadding(plan.added_positions, plan.call.output_rows, plan.padded_rows)
    if padding is not None and padding.columns and holds_only_recurrent_layers(cache):
        # Recurrent layers keep the masked pads out of their state, but count them (transformers 5.25), and upstream
        # slices a later turn's ids by that count: uncounted, the cache is an unpadded call's, which a later turn
        # continues unpadded (`decision.DECISION`).
        uncount_recurrent_tokens(cache, padding.columns)
        padding = CachePadding(0, padding.rows, padding.padded_rows) if padding.padded_rows != padding.rows else None
    if continues:
        ragged_rows = previous.ragged_rows if previous is not None else None
    else:
        # The mask of the call's own rows: after them, the dummy rows of `prefill_batch_buckets` are all ones.
        ragged_rows = attention_mask[: plan.call.rows] if right is not None and plan.call.ragged else None
    cache.__dict__[_CACHE_RECORD] = CacheRecord(padding, ragged_rows, plan.call.bucketing)


def sequence_length(input_ids, kwargs: dict) -> int:
    """
    The tokens the cache holds after the forward `prepare_inputs_for_generation` prepares: the tokens already in the
    cache plus the ones this forward adds, the length upstream gives the 2D attention mask.
    """
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor) and mask.ndim == 2:
        return mask.shape[1]
    _, cache = cache_argument(kwargs)
    past_length = (cache_seq_length(cache) or 0) if cache is not None else 0
    next_sequence_length = kwargs.get("next_sequence_length")
    inputs_embeds = kwargs.get("inputs_embeds")
    if next_sequence_length is not None:  # decode: the new tokens are the last ones of `input_ids`
        return past_length + int(next_sequence_length)  # a 0-d tensor when upstream took it from a static cache
    if inputs_embeds is not None and kwargs.get("is_first_iteration"):
        return inputs_embeds.shape[1]
    if input_ids.shape[1] > past_length:  # the whole sequence so far
        return input_ids.shape[1]
    return past_length + input_ids.shape[1]  # a later chunk of chunked prefill: only the chunk's ids

"""The KV cache of a bucketed call: how long a static cache is, and how a later call continues from a filled one.

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
(`pinned_cache_length`). A cache the user did not ask for that is longer than `DEFAULT_CACHE_SLOTS` logs its size in
bytes when it is made. Pin `max_cache_len` to the largest bucket plus `max_new_tokens` to choose the memory yourself
(`room_reason` checks a call against a pinned or passed cache).
"""

from dataclasses import dataclass
from functools import cached_property

import torch
from transformers.utils import logging

from ..buckets import BucketPolicy, round_up
from ..config import PREFILL_BUCKETS
from ..upstream.transformers_api import (
    cache_argument,
    cache_seq_length,
    is_static_cache,
    lazy_static_cache,
    previous_max_cache_length,
    sliding_window_slots,
    static_cache_init_shape,
    static_cache_slots,
)
from .kv_shapes import held_kv_shapes
from .settings import CallSettings


logger = logging.get_logger(__name__)

# A static cache's length is a multiple of this (or of `prefill_pad_to_multiple_of`): sizes kernels like.
CACHE_ALIGNMENT = 64
# The first cache of a policy without a largest bucket: prompts of up to 4k tokens with as many new tokens fit it
# without a growth. Windows make its slots cost no time (the guide's "Cache sizing" has the figures); its memory is
# SmolLM2-135M, fp32: 377 MB per row.
DEFAULT_CACHE_SLOTS = 8192
# A growth goes straight to the longest sequence the model takes only when that is at most this many slots.
MAX_UNASKED_SLOTS = 16384
# Where a bucketed call leaves its `CacheRecord` on the cache it filled.
_CACHE_RECORD = "_prefill_buckets_record"


def _aligned(policy: BucketPolicy, slots: int) -> int:
    return round_up(slots, policy.pad_to_multiple_of or CACHE_ALIGNMENT)


def static_cache_length(model, settings: CallSettings, needed: int, prompt_slots: int) -> int:
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
        first = _aligned(policy, max(needed, first))
        first = first if cap is None else min(first, cap)
        _log_unasked(model, first)
        return first
    grown = cap if cap is not None and cap <= MAX_UNASKED_SLOTS else policy.cache_length(needed)
    grown = grown if cap is None else min(_aligned(policy, grown), cap)
    logger.warning_once(
        f"A call needs {needed} static cache slots, more than the model's cache of {previous}, so the cache grows to "
        f"{grown} slots ({_megabytes(model, grown)} per row): a compiled model compiles its prefill and decode graphs "
        f"again for the new length. Pin `max_cache_len` for your longest prompt, list your largest "
        f"bucket in `{PREFILL_BUCKETS}`, or call `prefill_buckets.precompile` with your longest prompt, to allocate "
        "the cache once."
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
    shape = static_cache_init_shape(model)
    if shape is None:
        return None
    num_heads, head_dim = shape
    layers = lazy_static_cache(model, slots).layers
    heads = num_heads if isinstance(num_heads, (list, tuple)) else [num_heads] * len(layers)
    dims = head_dim if isinstance(head_dim, (list, tuple)) else [head_dim] * len(layers)
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


def pinned_cache_length(policy: BucketPolicy, needed: int) -> int:
    """The length `precompile` pins the static cache to, for a workload whose longest call needs `needed` slots."""
    return _aligned(policy, needed)


def room_reason(
    settings: CallSettings, cache, holds_padding: bool, prompt_length: int, padded_length: int
) -> str | None:
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
        if slots >= needed or all(sliding_window_slots(layer) is not None for layer in cache.layers):
            return None  # sliding-window layers drop the tokens past their window: they never run out of slots
        if holds_padding:
            raise ValueError(
                f"The cache passed in has {slots} slots, fewer than the {needed} this call needs ({what}; the cache "
                f"holds a bucketed call's padding, which this prompt is padded by too). A static cache does not grow: "
                "make the first call's `max_cache_len` at least the longest conversation, padded, plus "
                '`max_new_tokens` (the guide\'s "Cache sizing").'
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


def passed_cache(model_kwargs: dict):
    """The cache passed to (or returned by) `generate`, or to a forward, when it is a cache object."""
    _, cache = cache_argument(model_kwargs)
    return cache if hasattr(cache, "get_seq_length") else None


@dataclass(frozen=True)
class CacheRecord:
    """
    What the bucketed calls that filled a cache left in it, for a later call that continues from it (multi-turn chat).
    Every bucketed call writes it (`record_call`); a cache that holds no tokens (reset) has none (`cache_record`).
    """

    # `(columns added in front, batch size with dummy rows)`, when the cache's layout is not an unpadded call's: a
    # later call pads its prompt by the same columns (and brings the rows), so cache and prompt line up. `None`: the
    # cache holds what an unpadded call would (a right-padded call of rows of one length).
    padding: tuple[int, int] | None
    # A right-padded call of rows of different lengths: its attention mask `[rows, S]`, as the user passed it
    # (left-padded). Row i's `L_i` prompt tokens sit in slots `0..L_i-1` (the mask's ones moved to the front), its
    # generated tokens in the slots of their columns. A later call lines its mask up with that.
    ragged_rows: torch.Tensor | None = None
    # The bucket fields the call ran with (`CallSettings.bucketing`): a later call that sets none of its own continues
    # the conversation with them (`PassedCache.bucketing`), so every turn of a chat is bucketed as the first was.
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
    """
    The cache a call passes to `generate` (`None`: none), and what the call's steps ask of it, each read once per call
    when first asked (`generation.generate` makes it before the call writes its own record, and hands it on).
    """

    def __init__(self, model_kwargs: dict):
        self.cache = passed_cache(model_kwargs)

    @cached_property
    def tokens(self) -> int | None:
        """The tokens the cache holds (`cache_seq_length`; `None`: it can't tell); 0 when no cache is passed."""
        return cache_seq_length(self.cache) if self.cache is not None else 0

    @cached_property
    def record(self) -> CacheRecord | None:
        """The record the bucketed calls that filled it left (`cache_record`)."""
        if self.cache is None or _CACHE_RECORD not in self.cache.__dict__:
            return None
        return cache_record(self.cache, self.tokens)

    @property
    def continued(self) -> tuple[int, int] | None:
        """`(pad, padded batch)` when the cache holds a bucketed call's padding the call must continue, else `None`."""
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
    Writes the record of the bucketed call `plan` that filled `cache` (`continues`: from the tokens it held). A
    left-padded call, one with dummy rows, and one of ragged rows leave padding a later call must continue; a
    continuation keeps the ragged rows the cache was first filled with.
    """
    previous = cache.__dict__.get(_CACHE_RECORD)
    right = plan.right
    padding = previous.padding if previous is not None else None
    if right is None or plan.padded_batch > plan.batch_size or right.ragged:
        padding = (plan.added_positions, plan.padded_batch)
    if continues:
        ragged_rows = previous.ragged_rows if previous is not None else None
    else:
        ragged_rows = attention_mask if right is not None and right.ragged else None
    cache.__dict__[_CACHE_RECORD] = CacheRecord(padding, ragged_rows, plan.settings.bucketing)


def early_initialize(model, cache, rows: int) -> None:
    """
    Allocates a lazily initialized static cache for `rows` rows, when the model's layout allows it and the shape
    upstream predicts from the config is the one the attention modules hold (`held_kv_shapes`). Done before the first
    compiled forward, as upstream does for chunked prefill: tensors allocated inside the first compiled prefill are not
    static addresses, which CUDA graphs need. Where the shape can't be confirmed (a config that misstates its
    key/value heads: multi-query Falcon and GPT-BigCode, a GPT-NeoX config given an unused `num_key_value_heads`, a
    decoder whose heads differ from the encoder's), the cache initializes from the first keys it gets, as upstream's
    own lazily allocated cache does: exact, at the cost of one more graph on the first compiled call.
    """
    if not hasattr(cache, "early_initialization") or all(
        getattr(layer, "is_initialized", False) for layer in cache.layers
    ):
        return  # allocated already: the model's cache, reused by a later call
    shape = static_cache_init_shape(model)
    if shape is None:
        return
    num_heads, head_dim = shape
    if not _shape_is_held(model, cache, num_heads, head_dim):
        return
    cache.early_initialization(
        batch_size=rows, num_heads=num_heads, head_dim=head_dim, dtype=model.dtype, device=model.device
    )


def _shape_is_held(model, cache, num_heads, head_dim) -> bool:
    """Whether every layer early initialization would allocate gets the `(heads, head_dim)` its attention holds."""
    layers = cache.layers
    heads = num_heads if isinstance(num_heads, list) else [num_heads] * len(layers)
    dims = head_dim if isinstance(head_dim, list) else [head_dim] * len(layers)
    if len(heads) != len(layers) or len(dims) != len(layers):
        return False
    held = held_kv_shapes(model)
    for index, layer in enumerate(layers):
        if not getattr(layer, "supports_early_init", True) or getattr(layer, "is_initialized", False):
            continue
        if held.get(index, held.get(None)) != {(heads[index], dims[index])}:
            return False
    return True


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

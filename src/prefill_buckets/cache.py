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
3. A call that does not fit grows the cache: to the longest sequence the model takes (its `max_position_embeddings`
   plus the new tokens) when that is at most `MAX_UNASKED_SLOTS` (16,384) slots, else to the next power of two the
   call needs, which bounds the cache lengths by log2 of the longest sequence. A model that states no maximum grows
   geometrically too.

Every length is capped at what the model takes (step 3's first length), and rounded up to a multiple of 64 (or of
`prefill_pad_to_multiple_of`). `precompile` pins the cache to its longest bucket instead (`pinned_cache_length`).
A cache the user did not ask for that is longer than `DEFAULT_CACHE_SLOTS` logs its size in bytes when it is made.
Pin `max_cache_len` to choose the memory yourself.
"""

import torch
from transformers.utils import logging

from ._compat import lazy_static_cache, previous_max_cache_length, static_cache_init_shape
from .buckets import BucketPolicy, round_up
from .config import PREFILL_BUCKETS
from .settings import CallSettings
from .state import state_of


logger = logging.get_logger(__name__)

# Where `generate` and the forward take the cache: `cache` from transformers 5.24 on; before, `past_key_values`, or
# `cache_params` for a model whose class name contains "mamba" (upstream's `_prepare_cache_for_generation`).
CACHE_KWARGS = ("cache", "past_key_values", "cache_params")
# A static cache's length is a multiple of this (or of `prefill_pad_to_multiple_of`): sizes kernels like.
CACHE_ALIGNMENT = 64
# The first cache of a policy without a largest bucket: prompts of up to 4k tokens with as many new tokens fit it
# without a growth. Windows make its slots cost no time (the guide's "Cache sizing" has the figures); its memory is
# SmolLM2-135M, fp32: 377 MB per row.
DEFAULT_CACHE_SLOTS = 8192
# A growth goes straight to the longest sequence the model takes only when that is at most this many slots.
MAX_UNASKED_SLOTS = 16384
# Set on a cache filled by a bucketed call: `(columns added in front, batch size with dummy rows)`. A later call that
# continues from the cache (multi-turn chat) pads its prompt by the same columns, so cache and prompt line up.
_CACHE_PADDING = "_prefill_buckets_padding"


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
    cap = None if settings.max_positions is None else _aligned(policy, max(needed, settings.max_positions + new_slots))
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
        f"{grown} slots ({_megabytes(model, grown)} per row): every bucket compiles its prefill graph once more at "
        f"the new length, and decode its graphs. Pin `max_cache_len` for your longest prompt, list your largest "
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


def cache_bytes_per_row(model, slots: int) -> int:
    """The bytes a static cache of `slots` slots takes per batch row (sliding layers hold their window)."""
    shape = static_cache_init_shape(model)
    if shape is None:
        return 0
    num_heads, head_dim = shape
    layers = lazy_static_cache(model, slots).layers
    heads = num_heads if isinstance(num_heads, list) else [num_heads] * len(layers)
    item = torch.finfo(model.dtype).bits // 8 if model.dtype.is_floating_point else 4
    return sum(2 * getattr(layer, "max_cache_len", 0) * h * head_dim * item for layer, h in zip(layers, heads))


def _megabytes(model, slots: int) -> str:
    return f"{cache_bytes_per_row(model, slots) / 2**20:,.0f} MB"


def pinned_cache_length(policy: BucketPolicy, needed: int) -> int:
    """The length `precompile` pins the static cache to, for a workload whose longest call needs `needed` slots."""
    return _aligned(policy, needed)


def passed_cache(model_kwargs: dict):
    """The cache passed to (or returned by) `generate`, or to a forward, when it is a cache object."""
    cache = next((model_kwargs[key] for key in CACHE_KWARGS if model_kwargs.get(key) is not None), None)
    return cache if hasattr(cache, "get_seq_length") else None


def cache_seq_length(cache) -> int | None:
    """The tokens a cache holds, or `None` when it can't tell (only recurrent layers, as in Mamba's cache)."""
    try:
        return int(cache.get_seq_length())  # a 0-d tensor for a static cache
    except ValueError:
        return None


def mark_padding(cache, pad: int, padded_batch: int) -> None:
    """Records on a cache that a bucketed call filled it with `pad` columns in front and `padded_batch` rows."""
    cache.__dict__[_CACHE_PADDING] = (pad, padded_batch)


def is_marked(cache) -> bool:
    """Whether a bucketed call filled `cache`."""
    return _CACHE_PADDING in cache.__dict__


def continued_padding(model_kwargs: dict) -> tuple[int, int] | None:
    """`(pad, padded batch)` when the call continues from a cache that a bucketed call filled, else `None`."""
    cache = passed_cache(model_kwargs)
    if cache is None or not cache_seq_length(cache):
        return None
    return cache.__dict__.get(_CACHE_PADDING)


def early_initialize(model, cache, rows: int) -> None:
    """
    Allocates a lazily initialized static cache for `rows` rows, when the model's layout allows it. Done before the
    first compiled forward, as upstream does for chunked prefill: tensors allocated inside the first compiled prefill
    are not static addresses, which CUDA graphs need.
    """
    shape = static_cache_init_shape(model)
    if shape is None or not hasattr(cache, "early_initialization"):
        return
    num_heads, head_dim = shape
    declared = attention_kv_heads(model)
    if declared and set(num_heads if isinstance(num_heads, list) else [num_heads]) != declared:
        # The config misstates the key/value heads (multi-query Falcon: 1, whatever `num_kv_heads` says). Leave the
        # cache to initialize from the first keys it gets: exact, at the cost of one more graph on the first call.
        return
    cache.early_initialization(
        batch_size=rows, num_heads=num_heads, head_dim=head_dim, dtype=model.dtype, device=model.device
    )


def attention_kv_heads(model) -> set[int]:
    """The key/value head counts the attention modules hold themselves, where they do (looked up once per model)."""
    state = state_of(model)
    if state.attention_kv_heads is None:
        heads = set()
        for module in model.modules():
            for name in ("num_key_value_heads", "num_kv_heads"):
                value = module.__dict__.get(name)
                if isinstance(value, int) and not isinstance(value, bool) and module is not model:
                    heads.add(value)
        state.attention_kv_heads = heads
    return state.attention_kv_heads

"""The KV cache of a bucketed call: how long a static cache is, and how a later call continues from a filled one.

The cache-length rule, in one place (`static_cache_length`):

- `max_cache_len` set by the user: that, always.
- Otherwise the cache the model already has, when the call fits in it: upstream keeps the largest static cache it has
  made on the model, and every cache length is a compiled decode graph, so reusing it costs no graph.
- Otherwise a new length, bucketed geometrically (`BucketPolicy.cache_length`: the next power of two, aligned), so a
  mix of prompts needs a few cache lengths, not one per prompt.

`precompile` pins the cache once instead (`pinned_cache_length`): the slots its longest bucket needs, rounded up to
a multiple of 64 (or of `prefill_pad_to_multiple_of`), so every later call fits in it.
"""

from ._compat import previous_max_cache_length, static_cache_init_shape
from .buckets import BucketPolicy, round_up
from .state import state_of


CACHE_KWARGS = ("cache", "past_key_values")  # `cache` from transformers 5.24 on, `past_key_values` before
# A pinned static cache's length is a multiple of this (or of `prefill_pad_to_multiple_of`): sizes kernels like.
CACHE_ALIGNMENT = 64
# Set on a cache filled by a bucketed call: `(columns added in front, batch size with dummy rows)`. A later call that
# continues from the cache (multi-turn chat) pads its prompt by the same columns, so cache and prompt line up.
_CACHE_PADDING = "_prefill_buckets_padding"


def static_cache_length(model, policy: BucketPolicy, needed: int) -> int:
    """The length of the static cache a call that needs `needed` slots creates, when `max_cache_len` is not set."""
    previous = previous_max_cache_length(model)
    return previous if previous >= needed else policy.cache_length(needed)


def pinned_cache_length(policy: BucketPolicy, needed: int) -> int:
    """The length `precompile` pins the static cache to, for a workload whose longest call needs `needed` slots."""
    return round_up(needed, policy.pad_to_multiple_of or CACHE_ALIGNMENT)


def passed_cache(model_kwargs: dict):
    """The cache passed to (or returned by) `generate`, when it is a cache object."""
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

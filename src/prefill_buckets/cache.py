"""The KV cache of a bucketed call: how long a static cache is, and how a later call continues from a filled one.

The cache-length rule, in one place (`static_cache_length`), for a static cache whose `max_cache_len` is not set.
Every cache length is a compiled decode graph, and every bucket's prefill graph is compiled for one cache length, so
the rule allocates once, for the whole workload when it can tell, and grows at most once:

1. The cache the model already has, when the call fits in it (upstream keeps the largest static cache it has made
   on the model): no new graph.
2. The first cache of the model holds every prompt the policy bounds: with a list of buckets, the largest bucket
   plus the new tokens. `"pow2"` and `prefill_pad_to_multiple_of` alone have no largest bucket: the first cache then
   holds `FIRST_CACHE_SLOTS` slots (or the call, when it needs more).
3. A call that does not fit grows the cache once, to the longest sequence the model takes: its
   `max_position_embeddings` plus the new tokens. Later calls all fit. A model that states no maximum grows
   geometrically instead (the next power of two), which bounds its cache lengths by log2 of the longest sequence.

Every length is capped at what the model takes (step 3's length), and rounded up to a multiple of 64 (or of
`prefill_pad_to_multiple_of`). `precompile` pins the cache to its longest bucket instead (`pinned_cache_length`).
The price of a large cache is decode time (a static cache's decode step attends over every slot) and memory: pin
`max_cache_len` to the largest bucket plus `max_new_tokens` to pay only for that (`unpadded_for_room` checks a call
against a pinned or passed cache).
"""

from transformers.utils import logging

from ._compat import is_static_cache, previous_max_cache_length, static_cache_init_shape, static_cache_slots
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
# The first cache of a policy without a largest bucket: a few thousand slots serve most chat prompts without a growth
# (SmolLM2-135M, fp32: 94 MB per row; decode time against the cache length is in the guide's "Cache sizing").
FIRST_CACHE_SLOTS = 2048
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
        first = policy.bucket(largest) + new_slots if largest is not None else FIRST_CACHE_SLOTS
        first = _aligned(policy, max(needed, first))
        return first if cap is None else min(first, cap)
    grown = cap if cap is not None else policy.cache_length(needed)
    logger.warning_once(
        f"A call needs {needed} static cache slots, more than the model's cache of {previous}, so the cache grows to "
        f"{grown} slots: every bucket compiles its prefill graph once more at the new length, and decode one more "
        f"graph. Pin `max_cache_len` for your longest prompt, list your largest bucket in `{PREFILL_BUCKETS}`, or "
        "call `prefill_buckets.precompile` with your longest prompt, to allocate the cache once."
    )
    return grown


def pinned_cache_length(policy: BucketPolicy, needed: int) -> int:
    """The length `precompile` pins the static cache to, for a workload whose longest call needs `needed` slots."""
    return _aligned(policy, needed)


def unpadded_for_room(plan, model_kwargs: dict) -> str | None:
    """
    A left-padded call against the static cache it will write: its padded prompt (in a conversation, with the tokens
    the cache holds) plus the new tokens, less one (the last token is never written). Returns why the call must run
    unpadded, or `None` when it is bucketed:

    - a cache passed in with fewer slots, that holds no padding: the call runs unpadded, as upstream runs it (reason);
    - a cache passed in with fewer slots, that holds a bucketed call's padding: `ValueError` naming both lengths (the
      padding in the cache can't be left out, and the cache can't grow);
    - a pinned `max_cache_len` with fewer slots: upstream sizes the cache by what the call needs, so the call runs
      exact in a longer cache, a shape of its own; a warning says so (`None`).
    """
    settings = plan.settings
    new_tokens = settings.new_tokens(plan.prompt_length)
    needed = plan.padded_length + new_tokens - 1
    what = f"the bucket's {plan.padded_length} positions plus {new_tokens} new tokens, less one"
    cache = passed_cache(model_kwargs)
    if cache is not None and is_static_cache(cache):
        slots = static_cache_slots(cache)
        if slots >= needed:
            return None
        if is_marked(cache):
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

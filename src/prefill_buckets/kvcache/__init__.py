"""The KV cache of a bucketed call: how long a static cache is, what a filled one holds, and what its layers read.

Below `call/`, above `upstream/`: it imports nothing of `call/` or `compile/` (`tests/generation/test_imports.py`).
Import the module you need; nothing is re-exported here.

- `sizing.py`: the length of the static cache a call makes (`static_cache_length`, the rule in one place), whether a
  call fits a pinned or passed cache (`room_reason`), its allocation before the first compiled forward
  (`early_initialize`), and the cache a call made, kept for the next call's (`keep_cache`, `reuse_cache`).
- `kv_shapes.py`: the key/value heads and head size the attention modules hold, which early allocation must agree with.
- `record.py`: the record a bucketed call leaves on the cache it filled (`record_call`), which a later call that
  continues from it reads (`PassedCache`).
- `windows.py`: the attention windows, a full-attention layer reading only the slots its tokens fill.
- `ring.py`: the sliding-window layers as rings, whose graphs depend on no window.
- `attention_keys.py`: a static cache's attention weights laid out as upstream's layers lay them.
"""

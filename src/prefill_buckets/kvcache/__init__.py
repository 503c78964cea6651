"""The KV cache of a bucketed call: how long a static cache is, what a filled one holds, and what its layers read.

Below `call/`, above `upstream/`: it imports nothing of `call/` or `compile/` (`tests/generation/test_imports.py`).
Import the module you need; nothing is re-exported here. `sizing.py` (the cache's length, early allocation, reuse),
`kv_shapes.py` (the key/value shapes the attention modules hold), `record.py` (what a filled cache holds for the next
call), `windows.py` and `ring.py` (what its layers read), `attention_keys.py` (the attentions' key axis, upstream's).
"""

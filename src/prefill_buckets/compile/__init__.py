"""The compile tooling: what compiles a model's graphs, counts them, and carries them to another process.

`compiled_calls.py` (the user's compiled forward as a bucketed call runs it, and `GraphCounter`) sits below `call/`,
which imports it; the rest sits above: `precompile.py`, `aot_forward.py` with its dispatch key `aot_key.py`, and
`archive.py` (`save_compile_cache` / `load_compile_cache`). Their public names are the package's
(`prefill_buckets.precompile`, ...): import them from there; nothing is re-exported here.
"""

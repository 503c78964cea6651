"""The compile tooling: what compiles a model's graphs, counts them, and carries them to another process.

- `compiled_calls.py`: `GraphCounter` (a `torch.compile` backend that counts graphs), and the user's compiled forward
  as a bucketed call runs it (`compiled_forward`, `compiled_wrapper_forward`, `EagerFallback`, `is_aot_forward`). The
  call path imports it, so it sits below `call/` and imports nothing of it.
- `precompile.py`: `precompile`, every graph a bucket config needs compiled before the first request (it runs
  bucketed `generate`).
- `aot_forward.py`: `aot_forward`, a forward compiled ahead of time, one graph per input shape, that another process
  loads without tracing; `aot_key.py`: the dispatch key its graphs are told apart by (it reads the attention windows
  of `kvcache/windows.py`).
- `archive.py`: `save_compile_cache` / `load_compile_cache`, the file that carries torch's cache artifacts, inductor's
  kernels and `aot_forward`'s graphs to another process.

All but `compiled_calls.py` sit above `call/`. Their public names are the package's (`prefill_buckets.precompile`,
`prefill_buckets.GraphCounter`, ...): import them from there; nothing is re-exported here.
"""

"""Bucketed prefill for 🤗 Transformers `generate`: a bounded number of compiled graphs for any prompt length.

Where things are:

- the user's API: `config.py` (the `GenerationConfig` fields), `buckets.py` (bucketing as data), `patch.py`
  (`enable()`), `custom_generate.py`;
- the call path, a module per step of one bucketed `generate` call: `call/` (its `__init__` lists them in order);
- the compile tooling: `compilation.py` (graph counting, eager fallbacks), `warmup.py` (`precompile`),
  `compile_cache.py` (the warm start), `aot_compiled.py` and `aot_key.py` (`aot_forward`);
- the coupling to upstream, the bottom floor: `upstream/` (every private torch and transformers name, the version
  gate, the self-test; its `__init__` lists its modules); state kept between calls: `state.py`; tensor parallelism:
  `distributed.py`;
- the command line: `cli.py` (`python -m prefill_buckets`), `benchmark/`, `env.py`, `serving.py` (`serve`: transformers
  serve with bucketed generate).
"""

from .aot_compiled import aot_forward
from .buckets import BucketPolicy, WasteReport, padding_waste, suggest_buckets
from .call.generation import generate
from .compile_cache import CompileCacheFile, load_compile_cache, save_compile_cache
from .config import FIELDS, PREFILL_BATCH_BUCKETS, PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF, PREFILL_PADDING_SIDE
from .custom_generate import save_custom_generate
from .patch import disable, enable, is_enabled
from .version import __version__  # noqa: F401
from .warmup import CompiledShape, precompile


__all__ = [
    "FIELDS",
    "PREFILL_BATCH_BUCKETS",
    "PREFILL_BUCKETS",
    "PREFILL_PADDING_SIDE",
    "PREFILL_PAD_TO_MULTIPLE_OF",
    "BucketPolicy",
    "CompileCacheFile",
    "CompiledShape",
    "WasteReport",
    "aot_forward",
    "disable",
    "enable",
    "generate",
    "is_enabled",
    "load_compile_cache",
    "padding_waste",
    "precompile",
    "save_compile_cache",
    "save_custom_generate",
    "suggest_buckets",
]

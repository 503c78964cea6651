"""Bucketed prefill for 🤗 Transformers `generate`: a bounded number of compiled graphs for any prompt length.

Where things are, from the bottom floor up: a module imports from its own floor and those below
(`tests/generation/test_imports.py` checks it for `upstream/`).

- the coupling to upstream: `upstream/` (every private torch and transformers name, the version gate, the self-test;
  its `__init__` lists its modules), which imports nothing of the package above it;
- what the call path stands on: `config.py` (the `GenerationConfig` fields), `buckets.py` (bucketing as data),
  `state.py` (what is kept between calls), `distributed.py` (tensor parallelism), `forgotten_enable.py`, and
  `compile/compiled_calls.py` (the user's compiled forward as a call runs it, and `GraphCounter`);
- the call path, a module per step of one bucketed `generate` call: `call/` (its `__init__` lists them in order);
- the compile tooling, which runs or reads the call path: `compile/` (`precompile`, `aot_forward`, the compile cache;
  its `__init__` lists its modules);
- the user's API and the command line: `patch.py` (`enable()`), `custom_generate.py`, `cli.py`
  (`python -m prefill_buckets`), `benchmark/`, `env.py`, `serving.py` (`serve`: transformers serve with bucketed
  generate; `serving_loads.py`: where upstream's server loads each model), `testing_utils.py`.
"""

from .buckets import BucketPolicy, WasteReport, padding_waste, suggest_buckets
from .call.generation import generate
from .compile.aot_forward import aot_forward
from .compile.archive import CompileCacheFile, load_compile_cache, save_compile_cache
from .compile.compiled_calls import GraphCounter
from .compile.precompile import CompiledShape, precompile
from .config import FIELDS, PREFILL_BATCH_BUCKETS, PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF, PREFILL_PADDING_SIDE
from .custom_generate import save_custom_generate
from .patch import disable, enable, is_enabled
from .version import __version__  # noqa: F401


__all__ = [
    "FIELDS",
    "PREFILL_BATCH_BUCKETS",
    "PREFILL_BUCKETS",
    "PREFILL_PADDING_SIDE",
    "PREFILL_PAD_TO_MULTIPLE_OF",
    "BucketPolicy",
    "CompileCacheFile",
    "CompiledShape",
    "GraphCounter",
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

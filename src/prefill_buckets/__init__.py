"""Bucketed prefill for 🤗 Transformers `generate`: a bounded number of compiled graphs for any prompt length.

The package's floors, from the bottom up (a module imports from its own floor and those below; `test_imports.py`
checks it): `upstream/` (every private torch and transformers name, the version gate, the self-test); what the call
path stands on (`config.py`, `buckets.py`, `state.py`, `distributed.py`, `forgotten_enable.py`,
`compile/compiled_calls.py`); the call path, a module per step of one bucketed `generate` call (`call/`); the compile
tooling (`compile/`); and the user's API and command line (`patch.py`, `custom_generate.py`, `cli.py`, `benchmark/`,
`env.py`, `serving.py` with `serving_loads.py`, `testing_utils.py`).
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

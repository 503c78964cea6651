"""Bucketed prefill for 🤗 Transformers `generate`: a bounded number of compiled graphs for any prompt length."""

from .aot_compiled import aot_forward
from .buckets import BucketPolicy, WasteReport, padding_waste, suggest_buckets
from .compile_cache import CompileCacheFile, load_compile_cache, save_compile_cache
from .config import FIELDS, PREFILL_BATCH_BUCKETS, PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF, PREFILL_PADDING_SIDE
from .custom_generate import save_custom_generate
from .generation import generate
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

"""Bucketed prefill for 🤗 Transformers `generate`: a bounded number of compiled graphs for any prompt length."""

__version__ = "0.1.0"

from .buckets import BucketPolicy
from .config import PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF
from .generation import generate
from .patch import disable, enable, is_enabled


__all__ = [
    "PREFILL_BUCKETS",
    "PREFILL_PAD_TO_MULTIPLE_OF",
    "BucketPolicy",
    "disable",
    "enable",
    "generate",
    "is_enabled",
]

"""Tiny randomly initialised models built from configs, shared by the test files. Never a hub download.

The models live in `prefill_buckets.testing_utils`, shared with the CLI and `utils/`; this module names them for the
tests, with what only the tests need.
"""

from transformers.generation.utils import GenerateDecoderOnlyOutput

from prefill_buckets.testing_utils import tiny_llama, tiny_llama_config


# `generate` takes and returns the cache as `cache` from transformers 5.24 on, as `past_key_values` before.
CACHE = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"

__all__ = ["CACHE", "tiny_llama", "tiny_llama_config"]

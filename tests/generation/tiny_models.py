"""Tiny randomly initialised models built from configs, shared by the test files. Never a hub download.

The models live in `prefill_buckets.testing_utils`, shared with the CLI and `utils/`; this module names them for the
tests, with what only the tests need.
"""

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerateDecoderOnlyOutput

from prefill_buckets.testing_utils import tiny_llama, tiny_llama_config


# `generate` takes and returns the cache as `cache` from transformers 5.24 on, as `past_key_values` before.
CACHE = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"

__all__ = [
    "CACHE",
    "assert_same_generation",
    "static_config",
    "single_thread_module",
    "tiny_llama",
    "tiny_llama_config",
]


def static_config(new_tokens: int, **fields) -> GenerationConfig:
    """Greedy generation of exactly `new_tokens` tokens with a static cache, and `fields` (the bucket fields...)."""
    return GenerationConfig(
        cache_implementation="static", max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **fields
    )


def assert_same_generation(ours, theirs, scores: bool = True) -> None:
    """The tokens of two `generate` outputs are equal, and (with `scores`) the first step's finite scores are close."""
    torch.testing.assert_close(ours.sequences, theirs.sequences, rtol=0, atol=0)
    if scores:
        finite = torch.isfinite(theirs.scores[0])
        torch.testing.assert_close(ours.scores[0][finite], theirs.scores[0][finite], rtol=1e-5, atol=1e-5)


def single_thread_module():
    """
    `setUpModule, tearDownModule` for a module of tiny-model tests: one thread computes them as fast as two, and on a
    loaded machine the second thread's busy-waiting costs more than it brings. Restored for the other test modules.
    """
    threads = {}

    def set_up():
        threads["before"] = torch.get_num_threads()
        torch.set_num_threads(1)

    def tear_down():
        torch.set_num_threads(threads.pop("before"))

    return set_up, tear_down

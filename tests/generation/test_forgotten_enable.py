# Forgetting `enable()` is not silent: each entry point of the package that gets a model whose generation config sets
# bucket fields, while `model.generate` is upstream's, warns once and names `enable()` (`forgotten_enable.py`).

import logging as std_logging
import tempfile
import unittest

from transformers import GenerationConfig
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets

from .tiny_models import tiny_llama


def logged(run) -> str:
    std_logging.Logger.warning_once.cache_clear()
    with CaptureLogger(logging.get_logger("prefill_buckets")) as captured:
        run()
    return captured.out


class ForgottenEnableTest(unittest.TestCase):
    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)
        self.model = tiny_llama()
        self.model.generation_config = GenerationConfig(
            cache_implementation="static", max_new_tokens=2, prefill_buckets=[16]
        )

    def test_aot_forward_warns_once_naming_enable(self):
        first = logged(lambda: prefill_buckets.aot_forward(self.model))
        self.assertIn("`aot_forward` got a model whose generation config sets `prefill_buckets=[16]`", first)
        self.assertIn("Call `prefill_buckets.enable()`", first)
        with CaptureLogger(logging.get_logger("prefill_buckets")) as again:
            prefill_buckets.aot_forward(self.model)
        self.assertEqual(again.out, "")  # once

    def test_precompile_warns(self):
        out = logged(lambda: prefill_buckets.precompile(self.model, max_prompt_length=4, min_prompt_length=4))
        self.assertIn("`precompile` got a model whose generation config sets `prefill_buckets=[16]`", out)

    def test_save_compile_cache_warns_for_the_models_it_saves(self):
        forward = prefill_buckets.aot_forward(self.model)  # a live forward: what `save_compile_cache` saves
        with tempfile.TemporaryDirectory() as folder:
            out = logged(lambda: prefill_buckets.save_compile_cache(f"{folder}/cache.zip"))
        self.assertIn("`save_compile_cache` got a model whose generation config sets", out)
        self.assertEqual(forward.model, self.model)

    def test_load_compile_cache_warns(self):
        out = logged(lambda: prefill_buckets.load_compile_cache("/no/such/file.zip"))
        self.assertIn("`load_compile_cache` ran while `prefill_buckets.enable()` is not in effect", out)

    def test_an_invalid_value_is_named(self):
        self.model.generation_config.prefill_buckets = "pow3"  # stored as is: transformers doesn't know the field
        out = logged(lambda: prefill_buckets.aot_forward(self.model))
        self.assertIn("The fields are not valid either: `prefill_buckets` must be", out)
        self.assertIn("'pow3'", out)

    def test_silent_when_enabled(self):
        prefill_buckets.enable()
        self.assertEqual(logged(lambda: prefill_buckets.aot_forward(self.model)), "")
        self.assertEqual(logged(lambda: prefill_buckets.load_compile_cache("/no/such/file.zip")).count("enable()"), 0)

    def test_silent_without_bucket_fields(self):
        self.model.generation_config = GenerationConfig(max_new_tokens=2)
        self.assertEqual(logged(lambda: prefill_buckets.aot_forward(self.model)), "")

    def test_importing_changes_nothing_in_transformers(self):
        from transformers.generation.utils import GenerationMixin

        from prefill_buckets.upstream import transformers_api

        self.assertIs(GenerationMixin.__dict__["generate"], transformers_api.UPSTREAM_GENERATE)
        self.assertFalse(hasattr(GenerationConfig(), "prefill_buckets"))


if __name__ == "__main__":
    unittest.main()

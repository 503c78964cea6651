# A prompt outside the buckets gets one warning, and it says what was done with the prompt: padded to a multiple of
# the largest bucket, capped at `max_position_embeddings` (a length every such prompt shares: logged once), or not
# padded at all (longer than the model's positions: each length its own graph).
# (`call/padding_side.py`: `capped_bucket`, `warn_long_prompt`.) `LongPromptWarningTest` (a prompt longer than the
# largest bucket of a list warns, one inside them doesn't) moved whole from test_equivalence.py, whose models and ids
# it shares (in tiny_models.py).

import logging as std_logging
import unittest

import torch
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

import prefill_buckets
from prefill_buckets.state import called_by
from prefill_buckets.testing_utils import tiny_llama

from .tiny_models import get_model, random_batch_ids


package_logger = transformers_logging.get_logger("prefill_buckets")


class LongPromptWarningsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_llama(max_position_embeddings=64)

    def setUp(self):
        std_logging.Logger.warning_once.cache_clear()  # transformers logs each text once per process
        self.addCleanup(std_logging.Logger.warning_once.cache_clear)

    def generate(self, length: int, **fields) -> tuple[list[str], int]:
        """The warnings one bucketed call logs, and the length of its first forward's `input_ids`."""
        input_ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length))
        seen = []
        handle = self.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]) if not seen else None,
            with_kwargs=True,
        )
        try:
            with CaptureLogger(package_logger) as logs:
                prefill_buckets.generate(
                    self.model,
                    input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    max_new_tokens=2,
                    do_sample=False,
                    cache_implementation="static",
                    prefill_padding_side="left",
                    **fields,
                )
        finally:
            handle.remove()
        return [line for line in logs.out.splitlines() if line.strip()], seen[0]

    def test_past_the_largest_bucket(self):
        warnings, forwarded = self.generate(40, prefill_buckets=[16, 32])
        self.assertEqual(forwarded, 64)
        self.assertEqual(len(warnings), 1, warnings)
        self.assertIn("A prompt of 40 tokens is longer than the largest of `prefill_buckets` (32)", warnings[0])
        self.assertIn("padded to 64, the next multiple of 32", warnings[0])

    def test_advice_names_the_options_of_who_calls(self):
        # The same two warnings, a prompt past the largest bucket and the cache it outgrows, advise the Python API's
        # fields to a `generate` caller and the command line's options to a model `prefill-buckets serve` prepared
        # (`ModelState.entry`), which has no `prefill_pad_to_multiple_of` or `max_cache_len` to set.
        for entry, named, not_named in (
            ("generate", ["`prefill_pad_to_multiple_of`", "Pin `max_cache_len`"], ["--max-prompt"]),
            ("serve", ["--max-prompt", "--max-new-tokens"], ["prefill_pad_to_multiple_of", "max_cache_len"]),
        ):
            std_logging.Logger.warning_once.cache_clear()
            self.model = tiny_llama(max_position_embeddings=64)  # a cache of its own, sized by its first call
            with self.subTest(entry=entry), called_by(self.model, entry):
                self.generate(10, prefill_buckets=[16, 32])
                warnings, _ = self.generate(40, prefill_buckets=[16, 32])
                self.assertEqual(len(warnings), 2, warnings)
                self.assertIn("is longer than the largest of `prefill_buckets` (32)", warnings[0])
                self.assertIn("static cache slots, more than the model's cache of", warnings[1])
                for word in named:
                    self.assertIn(word, " ".join(warnings))
                for word in not_named:
                    self.assertNotIn(word, " ".join(warnings))
        self.model = type(self).model

    def test_past_the_model_positions_is_one_warning_that_says_unpadded(self):
        for length in (70, 100):
            warnings, forwarded = self.generate(length, prefill_buckets=[16, 32])
            self.assertEqual(forwarded, length)  # not padded
            # The static cache outgrows the positions too (never past them unless a call needs more): that is its own
            # warning, about the cache, not the prompt.
            warnings = [warning for warning in warnings if not warning.startswith("A call needs")]
            # One warning per prompt (before, a bucket list logged two for the same prompt), and no claim that
            # prompts this long share a length: each runs at its own.
            self.assertEqual(len(warnings), 1, warnings)
            self.assertIn(
                f"A prompt of {length} tokens is longer than the model's `max_position_embeddings`", warnings[0]
            )
            self.assertIn("not padded", warnings[0])
            self.assertNotIn("share", warnings[0])

    def test_bucket_capped_at_the_model_positions_is_logged_once(self):
        warnings, forwarded = self.generate(50, prefill_buckets=[32, 128])
        self.assertEqual(forwarded, 64)
        self.assertEqual(len(warnings), 1, warnings)
        self.assertIn("more positions than the model has", warnings[0])
        self.assertIn("padded to 64 instead", warnings[0])
        # Another prompt capped the same way shares that length: nothing new to say.
        warnings, forwarded = self.generate(60, prefill_buckets=[32, 128])
        self.assertEqual(forwarded, 64)
        self.assertEqual(warnings, [])

    def test_inside_the_buckets_nothing(self):
        warnings, forwarded = self.generate(20, prefill_buckets=[16, 32])
        self.assertEqual(forwarded, 32)
        self.assertEqual(warnings, [])


class LongPromptWarningTest(unittest.TestCase):
    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)
        transformers_logging.warning_once.cache_clear()  # the warning is logged once per message

    def test_prompt_longer_than_largest_bucket_warns(self):
        model = get_model("llama")
        with CaptureLogger(package_logger) as captured:
            prefill_buckets.generate(model, random_batch_ids(1, 70), max_new_tokens=2, prefill_buckets=[8, 16, 32, 64])
        self.assertIn("70 tokens", captured.out)
        self.assertIn("(64)", captured.out)
        self.assertIn("128", captured.out)

    def test_no_warning_inside_the_buckets(self):
        model = get_model("llama")
        with CaptureLogger(package_logger) as captured:
            prefill_buckets.generate(model, random_batch_ids(1, 60), max_new_tokens=2, prefill_buckets=[8, 16, 32, 64])
        self.assertEqual(captured.out, "")

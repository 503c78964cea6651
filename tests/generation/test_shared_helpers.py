# The helpers each rule is written once in: a positive int, the cache among a call's arguments, the embedding that
# fills pad positions, and the BOS prompt upstream starts from without one.

import unittest

import numpy as np
import torch

from prefill_buckets.buckets import check_positive_int, is_positive_int
from prefill_buckets.call.plan import fill_embedding
from prefill_buckets.call.resolved import bos_prompt, prompt_rows, resolve_settings
from prefill_buckets.kvcache.record import passed_cache
from prefill_buckets.upstream.transformers_api import cache_argument

from .tiny_models import tiny_llama


class PositiveIntTest(unittest.TestCase):
    def test_ints(self):
        self.assertTrue(all(is_positive_int(value) for value in (1, 64, 2**40)))
        for value in (0, -1, True, 1.0, "1", None, np.int64(3)):
            with self.subTest(value=value):
                self.assertFalse(is_positive_int(value))

    def test_integral(self):
        # A sample of lengths may hold numpy's ints; `True` is still not a length.
        self.assertTrue(is_positive_int(np.int64(3), integral=True))
        self.assertFalse(is_positive_int(np.int64(0), integral=True))
        self.assertFalse(is_positive_int(True, integral=True))

    def test_check_names_the_argument(self):
        check_positive_int(3, "max_bytes")
        with self.assertRaisesRegex(ValueError, r"^`max_bytes` must be a positive integer, but is 0\.$"):
            check_positive_int(0, "max_bytes")


class CacheArgumentTest(unittest.TestCase):
    def test_first_set_name(self):
        self.assertEqual(cache_argument({}), (None, None))
        self.assertEqual(cache_argument({"cache": None, "past_key_values": 3}), ("past_key_values", 3))
        self.assertEqual(cache_argument({"cache_params": 2, "cache": 1}), ("cache", 1))

    def test_passed_cache_is_a_cache_object(self):
        self.assertIsNone(passed_cache({"past_key_values": 3}))  # whatever it holds is not a cache


class FillEmbeddingTest(unittest.TestCase):
    def test_dtype_and_device_of_the_embeddings(self):
        embedding = torch.nn.Embedding(8, 4)  # fp32 weights
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with self.subTest(dtype=dtype):
                like = torch.zeros(2, 3, 4, dtype=dtype)
                fill = fill_embedding(embedding, 5, like)
                self.assertEqual((fill.shape, fill.dtype, fill.device), ((4,), dtype, like.device))
                self.assertFalse(fill.requires_grad)
                self.assertTrue(torch.equal(fill, embedding.weight[5].detach().to(dtype)))


class BosPromptTest(unittest.TestCase):
    def test_one_bos_token_per_row(self):
        model = tiny_llama()
        settings = resolve_settings(model, model.generation_config, {}, {})
        mask = torch.ones(3, 5, dtype=torch.long)
        self.assertEqual(prompt_rows({"attention_mask": mask}), 3)
        self.assertEqual(prompt_rows({}), 1)
        prompt = bos_prompt(model, settings, {"attention_mask": mask})
        self.assertTrue(torch.equal(prompt, torch.full((3, 1), settings.bos_token_id, dtype=torch.long)))

    def test_without_bos_token_id(self):
        model = tiny_llama()
        model.generation_config.bos_token_id = None
        model.config.bos_token_id = None
        settings = resolve_settings(model, model.generation_config, {}, {})
        with self.assertRaisesRegex(ValueError, "`bos_token_id` has to be defined when no `input_ids` are provided"):
            bos_prompt(model, settings, {})


if __name__ == "__main__":
    unittest.main()

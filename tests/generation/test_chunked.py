"""Chunked prefill with the prompt padded to a multiple of the chunk: one prefill graph for any prompt length."""

import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig

import prefill_buckets
from prefill_buckets import GraphCounter

from .tiny_models import tiny_llama


CHUNK = 32
NEW_TOKENS = 4


class ChunkedPrefillTest(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.reference = tiny_llama()
        self.model = tiny_llama()
        self.counter = GraphCounter()
        self.model.compile(backend=self.counter, dynamic=False, fullgraph=True)

    def tearDown(self):
        torch._dynamo.reset()

    @parameterized.expand([("pinned_cache", 256), ("bucketed_cache", None)])
    def test_one_prefill_graph_for_any_length(self, _, max_cache_len):
        config = GenerationConfig(
            cache_implementation="static",
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            prefill_chunk_size=CHUNK,
            max_cache_len=max_cache_len,
        )
        unpadded = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
        # Longest first: the cache is then sized once (upstream keeps the largest cache seen on the model).
        lengths = [200, 128, 96, 64, 50, 33, 32, 10, 1]
        for length in lengths:
            input_ids = torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length))
            calls = self.counter.calls
            out = prefill_buckets.generate(
                self.model, input_ids, generation_config=config, prefill_pad_to_multiple_of=CHUNK
            )
            torch.testing.assert_close(out, self.reference.generate(input_ids, generation_config=unpadded))
            chunks = -(-length // CHUNK)
            # Every chunk and every decode step is one compiled call: nothing ran eagerly.
            self.assertEqual(self.counter.calls - calls, chunks + NEW_TOKENS - 1, f"prompt length {length}")
        # One prefill graph (a chunk) and one decode graph, whatever the prompt length.
        self.assertEqual(self.counter.graphs, 2)
        prefill_shapes = {shape[0] for shape in self.counter.shapes if shape[0][1] > 1}
        self.assertEqual(prefill_shapes, {(1, CHUNK)})

    def test_ragged_last_chunk_warns(self):
        from transformers.testing_utils import CaptureLogger
        from transformers.utils import logging

        logger = logging.get_logger("prefill_buckets")
        config = GenerationConfig(
            cache_implementation="static", max_new_tokens=2, do_sample=False, prefill_chunk_size=CHUNK
        )
        with CaptureLogger(logger) as captured:
            prefill_buckets.generate(
                self.model, torch.randint(3, 128, (1, 40)), generation_config=config, prefill_pad_to_multiple_of=48
            )
        self.assertIn("prefill_chunk_size=32", captured.out)
        self.assertIn("prefill_pad_to_multiple_of", captured.out)


if __name__ == "__main__":
    unittest.main()

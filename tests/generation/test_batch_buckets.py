"""`prefill_batch_buckets`: dummy rows up to a batch bucket, finished from the start, stripped from the output."""

import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

import prefill_buckets
from prefill_buckets import GraphCounter

from .tiny_models import tiny_llama


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.values = []

    def put(self, value):
        self.values.append(value.clone())

    def end(self):
        self.values.append("end")


class BatchBucketsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.reference = tiny_llama()

    def setUp(self):
        torch._dynamo.reset()

    def prompts(self, batch_size, length=10, seed=0):
        return torch.randint(3, 128, (batch_size, length), generator=torch.Generator().manual_seed(seed))

    @parameterized.expand([("eos_never", None), ("eos_early", 5)])
    def test_graphs_per_batch_bucket_and_exact_tokens(self, _, eos_token_id):
        model = tiny_llama()
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = GenerationConfig(
            max_new_tokens=6,
            do_sample=False,
            cache_implementation="static",
            max_cache_len=64,
            eos_token_id=eos_token_id,
            return_dict_in_generate=True,
            output_scores=True,
        )
        for batch_size in [4, 3, 1, 2, 3, 1]:
            input_ids = self.prompts(batch_size, seed=batch_size)
            out = prefill_buckets.generate(
                model, input_ids, generation_config=config, prefill_buckets=[16], prefill_batch_buckets=[2, 4]
            )
            expected = self.reference.generate(input_ids, generation_config=config)
            torch.testing.assert_close(out.sequences, expected.sequences, rtol=0, atol=0)
            self.assertEqual(len(out.scores), len(expected.scores))
            for got, want in zip(out.scores, expected.scores):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # Two batch buckets, each one prefill and one decode graph.
        self.assertEqual(counter.graphs, 4)
        self.assertEqual({shape[0][0] for shape in counter.shapes}, {2, 4})

    def test_dummy_rows_do_not_prolong_generation(self):
        # Row 0 emits eos early; with dummy rows that never finish, the batch would run to max_new_tokens.
        config = GenerationConfig(max_new_tokens=12, do_sample=False)
        input_ids = self.prompts(1, seed=3)
        first = self.reference.generate(input_ids, generation_config=config)[0, 10]
        config.eos_token_id = int(first)
        out = prefill_buckets.generate(self.reference, input_ids, generation_config=config, prefill_batch_buckets=[4])
        expected = self.reference.generate(input_ids, generation_config=config)
        self.assertEqual(expected.shape, (1, 11))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)

    def test_num_return_sequences_and_streamer(self):
        config = GenerationConfig(max_new_tokens=4, do_sample=False, num_return_sequences=1)
        input_ids = self.prompts(1, seed=7)
        streamer, expected_streamer = RecordingStreamer(), RecordingStreamer()
        out = prefill_buckets.generate(
            self.reference,
            input_ids,
            generation_config=config,
            streamer=streamer,
            prefill_buckets=[16],
            prefill_batch_buckets=[4],
        )
        expected = self.reference.generate(input_ids, generation_config=config, streamer=expected_streamer)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        self.assertEqual(len(streamer.values), len(expected_streamer.values))
        for got, want in zip(streamer.values, expected_streamer.values):
            if isinstance(want, str):
                self.assertEqual(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=0, atol=0)

    def test_beam_search_is_not_batch_padded(self):
        config = GenerationConfig(max_new_tokens=4, do_sample=False, num_beams=2)
        input_ids = self.prompts(3, seed=11)
        out = prefill_buckets.generate(self.reference, input_ids, generation_config=config, prefill_batch_buckets=[4])
        torch.testing.assert_close(out, self.reference.generate(input_ids, generation_config=config), rtol=0, atol=0)

    def test_precompile_warms_up_the_batch_buckets(self):
        model = tiny_llama()
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = GenerationConfig(
            max_new_tokens=4, cache_implementation="static", prefill_buckets=[8, 16], prefill_batch_buckets=[2, 4]
        )
        shapes = prefill_buckets.precompile(model, config, batch_sizes=(1, 3), progress=False)
        self.assertEqual(sorted({shape.batch_size for shape in shapes}), [2, 4])
        graphs = counter.graphs
        # Per batch bucket: a prefill graph per bucket and a decode graph. Rows of different lengths, which precompile
        # warms up too for batch sizes above 1, share them (issue 24: they take the right side too).
        self.assertEqual(graphs, 2 * (2 + 1))
        for batch_size in (1, 2, 3, 4):
            prefill_buckets.generate(model, self.prompts(batch_size, length=5 + batch_size), generation_config=config)
            input_ids = self.prompts(batch_size, length=9)
            attention_mask = torch.ones_like(input_ids)
            attention_mask[-1, : batch_size + 1] = 0
            prefill_buckets.generate(model, input_ids, attention_mask=attention_mask, generation_config=config)
        self.assertEqual(counter.graphs, graphs)

    def test_precompile_needs_a_prompt_field(self):
        config = GenerationConfig(max_new_tokens=4, cache_implementation="static", prefill_batch_buckets=[2])
        with self.assertRaisesRegex(ValueError, "prefill_buckets"):
            prefill_buckets.precompile(self.reference, config, max_prompt_length=8, progress=False)

    def test_invalid_values(self):
        for value in [0, [0, 2], [4, 2], [], "pow3", [True, 2]]:
            with self.subTest(value=value), self.assertRaisesRegex(ValueError, "prefill_batch_buckets"):
                prefill_buckets.generate(
                    self.reference, self.prompts(1), max_new_tokens=2, prefill_batch_buckets=value
                )


if __name__ == "__main__":
    unittest.main()

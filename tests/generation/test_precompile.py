# `precompile` (`compile/precompile.py`): compile every graph a bucket config can need, up front; after it, prompts
# in the warmed-up buckets compile nothing, and every forward runs compiled with the tokens of an uncompiled run.
#
# The model, the counting backend and `CompilationTestCase` are shared (`tiny_models.py`): `GraphCounter` (eager
# backend) counts graphs and compiled calls, every compile uses `dynamic=False, fullgraph=True` unless a test says
# otherwise, and `min_new_tokens == max_new_tokens`, so "compiled calls == forwards" proves no forward ran eagerly.

import random
import unittest

import torch
from parameterized import parameterized

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.buckets import BucketPolicy
from prefill_buckets.compile.precompile import bucket_lengths
from prefill_buckets.state import state_of

from .tiny_models import (
    MAX_NEW_TOKENS,
    PAD,
    CompilationTestCase,
    decode_graphs,
    make_config,
    make_model,
    make_prompt,
    make_reference,
    prefill_lengths,
)


class LengthLoop(torch.nn.Embedding):
    """Embeddings that loop over the prompt length: a graph is traced for one length."""

    def forward(self, input_ids):
        for _ in range(input_ids.shape[1]):
            pass
        return super().forward(input_ids)


class PrecompileTest(CompilationTestCase):
    def test_pow2_then_random_traffic_compiles_nothing(self):
        self.enable()
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(prefill_buckets="pow2")
        max_prompt_length = 200
        buckets = bucket_lengths(BucketPolicy(buckets="pow2"), max_prompt_length)
        self.assertEqual(buckets, [1, 2, 4, 8, 16, 32, 64, 128, 256])
        batch_sizes = (1, 2)

        compiled = prefill_buckets.precompile(
            model, config, batch_sizes=batch_sizes, max_prompt_length=max_prompt_length, progress=False
        )

        # Per batch size, one prefill graph per bucket and one decode graph per attention window (the cache is pinned
        # at 256 + 4 -> 320 slots: windows 256 and 320); the 1-token bucket's prefill into the preallocated cache has
        # the decode step's shapes, so it is a decode graph. Batch size 2 is also warmed up with rows of different
        # lengths, which (issue 24) take the right side too, with the graphs of all-ones rows: nothing more.
        decode_windows = 2
        expected = len(batch_sizes) * (len(buckets) + decode_windows - (1 in buckets))
        self.assertEqual(counter.graphs, expected, f"graphs: {counter.shapes}")
        self.assertEqual(sorted(prefill_lengths(counter)), sorted(buckets[1:] * 2), f"graphs: {counter.shapes}")
        # The returned shapes: per batch size (largest first), the longest bucket first, all at one cache length.
        expected_jobs = [(batch_size, length) for batch_size in (2, 1) for length in reversed(buckets)]
        self.assertEqual([(shape.batch_size, shape.prompt_length) for shape in compiled], expected_jobs)
        self.assertEqual(compiled[0].prompt_length, max(buckets))
        cache_lengths = {shape.cache_length for shape in compiled}
        self.assertEqual(len(cache_lengths), 1, f"cache lengths {cache_lengths}")
        (cache_length,) = cache_lengths
        self.assertGreaterEqual(cache_length, max(buckets) + MAX_NEW_TOKENS - 1)
        self.assertEqual(model._previous_max_cache_length, cache_length)
        self.assertEqual(sum(shape.graphs for shape in compiled), counter.graphs)
        # The user's config is not changed by the warm-up calls.
        self.assertEqual((config.max_new_tokens, config.max_cache_len), (MAX_NEW_TOKENS, None))

        # Traffic: random lengths and batch sizes compile nothing more, and every forward runs compiled.
        graphs = counter.graphs
        rng = random.Random(0)
        plain_config = make_config()
        for call in range(30):
            length = rng.randint(1, max_prompt_length)
            batch_size = rng.choice(batch_sizes)
            input_ids = make_prompt(length, batch_size, seed=call)
            kwargs = {}
            if batch_size == 2:
                # The second row shorter, left-padded by hand with its mask, as a tokenizer would.
                short = rng.randint(1, length)
                attention_mask = torch.ones_like(input_ids)
                attention_mask[1, : length - short] = 0
                input_ids[1, : length - short] = PAD
                kwargs["attention_mask"] = attention_mask
            self.check_call(
                counter,
                lambda ids, **kw: model.generate(ids, generation_config=config, **kw),
                input_ids,
                reference,
                plain_config,
                **kwargs,
            )
            self.assertEqual(
                counter.graphs, graphs, f"call {call} (batch {batch_size}, length {length}) compiled a graph"
            )
        self.assertEqual(model._previous_max_cache_length, cache_length)

    @parameterized.expand(
        [
            # pow2 aligned to 3: 1, 2 -> 3; 4 -> 6; 8 -> 9; 16 -> 18; 32 -> 33 (a prompt of 3 tokens fits in 3)
            (
                "pow2_aligned_to_3",
                {"prefill_buckets": "pow2", "prefill_pad_to_multiple_of": 3},
                40,
                None,
                [3, 6, 9, 18, 33, 66],
            ),
            # a list aligned to 8: [5, 10, 20] -> 8, 16, 24
            (
                "list_aligned_to_8",
                {"prefill_buckets": [5, 10, 20], "prefill_pad_to_multiple_of": 8},
                24,
                None,
                [8, 16, 24],
            ),
            # buckets past max_position_embeddings (48) are capped there, as generate caps them
            ("capped_at_max_positions", {"prefill_buckets": [16, 64]}, 48, 48, [16, 48]),
        ]
    )
    def test_every_prompt_after_precompile_compiles_nothing(self, _, fields, max_prompt_length, positions, buckets):
        model = make_model()
        if positions is not None:
            model.config.max_position_embeddings = positions
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(**fields)

        compiled = prefill_buckets.precompile(model, config, max_prompt_length=max_prompt_length, progress=False)

        self.assertEqual(sorted(shape.prompt_length for shape in compiled), buckets)
        self.assertEqual(counter.graphs, len(buckets) + 1, f"graphs: {counter.shapes}")
        self.check_lengths_compile_nothing(counter, model, reference, config, range(1, max_prompt_length + 1))

    def test_shape_generic_graphs_are_warmed_at_the_ends(self):
        # `dynamic=None`: one prefill graph serves every bucket and one decode graph every window (the cache is pinned
        # at 256 + 4 -> 320 slots: windows 256 and 320, the whole cache's counted apart), so only the buckets at both
        # ends are warmed (the 1-token bucket is a decode step); after them, no prompt at either end of a bucket
        # compiles.
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=None, fullgraph=True)
        config = make_config(prefill_buckets="pow2")

        compiled = prefill_buckets.precompile(model, config, max_prompt_length=200, progress=False)

        self.assertEqual([shape.prompt_length for shape in compiled], [256, 2, 1])
        self.assertLessEqual(counter.graphs, 1 + 2, counter.shapes)  # prefill; decode: every window, the whole cache's
        ends = {n for bucket in bucket_lengths(BucketPolicy(buckets="pow2"), 200) for n in (bucket // 2 + 1, bucket)}
        self.check_lengths_compile_nothing(counter, model, reference, config, sorted(n for n in ends if n <= 200))

    def test_a_model_that_fixes_the_length_is_warmed_per_bucket(self):
        # Compiled shape-generic, but the model's code fixes the prompt length: the warm-ups at the ends find it, and
        # every bucket is warmed after all, so later calls compile nothing.
        model = make_model()
        reference = make_reference(model)
        model.model.embed_tokens.__class__ = LengthLoop
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=None, fullgraph=True)
        config = make_config(prefill_buckets=[4, 8, 16, 32])

        compiled = prefill_buckets.precompile(model, config, progress=False)

        self.assertEqual([shape.prompt_length for shape in compiled], [32, 16, 8, 4])
        self.check_lengths_compile_nothing(counter, model, reference, config, range(1, 33))

    def test_precompile_in_the_mode_calls_run_in(self):
        # The guide: precompile in the mode you serve in. Under `torch.inference_mode()`, calls after a warm-up in that
        # mode compile nothing; a call outside it compiles graphs of its own.
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(prefill_buckets=[8, 16])
        with torch.inference_mode():
            prefill_buckets.precompile(model, config, max_prompt_length=16, progress=False)
            warm = counter.graphs
            for length in (3, 16, 9):
                got = prefill_buckets.generate(model, make_prompt(length), generation_config=config)
                torch.testing.assert_close(
                    got, reference.generate(make_prompt(length), generation_config=make_config())
                )
        self.assertEqual(counter.graphs, warm, counter.shapes)
        prefill_buckets.generate(model, make_prompt(9), generation_config=config)
        self.assertGreater(counter.graphs, warm)

    def test_warm_up_calls_advise_in_precompiles_words(self):
        # While its warm-up calls run, advice names what to pass `precompile`, not "call `prefill_buckets.precompile`"
        # (`ModelState.entry`); the caller's entry is back afterwards.
        model = make_model()
        model.compile(backend=GraphCounter(), dynamic=False)
        entries = []
        model.register_forward_pre_hook(lambda module, args: entries.append(state_of(module).entry))
        prefill_buckets.precompile(model, make_config(prefill_buckets=[8, 16]), max_prompt_length=16, progress=False)
        self.assertEqual(set(entries), {"precompile"})
        self.assertEqual(state_of(model).entry, "generate")

    def test_min_prompt_length_skips_smaller_buckets(self):
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(prefill_buckets="pow2")

        # 5 tokens are in bucket 8, 20 in bucket 32: buckets 1, 2 and 4 are skipped.
        compiled = prefill_buckets.precompile(
            model, config, batch_sizes=(1,), max_prompt_length=20, min_prompt_length=5, progress=False
        )

        self.assertEqual([shape.prompt_length for shape in compiled], [32, 16, 8])
        # 3 prefill graphs and 1 decode graph, all at the cache length of bucket 32.
        self.assertEqual(counter.graphs, 4, f"graphs: {counter.shapes}")
        self.assertEqual(sorted(prefill_lengths(counter)), [8, 16, 32], f"graphs: {counter.shapes}")
        self.assertEqual(decode_graphs(counter), 1, f"graphs: {counter.shapes}")
        self.assertEqual(sum(shape.graphs for shape in compiled), counter.graphs)

        # Prompts from 5 to 20 tokens compile nothing; a shorter one, in a skipped bucket, compiles its prefill graph.
        def generate(input_ids):
            return prefill_buckets.generate(model, input_ids, generation_config=config)

        for length in (5, 8, 13, 20):
            self.check_call(counter, generate, make_prompt(length), reference, make_config())
        self.assertEqual(counter.graphs, 4, f"graphs: {counter.shapes}")
        self.check_call(counter, generate, make_prompt(3), reference, make_config())
        self.assertEqual(counter.graphs, 5, f"graphs: {counter.shapes}")
        self.assertEqual(sorted(prefill_lengths(counter)), [4, 8, 16, 32], f"graphs: {counter.shapes}")

    def test_min_prompt_length_in_the_largest_bucket(self):
        # An uncompiled model: which warm-up calls run is what is tested. 20 and 30 share bucket 32.
        model = make_model()
        config = make_config(prefill_buckets="pow2")
        compiled = prefill_buckets.precompile(
            model, config, batch_sizes=(1, 2), max_prompt_length=30, min_prompt_length=20, progress=False
        )
        self.assertEqual([(shape.batch_size, shape.prompt_length) for shape in compiled], [(2, 32), (1, 32)])
        # The default (and 1) warms every bucket up to the largest.
        for min_prompt_length in (None, 1):
            compiled = prefill_buckets.precompile(
                model, config, max_prompt_length=30, min_prompt_length=min_prompt_length, progress=False
            )
            self.assertEqual([shape.prompt_length for shape in compiled], [32, 16, 8, 4, 2, 1])

    def test_prompt_lengths_sample(self):
        # The shortest (23) and longest (495) prompt of a sample: pow2 buckets 32 to 512, not 1 to 512.
        model = make_model()
        config = make_config(prefill_buckets="pow2")
        compiled = prefill_buckets.precompile(model, config, prompt_lengths=[300, 23, 495, 100], progress=False)
        self.assertEqual([shape.prompt_length for shape in compiled], [512, 256, 128, 64, 32])
        for bad in ([], [0, 5], [2.5]):
            with self.assertRaisesRegex(ValueError, "`prompt_lengths` must be a non-empty sample of positive"):
                prefill_buckets.precompile(model, config, prompt_lengths=bad, progress=False)
        with self.assertRaisesRegex(ValueError, "either `prompt_lengths`"):
            prefill_buckets.precompile(model, config, prompt_lengths=[5], max_prompt_length=8, progress=False)

    def test_min_prompt_length_with_list_policy(self):
        model = make_model()
        config = make_config(prefill_buckets=[8, 16, 32])
        compiled = prefill_buckets.precompile(model, config, min_prompt_length=9, progress=False)
        self.assertEqual([shape.prompt_length for shape in compiled], [32, 16])

    @parameterized.expand([("zero", 0), ("negative", -4), ("bool", True), ("float", 4.0), ("string", "4")])
    def test_min_prompt_length_must_be_a_positive_integer(self, _, min_prompt_length):
        model = make_model()
        with self.assertRaisesRegex(ValueError, "`min_prompt_length` must be a positive integer"):
            prefill_buckets.precompile(
                model,
                make_config(prefill_buckets="pow2"),
                max_prompt_length=32,
                min_prompt_length=min_prompt_length,
                progress=False,
            )

    def test_min_prompt_length_larger_than_max_raises(self):
        model = make_model()
        with self.assertRaisesRegex(ValueError, r"`min_prompt_length` \(33\).*`max_prompt_length` \(32\)"):
            prefill_buckets.precompile(
                model, make_config(prefill_buckets="pow2"), max_prompt_length=32, min_prompt_length=33, progress=False
            )
        # With a list of buckets, `max_prompt_length` defaults to the largest bucket.
        with self.assertRaisesRegex(ValueError, r"`min_prompt_length` \(17\).*`max_prompt_length` \(16\)"):
            prefill_buckets.precompile(
                model, make_config(prefill_buckets=[8, 16]), min_prompt_length=17, progress=False
            )

    def test_list_policy_defaults_to_largest_bucket(self):
        # An uncompiled model: `precompile` only runs the warm-up calls, and which calls it runs is what is tested.
        model = make_model()
        config = make_config(prefill_buckets=[8, 16])
        compiled = prefill_buckets.precompile(model, config, progress=False)
        self.assertEqual([(shape.batch_size, shape.prompt_length) for shape in compiled], [(1, 16), (1, 8)])
        self.assertEqual({shape.cache_length for shape in compiled}, {64})  # 16 + 4 - 1 slots, a multiple of 64

    def test_without_buckets_raises(self):
        model = make_model()
        with self.assertRaisesRegex(ValueError, "prefill_buckets"):
            prefill_buckets.precompile(model, make_config(), max_prompt_length=32, progress=False)

    def test_pow2_without_max_prompt_length_raises(self):
        model = make_model()
        with self.assertRaisesRegex(ValueError, "max_prompt_length"):
            prefill_buckets.precompile(model, make_config(prefill_buckets="pow2"), progress=False)


if __name__ == "__main__":
    unittest.main()

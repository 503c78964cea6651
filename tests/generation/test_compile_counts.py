# Compile-count tests: bucketed prefill bounds the graphs a compiled model compiles, and every forward runs compiled.
#
# The forward is compiled with `GraphCounter` (eager backend: tracing only, so cheap) and `dynamic=False,
# fullgraph=True`. With `fullgraph=True` a forward is one compiled graph or an error, never a mix, so a generate
# call of `max_new_tokens` forwards (one prefill, `max_new_tokens - 1` decode steps) runs exactly `max_new_tokens`
# compiled calls. A call that ran eager (for example past the recompile limit) would show up as a missing call.
# `min_new_tokens=max_new_tokens` keeps eos from ending a call early, and the output length is asserted, so early
# stopping can't change the counts.

import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

import prefill_buckets
from prefill_buckets import GraphCounter

from .tiny_models import make_prompt, make_reference, prefill_lengths


MAX_NEW_TOKENS = 5

# Prompt lengths within the bucket 16. The exact fit comes first: it is the one prompt with nothing to pad, which
# upstream would run without a mask (it drops an all-ones 2D mask, and SDPA skips the 4D mask for an unpadded
# prefill), so if it compiled its own graph, every later (padded) length would compile another prefill graph.
LENGTHS_IN_BUCKET_16 = [16, 3, 9, 12, 15, 1, 7]

TINY_CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "attn_implementation": "sdpa",
}
MODELS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**TINY_CONFIG)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(head_dim=8, **TINY_CONFIG)),
}


def make_model(name: str = "llama"):
    model_class, make_config = MODELS[name]
    torch.manual_seed(0)
    return model_class(make_config()).eval()


def generation_config(cache_implementation: str | None = "static", **fields) -> GenerationConfig:
    return GenerationConfig(
        cache_implementation=cache_implementation,
        max_new_tokens=MAX_NEW_TOKENS,
        min_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        **fields,
    )


def compile_model(model, how: str) -> GraphCounter:
    counter = GraphCounter()
    if how == "model.compile":
        model.compile(backend=counter, dynamic=False, fullgraph=True)
    elif how == "torch.compile(forward)":
        model.forward = torch.compile(model.forward, backend=counter, dynamic=False, fullgraph=True)
    else:
        raise ValueError(how)
    return counter


class CompileCountTestBase(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)

    def generate_counted(self, counter: GraphCounter, generate, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """Runs one generate call and checks that each of its `MAX_NEW_TOKENS` forwards ran one compiled call."""
        calls_before = counter.calls
        output = generate(input_ids, **kwargs)
        self.assertEqual(output.shape, (input_ids.shape[0], input_ids.shape[1] + MAX_NEW_TOKENS))
        self.assertTrue(torch.equal(output[:, : input_ids.shape[1]], input_ids), "the prompt came back changed")
        self.assertEqual(
            counter.calls - calls_before,
            MAX_NEW_TOKENS,
            f"prompt of shape {tuple(input_ids.shape)}: {MAX_NEW_TOKENS} forwards should run {MAX_NEW_TOKENS} "
            "compiled calls; fewer means some forwards ran eager",
        )
        return output

    def assert_same_as_reference(self, output, reference, input_ids, config, **kwargs):
        expected = reference.generate(input_ids, generation_config=config, **kwargs)
        torch.testing.assert_close(output, expected, rtol=0, atol=0)


class StaticCacheBucketTest(CompileCountTestBase):
    @parameterized.expand(
        [
            ("llama", "model.compile"),
            ("llama", "torch.compile(forward)"),
            ("qwen3", "model.compile"),
            ("qwen3", "torch.compile(forward)"),
        ]
    )
    def test_one_bucket_compiles_two_graphs(self, model_name, how):
        model = make_model(model_name)
        reference = make_reference(model)
        counter = compile_model(model, how)
        config = generation_config()

        def bucketed(input_ids):
            return prefill_buckets.generate(model, input_ids, generation_config=config, prefill_buckets=[16])

        for length in LENGTHS_IN_BUCKET_16:
            input_ids = make_prompt(length)
            output = self.generate_counted(counter, bucketed, input_ids)
            # One prefill graph for the bucket, one decode graph for the (bucketed) cache length, from the first
            # call on: no later length, the exact fit included, compiles anything.
            self.assertEqual(counter.graphs, 2, f"after prompt length {length}: shapes {counter.shapes}")
            self.assert_same_as_reference(output, reference, input_ids, config)

        self.assertEqual(prefill_lengths(counter), [16])
        self.assertEqual(counter.calls, MAX_NEW_TOKENS * len(LENGTHS_IN_BUCKET_16))

    @parameterized.expand([("right",), ("left",)])
    def test_an_exact_fit_given_as_a_strided_view_compiles_nothing_new(self, side):
        # A padded prompt reaches the forward as a new, contiguous tensor; one that fits its bucket needs no padding,
        # and dynamo guards on strides: a row of a transposed batch must not compile a prefill of its own.
        model = make_model()
        counter = compile_model(model, "model.compile")
        config = generation_config(prefill_padding_side=side)

        def bucketed(input_ids):
            return prefill_buckets.generate(model, input_ids, generation_config=config, prefill_buckets=[16])

        self.generate_counted(counter, bucketed, make_prompt(12))
        view = make_prompt(16, batch_size=2).T.contiguous().T[:1]  # [1, 16], strides (1, 2)
        self.assertFalse(view.is_contiguous())
        self.generate_counted(counter, bucketed, view)
        self.assertEqual(counter.graphs, 2, f"shapes {counter.shapes}")

    def test_enable_and_model_generate(self):
        prefill_buckets.enable()
        self.addCleanup(prefill_buckets.disable)
        model = make_model()
        reference = make_reference(model)
        counter = compile_model(model, "model.compile")
        config = generation_config(prefill_buckets=[16])
        reference_config = generation_config()

        for length in LENGTHS_IN_BUCKET_16:
            input_ids = make_prompt(length)
            output = self.generate_counted(
                counter, lambda ids: model.generate(ids, generation_config=config), input_ids
            )
            self.assertEqual(counter.graphs, 2, f"after prompt length {length}: shapes {counter.shapes}")
            self.assert_same_as_reference(output, reference, input_ids, reference_config)
        self.assertEqual(prefill_lengths(counter), [16])

    @parameterized.expand([("descending",), ("ascending",)])
    def test_pad_to_multiple_of_spanning_three_buckets(self, order):
        # Lengths in the buckets 24, 16 and 8, exact fits included.
        lengths = [24, 20, 17, 16, 9, 8, 3, 1]
        if order == "ascending":
            lengths = lengths[::-1]
        multiple = 8
        buckets_touched = {-(-length // multiple) * multiple for length in lengths}
        self.assertEqual(buckets_touched, {8, 16, 24})

        model = make_model()
        reference = make_reference(model)
        counter = compile_model(model, "model.compile")
        config = generation_config()

        def bucketed(input_ids):
            return prefill_buckets.generate(
                model, input_ids, generation_config=config, prefill_pad_to_multiple_of=multiple
            )

        cache_lengths = []
        for length in lengths:
            input_ids = make_prompt(length)
            output = self.generate_counted(counter, bucketed, input_ids)
            self.assert_same_as_reference(output, reference, input_ids, config)
            cache_lengths.append(model._previous_max_cache_length)
            padded = -(-length // multiple) * multiple
            self.assertGreaterEqual(cache_lengths[-1], padded + MAX_NEW_TOKENS - 1)

        # Graphs: one prefill graph per padded prompt length (bucket), one decode graph per static cache length; the
        # prefill graphs guard on the cache length too, but each bucket here is only ever seen at one cache length.
        # The cache length is bucketed from `padded prompt + max_new_tokens - 1` by a rule that never gives a longer
        # prompt a smaller cache, and upstream sizes the cache as the max of that and
        # `model._previous_max_cache_length`.
        if order == "descending":
            # The first call has the largest bucket, so the largest cache: every later call reuses that cache length,
            # and so its decode graph. Expected from the rules alone, not from a run.
            expected_graphs = len(buckets_touched) + 1
            self.assertEqual(len(set(cache_lengths)), 1, f"cache lengths {cache_lengths}")
        else:
            # The cache may grow at each new bucket (how often depends on the cache rule): one decode graph per
            # cache length seen, never more cache lengths than buckets.
            self.assertLessEqual(len(set(cache_lengths)), len(buckets_touched))
            expected_graphs = len(buckets_touched) + len(set(cache_lengths))
        self.assertEqual(counter.graphs, expected_graphs, f"cache lengths {cache_lengths}, shapes {counter.shapes}")
        self.assertEqual(sorted(prefill_lengths(counter)), [8, 16, 24])

        # The same lengths again. The cache now has its final (largest) length, so a bucket whose prefill graph was
        # compiled at a smaller cache compiles its prefill once more (in ascending order: every bucket but the last);
        # the decode graph at the final cache length exists already. After that, nothing compiles.
        final_cache_length = cache_lengths[-1]
        stale_buckets = {
            -(-length // multiple) * multiple
            for length, cache_length in zip(lengths, cache_lengths)
            if cache_length != final_cache_length
        }
        if order == "descending":
            self.assertEqual(stale_buckets, set())
        for warm_pass in range(2):
            graphs_before = counter.graphs
            for length in lengths:
                self.generate_counted(counter, bucketed, make_prompt(length, seed=1 + warm_pass))
            self.assertEqual(model._previous_max_cache_length, final_cache_length)
            expected_new = len(stale_buckets) if warm_pass == 0 else 0
            self.assertEqual(counter.graphs - graphs_before, expected_new, f"pass {warm_pass + 2}: {counter.shapes}")

    def test_without_buckets_every_length_compiles(self):
        # The problem the feature solves: the same lengths, unbucketed, compile a prefill graph per new length.
        model = make_model()
        counter = compile_model(model, "model.compile")
        config = generation_config()

        # Let every graph compile, so the count is what the lengths cost rather than where the limit cut it.
        with torch._dynamo.config.patch(recompile_limit=64):
            for index, length in enumerate(LENGTHS_IN_BUCKET_16):
                graphs_before = counter.graphs
                self.generate_counted(
                    counter,
                    lambda ids: prefill_buckets.generate(model, ids, generation_config=config),
                    make_prompt(length),
                )
                if index > 0:
                    self.assertGreater(counter.graphs, graphs_before, f"prompt length {length} compiled no graph")

        self.assertGreater(counter.graphs, 2)
        self.assertGreaterEqual(counter.graphs, len(LENGTHS_IN_BUCKET_16) + 1)

    def test_batch_of_two_within_a_bucket(self):
        model = make_model()
        reference = make_reference(model)
        counter = compile_model(model, "model.compile")
        config = generation_config()

        def bucketed(input_ids, **kwargs):
            # Left padding throughout: rows of different lengths take it anyway, and so the all-ones (16, 16) batch
            # shares their graphs (on the right it would take its own: `test_prefill_right.py`, mixed workload).
            return prefill_buckets.generate(
                model, input_ids, generation_config=config, prefill_buckets=[16], prefill_padding_side="left", **kwargs
            )

        # Batch size 1 first: its graphs.
        for length in (16, 5):
            self.generate_counted(counter, bucketed, make_prompt(length))
        graphs_batch_1 = counter.graphs
        self.assertEqual(graphs_batch_1, 2)

        # Batch size 2: rows of different lengths, left-padded by hand to the longer one, with the mask. A new batch
        # size is a new shape, so it compiles its own prefill and decode graph, as many as batch size 1 did; then
        # no length within the bucket recompiles. (16, 16) is the exact fit with an all-ones mask.
        for long, short in ((16, 10), (16, 16), (11, 5), (4, 2), (9, 1)):
            rows = [make_prompt(long, seed=2)[0], make_prompt(short, seed=3)[0]]
            input_ids = torch.zeros(2, long, dtype=torch.long)
            attention_mask = torch.zeros(2, long, dtype=torch.long)
            for row, tokens in enumerate(rows):
                input_ids[row, long - len(tokens) :] = tokens
                attention_mask[row, long - len(tokens) :] = 1
            output = self.generate_counted(counter, bucketed, input_ids, attention_mask=attention_mask)
            self.assertEqual(
                counter.graphs - graphs_batch_1, graphs_batch_1, f"rows ({long}, {short}): shapes {counter.shapes}"
            )
            self.assert_same_as_reference(output, reference, input_ids, config, attention_mask=attention_mask)

        self.assertEqual(sorted(shapes[0] for shapes in counter.shapes), [(1, 1), (1, 16), (2, 1), (2, 16)])


class DynamicCacheBucketTest(CompileCountTestBase):
    def test_one_prefill_graph_per_bucket(self):
        # With the default (dynamic) cache, the key/value length grows every decode step, so with `dynamic=False`
        # each decode step compiles a graph. Bucketing still gives one prefill graph per bucket, and since the
        # decode shapes depend only on the padded length and the step, the decode graphs are shared within a bucket
        # too: `MAX_NEW_TOKENS` graphs per bucket (1 prefill + `MAX_NEW_TOKENS - 1` decode).
        buckets = [8, 16]
        lengths = [16, 3, 9, 12, 8, 1, 7]
        model = make_model()
        reference = make_reference(model)
        counter = compile_model(model, "model.compile")
        config = generation_config(cache_implementation=None)

        def bucketed(input_ids):
            return prefill_buckets.generate(model, input_ids, generation_config=config, prefill_buckets=buckets)

        # 2 buckets x 5 graphs is past the recompile limit (8); raise it so the counts are the real ones.
        with torch._dynamo.config.patch(recompile_limit=64):
            for length in lengths:
                input_ids = make_prompt(length)
                output = self.generate_counted(counter, bucketed, input_ids)
                self.assert_same_as_reference(output, reference, input_ids, config)

            self.assertEqual(sorted(prefill_lengths(counter)), buckets, f"shapes {counter.shapes}")
            decode_graphs = [shapes for shapes in counter.shapes if shapes[0][1] == 1]
            self.assertEqual(len(decode_graphs), len(buckets) * (MAX_NEW_TOKENS - 1), f"shapes {counter.shapes}")
            self.assertEqual(counter.graphs, len(buckets) * MAX_NEW_TOKENS)

            graphs_after_first_pass = counter.graphs
            for length in lengths:
                self.generate_counted(counter, bucketed, make_prompt(length, seed=1))
            self.assertEqual(counter.graphs, graphs_after_first_pass, f"shapes {counter.shapes}")


if __name__ == "__main__":
    unittest.main()

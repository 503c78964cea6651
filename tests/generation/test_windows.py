# Attention windows (issue 22): every forward of a bucketed call reads only the first W slots of its static cache,
# W the smallest window length holding the tokens cached plus the forward's own; the cache stays one allocation.
#
# - Equivalence: tokens and first-step scores against upstream eager on the unpadded prompt, with prompts 3 tokens
#   short of a window and 8 new tokens (decode crosses the window), on both padding sides, batch buckets, a continued
#   conversation, chunked prefill and compiled forwards.
# - Reads: the keys every forward reads span the window, not the cache; after the call the cache is upstream's again.
# - Graph counts (`GraphCounter`, tracing only): per batch size at most the prefill buckets used plus the windows used
#   plus 2, in a random order, on a long-context config (131,072 positions) with prompts up to 4k tokens; and a
#   window's graphs serve every prompt length of its bucket.
# - Memory: on that config the default cache holds at most 16,384 slots, never the model's whole context.

import json
import logging as std_logging
import random
import unittest

import torch
from parameterized import parameterized
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    CompileConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GenerationConfig,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    StaticLayer,
)
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.kvcache import windows
from prefill_buckets.kvcache.sizing import DEFAULT_CACHE_SLOTS, MAX_UNASKED_SLOTS
from prefill_buckets.upstream import checks

from .tiny_models import CACHE, assert_same_generation, static_config, tiny_llama


NEW_TOKENS = 8
SHORT_OF_WINDOW = windows.MIN_WINDOW - 3  # 253: prefill reads the first window, decode crosses into the next


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(1000 * seed + length))


_SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
_SMALL_CONFIG = {**_SMALL, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 1024}
_TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
MODELS = {
    "llama": lambda: tiny_llama(max_position_embeddings=1024),
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(head_dim=8, **_SMALL_CONFIG, **_TOKENS)).eval(),
    "gemma": lambda: GemmaForCausalLM(GemmaConfig(head_dim=8, **_SMALL_CONFIG, **_TOKENS)).eval(),
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**_SMALL_CONFIG, **_TOKENS)).eval(),
    # ALiBi from a 2D mask that upstream pads to every slot of a static cache (`windows.mask_to_window`).
    "bloom": lambda: BloomForCausalLM(
        BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4, **_TOKENS)
    ).eval(),
}


def make(name: str):
    torch.manual_seed(0)
    return MODELS[name]()


def config(**fields) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **fields,
    )


class WindowLengthTest(unittest.TestCase):
    def test_window_lengths(self):
        # Multiples of 256 up to 1024, then 4 per doubling; never more than the cache, and never all of it while a
        # slot is free (a window of every slot is a graph of its own).
        cases = [(1, 256), (256, 256), (257, 512), (1000, 1024), (1025, 1280), (2049, 2560), (4097, 5120)]
        self.assertEqual([windows.window_length(t, 10**6) for t, _ in cases], [w for _, w in cases])
        self.assertEqual(windows.window_length(300, 320), 319)
        self.assertEqual(windows.window_length(319, 320), 319)
        self.assertEqual(windows.window_length(320, 320), 320)
        self.assertEqual(windows.window_length(2080, 2112), 2111)
        self.assertEqual(sorted(windows.windows_between(250, 800, 10**6)), [256, 512, 768, 1024])


class ReadsTest(unittest.TestCase):
    @parameterized.expand(
        [
            # Left: the prompt is padded to 256 in front; every decode step holds more than 256 tokens.
            ("left", [256] + [512] * 7),
            # Right: the prefill fills 256 slots, then the cache holds 253 tokens; decode reaches 257 at its 4th step.
            ("right", [256] * 4 + [512] * 4),
        ]
    )
    def test_forwards_read_the_window_not_the_cache(self, side, expected):
        model = tiny_llama(max_position_embeddings=8192)
        reads = []
        update = windows.WindowedStaticLayer.update

        def recording(layer, *args, **kwargs):
            keys, values = update(layer, *args, **kwargs)
            reads.append((keys.shape[-2], values.shape[-2], layer.max_cache_len))
            return keys, values

        windows.WindowedStaticLayer.update = recording
        self.addCleanup(setattr, windows.WindowedStaticLayer, "update", update)
        out = prefill_buckets.generate(
            model,
            ids(1, SHORT_OF_WINDOW),
            generation_config=config(cache_implementation="static"),
            prefill_buckets="pow2",
            prefill_padding_side=side,
        )
        slots = {r[2] for r in reads}
        self.assertEqual(slots, {DEFAULT_CACHE_SLOTS})  # one allocation of the default length
        self.assertEqual([r[0] for r in reads[::2]], expected)  # 2 layers, 8 forwards
        self.assertTrue(all(r[0] == r[1] for r in reads))
        # Handed back, the cache is upstream's: it reads every slot.
        self.assertTrue(all(type(layer) is StaticLayer for layer in out[CACHE].layers))

    def test_upstream_unbucketed_call_reads_every_slot(self):
        model = tiny_llama()
        out = model.generate(ids(1, 20), generation_config=config(cache_implementation="static", max_cache_len=512))
        self.assertTrue(all(type(layer) is StaticLayer for layer in out[CACHE].layers))


class WindowEquivalenceTest(unittest.TestCase):
    """Tokens and first-step scores of upstream eager on the unpadded prompts, with decode crossing a window."""

    @classmethod
    def setUpClass(cls):
        cls.models = {}

    def model(self, name):
        if name not in self.models:
            self.models[name] = make(name)
        return self.models[name]

    def assert_upstream(self, ours, theirs, scores=True):
        assert_same_generation(ours, theirs, scores)

    @parameterized.expand([(name, side) for name in MODELS for side in ("left", "right")])
    def test_prompt_short_of_a_window(self, name, side):
        model = self.model(name)
        prompt = ids(1, SHORT_OF_WINDOW)
        theirs = model.generate(prompt, generation_config=config())
        ours = prefill_buckets.generate(
            model,
            prompt,
            generation_config=config(cache_implementation="static"),
            prefill_buckets="pow2",
            prefill_padding_side=side,
        )
        self.assert_upstream(ours, theirs)

    def test_batch_buckets_rows_of_different_lengths(self):
        model = self.model("llama")
        prompt = ids(3, SHORT_OF_WINDOW)
        mask = torch.ones_like(prompt)
        mask[1, :40] = 0
        mask[2, :200] = 0
        theirs = model.generate(prompt, attention_mask=mask, generation_config=config())
        ours = prefill_buckets.generate(
            model,
            prompt,
            attention_mask=mask,
            generation_config=config(cache_implementation="static"),
            prefill_buckets="pow2",
            prefill_batch_buckets=[4],
        )
        self.assert_upstream(ours, theirs)

    @parameterized.expand([("left",), ("right",)])
    def test_continued_conversation_crosses_windows(self, side):
        model = self.model("llama")
        first = config(cache_implementation="static")
        ours = prefill_buckets.generate(
            model, ids(1, 200), generation_config=first, prefill_buckets="pow2", prefill_padding_side=side
        )
        theirs = model.generate(
            ids(1, 200), generation_config=config(cache_implementation="static", max_cache_len=640)
        )
        self.assert_upstream(ours, theirs)
        for turn, user_tokens in enumerate((60, 250)):  # the cache crosses 256, then 512
            user = ids(1, user_tokens, seed=turn + 1)
            ours = prefill_buckets.generate(
                model,
                torch.cat([ours.sequences, user], dim=1),
                **{CACHE: ours[CACHE]},
                generation_config=config(),
                prefill_buckets="pow2",
                prefill_padding_side=side,
            )
            theirs = model.generate(
                torch.cat([theirs.sequences, user], dim=1), **{CACHE: theirs[CACHE]}, generation_config=config()
            )
            self.assert_upstream(ours, theirs, scores=False)

    def test_chunked_prefill_across_windows(self):
        model = self.model("llama")
        prompt = ids(1, 300)  # padded to 320: 5 chunks of 64, the last reads 512 slots
        theirs = model.generate(prompt, generation_config=config())
        ours = prefill_buckets.generate(
            model,
            prompt,
            generation_config=config(cache_implementation="static"),
            prefill_chunk_size=64,
            prefill_pad_to_multiple_of=64,
        )
        self.assert_upstream(ours, theirs)

    @parameterized.expand([("model.compile",), ("forward",), ("compile_config",)])
    def test_compiled(self, how):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        reference = self.model("llama")
        model = make("llama")
        counter = GraphCounter()
        fields = {"cache_implementation": "static"}
        if how == "model.compile":
            model.compile(backend=counter, dynamic=False, fullgraph=True)
        elif how == "forward":
            model.forward = torch.compile(model.forward, backend=counter, dynamic=False, fullgraph=True)
        else:
            fields["compile_config"] = CompileConfig(backend=counter, fullgraph=True, dynamic=False, mode=None)
        for length in (SHORT_OF_WINDOW, 20, 500):
            prompt = ids(1, length)
            theirs = reference.generate(prompt, generation_config=config())
            ours = prefill_buckets.generate(model, prompt, generation_config=config(**fields), prefill_buckets="pow2")
            self.assert_upstream(ours, theirs)
        self.assertGreater(counter.graphs, 0)

    @parameterized.expand([("static", False), ("dynamic", None)])
    def test_compiled_alibi_from_a_padded_mask(self, _, dynamic):
        # BLOOM builds its ALiBi bias inside the compiled forward from a 2D mask upstream pads to every slot: cut to
        # the window, one graph per window (it raised in tracing, as in eager, before `mask_to_window`). With dynamic
        # shapes the first forward reads only its own tokens' slots (`QUERY_WINDOW`), and the mask is cut to those
        # (it raised in tracing before: an ALiBi bias of every slot against the prompt's keys).
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        model, counter = make("bloom"), GraphCounter()
        model.compile(backend=counter, dynamic=dynamic, fullgraph=True)
        for length in (SHORT_OF_WINDOW, 20):
            prompt = ids(1, length)
            theirs = self.model("bloom").generate(prompt, generation_config=config())
            ours = prefill_buckets.generate(
                model, prompt, generation_config=config(cache_implementation="static"), prefill_buckets="pow2"
            )
            self.assert_upstream(ours, theirs)
        self.assertEqual(counter.calls, 2 * NEW_TOKENS, "every forward ran compiled")


class LongContextGraphTest(unittest.TestCase):
    """A 131,072-position model, prompts up to 4k tokens in a random order, no `max_cache_len`, no `precompile`."""

    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)

    def run_workload(self, lengths, batch_size=1, compiled=None, **fields):
        model, counter = compiled or (tiny_llama(max_position_embeddings=131072), GraphCounter())
        if compiled is None:
            model.compile(backend=counter, dynamic=False, fullgraph=True)
        generation_config = GenerationConfig(
            cache_implementation="static", max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
        chunk = fields.get("prefill_chunk_size")
        for length in lengths:
            calls_before = counter.calls
            out = prefill_buckets.generate(
                model, ids(batch_size, length), generation_config=generation_config, **fields
            )
            self.assertEqual(out.shape, (batch_size, length + NEW_TOKENS))
            prefill_forwards = 1 if chunk is None else -(-length // chunk)
            self.assertEqual(counter.calls - calls_before, prefill_forwards + NEW_TOKENS - 1, "a forward ran eagerly")
        return model, counter

    @parameterized.expand(
        [
            ("pow2", {"prefill_buckets": "pow2"}),
            ("pow2_quarters", {"prefill_buckets": "pow2-quarters"}),
            ("multiple_256", {"prefill_pad_to_multiple_of": 256}),
        ]
    )
    def test_buckets_plus_windows_plus_two(self, _, fields):
        lengths = random.Random(0).sample(range(10, 4097), 12)
        model, counter = self.run_workload(lengths, **fields)
        slots = model._previous_max_cache_length
        self.assertLessEqual(slots, MAX_UNASKED_SLOTS)
        self.assertEqual(slots, DEFAULT_CACHE_SLOTS)  # one allocation, the documented default
        policy = prefill_buckets.BucketPolicy(
            buckets=fields.get("prefill_buckets"), pad_to_multiple_of=fields.get("prefill_pad_to_multiple_of")
        )
        buckets = {policy.bucket(n) for n in lengths}
        used = set()
        for n in lengths:
            used |= windows.windows_between(policy.bucket(n), policy.bucket(n) + NEW_TOKENS - 1, slots)
        self.assertLessEqual(counter.graphs, len(buckets) + len(used) + 2, counter.shapes)

    def test_a_window_predicted_but_not_read_is_counted_when_read(self):
        # The benchmark's prompts in its shuffled order, right-padded to "pow2-quarters" buckets, 24 new tokens. A call
        # predicts every window its tokens could reach (842 tokens: 256 to 1024) and reads the last one only; torch
        # holds 7 graphs after 4 calls when the 523-token call (bucket 640) reads the window 768 for the first time: a
        # prefill graph and a decode graph more than the limit of 8. Counted as held since the 842-token call, the
        # window went uncounted, the limit stayed at 8, and torch ran the rest of the workload's new shapes eagerly.
        lengths = [267, 842, 367, 69, 523, 10, 219, 131, 953, 19, 38, 699, 871, 584, 636, 145]
        model, counter = tiny_llama(max_position_embeddings=8192), GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        generation_config = GenerationConfig(
            cache_implementation="static", max_new_tokens=24, min_new_tokens=24, do_sample=False
        )
        for length in lengths:
            calls_before = counter.calls
            prefill_buckets.generate(
                model, ids(1, length), generation_config=generation_config, prefill_buckets="pow2-quarters"
            )
            self.assertEqual(counter.calls - calls_before, 24, f"a forward of the {length}-token call ran eagerly")
        self.assertGreater(counter.graphs, 8)  # the positive control: past torch's default limit

    def test_chunked(self):
        # Every chunk has one length (256); a chunk graph per window the chunks reach and a decode graph per window
        # decode reaches: at most 2 per window used.
        lengths = random.Random(1).sample(range(10, 4097), 8)
        model, counter = self.run_workload(lengths, prefill_chunk_size=256, prefill_pad_to_multiple_of=256)
        slots = model._previous_max_cache_length
        chunk_windows, decode_windows = set(), set()
        for n in lengths:
            padded = -(-n // 256) * 256
            chunk_windows |= windows.windows_between(256, padded, slots)
            decode_windows |= windows.windows_between(padded + 1, padded + NEW_TOKENS - 1, slots)
        self.assertEqual(counter.graphs, len(chunk_windows) + len(decode_windows), counter.shapes)
        self.assertLessEqual(counter.graphs, 2 * len(chunk_windows | decode_windows), counter.shapes)

    def test_one_window_graph_serves_twenty_lengths(self):
        # Every length of the bucket 512 prefills into the window 512 and decodes in 768: 2 graphs in all.
        lengths = random.Random(2).sample(range(257, 513), 20)
        compiled = self.run_workload(lengths[:1], prefill_buckets="pow2")
        self.assertEqual(compiled[1].graphs, 2, compiled[1].shapes)
        self.run_workload(lengths[1:], compiled=compiled, prefill_buckets="pow2")
        self.assertEqual(compiled[1].graphs, 2, compiled[1].shapes)


class MemoryTest(unittest.TestCase):
    def test_long_context_default_is_bounded(self):
        model = tiny_llama(max_position_embeddings=131072)
        generation_config = GenerationConfig(cache_implementation="static", max_new_tokens=2, do_sample=False)
        for length in (4000, 100):
            prefill_buckets.generate(
                model, ids(1, length), generation_config=generation_config, prefill_buckets="pow2"
            )
            self.assertLessEqual(model._previous_max_cache_length, 16384)
        self.assertLess(model._previous_max_cache_length, model.config.max_position_embeddings)

    def test_a_small_cache_is_said_in_kilobytes(self):
        # After an upstream call made a 16-slot cache, a bucketed call grows it to the model's 512 positions: 64 KB per
        # row on the tiny Llama, which the warning once said as "0 MB".
        model = tiny_llama()
        generation_config = GenerationConfig(cache_implementation="static", max_new_tokens=2, do_sample=False)
        model.generate(ids(1, 10), generation_config=generation_config)
        std_logging.Logger.warning_once.cache_clear()
        with CaptureLogger(transformers_logging.get_logger("prefill_buckets")) as captured:
            prefill_buckets.generate(model, ids(1, 30), generation_config=generation_config, prefill_buckets="pow2")
        per_row = 2 * 2 * 2 * 8 * 4 * model._previous_max_cache_length
        self.assertIn(f"({per_row // 2**10} KB per row)", captured.out)
        self.assertNotIn("0 MB", captured.out)

    def test_growth_past_the_default_says_its_bytes(self):
        model = tiny_llama(max_position_embeddings=131072)
        generation_config = GenerationConfig(cache_implementation="static", max_new_tokens=2, do_sample=False)
        prefill_buckets.generate(model, ids(1, 10), generation_config=generation_config, prefill_buckets="pow2")
        logger = transformers_logging.get_logger("prefill_buckets")
        with CaptureLogger(logger) as captured:
            prompt = ids(1, 6000)  # bucket 8192, plus a new slot: past the default cache
            out = prefill_buckets.generate(model, prompt, generation_config=generation_config, prefill_buckets="pow2")
        self.assertEqual(model._previous_max_cache_length, 16384)  # the next power of two, not 131k
        per_row = 2 * 2 * 2 * 8 * 4 * 16384  # layers * (keys, values) * kv heads * head dim * fp32 bytes * slots
        self.assertIn(f"{per_row / 2**20:,.0f} MB per row", captured.out)
        expected = model.generate(prompt, max_new_tokens=2, do_sample=False)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


class PrecompileWindowsTest(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)

    @parameterized.expand([("left",), ("right",)])
    def test_precompile_warms_the_windows_calls_reach(self, side):
        # The cache is pinned at 1024 + 7 -> 1088 slots: windows 256, 512, 768, 1024 and 1088.
        model = tiny_llama(max_position_embeddings=2048)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        generation_config = static_config(NEW_TOKENS, prefill_buckets="pow2", prefill_padding_side=side)
        prefill_buckets.precompile(
            model, generation_config, max_prompt_length=1000, min_prompt_length=100, progress=False
        )
        graphs = counter.graphs
        for length in random.Random(3).sample(range(100, 1001), 12) + [253, 509, 1021]:
            calls = counter.calls
            out = prefill_buckets.generate(model, ids(1, length), generation_config=generation_config)
            self.assertEqual(out.shape[1], length + NEW_TOKENS)
            self.assertEqual(counter.calls - calls, NEW_TOKENS, "a forward ran eagerly")
        self.assertEqual(counter.graphs, graphs, f"later calls compiled {counter.graphs - graphs} more graphs")


@unittest.skipIf(checks.aot_compile_problem() is not None, "`aot_forward` raises on this torch (test_checks.py)")
class AOTForwardWindowsTest(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)

    def test_graphs_of_one_shape_are_told_apart_by_their_window(self):
        # Decode after 20 tokens (bucket 32) reads 256 slots, after 253 (bucket 256) 512: the same input shapes, told
        # apart by the window in their dispatch key (and by their saved guards).
        reference = tiny_llama(max_position_embeddings=1024)
        model = tiny_llama(max_position_embeddings=1024)
        model.forward = prefill_buckets.aot_forward(model, backend="aot_eager")
        for length in (20, SHORT_OF_WINDOW, 20):
            prompt = ids(1, length)
            expected = reference.generate(prompt, generation_config=config())
            ours = prefill_buckets.generate(
                model,
                prompt,
                generation_config=config(cache_implementation="static"),
                prefill_buckets="pow2",
                prefill_padding_side="left",
            )
            torch.testing.assert_close(ours.sequences, expected.sequences, rtol=0, atol=0)
        # Prefill 32 (window 256) and 256 (window 256), decode in windows 256 and 512.
        self.assertEqual(model.forward.graphs_compiled, 4)
        keys = [json.loads(key) for key in model.forward.functions]
        self.assertEqual(len(keys), 4, "each graph has a dispatch key of its own")
        windows_in_keys = sorted({window for key in keys for _, layers in key["windows"] for window in layers})
        self.assertEqual(windows_in_keys, [256, 512])

# Sliding-window and chunked-attention models in a bucketed call (issue 28): their static cache's sliding layers are
# rings for the call (`kvcache/ring.py`), so a compiled forward compiles once per (bucket, window, batch size).
#
# - Equivalence: tokens and first-step scores against upstream eager on the unpadded prompt, on tiny Gemma 2, Gemma 3,
#   GPT-OSS, Mistral (with `sliding_window`), Llama 4 (chunked) and Cohere2, with a 16-token window: prompts shorter
#   and longer than the window, decode crossing it, a conversation continued past it, chunked prefill across it,
#   batch buckets with rows of different lengths, beam search, both padding sides.
# - Graph counts (`GraphCounter`, tracing only): per batch size at most the buckets used plus the windows used plus 2
#   over 20 random prompt lengths around and beyond the window, 30 new tokens each; every forward compiled; a second
#   pass compiles nothing; `GraphBudget` and `precompile` count what torch compiled.
# - Memory: a sliding layer's storage is its window, during the call and after it.
# - Handed back: the layers are upstream's again, with upstream's count, and continue as upstream's would.

import importlib.util
import logging as std_logging
import os
import random
import re
import unittest
from pathlib import Path
from unittest import mock

import torch
from parameterized import parameterized
from transformers import (
    GenerationConfig,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from transformers.testing_utils import CaptureLogger, slow
from transformers.utils import logging as transformers_logging

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.kvcache import windows
from prefill_buckets.kvcache.ring import SlidingWindowRing
from prefill_buckets.state import state_of
from prefill_buckets.upstream import checks

from .tiny_models import (
    CACHE,
    SLIDING_MODELS,
    SLIDING_WINDOW,
    assert_same_generation,
    single_thread_module,
    static_config,
)


NEW_TOKENS = 30
# Each case runs on these in CI (a hybrid of sliding and full attention, and chunked attention), on all with
# RUN_SLOW=1.
FAST_MODELS = ("gemma3", "llama4")
_upstream_static = {}
setUpModule, tearDownModule = single_thread_module()


def make(name: str):
    torch.manual_seed(0)
    with CaptureLogger(transformers_logging.get_logger("transformers")):  # GPT-OSS's default rope scaling warns
        model = SLIDING_MODELS[name]().eval()
    return model


def ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(1000 * seed + length))


def config(new_tokens: int = NEW_TOKENS, **fields) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        **fields,
    )


def skip_without_upstream_static(test, name: str, fast=FAST_MODELS) -> None:
    """
    Skips `name` outside `FAST_MODELS` unless RUN_SLOW is set, and where upstream's own static cache fails (Llama 4 on
    transformers 5.17: its chunked mask takes no `block_sequence_ids`): nothing to match.
    """
    if name not in fast and os.environ.get("RUN_SLOW", "").lower() not in ("1", "true", "yes"):
        test.skipTest("test is slow (RUN_SLOW=1 runs it)")
    if name not in _upstream_static:
        try:
            make(name).generate(ids(1, 3), max_new_tokens=2, do_sample=False, cache_implementation="static")
            _upstream_static[name] = None
        except Exception as error:
            _upstream_static[name] = f"{type(error).__name__}: {error}"
    if _upstream_static[name] is not None:
        test.skipTest(f"upstream's static cache fails on `{name}` here: {_upstream_static[name]}")


class RingEquivalenceTest(unittest.TestCase):
    """Tokens and first-step scores of upstream eager on the unpadded prompts."""

    models = {}

    def model(self, name):
        skip_without_upstream_static(self, name)
        if name not in self.models:
            self.models[name] = make(name)
        return self.models[name]

    def assert_upstream(self, ours, theirs, scores=True):
        assert_same_generation(ours, theirs, scores)

    def bucketed(self, model, prompt, generation_config=None, **fields):
        layers = []
        update = SlidingWindowRing.update

        def recording(layer, *args, **kwargs):
            read = update(layer, *args, **kwargs)
            layers.append(layer.keys.shape[-2])
            return read

        with mock.patch.object(SlidingWindowRing, "update", recording):
            out = prefill_buckets.generate(
                model, prompt, generation_config=generation_config or config(cache_implementation="static"), **fields
            )
        self.assertTrue(layers, "no ring served the call")
        self.assertEqual(set(layers), {SLIDING_WINDOW})  # the storage is the window
        return out

    @parameterized.expand([(name, length) for name in SLIDING_MODELS for length in (12, 40)])
    def test_prompt_and_decode_past_the_window(self, name, length):
        # 12 tokens: right-padded to 16, decode crosses the window; 40: longer than the window, padded on the left.
        model = self.model(name)
        prompt = ids(1, length)
        theirs = model.generate(prompt, generation_config=config())
        for side in ("left", "auto") if length <= SLIDING_WINDOW else ("left",):  # past the window "auto" is the left
            ours = self.bucketed(model, prompt, prefill_buckets="pow2", prefill_padding_side=side)
            self.assert_upstream(ours, theirs)

    @parameterized.expand([(name,) for name in SLIDING_MODELS])
    def test_continued_conversation_past_the_window(self, name):
        # Left-padded from the first turn: a later turn, whose bucket the window can't hold past the cached tokens,
        # is padded on the left, in front of the cache's own padding (a right-padded first turn would leave it
        # unpadded: `padding_side.py`).
        model = self.model(name)
        new_tokens = 6
        ours = self.bucketed(
            model,
            ids(1, 10),
            config(new_tokens, cache_implementation="static"),
            prefill_buckets="pow2",
            prefill_padding_side="left",
        )
        theirs = model.generate(ids(1, 10), generation_config=config(new_tokens, cache_implementation="static"))
        self.assert_upstream(ours, theirs)
        for turn, user_tokens in enumerate((3, 20)):  # 16 + 3 tokens (past the window), then 25 + 20 more
            user = ids(1, user_tokens, seed=turn + 1)
            ours = self.bucketed(
                model,
                torch.cat([ours.sequences, user], dim=1),
                config(new_tokens),
                prefill_buckets="pow2",
                prefill_padding_side="left",
                **{CACHE: ours[CACHE]},
            )
            theirs = model.generate(
                torch.cat([theirs.sequences, user], dim=1),
                **{CACHE: theirs[CACHE]},
                generation_config=config(new_tokens),
            )
            self.assert_upstream(ours, theirs, scores=False)

    def test_a_right_padded_turn_then_one_past_the_window_runs_unpadded_and_says_why(self):
        # The first turn is padded on the right ("auto"), which leaves no padding in the cache; the next, whose bucket
        # the window can't hold, can be padded on neither side: it runs unpadded, exact, and its warning names both
        # reasons (it used to say the cache came from an unpadded call, and not why the right side was out).
        model = self.model("gemma3")
        first = config(4, cache_implementation="static", max_cache_len=64)
        ours = self.bucketed(model, ids(1, 10), first, prefill_buckets="pow2")
        theirs = model.generate(ids(1, 10), generation_config=first)
        user = ids(1, 5, seed=9)  # 14 + 5 tokens, in bucket 32: past the window
        std_logging.Logger.warning_once.cache_clear()
        with CaptureLogger(transformers_logging.get_logger("prefill_buckets")) as captured:
            ours = prefill_buckets.generate(
                model, torch.cat([ours.sequences, user], 1), **{CACHE: ours[CACHE]}, generation_config=config(4)
            )
        theirs = model.generate(
            torch.cat([theirs.sequences, user], 1), **{CACHE: theirs[CACHE]}, generation_config=config(4)
        )
        self.assert_upstream(ours, theirs)
        message = " ".join(captured.out.split())
        self.assertIn("already holds tokens from a right-padded call, so the prompt can't be padded in front", message)
        self.assertIn(
            f"and it is not padded on the right: a sliding window of {SLIDING_WINDOW} slots is shorter", message
        )

    @parameterized.expand([(name,) for name in SLIDING_MODELS])
    def test_handed_back_upstream_continues_past_the_window(self, name):
        # A right-padded call leaves no padding in the cache: upstream's own `generate` continues it as its own.
        model = self.model(name)
        ours = self.bucketed(model, ids(1, 10), config(4, cache_implementation="static"), prefill_buckets="pow2")
        theirs = model.generate(ids(1, 10), generation_config=config(4, cache_implementation="static"))
        self.assert_upstream(ours, theirs)
        for layer in ours[CACHE].layers:
            self.assertIn(type(layer), (StaticLayer, StaticSlidingWindowLayer))
        user = ids(1, 5, seed=9)  # 13 + 5 tokens: past the window
        ours = model.generate(torch.cat([ours.sequences, user], 1), **{CACHE: ours[CACHE]}, generation_config=config())
        theirs = model.generate(
            torch.cat([theirs.sequences, user], 1), **{CACHE: theirs[CACHE]}, generation_config=config()
        )
        self.assert_upstream(ours, theirs)

    @parameterized.expand([(name,) for name in SLIDING_MODELS])
    def test_chunked_prefill_across_the_window(self, name):
        model = self.model(name)
        prompt = ids(1, 30)  # padded to 32: 4 chunks of 8, the last two past the window
        theirs = model.generate(prompt, generation_config=config(8))
        ours = self.bucketed(
            model,
            prompt,
            config(8, cache_implementation="static"),
            prefill_chunk_size=8,
            prefill_pad_to_multiple_of=8,
        )
        self.assert_upstream(ours, theirs)

    @parameterized.expand([(name,) for name in SLIDING_MODELS])
    def test_batch_buckets_rows_of_different_lengths(self, name):
        model = self.model(name)
        prompt = ids(3, 20)
        mask = torch.ones_like(prompt)
        mask[1, :5] = 0
        mask[2, :13] = 0
        theirs = model.generate(prompt, attention_mask=mask, generation_config=config(12))
        ours = self.bucketed(
            model,
            prompt,
            config(12, cache_implementation="static"),
            attention_mask=mask,
            prefill_buckets="pow2",
            prefill_batch_buckets=[4],
        )
        self.assert_upstream(ours, theirs)

    @parameterized.expand([(name, side) for name in SLIDING_MODELS for side in ("left", "right")])
    def test_beam_search(self, name, side):
        model = self.model(name)
        prompt = ids(1, 12)
        beams = {"num_beams": 2, "num_return_sequences": 2}
        theirs = model.generate(prompt, generation_config=config(12, **beams))
        ours = self.bucketed(
            model,
            prompt,
            config(12, cache_implementation="static", **beams),
            prefill_buckets="pow2",
            prefill_padding_side=side,
        )
        self.assert_upstream(ours, theirs, scores=False)


class RingGraphTest(unittest.TestCase):
    """`model.compile(dynamic=False, fullgraph=True)` with the counting backend, 30 new tokens per call."""

    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)

    def compiled(self, name):
        skip_without_upstream_static(self, name, fast=("gemma3",))  # compiling the others: RUN_SLOW=1
        model = make(name)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        return model, counter

    def run_workload(self, model, counter, lengths, batch_size=1, **fields):
        generation_config = GenerationConfig(
            cache_implementation="static", max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
        for length in lengths:
            calls = counter.calls
            out = prefill_buckets.generate(
                model, ids(batch_size, length), generation_config=generation_config, prefill_buckets="pow2", **fields
            )
            self.assertEqual(out.shape, (batch_size, length + NEW_TOKENS))
            self.assertEqual(counter.calls - calls, NEW_TOKENS, f"a forward of a {length}-token call ran eagerly")

    def assert_bound(self, model, counter, lengths):
        policy = prefill_buckets.BucketPolicy(buckets="pow2")
        slots = model._previous_max_cache_length
        buckets = {policy.bucket(n) for n in lengths}
        used = set()  # the full-attention windows: one here, the cache being at most 256 slots
        for n in lengths:
            used |= windows.windows_between(1, policy.bucket(n) + NEW_TOKENS, slots)
        self.assertLessEqual(counter.graphs, len(buckets) + len(used) + 2, counter.shapes)

    @parameterized.expand([(name,) for name in SLIDING_MODELS])
    def test_buckets_plus_windows_plus_two(self, name):
        model, counter = self.compiled(name)
        lengths = random.Random(0).sample(range(1, 4 * SLIDING_WINDOW), 20)  # around and beyond the window
        self.run_workload(model, counter, lengths)
        self.assert_bound(model, counter, lengths)
        self.assertEqual(state_of(model).budget.graphs, counter.graphs)  # the budget counts what torch compiled
        graphs = counter.graphs
        self.run_workload(model, counter, lengths)  # a second pass compiles nothing
        self.assertEqual(counter.graphs, graphs)

    @parameterized.expand([(name,) for name in SLIDING_MODELS])
    @slow
    def test_per_batch_size(self, name):
        model, counter = self.compiled(name)
        lengths = random.Random(1).sample(range(1, 4 * SLIDING_WINDOW), 6)
        self.run_workload(model, counter, lengths, batch_size=1)
        one = counter.graphs
        self.run_workload(model, counter, lengths, batch_size=2)
        self.assertLessEqual(counter.graphs - one, one)  # batch 2 compiles at most what batch 1 did
        self.assertEqual(state_of(model).budget.graphs, counter.graphs)

    @parameterized.expand([("gemma3",), ("llama4",)])
    def test_precompile_counts_the_graphs(self, name):
        model, counter = self.compiled(name)
        generation_config = static_config(NEW_TOKENS, prefill_buckets="pow2")
        compiled = prefill_buckets.precompile(
            model, generation_config, max_prompt_length=SLIDING_WINDOW, progress=False
        )
        self.assertEqual(sum(shape.graphs for shape in compiled), counter.graphs)
        self.assertEqual(state_of(model).budget.graphs, counter.graphs)
        graphs = counter.graphs
        for length in random.Random(2).sample(range(1, SLIDING_WINDOW + 1), 5):
            calls = counter.calls
            prefill_buckets.generate(model, ids(1, length), generation_config=generation_config)
            self.assertEqual(counter.calls - calls, NEW_TOKENS, "a forward ran eagerly")
        self.assertEqual(counter.graphs, graphs)

    @slow
    def test_without_rings_every_step_past_the_window_retraces(self):
        # The fix's counterpart: upstream's sliding layers (here kept by a failed upstream check) make a new decode
        # graph per step past the window, until torch's limit, and then run eagerly; exact either way.
        expected = make("gemma3").generate(ids(1, 12), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
        model, counter = make("gemma3"), GraphCounter()
        model.compile(backend=counter, dynamic=False)
        logger = transformers_logging.get_logger("prefill_buckets")
        with mock.patch.object(checks, "sliding_layer_problem", return_value="a test"), CaptureLogger(logger) as log:
            generation_config = GenerationConfig(
                cache_implementation="static", max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            out = prefill_buckets.generate(
                model, ids(1, 12), generation_config=generation_config, prefill_buckets="pow2"
            )
        self.assertIn("The sliding-window layers stay upstream's for this call: a test", log.out)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        self.assertLess(counter.calls, NEW_TOKENS)  # some forwards ran eagerly


class RingMemoryTest(unittest.TestCase):
    def test_sliding_storage_is_the_window(self):
        model = make("gemma3")
        out = prefill_buckets.generate(
            model, ids(1, 40), generation_config=config(cache_implementation="static"), prefill_buckets="pow2"
        )
        sliding, full = out[CACHE].layers
        self.assertIs(type(sliding), StaticSlidingWindowLayer)
        self.assertEqual(tuple(sliding.keys.shape), (1, 2, SLIDING_WINDOW, 8))
        self.assertEqual(tuple(sliding.values.shape), (1, 2, SLIDING_WINDOW, 8))
        self.assertEqual(full.keys.shape[-2], model._previous_max_cache_length)
        self.assertGreater(model._previous_max_cache_length, SLIDING_WINDOW)
        # Upstream's count, and its layout: the last 16 of the 64 + 29 tokens held.
        self.assertEqual(sliding.cumulative_length_int, 64 + NEW_TOKENS - 1)
        self.assertEqual(int(sliding.cumulative_length), 64 + NEW_TOKENS - 1)


class RingLayerTest(unittest.TestCase):
    """The ring against upstream's layer, forward by forward: what each keeps, and the keys each forward attends."""

    def test_same_storage_and_positions_as_upstream(self):
        upstream = StaticSlidingWindowLayer(max_cache_len=64, sliding_window=4)
        ring = StaticSlidingWindowLayer(max_cache_len=64, sliding_window=4)
        SlidingWindowRing.open(ring)
        position = 0
        for new in (1, 2, 1, 5, 1, 1, 3, 1):
            keys = torch.arange(position, position + new, dtype=torch.float32).view(1, 1, new, 1) + 1
            ring.set_tokens(position + new)
            length, offset = ring.get_mask_sizes(new)
            expected_keys, _ = upstream.update(keys, keys)
            read, _ = ring.update(keys, keys)
            self.assertEqual(read.shape[-2], length)  # the mask spans what the forward reads
            # Every slot read holds its position (`offset + j`) or nothing yet, and every position upstream's
            # forward attends is among them.
            held = {int(k) - 1: j + offset for j, k in enumerate(read.view(-1).tolist()) if k}
            self.assertTrue(all(slot == key for key, slot in held.items()))
            self.assertLessEqual({int(k) - 1 for k in expected_keys.view(-1).tolist() if k}, set(held))
            torch.testing.assert_close(ring.keys, upstream.keys, rtol=0, atol=0)
            position += new
        SlidingWindowRing.close(ring)
        self.assertIs(type(ring), StaticSlidingWindowLayer)
        self.assertEqual(ring.cumulative_length_int, upstream.cumulative_length_int)


_ROOT = Path(__file__).resolve().parents[2]


def load_sliding_sweep():
    """`utils/sliding_sweep.py`, imported."""
    spec = importlib.util.spec_from_file_location("sliding_sweep", _ROOT / "utils" / "sliding_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    return sweep


def architectures_page_rows(section: str, pattern: str) -> dict[str, str]:
    """The table rows of the architecture page from its `section` on, matching `pattern`, by model type."""
    page = (_ROOT / "docs" / "source" / "en" / "architectures.md").read_text(encoding="utf-8")
    page = page[page.index(section) :]
    return {m.group(1): m.group(0) for m in re.finditer(pattern, page, re.M)}


class SweepTableTest(unittest.TestCase):
    """The architecture page's sliding table (`utils/sliding_sweep.py`) says what the sweep finds: one row in CI."""

    @classmethod
    def setUpClass(cls):
        cls.sweep = load_sliding_sweep()
        cls.rows = architectures_page_rows(
            "## Sliding-window and chunked attention", r"^\| `([\w-]+)` \|.*\| (?:ring|upstream).*$"
        )

    def tearDown(self):
        torch._dynamo.reset()

    @parameterized.expand([("mistral",), ("gemma3_text",), ("llama4_text",), ("gpt_oss",), ("cohere2",), ("gemma2",)])
    def test_row(self, model_type):
        if model_type != "mistral" and os.environ.get("RUN_SLOW", "").lower() not in ("1", "true", "yes"):
            self.skipTest("test is slow (RUN_SLOW=1 runs it)")
        import transformers

        if transformers.__version__ != "5.24.0":
            self.skipTest("the table is of transformers 5.24.0")
        row = self.sweep.sweep_one(model_type)
        self.assertIn(model_type, self.rows)
        self.assertEqual(self.sweep.markdown_table([row]).strip().splitlines()[-1], self.rows[model_type])
        self.assertEqual((row.layers, row.tokens), ("ring", "same"))


class EveryTypeTableTest(unittest.TestCase):
    """
    The architecture page's table of every type compiled (`utils/sliding_sweep.py --every-type`) says what the sweep
    finds: one row in CI (`llama`: full attention, nothing new compiled for other prompt lengths in the same buckets).
    """

    @classmethod
    def setUpClass(cls):
        cls.sweep = load_sliding_sweep()
        cls.rows = architectures_page_rows("## Every architecture, compiled", r"^\| `([\w-]+)` \|.*$")

    def tearDown(self):
        torch._dynamo.reset()

    @parameterized.expand([("llama",), ("gpt2",), ("jetmoe",)])
    def test_row(self, model_type):
        if model_type != "llama" and os.environ.get("RUN_SLOW", "").lower() not in ("1", "true", "yes"):
            self.skipTest("test is slow (RUN_SLOW=1 runs it)")
        import transformers

        if transformers.__version__ != "5.24.0":
            self.skipTest("the table is of transformers 5.24.0")
        row = self.sweep.sweep_one(model_type, every_type=True)
        self.assertEqual(self.sweep.markdown_table([row]).strip().splitlines()[-1], self.rows[model_type])
        if model_type != "jetmoe":  # its experts' token counts are Python ints in the forward: graphs per routing
            self.assertEqual((row.kinds, row.tokens, "+" in row.graphs), ("full", "same", False))

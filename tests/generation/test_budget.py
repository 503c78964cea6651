# The graph budget (`call/budget.py`): how many graphs bucketed calls compile, and torch's recompile limit, which the
# budget raises for the graphs a call needs (shared by models whose forwards are one code object), puts back after
# the call, and leaves room above for a call on upstream's path.
#
# The model, the counting backend and `CompilationTestCase` are shared (`tiny_models.py`): `GraphCounter` (eager
# backend) counts graphs and compiled calls, every compile uses `dynamic=False, fullgraph=True` unless a test says
# otherwise, and `min_new_tokens == max_new_tokens`, so "compiled calls == forwards" proves no forward ran eagerly.

import contextlib
import threading
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import CompileConfig, Qwen2Config, Qwen2ForCausalLM
from transformers.testing_utils import CaptureLogger

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.buckets import BucketPolicy
from prefill_buckets.call.budget import ANY_WINDOW, decode_graphs
from prefill_buckets.testing_utils import as_new_process
from prefill_buckets.upstream import torch_api
from prefill_buckets.upstream.transformers_api import compile_on_all_devices

from .tiny_models import (
    COUNTER_BACKEND,
    MAX_NEW_TOKENS,
    CompilationTestCase,
    logger,
    make_config,
    make_model,
    make_prompt,
    make_reference,
)


# ---------------------------------------------------------------------------------------------------------------------
# How many graphs, and torch's recompile limit
# ---------------------------------------------------------------------------------------------------------------------


class GraphCountTest(CompilationTestCase):
    def test_pinned_cache_length_formula(self):
        # With `max_cache_len` pinned, every call of a batch size uses one cache shape: graphs = per batch size, the
        # buckets its prompts touched + 1 decode graph. Ascending lengths, so an unpinned cache would have grown.
        buckets = [8, 16, 32]
        policy = BucketPolicy(buckets=tuple(buckets))
        calls = [(1, 3), (1, 5), (1, 20), (1, 30), (2, 10), (2, 15)]
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(max_cache_len=64)
        plain_config = make_config(max_cache_len=64)

        touched: dict[int, set[int]] = {}
        for batch_size, length in calls:
            self.check_call(
                counter,
                lambda ids: prefill_buckets.generate(model, ids, generation_config=config, prefill_buckets=buckets),
                make_prompt(length, batch_size),
                reference,
                plain_config,
            )
            touched.setdefault(batch_size, set()).add(policy.bucket(length))
            expected = sum(len(lengths) + 1 for lengths in touched.values())
            self.assertEqual(counter.graphs, expected, f"after {(batch_size, length)}: graphs {counter.shapes}")
            self.assertEqual(model._previous_max_cache_length, 64)
        self.assertEqual(counter.graphs, (2 + 1) + (1 + 1))

    def test_more_graphs_than_recompile_limit(self):
        # 6 buckets + 1 decode graph = 7 graphs through one compiled forward, with the limit at 4: torch would run
        # forwards past the 4th graph eagerly (with `fullgraph=True` it raises instead). The limit is raised as the
        # graphs are needed, with one warning.
        torch._dynamo.config.recompile_limit = 4
        buckets = [2, 4, 8, 16, 32, 64]
        lengths = [60, 30, 13, 6, 3, 1]  # one per bucket, longest first
        self.assertEqual([BucketPolicy(buckets=tuple(buckets)).bucket(length) for length in lengths], buckets[::-1])
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(max_cache_len=128)

        with CaptureLogger(logger) as captured:
            for _ in range(2):  # the second pass compiles nothing
                for length in lengths:
                    self.check_call(
                        counter,
                        lambda ids: prefill_buckets.generate(
                            model, ids, generation_config=config, prefill_buckets=buckets
                        ),
                        make_prompt(length),
                        reference,
                        make_config(max_cache_len=128),
                    )
                self.assertEqual(counter.graphs, len(buckets) + 1, f"graphs: {counter.shapes}")
                # With no call in flight the limit is the user's again; the second pass raises it for itself, and
                # says nothing more (`fullgraph=True`: a graph torch refused would raise).
                self.assertEqual(torch._dynamo.config.recompile_limit, 4)
        self.assertEqual(counter.graphs, len(buckets) + 1, f"graphs: {counter.shapes}")
        self.assertEqual(torch._dynamo.config.recompile_limit, 4)
        self.assertEqual(captured.out.count("recompile_limit"), 1, captured.out)

    def test_returned_hidden_states_are_graphs_of_their_own(self):
        # `output_hidden_states` is another argument of every forward: graphs of its own, at the shapes a call without
        # it compiled. With the limit at that call's 2 graphs, the call asking for hidden states makes room for them.
        # (transformers' output capture takes a lock dynamo can't trace: the forward breaks its graph there, so
        # `fullgraph=True` can't compile it, and a graph torch refused would run eagerly, which the package says.)
        torch._dynamo.config.recompile_limit = 2
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False)
        prompt = make_prompt(11)
        with CaptureLogger(logger) as captured:
            for outputs in ({}, {"output_hidden_states": True}):
                config = make_config(max_cache_len=64, return_dict_in_generate=True, **outputs)
                got = prefill_buckets.generate(model, prompt, generation_config=config, prefill_buckets=[16])
                expected = reference.generate(prompt, generation_config=config)
                torch.testing.assert_close(got.sequences, expected.sequences, rtol=0, atol=0)
                for step, (mine, theirs) in enumerate(zip(got.hidden_states or (), expected.hidden_states or ())):
                    torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5, msg=f"step {step}")
        self.assertIn("Raised the limit", captured.out)
        # Compiled without `fullgraph=True`: room for the frames its graph breaks start, said with the limit.
        self.assertIn("more while its calls run: a forward compiled without `fullgraph=True`", captured.out)
        self.assertNotIn("may have run some of its forwards eagerly", captured.out)
        self.assertEqual(torch._dynamo.config.recompile_limit, 2)  # the user's again

    def test_a_prompt_given_as_embeddings_is_a_prefill_graph_of_its_own(self):
        # `inputs_embeds` is another input of the prefill forward than `input_ids`: a graph of its own at a bucket ids
        # compiled already. With the limit at the ids calls' 3 graphs (prefill 16, prefill 32, decode), the embeddings
        # call makes room for its prefill graph and runs it compiled (with `fullgraph=True`, a graph torch refused
        # would raise `FailOnRecompileLimitHit`).
        torch._dynamo.config.recompile_limit = 3
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(max_cache_len=64)
        embeds = reference.get_input_embeddings()(make_prompt(11)).detach()
        with CaptureLogger(logger) as captured:
            for inputs in ({"input_ids": make_prompt(11)}, {"input_ids": make_prompt(20)}, {"inputs_embeds": embeds}):
                got = prefill_buckets.generate(model, **inputs, generation_config=config, prefill_buckets=[16, 32])
                expected = reference.generate(**inputs, generation_config=config)
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
        self.assertEqual(counter.graphs, 4, counter.shapes)  # prefill 16 and 32 from ids, 16 from embeddings, decode
        # `fullgraph=True`: no room for frames of graph breaks (`test_returned_hidden_states_are_graphs_of_their_own`).
        self.assertIn("Raised the limit to 6. To need fewer graphs", captured.out)
        self.assertEqual(torch._dynamo.config.recompile_limit, 3)  # the user's again

    @parameterized.expand([("inference_mode",), ("autocast",), ("threads",)])
    def test_calls_in_another_state_of_torch_are_graphs_of_their_own(self, change):
        # dynamo guards every graph on torch's global state (autocast, threads, default dtype, ...) and on
        # `torch.inference_mode()` (the parameters' dispatch keys; a call's cache is made of tensors of its own mode,
        # `kvcache.sizing`): a call in another state compiles its own graphs at shapes compiled already. With the limit
        # at the first call's 2 graphs (prefill 16, decode), the call in the other state makes room for its 2 (with
        # `fullgraph=True`, a graph torch refused would raise), and later calls in either state compile nothing.
        self.enterContext(as_new_process())
        torch._dynamo.config.recompile_limit = 2

        @contextlib.contextmanager
        def other_threads():
            threads = torch.get_num_threads()
            torch.set_num_threads(2 if threads == 1 else 1)
            try:
                yield
            finally:
                torch.set_num_threads(threads)

        states = {
            "inference_mode": torch.inference_mode,
            "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
            "threads": other_threads,
        }
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(max_cache_len=64)
        with CaptureLogger(logger) as captured:
            for length, other_state in ((11, False), (9, True), (13, False), (6, True)):
                with states[change]() if other_state else contextlib.nullcontext():
                    got = prefill_buckets.generate(
                        model, make_prompt(length), generation_config=config, prefill_buckets=[16]
                    )
                    expected = reference.generate(make_prompt(length), generation_config=config)
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
        self.assertEqual(counter.graphs, 4, counter.shapes)
        self.assertIn("Raised the limit to 4. To need fewer graphs", captured.out)
        self.assertNotIn("may have run some of its forwards eagerly", captured.out)
        self.assertEqual(torch._dynamo.config.recompile_limit, 2)  # the user's again


class UpstreamCallAfterBucketedCallsTest(CompilationTestCase):
    """
    A call on upstream's path (no bucket fields, or fields it can't honor) on a forward where bucketed calls left more
    graphs than torch's limit: the package put the user's limit back after them, so the graphs it made counted
    against it, and torch compiled none of the call's new shapes: it raised, compiled with `fullgraph=True`
    (`FailOnRecompileLimitHit`), or ran them eagerly. The call gets the user's limit above those graphs.
    """

    BUCKETS = [4, 8, 12, 16, 20, 24, 28, 32]  # a prefill graph each, and a decode graph: 9, past torch's 8

    @parameterized.expand([("fullgraph", True), ("graph_breaks_allowed", False)])
    def test_it_compiles_as_upstreams_call_would(self, _, fullgraph):
        torch._dynamo.config.recompile_limit = 8  # torch's default, as in a fresh process
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=fullgraph)
        bucketed = make_config(max_cache_len=64, prefill_buckets=self.BUCKETS)
        for length in (3, 7, 11, 15, 19, 23, 27, 31):
            got = prefill_buckets.generate(model, make_prompt(length), generation_config=bucketed)
            expected = reference.generate(make_prompt(length), generation_config=make_config(max_cache_len=64))
            self.assertEqual(got.tolist(), expected.tolist(), f"bucketed, prompt {length}")
        self.assertGreater(counter.graphs, 8)
        self.assertEqual(torch._dynamo.config.recompile_limit, 8, "the user's again")
        graphs, calls = counter.graphs, counter.calls
        unbucketed = make_config(max_cache_len=64)
        no_cache = make_config(use_cache=False, prefill_buckets=self.BUCKETS)  # a row of `UNSUPPORTED`
        for config, length in ((unbucketed, 5), (unbucketed, 6), (no_cache, 9)):
            got = prefill_buckets.generate(model, make_prompt(length), generation_config=config)
            upstream = make_config(max_cache_len=64, use_cache=config.use_cache)
            expected = reference.generate(make_prompt(length), generation_config=upstream)
            self.assertEqual(got.tolist(), expected.tolist(), f"upstream's path, prompt {length}")
        # Two prefill graphs, and a graph per forward without a cache: within the user's limit of 8.
        self.assertEqual(counter.graphs - graphs, 2 + MAX_NEW_TOKENS)
        self.assertEqual(counter.calls - calls, 3 * MAX_NEW_TOKENS, "every forward ran compiled")
        self.assertEqual(torch._dynamo.config.recompile_limit, 8, "the user's again")
        if not fullgraph:  # past the user's limit, as upstream's call would be: 8 graphs of such calls, the rest eager
            got = prefill_buckets.generate(model, make_prompt(13), generation_config=no_cache)
            expected = reference.generate(make_prompt(13), generation_config=make_config(use_cache=False))
            self.assertEqual(got.tolist(), expected.tolist(), "upstream's path, prompt 13")
            self.assertEqual(counter.graphs - graphs, 8)

    def test_a_forward_called_directly_counts_them(self):
        # The Messages page's row (messages.md): outside `generate` the package can't make room, so a forward called
        # directly runs under the user's limit with the bucketed graphs counted; raised by those graphs, it compiles.
        torch._dynamo.config.recompile_limit = 2
        model = make_model()
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        bucketed = make_config(max_cache_len=64, prefill_buckets=[4, 8])
        for length in (3, 7):
            prefill_buckets.generate(model, make_prompt(length), generation_config=bucketed)
        self.assertEqual((counter.graphs, torch._dynamo.config.recompile_limit), (3, 2))
        with torch.no_grad():
            with self.assertRaises(torch._dynamo.exc.FailOnRecompileLimitHit):
                model(make_prompt(9))
            torch._dynamo.config.recompile_limit += counter.graphs
            model(make_prompt(9))
        self.assertEqual(counter.graphs, 4)

    def test_a_forward_generate_compiles(self):
        # With `compile_config` upstream compiles decode itself (`fullgraph=True`, its default): a new cache length is
        # a new decode graph, and bucketed calls' graphs are on the same code objects.
        torch._dynamo.config.recompile_limit = 8
        model = make_model()
        reference = make_reference(model)
        counter = self.registered_counter()
        compile_config = CompileConfig(backend=COUNTER_BACKEND, fullgraph=True, dynamic=False, mode=None)
        compile_on_all_devices(compile_config)  # upstream compiles on CUDA only, and bucketed calls everywhere
        bucketed = make_config(max_cache_len=64, compile_config=compile_config, prefill_buckets=self.BUCKETS)
        for length in (3, 7, 11, 15, 19, 23, 27, 31):
            prefill_buckets.generate(model, make_prompt(length), generation_config=bucketed)
        self.assertGreater(counter.graphs, 8)
        graphs = counter.graphs
        for length in (70, 100, 130):  # each a cache longer than the last: a decode graph each
            config = make_config(compile_config=compile_config)
            got = prefill_buckets.generate(model, make_prompt(length), generation_config=config)
            expected = reference.generate(make_prompt(length), generation_config=make_config())
            self.assertEqual(got.tolist(), expected.tolist(), f"upstream's path, prompt {length}")
        self.assertEqual(counter.graphs - graphs, 3)
        self.assertEqual(torch._dynamo.config.recompile_limit, 8, "the user's again")


class SharedRecompileLimitTest(CompilationTestCase):
    """
    torch's recompile limit counts graphs per code object, and transformers' decorators make most classes' `forward`
    one code object (`wrapped_func` in `transformers/utils/deprecation.py`): models compiled in one process share one
    limit. Issue 27: a second model got 2 graphs, then ran its other buckets eagerly without a word.
    """

    BUCKETS = [4, 8, 16]
    LENGTHS = [13, 6, 3]  # one per bucket

    def setUp(self):
        super().setUp()  # restores the limit after the test
        # torch's default, as in a fresh process: bucketed calls of earlier tests raised the process-wide limit.
        torch._dynamo.config.recompile_limit = 8

    def three_models(self):
        torch.manual_seed(0)
        qwen = Qwen2ForCausalLM(Qwen2Config(**make_model().config.to_diff_dict())).eval()
        models = [make_model(), make_model(), qwen]
        with torch.no_grad():  # two Llamas with different weights
            models[1].lm_head.weight.mul_(-1)
        forward_codes = {type(model).forward.__code__ for model in models}
        self.assertEqual(len(forward_codes), 1, "the premise: every model's forward is one code object")
        return models

    def test_three_models_of_two_classes_compile_every_forward(self):
        # 3 models x (3 prefill + 1 decode) graphs = 12 on one code object, with torch's limit at 8.
        self.assertEqual(torch._dynamo.config.recompile_limit, 8)
        per_model = len(self.BUCKETS) + 1
        config = make_config(max_cache_len=128, prefill_buckets=self.BUCKETS)
        for model in self.three_models():
            reference = make_reference(model)
            counter = GraphCounter()
            model.compile(backend=counter, dynamic=False)  # not fullgraph: past the limit torch runs eagerly
            compiled = prefill_buckets.precompile(model, config, progress=False)
            self.assertEqual(sum(shape.graphs for shape in compiled), counter.graphs, type(model).__name__)
            self.assertEqual(counter.graphs, per_model, f"{type(model).__name__}: {counter.shapes}")
            # Every forward a compiled call, and upstream's tokens.
            self.check_lengths_compile_nothing(counter, model, reference, config, self.LENGTHS)
        # Each call raised the limit for the graphs it needed (3 models' on one code object); none is in flight now.
        self.assertEqual(torch._dynamo.config.recompile_limit, 8)

    def test_forwards_torch_runs_eagerly_are_said(self):
        # As if the budget had missed graphs (it leaves the limit at 8): the third model's calls pass torch's limit,
        # and each call whose forwards may have run eagerly says so, naming the model and the shapes.
        config = make_config(max_cache_len=128, prefill_buckets=self.BUCKETS)
        counters = []
        with mock.patch("prefill_buckets.call.budget.make_room"), CaptureLogger(logger) as captured:
            for model in self.three_models():
                counters.append(GraphCounter())
                model.compile(backend=counters[-1], dynamic=False)
                for length in self.LENGTHS:
                    prefill_buckets.generate(model, make_prompt(length), generation_config=config)
        forwards = MAX_NEW_TOKENS * len(self.LENGTHS)
        self.assertEqual([counter.calls for counter in counters[:2]], [forwards, forwards])
        self.assertLess(counters[2].calls, forwards)  # the premise: torch ran some forwards eagerly
        self.assertIn("The compiled forward of `Qwen2ForCausalLM` holds 8 graphs", captured.out)
        self.assertIn("(torch refused to compile past it once during the call)", captured.out)
        self.assertIn("may have run some of its forwards eagerly", captured.out)
        self.assertIn("prefill [1, 4] with a 128-slot cache", captured.out)

    def test_a_call_that_overlaps_another_is_not_said_to_run_eagerly(self):
        # Two threads: call A is accounted for (bucket 16: prefill and decode, within the limit of 3) and pauses after
        # its prefill, while call B (bucket 32) runs whole and raises the limit for both. A's forward then holds B's
        # graphs too, at A's limit: graphs another call predicted, not refused ones, so nothing is said of eager
        # forwards (every forward ran compiled).
        self.enterContext(as_new_process())
        torch._dynamo.config.recompile_limit = 3
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(max_cache_len=64, prefill_buckets=[16, 32])
        prefilled, release = threading.Event(), threading.Event()

        class PausingStreamer:
            puts = 0

            def put(self, value):
                self.puts += 1
                if self.puts == 2:  # the first new token: A's prefill ran
                    prefilled.set()
                    release.wait(timeout=120)

            def end(self):
                pass

        results = {}

        def call_a():
            torch._dynamo.config.recompile_limit = 3  # torch >= 2.13 keeps the config per thread
            results[11] = prefill_buckets.generate(
                model, make_prompt(11), generation_config=config, streamer=PausingStreamer()
            )
            results["a's limit after"] = torch._dynamo.config.recompile_limit

        with CaptureLogger(logger) as captured:
            thread = threading.Thread(target=call_a)
            thread.start()
            self.assertTrue(prefilled.wait(timeout=120))
            results[20] = prefill_buckets.generate(model, make_prompt(20), generation_config=config)
            release.set()
            thread.join(timeout=120)
        for length in (11, 20):
            expected = reference.generate(make_prompt(length), generation_config=make_config(max_cache_len=64))
            torch.testing.assert_close(results[length], expected, rtol=0, atol=0)
        # Each thread's limit is its user's again once its calls are done, whichever call ended last.
        self.assertEqual((results["a's limit after"], torch._dynamo.config.recompile_limit), (3, 3))
        self.assertEqual(counter.graphs, 3, counter.shapes)  # prefill 16 and 32, decode
        self.assertEqual(counter.calls, 2 * MAX_NEW_TOKENS, "every forward ran compiled")
        self.assertIn("Raised the limit", captured.out)  # the premise: B needed more than the limit A ran under
        self.assertNotIn("may have run some of its forwards eagerly", captured.out)

    def test_a_limit_raised_in_a_thread_is_said_to_be_the_threads(self):
        # From torch 2.13 dynamo's config is per thread (`torch_api.DYNAMO_CONFIG_PER_THREAD`): a limit set in the main
        # thread is not a worker's. The raise warning of a call in a worker thread says whose limit it raised.
        self.enterContext(as_new_process())
        torch._dynamo.config.recompile_limit = 1
        seen = {}
        worker = threading.Thread(target=lambda: seen.setdefault("limit", torch._dynamo.config.recompile_limit))
        worker.start()
        worker.join(timeout=60)
        self.assertEqual(seen["limit"] != 1, torch_api.DYNAMO_CONFIG_PER_THREAD)  # the torch fact the probe reads

        model = make_model()
        model.compile(backend=GraphCounter(), dynamic=False, fullgraph=True)
        config = make_config(max_cache_len=64, prefill_buckets=[16])

        def call():
            torch._dynamo.config.recompile_limit = 1  # the worker's own (global before torch 2.13)
            prefill_buckets.generate(model, make_prompt(11), generation_config=config)

        with CaptureLogger(logger) as captured:
            worker = threading.Thread(target=call)
            worker.start()
            worker.join(timeout=120)
        self.assertIn("Raised the limit to 2", captured.out)
        said = "recompile_limit` (1 in this thread: from torch 2.13 each thread has its own" in captured.out
        self.assertEqual(said, torch_api.DYNAMO_CONFIG_PER_THREAD, captured.out)

    def test_a_code_object_past_the_limit_compiles_nothing_new_for_good(self):
        # The torch fact the room below exists for (and the docs state): once a frame passes the limit, torch runs
        # that code object's new shapes eagerly from then on, even after the limit is raised.
        def double(x):
            return x * 2

        counter = GraphCounter()
        compiled = torch.compile(double, backend=counter, dynamic=False)
        torch._dynamo.config.recompile_limit = 1
        compiled(torch.ones(1))
        compiled(torch.ones(2))  # past the limit: eager
        torch._dynamo.config.recompile_limit = 8
        compiled(torch.ones(3))
        self.assertEqual(counter.graphs, 1, counter.shapes)

    def test_a_forward_that_breaks_its_graph_leaves_room_for_its_frames(self):
        # Compiled without `fullgraph=True`, a forward that breaks its graph (`output_hidden_states`: transformers'
        # capture lock) resumes in frames of its own, and those that start in a decorated function (`wrapped_func`
        # around `create_causal_mask`) are entries on the forward's code object: torch's limit counts them, and the
        # budget can't predict them. With the limit at exactly the graphs predicted, the frame past it made torch mark
        # the code object run-only for good: a later model's new shapes then ran eagerly (with `fullgraph=True`,
        # "found no compiled frames"). A call whose forward may break its graph runs with room for such frames.
        config = make_config(max_cache_len=128, prefill_buckets=self.BUCKETS)
        first, breaking, last = self.three_models()
        first.compile(backend=GraphCounter(), dynamic=False, fullgraph=True)
        for length in self.LENGTHS:  # 3 prefill graphs and 1 decode graph
            prefill_buckets.generate(first, make_prompt(length), generation_config=config)
        torch._dynamo.config.recompile_limit = 6  # and 2 for the next call: the graphs predicted, nothing more
        reference = make_reference(breaking)
        breaking.compile(backend=GraphCounter(), dynamic=False)
        hidden = make_config(max_cache_len=128, return_dict_in_generate=True, output_hidden_states=True)
        got = prefill_buckets.generate(breaking, make_prompt(13), generation_config=hidden, prefill_buckets=[16])
        expected = reference.generate(make_prompt(13), generation_config=hidden)
        torch.testing.assert_close(got.sequences, expected.sequences, rtol=0, atol=0)
        self.assertEqual(torch._dynamo.config.recompile_limit, 6)  # the user's again
        # The last model's new shapes compile (every forward a compiled call), and give upstream's tokens.
        counter = GraphCounter()
        last.compile(backend=counter, dynamic=False, fullgraph=True)
        reference = make_reference(last)
        for length in self.LENGTHS:
            self.check_call(
                counter,
                lambda ids: prefill_buckets.generate(last, ids, generation_config=config),
                make_prompt(length),
                reference,
                make_config(),
            )
        self.assertEqual(counter.graphs, len(self.BUCKETS) + 1, counter.shapes)

    def test_frames_that_fill_the_limit_exactly_are_not_said_to_run_eagerly(self):
        # `output_attentions` on sdpa breaks the forward's graph (transformers warns from inside it): its 2 predicted
        # graphs, shape-generic (`dynamic=None`), and the room for frames (8, torch's limit) fill the raised limit of
        # 10 exactly. Torch refused no compile, so every forward ran compiled: nothing is said of eager forwards,
        # though the forward's code is at the limit with more graphs than predicted.
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter)
        config = make_config(return_dict_in_generate=True, output_attentions=True, prefill_buckets="pow2-quarters")
        refused = torch_api.limit_refusals()
        with CaptureLogger(logger) as captured:
            got = prefill_buckets.generate(model, make_prompt(9), generation_config=config)
        expected = reference.generate(make_prompt(9), generation_config=config)
        torch.testing.assert_close(got.sequences, expected.sequences, rtol=0, atol=0)
        self.assertEqual(torch_api.limit_refusals(), refused, "the premise: torch refused no compile")
        self.assertGreater(torch_api.forward_graphs(model), 2, "the premise: graph breaks added entries")
        self.assertNotIn("may have run some of its forwards eagerly", captured.out)


# ---------------------------------------------------------------------------------------------------------------------
# The decode graphs a call's windows compile (`decode_graphs`); test_compiled_calls counts them on real graphs
# ---------------------------------------------------------------------------------------------------------------------


class DecodeGraphsTest(unittest.TestCase):
    def test_static_shapes_compile_a_graph_per_window(self):
        self.assertEqual(decode_graphs(set(), {256, 512, 1024}, 1024, generic=False), [1024, 256, 512])
        self.assertEqual(decode_graphs({256}, {256, 512}, 1024, generic=False), [512])

    def test_generic_windows_share_a_graph(self):
        # The window is marked symbolic: one graph reads every window.
        self.assertEqual(decode_graphs(set(), {512, 256, 768}, 2048, generic=True), [ANY_WINDOW])
        self.assertEqual(decode_graphs({256}, {512, 1024}, 2048, generic=True), [])

    def test_generic_window_of_the_whole_cache_is_its_own(self):
        # Torch may specialize a length equal to the cache's: its own graph, besides the others.
        self.assertEqual(decode_graphs(set(), {256, 512}, 512, generic=True), [512, ANY_WINDOW])
        self.assertEqual(decode_graphs({512}, {256, 512}, 512, generic=True), [ANY_WINDOW])
        self.assertEqual(decode_graphs({256}, {384, 512}, 512, generic=True), [512])

    def test_no_windows(self):
        self.assertEqual(decode_graphs(set(), {None}, 64, generic=True), [None])
        self.assertEqual(decode_graphs({None}, {None}, 64, generic=True), [])


if __name__ == "__main__":
    unittest.main()

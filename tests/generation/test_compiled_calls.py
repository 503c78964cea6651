# The compiled forward as bucketed calls run it (`compile/compiled_calls.py`): compiled with any `dynamic` but `False`,
# a bucketed prefill is one graph symbolic in the prompt length for every bucket (`mark_prefill_dynamic`, the window
# of its own tokens: `windows.QUERY_WINDOW`), and decode one graph symbolic in the window for every window
# (`mark_window_dynamic`, `budget.decode_graphs`); compiled with `dynamic=False`, each bucket and each window is a
# static graph of its own, as asked.
#
# Counts are real compiled graphs and compiled calls (`GraphCounter`, eager backend, `fullgraph=True`: a forward is
# one compiled graph or an error), and every output is compared with an unpadded, uncompiled run of the same weights.
#
# Below, every way of compiling a model (`model.compile()`, a compiled `forward`, `compile_config`, the
# `torch.compile(model)` wrapper, real inductor), as the call path reads it (`compiled_forward`, `call_compilation`,
# `compiled_wrapper_forward`, `forward_compiled_with_fullgraph`), on the compile tests' shared model.

import threading
import unittest

import torch
from parameterized import parameterized
from transformers import (
    CompileConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
)
from transformers.generation.streamers import BaseStreamer
from transformers.testing_utils import CaptureLogger, slow

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.call.budget import budget_of
from prefill_buckets.compile.compiled_calls import forward_compiled_with_fullgraph
from prefill_buckets.kvcache.windows import window_length

from .tiny_models import (
    BOS,
    BUCKETS,
    COUNTER_BACKEND,
    EOS,
    MAX_NEW_TOKENS,
    PAD,
    VOCAB,
    CompilationTestCase,
    logger,
    make_config,
    make_model,
    make_prompt,
    make_reference,
    prefill_lengths,
    random_ids,
    tiny_llama,
)


CONFIG = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "max_position_embeddings": 2048,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "attn_implementation": "sdpa",
}
NEW_TOKENS = 4
# Buckets of "pow2-quarters" from 8 to 320 (and windows of 256 and 512 slots): 11 prefill shapes.
LENGTHS = [5, 11, 23, 40, 57, 100, 130, 200, 250, 300]
SLOTS = 1024  # max_cache_len: one cache for every call


class SymbolicLength(LlamaForCausalLM):
    """A Llama whose forward reads its prompt length as a Python int: a graph can't keep it symbolic."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        if input_ids is not None:
            for _ in range(input_ids.shape[1]):  # a loop over the length: a graph is traced for one length
                pass
        return super().forward(input_ids, attention_mask, position_ids, past_key_values, **kwargs)


def model_and_reference(model_class=LlamaForCausalLM):
    torch.manual_seed(0)
    model = model_class(LlamaConfig(**CONFIG)).eval()
    reference = LlamaForCausalLM(model.config).eval()
    reference.load_state_dict(model.state_dict())
    return model, reference


def prompt(length: int) -> torch.Tensor:
    return torch.randint(3, CONFIG["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))


def config(**fields) -> GenerationConfig:
    return GenerationConfig(
        cache_implementation="static",
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        max_cache_len=SLOTS,
        **fields,
    )


class GenericPrefillTest(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        prefill_buckets.enable()
        self.addCleanup(prefill_buckets.disable)
        self.addCleanup(torch._dynamo.reset)

    def run_lengths(self, model, reference, dynamic, side="auto"):
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=dynamic, fullgraph=True)
        bucketed = config(prefill_buckets="pow2-quarters", prefill_padding_side=side)
        for length in LENGTHS:
            ids = prompt(length)
            mask = torch.ones_like(ids)
            calls = counter.calls
            out = model.generate(ids, attention_mask=mask, generation_config=bucketed)
            expected = reference.generate(ids, attention_mask=mask, generation_config=config())
            torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"prompt of {length} tokens")
            self.assertEqual(counter.calls - calls, NEW_TOKENS, f"a forward of the {length}-token call ran eagerly")
        return counter

    @parameterized.expand([("left",), ("right",)])
    def test_one_prefill_graph_for_every_bucket(self, side):
        model, reference = model_and_reference()
        counter = self.run_lengths(model, reference, dynamic=None, side=side)
        # One prefill graph, and one decode graph symbolic in the window for the windows of 256 and 512 slots.
        windows = {window_length(length + 1, SLOTS) for length in (8, 320)}  # the first and last buckets'
        self.assertEqual(len(windows), 2)
        self.assertEqual(counter.graphs, 2, counter.shapes)

    @parameterized.expand(
        [
            ("windows_inside_the_cache", 2048, (100, 300, 600), 4, 2, (2,)),
            ("windows_up_to_the_cache", 512, (200,), 300, 2, (2,)),
        ]
    )
    def test_decode_windows_share_a_graph(self, _, slots, lengths, new_tokens, limit, graphs):
        # Decode reads windows of 256, 512 and 768 slots (one per call): one graph symbolic in the window, besides the
        # prefill's. Or 256 and 511 of a 512-slot cache (in one call): a window stops a slot short of the cache while
        # one is free, so no window is the whole cache, a length inductor specializes (on SmolLM2), and the budget
        # counts no graph for it. With torch's limit at what the budget counts it needs no room (no warning), and every
        # forward runs compiled (`fullgraph=True` would raise past the limit).
        model, reference = model_and_reference()
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=None, fullgraph=True)
        torch._dynamo.config.recompile_limit, user_limit = limit, torch._dynamo.config.recompile_limit
        self.addCleanup(setattr, torch._dynamo.config, "recompile_limit", user_limit)
        fields = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "max_cache_len": slots}
        with CaptureLogger(logger) as logs:
            for length in lengths:
                ids = prompt(length)
                mask = torch.ones_like(ids)
                calls = counter.calls
                bucketed = config(prefill_buckets="pow2-quarters")
                bucketed.update(**fields)
                plain = config()
                plain.update(**fields)
                out = model.generate(ids, attention_mask=mask, generation_config=bucketed)
                expected = reference.generate(ids, attention_mask=mask, generation_config=plain)
                torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=f"prompt of {length} tokens")
                self.assertEqual(
                    counter.calls - calls, new_tokens, f"a forward of the {length}-token call ran eagerly"
                )
        self.assertIn(counter.graphs, graphs, counter.shapes)
        self.assertNotIn("recompile_limit", logs.out)

    def test_static_shapes_compile_a_graph_per_bucket(self):
        # `dynamic=False`, as asked: each bucket is its own prefill graph (10 lengths, 10 buckets).
        model, reference = model_and_reference()
        counter = self.run_lengths(model, reference, dynamic=False, side="left")
        self.assertEqual(counter.graphs, len(LENGTHS) + 2, counter.shapes)

    def test_the_tensors_passed_in_are_not_marked(self):
        model, _ = model_and_reference()
        model.compile(backend=GraphCounter(), dynamic=None, fullgraph=True)
        ids = prompt(16)  # an exact fit: its ids reach the forward as they are
        mask = torch.ones_like(ids)
        model.generate(ids, attention_mask=mask, generation_config=config(prefill_buckets=[16, 64]))
        for tensor in (ids, mask):
            self.assertFalse(hasattr(tensor, "_dynamo_weak_dynamic_indices"))
            self.assertFalse(hasattr(tensor, "_dynamo_dynamic_indices"))

    def test_a_prefill_the_model_specializes_is_counted_per_bucket(self):
        # The model's code fixes the length: every bucket compiles, the budget learns it after the second call, and no
        # forward runs eagerly past torch's limit (`fullgraph=True` would raise).
        model, reference = model_and_reference(SymbolicLength)
        torch._dynamo.config.recompile_limit, limit = 4, torch._dynamo.config.recompile_limit
        self.addCleanup(setattr, torch._dynamo.config, "recompile_limit", limit)
        with self.assertLogs("prefill_buckets", level="INFO") as logs:
            counter = self.run_lengths(model, reference, dynamic=None, side="left")
        self.assertTrue(budget_of(model).prefill_specializes)
        # A prefill graph per bucket, and one decode graph for the windows of 256 and 512 slots.
        self.assertEqual(counter.graphs, len(LENGTHS) + 1, counter.shapes)
        self.assertTrue(any("compiled a graph per prompt length" in line for line in logs.output), logs.output)


# ---------------------------------------------------------------------------------------------------------------------
# Every compile entry point (the compile tests' model and counting backend, `tiny_models.CompilationTestCase`):
# bucketed `generate` runs through compiled graphs, a bounded number of them, with the tokens of an uncompiled,
# unbucketed run
# ---------------------------------------------------------------------------------------------------------------------


class CompileEntryPointTest(CompilationTestCase):
    def test_model_compile(self):
        # In place, called the patched way: `enable()`, then `model.generate` with the field on the config.
        self.enable()
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = make_config(prefill_buckets=BUCKETS)

        def generate(ids, **kwargs):
            return model.generate(ids, generation_config=config, **kwargs)

        self.check_lengths(counter, generate, reference, make_config(), model)

    def test_compiled_forward(self):
        # A compiled `forward`, called without patching: `prefill_buckets.generate` with the field as a kwarg.
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.forward = torch.compile(model.forward, backend=counter, dynamic=False, fullgraph=True)
        config = make_config()

        def generate(ids, **kwargs):
            return prefill_buckets.generate(model, ids, generation_config=config, prefill_buckets=BUCKETS, **kwargs)

        self.check_lengths(counter, generate, reference, make_config(), model)

    def test_whether_a_forward_was_compiled_with_fullgraph_is_read(self):
        # Without `fullgraph=True`, a bucketed call runs with room for the frames graph breaks start (`budget.py`):
        # read from torch's compiled function, whichever way the user compiled the forward.
        for fullgraph in (True, False):
            model = make_model()
            model.compile(backend=GraphCounter(), dynamic=False, fullgraph=fullgraph)
            self.assertIs(forward_compiled_with_fullgraph(model), fullgraph, "model.compile()")
            model = make_model()
            model.forward = torch.compile(model.forward, backend=GraphCounter(), dynamic=False, fullgraph=fullgraph)
            self.assertIs(forward_compiled_with_fullgraph(model), fullgraph, "torch.compile(model.forward)")
        self.assertFalse(forward_compiled_with_fullgraph(make_model()))

    def test_compile_config(self):
        # Upstream's auto-compile (`compile_config` + static cache) runs prefill eagerly and compiles decode only.
        # With buckets, prefill runs through the same compiled call (one chunk of the padded prompt): every forward.
        self.enable()
        model = make_model()
        reference = make_reference(model)
        counter = self.registered_counter()
        compile_config = CompileConfig(backend=COUNTER_BACKEND, fullgraph=True, dynamic=False, mode=None)
        config = make_config(prefill_buckets=BUCKETS, compile_config=compile_config)

        def generate(ids, **kwargs):
            return model.generate(ids, generation_config=config, **kwargs)

        self.check_lengths(counter, generate, reference, make_config(), model)
        # The CPU opt-in is made on `generate`'s own copy of the config, never on the user's.
        self.assertIsNone(compile_config._compile_all_devices)
        self.assertIsNone(config.prefill_chunk_size)

    def test_compile_config_keeps_recompile_limit(self):
        # A bucketed call with `compile_config` prefills in one chunk; transformers < 5.23 sets the recompile limit
        # to 64 before every chunked prefill, which must not lower a limit the user (or this package) set.
        torch._dynamo.config.recompile_limit = 100
        model = make_model()
        self.registered_counter()
        compile_config = CompileConfig(backend=COUNTER_BACKEND, fullgraph=True, dynamic=False, mode=None)
        config = make_config(prefill_buckets=BUCKETS, compile_config=compile_config)
        prefill_buckets.generate(model, make_prompt(5), generation_config=config)
        self.assertEqual(torch._dynamo.config.recompile_limit, 100)

    def test_compile_config_without_buckets(self):
        # The contrast, upstream unchanged. On CPU upstream honours `compile_config` only with the private
        # `_compile_all_devices=True` (else only on CUDA/XPU/...): without it, nothing runs compiled at all; with it,
        # decode runs compiled and prefill eagerly: `MAX_NEW_TOKENS - 1` compiled calls per call.
        self.enable()
        model = make_model()
        reference = make_reference(model)
        counter = self.registered_counter()
        for compile_all_devices, expected_calls in ((None, 0), (True, MAX_NEW_TOKENS - 1)):
            compile_config = CompileConfig(backend=COUNTER_BACKEND, fullgraph=True, dynamic=False, mode=None)
            compile_config._compile_all_devices = compile_all_devices
            config = make_config(compile_config=compile_config)
            for length in (16, 9):
                self.check_call(
                    counter,
                    lambda ids: model.generate(ids, generation_config=config),
                    make_prompt(length),
                    reference,
                    make_config(),
                    expected_calls=expected_calls,
                )
        self.assertEqual(prefill_lengths(counter), [], "upstream compiled a prefill graph")

    def test_compile_config_on_a_cache_of_recurrent_layers(self):
        # Prefill goes through the compiled call as upstream's chunked prefill, which reads the cache's length: a cache
        # of only recurrent layers (Mamba-2) can't tell it before transformers 5.25, and the call raised there
        # (`get_seq_length` can only be called on Attention layers). Such a cache keeps prefill eager, as upstream does.
        config = Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=8, head_dim=8, n_groups=8, state_size=2,
            conv_kernel=4, chunk_size=8, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        )  # fmt: skip
        torch.manual_seed(0)
        model = Mamba2ForCausalLM(config).eval()
        counter = self.registered_counter()
        compile_config = CompileConfig(backend=COUNTER_BACKEND, fullgraph=True, dynamic=False, mode=None)
        for length in (5, 9):
            prompt = make_prompt(length)
            expected = model.generate(prompt, generation_config=make_config())
            config = make_config(prefill_buckets=BUCKETS, compile_config=compile_config)
            self.assertEqual(
                prefill_buckets.generate(model, prompt, generation_config=config).tolist(), expected.tolist()
            )
        self.assertGreaterEqual(counter.calls, 2 * (MAX_NEW_TOKENS - 1), "decode ran compiled")

    def test_compiled_wrapper(self):
        # `torch.compile(model)` returns an `OptimizedModule` whose `generate` is the wrapped module's: upstream runs
        # every forward of it eagerly. With buckets the call goes through the wrapper's compiled forward, called
        # either way: `wrapper.generate` after `enable()`, or `prefill_buckets.generate(wrapper, ...)` without it.
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        wrapper = torch.compile(model, backend=counter, dynamic=False, fullgraph=True)
        plain_config = make_config()

        # Enabled: `wrapper.generate`. Bucketed first, while the `OptimizedModule` warning has not been logged yet.
        self.enable()
        bucketed_config = make_config(prefill_buckets=BUCKETS)
        with CaptureLogger(logger) as captured:
            self.check_lengths(
                counter,
                lambda ids: wrapper.generate(ids, generation_config=bucketed_config),
                reference,
                plain_config,
                model,
            )
        self.assertNotIn("OptimizedModule", captured.out)
        self.assertIsNone(model._compiled_call_impl, "the compiled call stayed on the module after the call")
        self.check_unbucketed_wrapper(
            counter, lambda ids: wrapper.generate(ids, generation_config=plain_config), reference, warns=True
        )

        # Not enabled: `prefill_buckets.generate(wrapper, ...)`. The wrapper keeps its compiled call, so the graphs
        # compiled above serve these calls too (bucket 32, at the cache length 64 the model now has).
        prefill_buckets.disable()
        logger.warning_once.cache_clear()
        graphs = counter.graphs
        with CaptureLogger(logger) as captured:
            for length in (32, 17, 30):
                self.check_call(
                    counter,
                    lambda ids: prefill_buckets.generate(
                        wrapper, ids, generation_config=plain_config, prefill_buckets=BUCKETS
                    ),
                    make_prompt(length, seed=1),
                    reference,
                    plain_config,
                )
        self.assertEqual(captured.out, "")
        self.assertEqual(counter.graphs, graphs, f"graphs: {counter.shapes}")
        self.check_unbucketed_wrapper(
            counter,
            lambda ids: prefill_buckets.generate(wrapper, ids, generation_config=plain_config),
            reference,
            warns=True,
        )
        # ... while upstream's own `wrapper.generate` compiles nothing, and says nothing.
        self.check_unbucketed_wrapper(
            counter, lambda ids: wrapper.generate(ids, generation_config=plain_config), reference, warns=False
        )

    def check_unbucketed_wrapper(self, counter, generate, reference, warns: bool):
        """Without buckets, the wrapper's `generate` runs eagerly (upstream behaviour): 0 compiled calls, no graph."""
        graphs = counter.graphs
        with CaptureLogger(logger) as captured:
            self.check_call(counter, generate, make_prompt(9), reference, make_config(), expected_calls=0)
        self.assertEqual(counter.graphs, graphs)
        if warns:
            self.assertIn("OptimizedModule", captured.out)
            self.assertIn("prefill_buckets", captured.out)
        else:
            self.assertEqual(captured.out, "")


# ---------------------------------------------------------------------------------------------------------------------
# Real inductor
# ---------------------------------------------------------------------------------------------------------------------


class InductorTest(CompilationTestCase):
    @slow
    def test_inductor_tokens_match_eager(self):
        # Real kernels (default inductor backend): one bucket, three lengths, the exact fit included.
        model = make_model()
        reference = make_reference(model)
        model.compile(dynamic=False)
        config = make_config()
        for length in (16, 7, 1):
            input_ids = make_prompt(length)
            output = prefill_buckets.generate(model, input_ids, generation_config=config, prefill_buckets=[16])
            expected = reference.generate(input_ids, generation_config=config)
            self.assertEqual(output.tolist(), expected.tolist(), f"prompt length {length}")


# ---------------------------------------------------------------------------------------------------------------------
# A `torch.compile(model)` wrapper shared by threads keeps every forward compiled (`compiled_wrapper_forward`)
# ---------------------------------------------------------------------------------------------------------------------


class _PausingStreamer(BaseStreamer):
    """Sets `started` at the prompt, then blocks its generation at token `pause_at` until `resume` is set."""

    def __init__(self, pause_at: int, resume: threading.Event):
        self.started = threading.Event()
        self.resume = resume
        self.pause_at = pause_at
        self.puts = 0

    def put(self, value):
        if self.puts == 0:
            self.started.set()
        if self.puts == self.pause_at:
            assert self.resume.wait(timeout=120), "the other thread never got there"
        self.puts += 1

    def end(self):
        pass


class SharedWrapperThreadsTest(unittest.TestCase):
    def test_overlapping_calls_on_one_wrapper_stay_compiled(self):
        # Two threads share one `torch.compile(model)` wrapper. A enters first; B enters while A runs, and pauses;
        # A returns; then B finishes. B's forwards after A returned must still run compiled: each forward is one
        # compiled call.
        model = tiny_llama()
        counter = GraphCounter()
        wrapper = torch.compile(model, backend=counter, dynamic=False)
        config = GenerationConfig(cache_implementation="static", do_sample=False, prefill_buckets=[16])
        outputs, errors = {}, []

        def run(name, length, new_tokens, **kwargs):
            try:
                outputs[name] = prefill_buckets.generate(
                    wrapper,
                    random_ids(length, seed=length),
                    generation_config=config,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    **kwargs,
                )
            except Exception as error:  # reported below, not lost in the thread
                errors.append(error)

        run("warm", 10, 2)  # compiles the shapes, so the threads only run graphs
        calls_before = counter.calls
        b_started, a_done = threading.Event(), threading.Event()
        streamer_a = _PausingStreamer(pause_at=1, resume=b_started)  # A waits in its call until B is in its own
        streamer_b = _PausingStreamer(pause_at=2, resume=a_done)  # B waits until A has returned
        thread_a = threading.Thread(target=run, args=("a", 10, 3), kwargs={"streamer": streamer_a})
        thread_b = threading.Thread(target=run, args=("b", 12, 6), kwargs={"streamer": streamer_b})
        thread_a.start()
        self.assertTrue(streamer_a.started.wait(timeout=120))
        thread_b.start()
        self.assertTrue(streamer_b.started.wait(timeout=120))
        b_started.set()
        thread_a.join(timeout=120)
        a_done.set()
        thread_b.join(timeout=120)
        self.assertFalse(thread_a.is_alive() or thread_b.is_alive())
        self.assertEqual(errors, [])
        self.assertEqual(counter.calls - calls_before, 3 + 6)  # every forward of both calls compiled
        for name, length, new_tokens in (("a", 10, 3), ("b", 12, 6)):
            expected = model.generate(
                random_ids(length, seed=length), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
            )
            self.assertTrue(torch.equal(outputs[name], expected), name)
        self.assertIsNone(model._compiled_call_impl)  # the last call out removed the wrapper's compiled call


if __name__ == "__main__":
    unittest.main()

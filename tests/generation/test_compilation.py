# Compilation tests: every way of compiling a model runs bucketed `generate` through compiled graphs, a bounded number
# of them, with the tokens of an uncompiled, unbucketed run.
#
# Counting: `GraphCounter` (eager backend, so a graph costs only dynamo's tracing) counts graphs and compiled calls.
# Every compile here uses `dynamic=False, fullgraph=True`, so one forward is exactly one compiled call (or an error),
# and `min_new_tokens == max_new_tokens`, so one call is exactly `MAX_NEW_TOKENS` forwards (one prefill, the rest
# decode). "compiled calls == forwards" is then the proof that no forward ran eagerly (for example past torch's
# recompile limit, where torch silently falls back to eager).

import contextlib
import random
import threading
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from torch._dynamo.backends.registry import register_backend
from transformers import (
    CompileConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)
from transformers.testing_utils import CaptureLogger, slow
from transformers.utils import logging

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.buckets import BucketPolicy
from prefill_buckets.call import generation
from prefill_buckets.compile.compiled_calls import forward_compiled_with_fullgraph
from prefill_buckets.compile.precompile import bucket_lengths
from prefill_buckets.testing_utils import as_new_process
from prefill_buckets.upstream import torch_api
from prefill_buckets.upstream.transformers_api import compile_on_all_devices


PAD, EOS, BOS = 0, 1, 2
VOCAB = 128
FIRST_PROMPT_ID = 3  # prompt ids are above pad, eos and bos, so no prompt token reads as padding
MAX_NEW_TOKENS = 4

# Two buckets, lengths in both; the exact fit of the first bucket comes first (it is the one prompt upstream would
# run without a mask, so a second prefill graph for it would show at once).
BUCKETS = [16, 32]
LENGTHS = [16, 9, 12, 5, 3, 30, 17]
# What those lengths compile, from the rules: the first static cache holds the largest bucket (`32 + MAX_NEW_TOKENS
# - 1` = 35 slots, rounded up to a multiple of 64), so every call runs at cache 64: prefill 16 @ 64, prefill 32 @ 64,
# one decode graph @ 64.
GRAPHS_FOR_LENGTHS = 3
DECODE_GRAPHS_FOR_LENGTHS = 1

logger = logging.get_logger("prefill_buckets")


# ---- a registered counting backend, for `CompileConfig` --------------------------------------------------------------
# `generate` deep-copies its `GenerationConfig`, `compile_config` included, and upstream recompiles whenever the
# (copied) `CompileConfig` differs from the last one: a backend *object* would be copied into an unequal one every
# call. A registered name compares equal. `register_backend` refuses a name twice (`AssertionError: duplicate name`),
# so the name is registered once, and its backend hands each graph to the counter of the running test.

COUNTER_BACKEND = "pb_test_counter"
_active_counter: dict[str, GraphCounter | None] = {"counter": None}


def _counting_backend(gm, example_inputs):
    counter = _active_counter["counter"]
    if counter is None:
        raise RuntimeError(f"The `{COUNTER_BACKEND}` backend was used outside a test that set its counter.")
    return counter(gm, example_inputs)


if COUNTER_BACKEND not in torch._dynamo.list_backends(exclude_tags=()):
    register_backend(name=COUNTER_BACKEND, compiler_fn=_counting_backend)


# ---- models, prompts, configs ----------------------------------------------------------------------------------------


def make_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )
    return LlamaForCausalLM(config).eval()


def make_reference(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """An uncompiled copy of `model` (same weights), run without buckets for the expected tokens."""
    reference = type(model)(model.config).eval()
    reference.load_state_dict(model.state_dict())
    return reference


def make_prompt(length: int, batch_size: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * seed + length)
    return torch.randint(FIRST_PROMPT_ID, VOCAB, (batch_size, length), generator=generator)


def make_config(max_new_tokens: int = MAX_NEW_TOKENS, **fields) -> GenerationConfig:
    """Greedy, static cache, exactly `max_new_tokens` forwards per call. Without `enable()`, the bucket fields are
    stored on the config as plain attributes, which `prefill_buckets.generate` reads all the same."""
    return GenerationConfig(
        cache_implementation="static",
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        **fields,
    )


def prefill_lengths(counter: GraphCounter) -> list[int]:
    """Sequence lengths of the prefill graphs (first input `input_ids` [B, S], S > 1), in compile order."""
    return [shapes[0][1] for shapes in counter.shapes if shapes[0][1] > 1]


def decode_graphs(counter: GraphCounter) -> int:
    return sum(1 for shapes in counter.shapes if shapes[0][1] == 1)


class CompilationTestCase(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        recompile_limit = torch._dynamo.config.recompile_limit
        self.addCleanup(setattr, torch._dynamo.config, "recompile_limit", recompile_limit)
        # `warning_once` is one `functools.lru_cache` shared by every logger (keyed on logger and message): clear it
        # so a warning an earlier test logged can be seen again here.
        logger.warning_once.cache_clear()
        self.addCleanup(logger.warning_once.cache_clear)
        _active_counter["counter"] = None
        self.addCleanup(_active_counter.__setitem__, "counter", None)

    def enable(self):
        prefill_buckets.enable()
        self.addCleanup(prefill_buckets.disable)

    def registered_counter(self) -> GraphCounter:
        """A fresh counter behind the registered backend name `COUNTER_BACKEND`."""
        counter = GraphCounter()
        _active_counter["counter"] = counter
        return counter

    def check_call(
        self,
        counter: GraphCounter,
        generate,
        input_ids: torch.Tensor,
        reference: LlamaForCausalLM,
        reference_config: GenerationConfig,
        expected_calls: int = MAX_NEW_TOKENS,
        **kwargs,
    ) -> torch.Tensor:
        """
        Runs `generate(input_ids, **kwargs)` and checks that it ran `expected_calls` compiled calls and returned the
        tokens of the reference model, uncompiled and without buckets.
        """
        calls_before = counter.calls
        output = generate(input_ids, **kwargs)
        calls = counter.calls - calls_before
        self.assertEqual(
            calls,
            expected_calls,
            f"prompt {tuple(input_ids.shape)}: {calls} compiled calls, expected {expected_calls} "
            f"({MAX_NEW_TOKENS} forwards); fewer means forwards ran eagerly. Graphs: {counter.shapes}",
        )
        self.assertEqual(tuple(output.shape), (input_ids.shape[0], input_ids.shape[1] + MAX_NEW_TOKENS))
        expected = reference.generate(input_ids, generation_config=reference_config, **kwargs)
        self.assertEqual(output.tolist(), expected.tolist(), f"prompt {tuple(input_ids.shape)}: tokens differ")
        return output

    def check_lengths(self, counter, generate, reference, reference_config, model):
        """`LENGTHS` through `generate`: every forward compiled, the tokens of the reference, `GRAPHS_FOR_LENGTHS`."""
        for length in LENGTHS:
            self.check_call(counter, generate, make_prompt(length), reference, reference_config)
        self.assertEqual(counter.graphs, GRAPHS_FOR_LENGTHS, f"graphs: {counter.shapes}")
        self.assertEqual(sorted(prefill_lengths(counter)), BUCKETS, f"graphs: {counter.shapes}")
        self.assertEqual(decode_graphs(counter), DECODE_GRAPHS_FOR_LENGTHS, f"graphs: {counter.shapes}")
        self.assertEqual(model._previous_max_cache_length, 64)
        self.assertEqual(counter.calls, MAX_NEW_TOKENS * len(LENGTHS))


# ---------------------------------------------------------------------------------------------------------------------
# 1. Every compile entry point
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
# 2. precompile
# ---------------------------------------------------------------------------------------------------------------------


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
        for length in range(1, max_prompt_length + 1):
            self.check_call(
                counter,
                lambda ids: prefill_buckets.generate(model, ids, generation_config=config),
                make_prompt(length),
                reference,
                make_config(),
            )
        self.assertEqual(counter.graphs, len(buckets) + 1, f"graphs: {counter.shapes}")

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


# ---------------------------------------------------------------------------------------------------------------------
# 3. and 4. How many graphs, and torch's recompile limit
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


class GuidanceTest(CompilationTestCase):
    """
    Classifier-free guidance (`guidance_scale`) runs the model's forward from its logits processor at every step, on
    the last token's view of the sequence (its stride is the sequence's length) with a growing cache: a forward the user
    compiled gets new graphs for those on every call, which no bucket bounds.
    """

    LENGTHS = (5, 6, 7, 9, 11)

    def guided_config(self, **fields) -> GenerationConfig:
        return make_config(guidance_scale=1.5, **fields)

    def test_a_forward_the_user_compiled_runs_upstreams_call(self):
        # Bucketed, the package raised torch's limit for graphs it had not predicted (graph breaks' room, as it reads
        # them), and every call compiled 5 more: 22 graphs after these 5 calls, against upstream's 8 and eager after.
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False)  # no fullgraph: torch runs past its limit eagerly
        config = self.guided_config(prefill_buckets=BUCKETS)
        with CaptureLogger(logging.get_logger("prefill_buckets.call.generation")) as captured:
            for length in self.LENGTHS:
                got = prefill_buckets.generate(model, make_prompt(length), generation_config=config)
                expected = reference.generate(make_prompt(length), generation_config=self.guided_config())
                self.assertEqual(got.tolist(), expected.tolist(), f"prompt {length}")
        self.assertLessEqual(counter.graphs, 8, "torch's own limit: the package raised it for the guidance's graphs")
        self.assertEqual(torch._dynamo.config.recompile_limit, 8)
        self.assertIn("are ignored for this call: classifier-free guidance (`guidance_scale=1.5`)", captured.out)
        self.assertIn("compiled with `model.compile()`", captured.out)

    def test_a_forward_upstream_compiles_is_bucketed(self):
        # With `compile_config`, the processor calls the model's eager module: every forward `generate` runs is
        # compiled, one graph per bucket, and the guidance's forwards compile nothing.
        model = make_model()
        reference = make_reference(model)
        counter = self.registered_counter()
        compile_config = CompileConfig(backend=COUNTER_BACKEND, fullgraph=True, dynamic=False, mode=None)
        config = self.guided_config(prefill_buckets=BUCKETS, compile_config=compile_config)
        for length in self.LENGTHS:
            self.check_call(
                counter,
                lambda ids: prefill_buckets.generate(model, ids, generation_config=config),
                make_prompt(length),
                reference,
                self.guided_config(),
            )
        self.assertEqual(counter.graphs, 2, counter.shapes)  # prefill 16, decode


class NoCacheTest(CompilationTestCase):
    """
    Without a cache (`use_cache=False`) every step's forward runs the whole sequence, a token longer than the last: a
    forward the user compiled gets a graph per step of every call, which no bucket bounds.
    """

    def test_a_forward_the_user_compiled_runs_upstreams_call(self):
        # Bucketed, the package took each step for a decode step on a cache and raised torch's limit for the graphs it
        # predicted, so torch compiled past its own limit (12 graphs here), and then said torch may have run forwards
        # eagerly. Upstream's call compiles up to torch's limit (8), then runs eagerly.
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False)  # no fullgraph: torch runs past its limit eagerly
        config = make_config(use_cache=False, prefill_buckets=[8, 16, 32])
        with CaptureLogger(logging.get_logger("prefill_buckets.call.generation")) as captured:
            for length in (5, 12, 20):  # 12 lengths of forwards, padded or not: more than torch's limit of 8
                got = prefill_buckets.generate(model, make_prompt(length), generation_config=config)
                expected = reference.generate(make_prompt(length), generation_config=make_config(use_cache=False))
                self.assertEqual(got.tolist(), expected.tolist(), f"prompt {length}")
        self.assertEqual(torch._dynamo.config.recompile_limit, 8)
        self.assertLessEqual(counter.graphs, 8, "torch's own limit: the package raised it")
        self.assertIn("are ignored for this call: without a cache (`use_cache=False`)", captured.out)
        self.assertIn("compiled with `model.compile()`", captured.out)

    def test_an_eager_forward_is_bucketed(self):
        # Eager, nothing compiles: the call is padded on the left (`padding_side.RULE`), exact.
        model = make_model()
        reference = make_reference(model)
        config = make_config(use_cache=False, prefill_buckets=BUCKETS)
        sides = []
        choose_side = generation.choose_side
        with mock.patch.object(generation, "choose_side", lambda call: sides.append(choose_side(call)) or sides[-1]):
            for length in (5, 9):
                got = prefill_buckets.generate(model, make_prompt(length), generation_config=config)
                expected = reference.generate(make_prompt(length), generation_config=make_config(use_cache=False))
                self.assertEqual(got.tolist(), expected.tolist(), f"prompt {length}")
        self.assertEqual([side.side for side in sides], ["left", "left"])


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
            for length in self.LENGTHS:  # every forward a compiled call, and upstream's tokens
                self.check_call(
                    counter,
                    lambda ids: prefill_buckets.generate(model, ids, generation_config=config),
                    make_prompt(length),
                    reference,
                    make_config(),
                )
            self.assertEqual(counter.graphs, per_model, f"{type(model).__name__}: {counter.shapes}")
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


# ---------------------------------------------------------------------------------------------------------------------
# 5. Warnings
# ---------------------------------------------------------------------------------------------------------------------


class CompileWarningTest(CompilationTestCase):
    """One new token per call (prefill only): the warnings are about prefill graphs, and each graph costs time."""

    def compiled_model(self):
        model = make_model()
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        return model, counter

    def generate_captured(self, model, length: int, **kwargs) -> str:
        with CaptureLogger(logger) as captured:
            prefill_buckets.generate(model, make_prompt(length), generation_config=make_config(1), **kwargs)
        return captured.out

    def test_second_prompt_length_warns_once(self):
        model, _ = self.compiled_model()
        self.assertEqual(self.generate_captured(model, 5), "")
        out = self.generate_captured(model, 9)
        lines = out.splitlines()
        self.assertEqual(len(lines), 1, out)
        self.assertIn("prefill_buckets", lines[0])
        self.assertIn("pad_to_multiple_of", lines[0])
        self.assertEqual(self.generate_captured(model, 12), "")

    @parameterized.expand(
        [
            # The setup of the test above, with buckets: several lengths, one graph, nothing to warn about.
            ("with_buckets", (5, 9, 12), {"prefill_buckets": BUCKETS}),
            # Without buckets, but one prompt length: one graph, nothing to warn about.
            ("one_prompt_length", (7, 7, 7), {}),
        ]
    )
    def test_no_warning(self, _, lengths, fields):
        model, counter = self.compiled_model()
        for length in lengths:
            self.assertEqual(self.generate_captured(model, length, **fields), "")
        self.assertEqual(counter.graphs, 1)

    # The `OptimizedModule` warning (fires without buckets, not with them) is checked in
    # `CompileEntryPointTest.test_compiled_wrapper`, on the same calls that count its compiled forwards.

    def test_prompt_longer_than_largest_bucket_warns(self):
        # A warning about the padded length, compiled or not: an uncompiled model is enough.
        model = make_model()
        reference = make_reference(model)
        input_ids = make_prompt(10)
        with CaptureLogger(logger) as captured:
            output = prefill_buckets.generate(
                model, input_ids, generation_config=make_config(), prefill_buckets=[4, 8]
            )
        self.assertIn("prefill_buckets", captured.out)
        self.assertIn("16", captured.out)  # past the largest bucket: the next multiple of it
        expected = reference.generate(input_ids, generation_config=make_config())
        self.assertEqual(output.tolist(), expected.tolist())


# ---------------------------------------------------------------------------------------------------------------------
# 6. Real inductor
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


if __name__ == "__main__":
    unittest.main()

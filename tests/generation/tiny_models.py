"""Tiny randomly initialised models built from configs, and every helper more than one test file needs: the one place
for them, so that no test file imports another's (a test file holds only what it alone uses). Never a hub download.
Imports nothing relative, so that a process a test starts can import it by name (test_aot_forward.py).

The models live in `prefill_buckets.testing_utils`, shared with the CLI and `utils/`; this module names them for the
tests, with what only the tests need, in sections (each says which test files use it):

- the compile tests' tiny Llama, their registered counting backend and `CompilationTestCase`; `PAD`, `EOS`, `BOS`,
  `VOCAB`, the ids every section here shares;
- `random_ids`, one prompt of random ids;
- the equivalence suite's models of several architectures (`MODEL_SPECS`, `get_model`), its batches
  (`random_batch_ids`, `left_padded_batch`) and `ForwardRecorder`;
- `assert_same` and `hide_user_pads`: every field of two `generate` outputs compared;
- the right-padding tests' runs (`right_padding_config`, `run`, `run_bucketed`), `SideSpy`, `first_right_turn` and
  `CompiledLlamaTestCase`;
- the config and patch tests' `tiny_llama_256_positions` and `FirstForwardLength`;
- the benchmark tests' `bench_parser` and `tiny_workload`;
- the serving tests' tiny model folder (`save_tiny_model`, `set_up_tiny_model_folder`), requests (`REQUESTS`, `ask`)
  and server helpers (`free_port`, `wait_ready`);
- the sliding-window tests' `SLIDING_MODELS`;
- `RobustnessTestBase`, the robustness tests' base class.

Its base classes have no tests of their own, and pytest collects none from this module (its name is not `test_*`).
"""

import functools
import json
import os
import socket
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from torch._dynamo.backends.registry import register_backend
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GenerationConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    masking_utils,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput, logging

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.call import generation
from prefill_buckets.call.hooks import HOOKS
from prefill_buckets.compile.compiled_calls import EagerFallback
from prefill_buckets.testing_utils import tiny_llama, tiny_llama_config
from prefill_buckets.upstream import versions


# `generate` takes and returns the cache as `cache` from transformers 5.24 on, as `past_key_values` before.
CACHE = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"

__all__ = [
    "CACHE",
    "assert_same_generation",
    "static_config",
    "single_thread_module",
    "tiny_llama",
    "tiny_llama_config",
    # the compile tests' model and counting backend (below)
    "BOS",
    "BUCKETS",
    "COUNTER_BACKEND",
    "CompilationTestCase",
    "EOS",
    "MAX_NEW_TOKENS",
    "PAD",
    "VOCAB",
    "decode_graphs",
    "logger",
    "make_config",
    "make_model",
    "make_prompt",
    "make_reference",
    "prefill_lengths",
    # the upstream-coupling, config and patch tests' prompt
    "random_ids",
    # the equivalence suite's models, prompts and forward recorder (below)
    "ForwardRecorder",
    "LLAMA_LIKE",
    "MODEL_SPECS",
    "SPECIAL_TOKENS",
    "get_model",
    "left_padded_batch",
    "random_batch_ids",
    # every field of two `generate` outputs compared (below)
    "ATOL",
    "assert_same",
    "hide_user_pads",
    # the right-padding tests' runs, spy on the side taken and compiled Llama (below)
    "RIGHT_PADDING_BUCKETS",
    "RIGHT_PADDING_NEW_TOKENS",
    "CompiledLlamaTestCase",
    "SideSpy",
    "first_right_turn",
    "right_padding_config",
    "run",
    "run_bucketed",
    "sdpa_recording_backend",
    "skip_unless_sdpa_skips_while_compiling",
    # the config and patch tests' model and forward-length recorder (below)
    "FirstForwardLength",
    "tiny_llama_256_positions",
    # the benchmark tests' parser and workload (below)
    "bench_parser",
    "tiny_workload",
    # the serving tests' tiny model folder, requests and server calls (below)
    "ASKED_NEW_TOKENS",
    "MAX_PROMPT",
    "REQUESTS",
    "SERVED_NEW_TOKENS",
    "ask",
    "free_port",
    "save_tiny_model",
    "set_up_tiny_model_folder",
    "wait_ready",
    "word_prompt",
    # the sliding-window tests' models (below)
    "SLIDING_MODELS",
    "SLIDING_WINDOW",
    # the robustness tests' base class (below)
    "UPSTREAM_IGNORE_CAUSAL_MASK_SDPA",
    "RobustnessTestBase",
]


def static_config(new_tokens: int, **fields) -> GenerationConfig:
    """Greedy generation of exactly `new_tokens` tokens with a static cache, and `fields` (the bucket fields...)."""
    return GenerationConfig(
        cache_implementation="static", max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **fields
    )


def assert_same_generation(ours, theirs, scores: bool = True) -> None:
    """The tokens of two `generate` outputs are equal, and (with `scores`) the first step's finite scores are close."""
    torch.testing.assert_close(ours.sequences, theirs.sequences, rtol=0, atol=0)
    if scores:
        finite = torch.isfinite(theirs.scores[0])
        torch.testing.assert_close(ours.scores[0][finite], theirs.scores[0][finite], rtol=1e-5, atol=1e-5)


def single_thread_module():
    """
    `setUpModule, tearDownModule` for a module of tiny-model tests: one thread computes them as fast as two, and on a
    loaded machine the second thread's busy-waiting costs more than it brings. Restored for the other test modules.
    """
    threads = {}

    def set_up():
        threads["before"] = torch.get_num_threads()
        torch.set_num_threads(1)

    def tear_down():
        torch.set_num_threads(threads.pop("before"))

    return set_up, tear_down


# =====================================================================================================================
# The compile tests' tiny Llama, its counting backend, and `CompilationTestCase` (test_compiled_calls.py,
# test_precompile.py, test_budget.py, test_decision.py, test_generation.py): every way of compiling a model runs
# bucketed `generate` through compiled graphs, a bounded number of them, with the tokens of an uncompiled, unbucketed
# run.
#
#
# Counting: `GraphCounter` (eager backend, so a graph costs only dynamo's tracing) counts graphs and compiled calls.
# Every compile here uses `dynamic=False, fullgraph=True`, so one forward is exactly one compiled call (or an error),
# and `min_new_tokens == max_new_tokens`, so one call is exactly `MAX_NEW_TOKENS` forwards (one prefill, the rest
# decode). "compiled calls == forwards" is then the proof that no forward ran eagerly (for example past torch's
# recompile limit, where torch silently falls back to eager).
# =====================================================================================================================

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


# torch's default `recompile_limit`, which the counting tests' bounds are written against.
TORCH_DEFAULT_RECOMPILE_LIMIT = 8


class CompilationTestCase(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        recompile_limit = torch._dynamo.config.recompile_limit
        self.addCleanup(setattr, torch._dynamo.config, "recompile_limit", recompile_limit)
        # Each test starts at torch's default limit, whatever an earlier test in the process left: upstream's chunked
        # prefill sets 64 process-wide on transformers < 5.23 (`budget.restore_recompile_limit`).
        torch._dynamo.config.recompile_limit = TORCH_DEFAULT_RECOMPILE_LIMIT
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

    def check_lengths_compile_nothing(self, counter, model, reference, config, lengths):
        """After `precompile`: a prompt of each of `lengths` runs compiled, with the reference's tokens, compiling none."""
        graphs = counter.graphs
        for length in lengths:
            self.check_call(
                counter,
                lambda ids: prefill_buckets.generate(model, ids, generation_config=config),
                make_prompt(length),
                reference,
                make_config(),
            )
        self.assertEqual(counter.graphs, graphs, f"graphs: {counter.shapes}")

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


# ---- one prompt of random ids (test_checks.py, test_gate.py, test_selftest.py, test_compiled_calls.py, test_config.py,
# test_patch.py) ------------------------------------------------------------------------------------------------------


def random_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


# =====================================================================================================================
# The equivalence suite's tiny models of several architectures, its prompts and its forward recorder (moved from
# test_equivalence.py; test_all_outputs.py, test_prefill_right.py, test_ragged_batches.py, test_decision.py,
# test_sizing.py, test_views.py, test_padding_side.py, test_properties.py, test_record_recurrent.py,
# test_robustness.py, test_hooks.py). Their pad, eos and bos ids and vocabulary are the compile tests' (`PAD`, `EOS`, `BOS`, `VOCAB`
# above).
# =====================================================================================================================

LLAMA_LIKE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
SPECIAL_TOKENS = {"pad_token_id": PAD, "eos_token_id": EOS, "bos_token_id": BOS}

# name -> (model class, config). Tiny, fp32, random weights (seeded): never a hub download.
MODEL_SPECS = {
    "llama": (LlamaForCausalLM, lambda: LlamaConfig(**LLAMA_LIKE, **SPECIAL_TOKENS)),
    "qwen3": (Qwen3ForCausalLM, lambda: Qwen3Config(**LLAMA_LIKE, head_dim=8, **SPECIAL_TOKENS)),
    # A sliding window shorter than most prompts here.
    "mistral_sliding": (MistralForCausalLM, lambda: MistralConfig(**LLAMA_LIKE, sliding_window=8, **SPECIAL_TOKENS)),
    "gemma": (GemmaForCausalLM, lambda: GemmaConfig(**LLAMA_LIKE, head_dim=8, **SPECIAL_TOKENS)),
    "phi3": (Phi3ForCausalLM, lambda: Phi3Config(**LLAMA_LIKE, **SPECIAL_TOKENS)),
    # Absolute position embeddings: positions must come from the mask, not from the padded index.
    "gpt2_no_pad": (
        GPT2LMHeadModel,
        lambda: GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, eos_token_id=EOS, bos_token_id=BOS
        ),
    ),
    "gpt2_pad": (
        GPT2LMHeadModel,
        lambda: GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=256, **SPECIAL_TOKENS),
    ),
    # No pad token anywhere (eos set), and neither pad nor eos.
    "llama_no_pad": (
        LlamaForCausalLM,
        lambda: LlamaConfig(**LLAMA_LIKE, pad_token_id=None, eos_token_id=EOS, bos_token_id=BOS),
    ),
    "llama_no_pad_no_eos": (
        LlamaForCausalLM,
        lambda: LlamaConfig(**LLAMA_LIKE, pad_token_id=None, eos_token_id=None, bos_token_id=BOS),
    ),
}


@functools.cache
def get_model(name: str, attn_implementation: str | None = None):
    model_class, make_config = MODEL_SPECS[name]
    torch.manual_seed(0)
    if attn_implementation is None:
        model = model_class(make_config())
    else:
        model = model_class._from_config(make_config(), attn_implementation=attn_implementation)
    return model.eval()


def random_batch_ids(batch_size: int, length: int, seed: int = 0) -> torch.Tensor:
    """A batch of random ids (`random_ids` is its one row): ids 3.., so a prompt never holds pad, eos or bos by chance."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch_size, length), generator=generator)


def left_padded_batch(lengths, pad_id: int, seed: int = 0):
    """A batch padded on the left by hand, as a tokenizer with `padding_side="left"` would: (input_ids, attention_mask)."""
    width = max(lengths)
    input_ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, width - length :] = random_batch_ids(1, length, seed=seed + row)[0]
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def _shapes(value):
    """The shape of a tensor, or of each tensor of a dict (a model with several attention types gets a dict of masks)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, dict) and value and all(isinstance(v, torch.Tensor) for v in value.values()):
        return {k: tuple(v.shape) for k, v in value.items()}
    return None


class ForwardRecorder:
    """Forward pre-hook recording what each forward of the model receives: sequence length and tensor shapes."""

    def __init__(self, model):
        self.calls = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        tensor = kwargs.get("inputs_embeds")
        if tensor is None:
            tensor = kwargs.get("input_ids")
        self.calls.append(
            {
                "length": tensor.shape[1],
                "shapes": {k: _shapes(v) for k, v in kwargs.items() if _shapes(v) is not None},
                "none": sorted(k for k, v in kwargs.items() if v is None),
            }
        )

    @property
    def first_length(self) -> int:
        return self.calls[0]["length"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


# =====================================================================================================================
# Every field of two `generate` outputs compared, bucketed against unpadded (moved from test_all_outputs.py;
# test_prefill_right.py, test_ragged_batches.py, test_attention_keys.py).
# =====================================================================================================================

ATOL = 1e-5  # `assert_same`'s tolerance on floats


def assert_same(test: unittest.TestCase, got, want, path: str):
    """Recursively compares two outputs: same structure, shapes and values (ids exactly, floats within ATOL)."""
    if isinstance(want, ModelOutput):
        ignored = {"cache", "past_key_values"}  # the returned cache holds the padding: documented
        test.assertEqual(set(got.keys()) - ignored, set(want.keys()) - ignored, path)
        for key in set(want.keys()) - ignored:
            assert_same(test, got[key], want[key], f"{path}.{key}")
        return
    if isinstance(want, tuple):
        test.assertIsInstance(got, tuple, path)
        test.assertEqual(len(got), len(want), path)
        for index, (g, w) in enumerate(zip(got, want)):
            assert_same(test, g, w, f"{path}[{index}]")
        return
    if isinstance(want, torch.Tensor):
        test.assertEqual(got.shape, want.shape, path)
        if want.dtype.is_floating_point:
            finite = torch.isfinite(want)
            test.assertTrue(torch.equal(finite, torch.isfinite(got)), path)
            torch.testing.assert_close(got[finite], want[finite], atol=ATOL, rtol=0, msg=path)
        else:
            test.assertTrue(torch.equal(got, want), f"{path}: {got.tolist()} != {want.tolist()}")
        return
    test.assertEqual(got, want, path)


def hide_user_pads(output, attention_mask) -> None:
    """
    Zeroes the hidden states at the user's own pad positions of the prompt: a query that attends to nothing averages
    the values of every slot its layer reads, which the mask does not define (`test_equivalence.py` skips them too).
    Their attention weights are compared: a row masked everywhere is `1 / keys` on every key, in both runs.
    """
    if output.get("hidden_states") is None:
        return
    width = attention_mask.shape[1]
    hidden = []
    for layers in output.hidden_states:  # without a cache, every step re-runs the prompt
        if layers[0].shape[1] >= width:
            # Rows per prompt: beams (beam search runs `num_beams` rows whatever `num_return_sequences` is).
            pads = ~attention_mask.bool().repeat_interleave(layers[0].shape[0] // attention_mask.shape[0], dim=0)
            layers = tuple(
                torch.cat([h[:, :width].masked_fill(pads[..., None], 0.0), h[:, width:]], 1) for h in layers
            )
        hidden.append(layers)
    output["hidden_states"] = tuple(hidden)


# =====================================================================================================================
# The right-padding tests' runs, their spy on the side each call takes and their compiled Llama (moved from
# test_prefill_right.py; test_ragged_batches.py).
# =====================================================================================================================

RIGHT_PADDING_BUCKETS = [8, 16, 32]
RIGHT_PADDING_NEW_TOKENS = 5


def sdpa_recording_backend():
    """A compile backend that records each SDPA call it traces as `(query length, no mask, is_causal)`, and the list."""
    sdpa_calls = []

    def backend(gm, example_inputs, **kwargs):
        for node in gm.graph.nodes:
            if node.op == "call_function" and "scaled_dot_product_attention" in str(node.target):
                mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
                query_length = node.args[0].meta["example_value"].shape[-2]
                sdpa_calls.append((query_length, mask is None, node.kwargs.get("is_causal")))
        return gm.forward

    return backend, sdpa_calls


class SideSpy:
    """Records every bucketed call and the side it takes (`decision.choose_side`, as `generate` calls it)."""

    def __init__(self, test: unittest.TestCase):
        self.calls, self.sides = [], []
        original = generation.choose_side

        def spy(call):
            side = original(call)
            self.calls.append(call)
            self.sides.append(side)
            return side

        patcher = mock.patch.object(generation, "choose_side", spy)
        patcher.start()
        test.addCleanup(patcher.stop)

    def last(self) -> str:
        return self.sides[-1].side


def right_padding_config(**kwargs) -> GenerationConfig:
    values = {
        "max_new_tokens": RIGHT_PADDING_NEW_TOKENS,
        "do_sample": False,
        "cache_implementation": "static",
        "pad_token_id": PAD,
        "eos_token_id": EOS,
        "return_dict_in_generate": True,
        "output_scores": True,
        "output_logits": True,
    }
    values.update(kwargs)
    return GenerationConfig(**values)


def run(model, input_ids, generation_config, seed=11, **kwargs):
    torch.manual_seed(seed)
    return model.generate(input_ids, generation_config=generation_config, **kwargs)


def run_bucketed(model, input_ids, generation_config, seed=11, **kwargs):
    torch.manual_seed(seed)
    return prefill_buckets.generate(model, input_ids, generation_config=generation_config, **kwargs)


# The mask-free prefill tests: on transformers < 5.24 upstream's own exact prefill is masked while compiling.
skip_unless_sdpa_skips_while_compiling = unittest.skipIf(
    versions.TRANSFORMERS_VERSION.release < (5, 24),
    "transformers 5.17 never skips the SDPA mask while compiling (`is_tracing`): upstream's exact prefill is masked too",
)


def first_right_turn(test, rows: int):
    """
    The first turn of a conversation, `rows` rows of 9 tokens right-padded into a 96-slot cache (the side checked), and
    upstream's; with the config of the later turns. `test` has `model` and `spy`.
    """
    first_config = right_padding_config(max_cache_len=96, output_scores=False, output_logits=False)
    later_config = right_padding_config(cache_implementation=None, output_scores=False, output_logits=False)
    first = random_batch_ids(rows, 9, seed=1)
    ours = run_bucketed(test.model, first, first_config, prefill_buckets=RIGHT_PADDING_BUCKETS)
    theirs = run(test.model, first, first_config)
    test.assertEqual(test.spy.last(), "right")
    return ours, theirs, later_config


class CompiledLlamaTestCase(unittest.TestCase):
    """A tiny Llama compiled with a given backend (`dynamic=False`, `fullgraph=True`), and a spy on the side taken."""

    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        self.spy = SideSpy(self)

    def compiled_llama(self, backend):
        model_class, make_config = MODEL_SPECS["llama"]
        torch.manual_seed(0)
        model = model_class(make_config()).eval()
        model.compile(backend=backend, dynamic=False, fullgraph=True)
        return model


# =====================================================================================================================
# The config and patch tests' tiny Llama and recorder of each forward's length (moved from test_config.py;
# test_patch.py). Their prompt, `random_ids(5)`, is the upstream-coupling tests' above.
# =====================================================================================================================


def tiny_llama_256_positions() -> LlamaForCausalLM:
    """`tiny_llama()` with 256 positions."""
    return tiny_llama(max_position_embeddings=256)


class FirstForwardLength:
    """A forward pre-hook that records the sequence length of every forward the model runs."""

    def __init__(self, model):
        self.lengths = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        tensor = kwargs.get("input_ids")
        if tensor is None:
            tensor = kwargs.get("inputs_embeds")
        self.lengths.append(tensor.shape[1])

    @property
    def first(self) -> int:
        return self.lengths[0]

    def remove(self):
        self.handle.remove()


# =====================================================================================================================
# The benchmark tests' parser of `prefill-buckets bench` and saved tiny workload (moved from test_bench_cli.py;
# test_bench_steady.py, test_bench_baseline.py). The parser imports the benchmark package when called, so that
# importing this module does not.
# =====================================================================================================================


def tiny_workload(lengths):
    """A saved tiny Llama and a workload of one random prompt per length: `(tmp dir, model dir, path, workload)`."""
    tmp = tempfile.TemporaryDirectory()
    model_dir = os.path.join(tmp.name, "tiny")
    tiny_llama().save_pretrained(model_dir)
    workload_path = os.path.join(tmp.name, "workload.json")
    workload = [
        {
            "name": f"p{n}",
            "length": n,
            "ids": torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist(),
        }
        for n in lengths
    ]
    Path(workload_path).write_text(json.dumps(workload))
    return tmp, model_dir, workload_path, workload


def bench_parser():
    """An `argparse` parser of `prefill-buckets bench`'s arguments."""
    import argparse

    from prefill_buckets import benchmark as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser


# =====================================================================================================================
# The serving tests' tiny Llama folder (offline word-level tokenizer, chat template), their requests and the calls they
# make to a server (moved from test_serving.py; test_serving_loads.py, test_serve_process.py). The `openai` client
# (the serving extra) is imported only by `set_up_tiny_model_folder`, when called.
# =====================================================================================================================

# Prompt lengths in words, each word one token; the chat template adds one (`w3`). 13 lengths, up to 61 tokens.
REQUEST_WORDS = (3, 5, 7, 10, 13, 17, 21, 26, 31, 37, 44, 52, 60)
MAX_PROMPT = 64
ASKED_NEW_TOKENS = 8
SERVED_NEW_TOKENS = 32  # --max-new-tokens: the cache holds the largest bucket and these
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)


def chat_word_tokenizer() -> PreTrainedTokenizerFast:
    """
    A word-level tokenizer over the tiny model's ids: `w<id>` is one token from id 3 on; pad `<pad>`, eos `</s>`, bos
    `<s>` (special tokens are matched inside words, so they share no text with the others).
    """
    vocab = {"<pad>": 0, "</s>": 1, "<s>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        model_input_names=["input_ids", "attention_mask"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(folder: str) -> None:
    """A tiny Llama, its tokenizer and chat template, in `folder`: what `transformers serve` loads by path."""
    model = tiny_llama(seed=0)
    model.generation_config.do_sample = False
    model.save_pretrained(folder)
    chat_word_tokenizer().save_pretrained(folder)


def word_prompt(words: int, offset: int = 0) -> str:
    """`words` distinct-ish words, seeded by the length so that every prompt differs."""
    ids = torch.randint(4, VOCAB, (words,), generator=torch.Generator().manual_seed(words + offset)).tolist()
    return " ".join(f"w{i}" for i in ids)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(client, model: str, timeout: float = 120.0) -> None:
    """Until the server answers `/v1/models` (it is up: the model was loaded before uvicorn started)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.models.list()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def ask(client, model: str, kind: str, stream: bool, words: int, **extra) -> str:
    """One request (`chat` or `completion`), its answer's text (streamed chunks joined)."""
    common = {"model": model, "max_tokens": ASKED_NEW_TOKENS, "temperature": 0, **extra}
    if kind == "chat":
        response = client.chat.completions.create(
            messages=[{"role": "user", "content": word_prompt(words)}], stream=stream, **common
        )
        if not stream:
            return response.choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in response if c.choices)
    response = client.completions.create(prompt=word_prompt(words) + " w3", stream=stream, **common)
    if not stream:
        return response.choices[0].text
    return "".join(c.choices[0].text or "" for c in response if c.choices)


def set_up_tiny_model_folder(test_class) -> None:
    """For a test class: `openai` as `test_class.openai`, and the tiny model saved in a folder removed after the class."""
    import openai

    test_class.openai = openai
    test_class.tmp = tempfile.TemporaryDirectory()
    test_class.addClassCleanup(test_class.tmp.cleanup)
    test_class.folder = os.path.join(test_class.tmp.name, "tiny-llama")
    save_tiny_model(test_class.folder)


REQUESTS = [
    (kind, stream, words) for words in REQUEST_WORDS for kind in ("chat", "completion") for stream in (False, True)
]


# =====================================================================================================================
# The sliding-window tests' models (moved from test_sliding.py; test_attention_keys.py). Their pad, eos and bos ids
# are `SPECIAL_TOKENS` above.
# =====================================================================================================================

SLIDING_WINDOW = 16  # the sliding window (Llama 4: the attention chunk)
_SLIDING_SIZES = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
_SLIDING_BASE = {
    **_SLIDING_SIZES,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 1024,
    "num_hidden_layers": 2,
}
_SLIDING_HYBRID = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": SLIDING_WINDOW}
_SLIDING_EXPERTS = {"num_local_experts": 2, "num_experts_per_tok": 1}
# Each a sliding (or chunked) layer and a full-attention one, except Mistral, whose layers all slide.
SLIDING_MODELS = {
    "gemma2": lambda: Gemma2ForCausalLM(
        Gemma2Config(**_SLIDING_BASE, **SPECIAL_TOKENS, sliding_window=SLIDING_WINDOW)
    ),
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**_SLIDING_BASE, **SPECIAL_TOKENS, **_SLIDING_HYBRID)),
    "gpt_oss": lambda: GptOssForCausalLM(
        GptOssConfig(**_SLIDING_BASE, **SPECIAL_TOKENS, **_SLIDING_EXPERTS, sliding_window=SLIDING_WINDOW)
    ),
    "mistral": lambda: MistralForCausalLM(
        MistralConfig(**_SLIDING_BASE, **SPECIAL_TOKENS, sliding_window=SLIDING_WINDOW)
    ),
    "llama4": lambda: Llama4ForCausalLM(
        Llama4TextConfig(
            **_SLIDING_BASE,
            **SPECIAL_TOKENS,
            **_SLIDING_EXPERTS,
            attention_chunk_size=SLIDING_WINDOW,
            no_rope_layers=[1, 0],
            intermediate_size_mlp=64,
        )
    ),
    "cohere2": lambda: Cohere2ForCausalLM(Cohere2Config(**_SLIDING_BASE, **SPECIAL_TOKENS, **_SLIDING_HYBRID)),
}


# =====================================================================================================================
# The base class of the robustness tests (moved from test_robustness.py; test_hooks.py): a tiny Llama per test, and
# after each, no hook, no eager fallback and upstream's SDPA mask-skip rule left behind.
# =====================================================================================================================

# Upstream's SDPA mask-skip rule, which a bucketed call replaces while it runs and must put back.
UPSTREAM_IGNORE_CAUSAL_MASK_SDPA = masking_utils._ignore_causal_mask_sdpa


class RobustnessTestBase(unittest.TestCase):
    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)
        self.model = tiny_llama()
        self.addCleanup(self.assertNoHooksLeft, self.model)

    def assertNoHooksLeft(self, model):
        for name in HOOKS:
            self.assertNotIn(name, model.__dict__)
        self.assertNotIsInstance(model.__dict__.get("_compiled_call_impl"), EagerFallback)
        self.assertNotIsInstance(model.__dict__.get("forward"), EagerFallback)
        self.assertIs(masking_utils._ignore_causal_mask_sdpa, UPSTREAM_IGNORE_CAUSAL_MASK_SDPA)

    def assertSameIds(self, actual, expected):
        self.assertEqual(tuple(actual.shape), tuple(expected.shape))
        self.assertTrue(torch.equal(actual, expected), f"\n{actual}\n!=\n{expected}")

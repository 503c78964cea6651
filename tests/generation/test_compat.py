# The coupling to private upstream API (`upstream/`): a missing or reshaped hook target raises a clear error instead
# of being skipped, and a `torch.compile(model)` wrapper shared by threads keeps every forward compiled.

import ast
import contextlib
import inspect
import re
import threading
import time
import types
import unittest
from pathlib import Path
from unittest import mock

import torch
import transformers
from packaging.version import Version
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets import GraphCounter, upstream
from prefill_buckets.call import support
from prefill_buckets.state import PROCESS
from prefill_buckets.testing_utils import as_new_process
from prefill_buckets.upstream import checks, gate, transformers_api, versions
from prefill_buckets.upstream.gate import SELF_TEST_RUNNING
from prefill_buckets.upstream.selftest import self_test

from .tiny_models import tiny_llama, tiny_llama_config


# A torch release just outside the tested range at each end (`versions.TESTED_TORCH`).
OLDER_TORCH = "2.10.0"
NEWER_TORCH = f"2.{Version(versions.TESTED_TORCH[-1]).minor + 1}.0"


def random_ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


class RenamedHookTarget(LlamaForCausalLM):
    """As if a transformers release renamed `_prepare_generated_length`."""

    _prepare_generated_length = None


class ReshapedHookTarget(LlamaForCausalLM):
    """As if a transformers release renamed a parameter the hook passes by position and reads by name."""

    def _prepare_generated_length(self, generation_config, has_default_max_length, has_default_min_length, input_name,
                                  input_ids_length, inputs_tensor):  # fmt: skip
        return super()._prepare_generated_length(
            generation_config,
            has_default_max_length,
            has_default_min_length,
            input_name,
            input_ids_length,
            inputs_tensor,
        )


class KwargsOverride(LlamaForCausalLM):
    """A model's own step that takes the cache and the mask through `**kwargs`, and passes them on (Zamba2 on 5.24)."""

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return super().prepare_inputs_for_generation(input_ids, **kwargs)


class StepWithoutMask(LlamaForCausalLM):
    """A model's own step that really takes no mask: it names its parameters and passes nothing on."""

    def prepare_inputs_for_generation(self, input_ids, cache=None, inputs_embeds=None, use_cache=None):
        return super().prepare_inputs_for_generation(input_ids, cache=cache, use_cache=use_cache)


class KwargsOverOverrideWithoutMask(StepWithoutMask):
    """A `**kwargs` pass-through over that step: what it passes on still can't take the mask."""

    def prepare_inputs_for_generation(self, input_ids, **kwargs):
        return super().prepare_inputs_for_generation(input_ids, **kwargs)


class StepDroppingMask(LlamaForCausalLM):
    """
    A model's own step that takes the mask by name (so `check_upstream` passes it) and drops it from its inputs when it
    generates with a cache: what the decision's probe (no cache) can't see, and the hook must.
    """

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        inputs = super().prepare_inputs_for_generation(input_ids, attention_mask=attention_mask, **kwargs)
        if kwargs.get("use_cache", True):
            inputs.pop("attention_mask", None)
        return inputs


class KeywordTargetThroughKwargs(LlamaForCausalLM):
    """An override of `_prepare_generated_length`, which upstream calls by keyword, taking them through `**kwargs`."""

    def _prepare_generated_length(self, generation_config, **kwargs):
        return super()._prepare_generated_length(generation_config, **kwargs)


class CheckUpstreamTest(unittest.TestCase):
    def test_kwargs_override_is_exact(self):
        # Upstream generates with it; so must the package, on the right (one prompt) and the left (a ragged batch).
        torch.manual_seed(0)
        model = KwargsOverride(tiny_llama_config()).eval()
        batch = torch.cat([random_ids(9, seed=1), random_ids(9, seed=2)])
        mask = torch.ones_like(batch)
        mask[1, :3] = 0
        for input_ids, attention_mask in ((random_ids(5), None), (batch, mask)):
            kwargs = {"attention_mask": attention_mask, "max_new_tokens": 4, "do_sample": False}
            kwargs["cache_implementation"] = "static"
            expected = model.generate(input_ids, **kwargs)
            actual = prefill_buckets.generate(model, input_ids, prefill_buckets=[8, 16], **kwargs)
            self.assertTrue(torch.equal(actual, expected), f"\n{actual}\n!=\n{expected}")

    def test_a_step_that_drops_a_mask_hiding_pads_raises(self):
        # Eager, on the left: a prompt padded to its bucket needs its mask, and the call raises rather than attend to
        # the pads; an exact fit's all-ones mask hides nothing, and its call is upstream's (5.17 drops its key too).
        torch.manual_seed(0)
        model = StepDroppingMask(tiny_llama_config()).eval()
        kwargs = {"max_new_tokens": 4, "do_sample": False, "prefill_buckets": [8], "prefill_padding_side": "left"}
        with self.assertRaisesRegex(RuntimeError, "does not pass the attention mask on to the model"):
            prefill_buckets.generate(model, random_ids(5), **kwargs)
        exact = random_ids(8)
        expected = model.generate(exact, max_new_tokens=4, do_sample=False)
        self.assertTrue(torch.equal(prefill_buckets.generate(model, exact, **kwargs), expected))

    def test_step_without_the_parameter_raises(self):
        for model_class in (StepWithoutMask, KwargsOverOverrideWithoutMask):
            with self.subTest(model_class.__name__):
                with self.assertRaisesRegex(
                    RuntimeError,
                    r"`StepWithoutMask\.prepare_inputs_for_generation` takes no parameter `attention_mask`",
                ):
                    support.check_upstream(model_class, generate=prefill_buckets.generate)

    def test_keyword_target_through_kwargs_is_exact(self):
        # Upstream passes `_prepare_generated_length` its arguments by keyword, and the hook passes them on as it got
        # them: an override that takes them through `**kwargs` works, as it does upstream.
        support.check_upstream(KeywordTargetThroughKwargs, generate=prefill_buckets.generate)
        torch.manual_seed(0)
        model = KeywordTargetThroughKwargs(tiny_llama_config()).eval()
        kwargs = {"max_new_tokens": 4, "do_sample": False}
        expected = model.generate(random_ids(5), **kwargs)
        actual = prefill_buckets.generate(
            model, random_ids(5), prefill_buckets=[8], prefill_padding_side="left", **kwargs
        )
        self.assertEqual(actual.tolist(), expected.tolist())

    def test_tested_version_passes(self):
        support.check_upstream(generate=prefill_buckets.generate)
        support.check_upstream(LlamaForCausalLM, generate=prefill_buckets.generate)

    def test_missing_hook_target_raises(self):
        torch.manual_seed(0)
        model = RenamedHookTarget(tiny_llama_config()).eval()
        ids = random_ids(5)
        with self.assertRaisesRegex(
            RuntimeError, r"transformers \d+\.\d+.*`RenamedHookTarget\._prepare_generated_length`"
        ):
            prefill_buckets.generate(model, ids, max_new_tokens=2, prefill_buckets=[8])

    def test_reshaped_hook_target_raises(self):
        torch.manual_seed(0)
        model = ReshapedHookTarget(tiny_llama_config()).eval()
        with self.assertRaisesRegex(RuntimeError, "takes no parameter `model_input_name`"):
            prefill_buckets.generate(model, random_ids(5), max_new_tokens=2, prefill_buckets=[8])

    def test_the_gate_is_asked_until_a_class_passes(self):
        # A class that passed is not asked again (a warm call skips the gate); one that failed raises on every call,
        # and so does every call while the self-test runs.
        self.enterContext(as_new_process())
        kwargs = {"max_new_tokens": 2, "do_sample": False, "prefill_buckets": [8]}
        with mock.patch.object(support, "check_upstream", wraps=support.check_upstream) as asked:
            model = tiny_llama()
            for _ in range(3):
                prefill_buckets.generate(model, random_ids(5), **kwargs)
            self.assertEqual(asked.call_count, 1)
            self.assertIn(LlamaForCausalLM, PROCESS.upstream_passed)
            broken = ReshapedHookTarget(tiny_llama_config()).eval()
            for _ in range(2):
                with self.assertRaisesRegex(RuntimeError, "takes no parameter `model_input_name`"):
                    prefill_buckets.generate(broken, random_ids(5), **kwargs)
            self.assertEqual(asked.call_count, 3)
            self.assertNotIn(ReshapedHookTarget, PROCESS.upstream_passed)
        PROCESS.upstream_passed.clear()
        PROCESS.self_test_verdict = SELF_TEST_RUNNING  # as the self-test's own calls see it: passing, not for good
        support.check_upstream(LlamaForCausalLM, generate=prefill_buckets.generate)
        self.assertNotIn(LlamaForCausalLM, PROCESS.upstream_passed)


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


class UntestedVersionTest(unittest.TestCase):
    def setUp(self):
        # As on a transformers release outside the tested range, in a fresh process: nothing checked yet.
        self.enterContext(as_new_process())
        patcher = mock.patch.object(gate, "is_tested_range", return_value=False)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_self_test_passes_here(self):
        self_test(prefill_buckets.generate)

    def test_self_test_runs_on_the_cpu_in_float32_whatever_the_call_runs_under(self):
        # The first bucketed call runs it, inside whatever the user's call runs under: a `with torch.device("cuda"):`
        # block (the meta device plays it on a CPU-only machine) made its model there, and it failed ("Cannot copy
        # out of meta tensor"), and with it, for the whole process, every bucketed call; a float16 default dtype made
        # its model float16.
        with torch.device("meta"):
            self_test(prefill_buckets.generate)
        previous = torch.get_default_dtype()
        self.addCleanup(torch.set_default_dtype, previous)
        torch.set_default_dtype(torch.float16)
        models = []

        def generate(model, *args, **kwargs):
            models.append((model.dtype, model.device.type))
            return prefill_buckets.generate(model, *args, **kwargs)

        self_test(generate)
        self.assertEqual(set(models), {(torch.float32, "cpu")})

    def test_self_test_logs_nothing(self):
        # It generates on a model of its own, which the user never sees: it logged that its bucketed call grew the
        # static cache of its unpadded one ("A call needs 10 static cache slots, more than the model's cache of 7").
        logger = logging.get_logger("prefill_buckets")
        logger.warning_once.cache_clear()
        self.addCleanup(logger.warning_once.cache_clear)
        with CaptureLogger(logger) as logs:
            self_test(prefill_buckets.generate)
        # The version gate's own warning aside (this test plays an untested version, and its calls pass the gate).
        others = [line for line in logs.out.splitlines() if line and "prefill_buckets is tested on" not in line]
        self.assertEqual(others, [])

    def test_first_bucketed_call_warns_and_self_tests(self):
        model = tiny_llama()
        with mock.patch("prefill_buckets.upstream.selftest.self_test", wraps=self_test) as spy:
            with CaptureLogger(logging.get_logger("prefill_buckets")) as logs:
                out = prefill_buckets.generate(model, random_ids(5), max_new_tokens=2, prefill_buckets=[8])
                prefill_buckets.generate(model, random_ids(6), max_new_tokens=2, prefill_buckets=[8])
        self.assertEqual(out.shape, (1, 7))
        self.assertEqual(spy.call_count, 1)  # once per process
        self.assertIn("prefill_buckets is tested on transformers", logs.out)

    def test_a_changed_step_fails_loudly(self):
        # As if a release changed what a hooked step means: here, the padding is no longer stripped.
        with mock.patch("prefill_buckets.call.generation.strip_output", lambda output, plan: output):
            with self.assertRaisesRegex(RuntimeError, "self-test failed on transformers"):
                prefill_buckets.generate(tiny_llama(), random_ids(5), max_new_tokens=2, prefill_buckets=[8])

    def test_a_failed_self_test_keeps_failing(self):
        # The verdict sticks: the second call (the step still broken, or not) raises too, instead of running bucketed
        # on a version the self-test has shown to be broken. The self-test runs once.
        model = tiny_llama()
        with mock.patch("prefill_buckets.upstream.selftest.self_test", wraps=self_test) as spy:
            with mock.patch("prefill_buckets.call.generation.strip_output", lambda output, plan: output):
                with self.assertRaisesRegex(RuntimeError, "self-test failed on transformers"):
                    prefill_buckets.generate(model, random_ids(5), max_new_tokens=2, prefill_buckets=[8])
            for _ in range(2):
                with self.assertRaisesRegex(RuntimeError, "self-test failed on transformers"):
                    prefill_buckets.generate(model, random_ids(5), max_new_tokens=2, prefill_buckets=[8])
        self.assertEqual(spy.call_count, 1)
        # Unbucketed calls are upstream's, and still run.
        self.assertEqual(prefill_buckets.generate(model, random_ids(5), max_new_tokens=2).shape, (1, 7))

    def test_concurrent_first_calls_wait_for_the_verdict(self):
        # A second thread's first call, made while the self-test runs, waits for its verdict and raises it too.
        started, results = threading.Event(), {}

        def failing_self_test(generate):
            started.set()
            time.sleep(0.5)  # long enough for the other thread to be waiting on the verdict
            raise RuntimeError("prefill_buckets' self-test failed on transformers (simulated)")

        def call(name):
            try:
                prefill_buckets.generate(tiny_llama(), random_ids(5), max_new_tokens=2, prefill_buckets=[8])
                results[name] = "ran"
            except RuntimeError as error:
                results[name] = str(error)

        with mock.patch("prefill_buckets.upstream.selftest.self_test", failing_self_test):
            first = threading.Thread(target=call, args=("first",))
            first.start()
            self.assertTrue(started.wait(timeout=60))
            second = threading.Thread(target=call, args=("second",))
            second.start()
            first.join(timeout=60)
            second.join(timeout=60)
        self.assertEqual(set(results), {"first", "second"})
        for name in ("first", "second"):
            self.assertIn("self-test failed", results[name], name)


@contextlib.contextmanager
def removed(owner, name: str):
    """As if a torch release renamed `owner.name`: the attribute is gone for the block."""
    saved = owner.__dict__[name]
    delattr(owner, name)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def private_torch_paths() -> set[str]:
    """
    Every private torch name the modules of `upstream/` read, as a dotted path from `torch`: attribute chains from
    `torch` and from names imported from torch modules (function-level imports too), read from their source with `ast`.
    """
    paths = set()
    for source in sorted(Path(upstream.__file__).parent.glob("*.py")):
        paths |= _private_torch_paths(ast.parse(source.read_text(encoding="utf-8")))
    return paths


def _private_torch_paths(tree: ast.AST) -> set[str]:
    aliases = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            aliases.update({alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names})
    paths = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain, target = [], node
        while isinstance(target, ast.Attribute):
            chain.append(target.attr)
            target = target.value
        if isinstance(target, ast.Name) and target.id in aliases:
            path = ".".join([aliases[target.id], *reversed(chain)])
            if any(part.startswith("_") and not part.startswith("__") for part in path.split(".")):
                paths.add(path)
    for node in ast.walk(tree):  # imported private names, used whole
        if isinstance(node, ast.ImportFrom) and "._" in f".{node.module}":
            paths.update(f"{node.module}.{alias.name}" for alias in node.names)
    return paths


class TextConfigTest(unittest.TestCase):
    def test_only_configs_that_may_nest_one_ask_for_their_text_config(self):
        # `max_positions` reads the text config, and asks `get_text_config()` (slow: each name it looks under goes
        # through the config's attribute hooks) only of configs that may nest one: for every config class of
        # transformers, one that doesn't is its own text config.
        checked = 0
        for name in dir(transformers):
            if not name.endswith("Config"):
                continue
            try:  # a lazily imported name whose module needs what this machine lacks raises here
                config_class = getattr(transformers, name)
                if not (inspect.isclass(config_class) and issubclass(config_class, transformers.PretrainedConfig)):
                    continue
                config = config_class()
            except Exception:  # noqa: BLE001 (also a config that needs arguments)
                continue
            checked += 1
            if not transformers_api._may_nest_a_text_config(config):
                self.assertIs(config.get_text_config(), config, name)
        self.assertGreater(checked, 100)

    def test_a_text_config_set_on_the_instance_is_read(self):
        config = LlamaConfig(max_position_embeddings=512)
        model = types.SimpleNamespace(config=config)
        self.assertEqual(transformers_api.max_positions(model), 512)
        config.text_config = LlamaConfig(max_position_embeddings=77)
        self.assertEqual(transformers_api.max_positions(model), 77)

    def test_a_config_class_with_its_own_get_text_config_is_asked(self):
        class OwnTextConfig(LlamaConfig):  # as a model's remote code may define it
            def get_text_config(self, *args, **kwargs):
                return LlamaConfig(max_position_embeddings=33)

        model = types.SimpleNamespace(config=OwnTextConfig(max_position_embeddings=512))
        self.assertEqual(transformers_api.max_positions(model), 33)


class TorchVersionTest(unittest.TestCase):
    def setUp(self):
        self.enterContext(as_new_process())  # nothing checked yet, and checked again after

    def test_every_private_torch_name_is_checked(self):
        # Each private torch name `upstream/` reads is one `upstream_problems` (or, for `aot_forward`, the AOT check)
        # looks up: listed whole, or a module or object on the way to one that is.
        listed = (*checks.PRIVATE_TORCH_NAMES, *checks.OPTIONAL_TORCH_NAMES, *checks.AOT_TORCH_NAMES)
        read = private_torch_paths()
        self.assertIn("torch._dynamo.config.recompile_limit", read)  # the positive control of the scan
        self.assertIn("torch._inductor.runtime.cache_dir_utils.cache_dir", read)
        unchecked = sorted(
            path for path in read if not any(name == path or name.startswith(path + ".") for name in listed)
        )
        self.assertEqual(unchecked, [])
        self.assertEqual(checks.torch_problems(), ())
        if versions.TORCH_VERSION.release[:2] >= versions.AOT_FORWARD_TORCH:
            self.assertIsNone(checks.aot_compile_problem())

    def test_missing_private_torch_name_raises_naming_it(self):
        with removed(torch._dynamo, "lookup_backend"):
            checks.torch_problems.cache_clear()
            with self.assertRaisesRegex(
                RuntimeError,
                rf"can't bucket `generate` on transformers .* with torch {re.escape(torch.__version__)}: "
                r"`torch\._dynamo\.lookup_backend` does not exist.*tested on .* "
                + re.escape(f"torch {versions.TESTED_TORCH[0]} to {versions.TESTED_TORCH[-1]}"),
            ):
                prefill_buckets.generate(tiny_llama(), random_ids(5), max_new_tokens=2, prefill_buckets=[8])

    def test_reshaped_compile_wrapper_raises(self):
        # A torch whose `torch.compile(module)` wrapper keeps the module under another name.
        with mock.patch.object(torch, "compile", lambda target, **kwargs: types.SimpleNamespace(dynamo_ctx=print)):
            problems = checks.torch_problems()
        self.assertIn("`torch.compile(module)._orig_mod` is not the module", problems)
        self.assertIn("`torch.compile(function)._torchdynamo_orig_callable` is not the function", problems)

    @unittest.skipIf(checks.aot_compile_problem() is not None, "aot_forward raises on this torch")
    def test_aot_forward_raises_where_torch_cannot_save(self):
        with removed(torch._dynamo.aot_compile.AOTCompiledFunction, "disable_guard_check"):
            with self.assertRaisesRegex(
                RuntimeError,
                r"`prefill_buckets\.aot_forward` can't compile ahead of time on torch .*"
                r"`torch\._dynamo\.aot_compile\.AOTCompiledFunction\.disable_guard_check` does not exist",
            ):
                prefill_buckets.aot_forward(tiny_llama())

    def test_aot_forward_refuses_before_torch_2_13(self):
        # On torch 2.11 (the oldest tested, and the GPU machine's), `aot_forward`'s graphs don't compile or save: a
        # clear error when it is made, never a crash inside a call. Real on 2.11; simulated on a newer torch.
        with mock.patch.object(versions, "TORCH_VERSION", Version("2.11.0")):
            checks.aot_compile_problem.cache_clear()
            with self.assertRaisesRegex(
                RuntimeError,
                r"`prefill_buckets\.aot_forward` can't compile ahead of time on torch .*: it needs torch 2\.13 or newer",
            ):
                prefill_buckets.aot_forward(tiny_llama())

    @unittest.skipIf(checks.aot_compile_problem() is not None, "aot_forward raises on this torch")
    def test_aot_forward_where_aot_compile_is_off_by_default(self):
        # torch gives `torch.compile(function)` its `aot_compile` only under `torch._dynamo.config.enable_aot_compile`,
        # off by default before 2.13: set, or not, the package's graphs compile ahead of time.
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        model = tiny_llama()
        config = GenerationConfig(cache_implementation="static", max_new_tokens=3, min_new_tokens=3, do_sample=False)
        expected = model.generate(random_ids(5), generation_config=config)
        with torch._dynamo.config.patch(enable_aot_compile=False):
            model.forward = prefill_buckets.aot_forward(model, backend="eager")
            got = prefill_buckets.generate(model, random_ids(5), generation_config=config, prefill_buckets=[8])
        self.assertEqual(got.tolist(), expected.tolist())
        self.assertEqual(model.forward.graphs_compiled, 2)  # prefill 8, decode: compiled ahead of time, not eager

    def test_torch_outside_the_tested_range_self_tests(self):
        # A real version outside the range (not a mocked verdict): the first bucketed call warns, naming torch, and
        # runs the self-test once; a step that changed meaning then fails loudly.
        model = tiny_llama()
        for installed in (OLDER_TORCH, NEWER_TORCH):
            with self.subTest(installed=installed), as_new_process():  # each version in a process of its own
                with mock.patch.object(versions, "TORCH_VERSION", Version(installed)):
                    self.assertTrue(gate.is_tested_transformers())
                    self.assertFalse(gate.is_tested_range())
                    with mock.patch("prefill_buckets.upstream.selftest.self_test", wraps=self_test) as spy:
                        with CaptureLogger(logging.get_logger("prefill_buckets")) as logs:
                            prefill_buckets.generate(model, random_ids(5), max_new_tokens=2, prefill_buckets=[8])
                            prefill_buckets.generate(model, random_ids(6), max_new_tokens=2, prefill_buckets=[8])
                self.assertEqual(spy.call_count, 1)
                oldest, newest = versions.TESTED_TORCH
                self.assertIn(f"torch {oldest} to {newest}, and this is torch {torch.__version__}", logs.out)
        with as_new_process(), mock.patch.object(versions, "TORCH_VERSION", Version(NEWER_TORCH)):
            with mock.patch("prefill_buckets.call.generation.strip_output", lambda output, plan: output):
                with self.assertRaisesRegex(RuntimeError, r"self-test failed on transformers .* \(torch "):
                    prefill_buckets.generate(model, random_ids(5), max_new_tokens=2, prefill_buckets=[8])

    def test_tested_torch_runs_no_self_test(self):
        for installed in ("2.11.0+cu130", "2.13.0+cpu", "2.14.1", "2.15.0+cu132"):
            with mock.patch.object(versions, "TORCH_VERSION", Version(installed)):
                self.assertTrue(gate.is_tested_torch(), installed)
        with mock.patch.object(versions, "TORCH_VERSION", Version("2.14.0.dev20260101")):
            self.assertFalse(gate.is_tested_torch())  # a nightly is not the release CI tested

# The coupling to private upstream API (`upstream/checks.py`, asked by the version gate, `upstream/gate.py`, through
# `call/hooks.py`): a missing or reshaped hook target, or private torch name, raises a clear error instead of being
# skipped. The self-test outside the tested range: test_selftest.py; the transformers names: test_transformers_api.py.

import ast
import contextlib
import re
import types
import unittest
from pathlib import Path
from unittest import mock

import torch
from packaging.version import Version
from transformers import GenerationConfig, LlamaForCausalLM
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets import upstream
from prefill_buckets.call import hooks
from prefill_buckets.state import PROCESS
from prefill_buckets.testing_utils import as_new_process
from prefill_buckets.upstream import checks, gate, versions
from prefill_buckets.upstream.gate import SELF_TEST_RUNNING
from prefill_buckets.upstream.selftest import self_test

from .tiny_models import random_ids, tiny_llama, tiny_llama_config


# A torch release just outside the tested range at each end (`versions.TESTED_TORCH`).
OLDER_TORCH = "2.10.0"
NEWER_TORCH = f"2.{Version(versions.TESTED_TORCH[-1]).minor + 1}.0"


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
                    hooks.check_upstream(model_class, generate=prefill_buckets.generate)

    def test_keyword_target_through_kwargs_is_exact(self):
        # Upstream passes `_prepare_generated_length` its arguments by keyword, and the hook passes them on as it got
        # them: an override that takes them through `**kwargs` works, as it does upstream.
        hooks.check_upstream(KeywordTargetThroughKwargs, generate=prefill_buckets.generate)
        torch.manual_seed(0)
        model = KeywordTargetThroughKwargs(tiny_llama_config()).eval()
        kwargs = {"max_new_tokens": 4, "do_sample": False}
        expected = model.generate(random_ids(5), **kwargs)
        actual = prefill_buckets.generate(
            model, random_ids(5), prefill_buckets=[8], prefill_padding_side="left", **kwargs
        )
        self.assertEqual(actual.tolist(), expected.tolist())

    def test_tested_version_passes(self):
        hooks.check_upstream(generate=prefill_buckets.generate)
        hooks.check_upstream(LlamaForCausalLM, generate=prefill_buckets.generate)

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
        with mock.patch.object(hooks, "check_upstream", wraps=hooks.check_upstream) as asked:
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
        hooks.check_upstream(LlamaForCausalLM, generate=prefill_buckets.generate)
        self.assertNotIn(LlamaForCausalLM, PROCESS.upstream_passed)


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

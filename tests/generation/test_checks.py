# Tests `upstream/checks.py`: the coupling to private torch API (asked by the version gate, `upstream/gate.py`), where a
# missing or reshaped private torch name raises a clear error instead of being skipped. The hook targets
# (`gate.check_upstream` through `call/hooks.py`): test_gate.py; the self-test outside the tested range:
# test_selftest.py; the transformers names: test_transformers_api.py.

import ast
import contextlib
import re
import types
import unittest
from pathlib import Path
from unittest import mock

import torch
from packaging.version import Version
from transformers import GenerationConfig
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets import upstream
from prefill_buckets.testing_utils import as_new_process
from prefill_buckets.upstream import checks, gate, versions
from prefill_buckets.upstream.selftest import self_test

from .tiny_models import random_ids, tiny_llama


# A torch release just outside the tested range at each end (`versions.TESTED_TORCH`).
OLDER_TORCH = "2.10.0"
NEWER_TORCH = f"2.{Version(versions.TESTED_TORCH[-1]).minor + 1}.0"


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

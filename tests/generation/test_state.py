# What the package remembers between calls lives in `state.py`: no module keeps its own mutable holder, and tests reset
# it all with one `testing_utils.as_new_process`.

import ast
import copy
import io
import tempfile
import unittest
from pathlib import Path

import torch
from transformers import GenerationConfig

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.compile import aot_forward
from prefill_buckets.state import PROCESS, SELF_TEST_PENDING, advice_for, called_by, state_of
from prefill_buckets.testing_utils import as_new_process
from prefill_buckets.upstream import checks

from .tiny_models import tiny_llama


PACKAGE = Path(prefill_buckets.__file__).parent
MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "WeakSet", "WeakKeyDictionary", "WeakValueDictionary"}


def module_holders(path: Path) -> set[str]:
    """
    The names a module binds at module level to a new mutable container (`{}`, `[]`, `set()`, `WeakSet()`, ...),
    but constants: an upper-case name (a table, `__all__`) is never changed after import.
    """
    holders = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets, value = [], None
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call)
            and getattr(value.func, "attr", getattr(value.func, "id", None)) in MUTABLE_CALLS
        )
        if mutable:
            names = (target.id for target in targets if isinstance(target, ast.Name))
            holders.update(name for name in names if not (name.startswith("__") or name.strip("_").isupper()))
    return holders


class EntryTest(unittest.TestCase):
    def test_called_by_names_the_caller_while_open_and_restores_it(self):
        # Advice about a model names the options of who calls it; `called_by` sets that for a block, and puts the
        # previous caller back, after an error too. A caller without a text of its own gets `generate`'s.
        model = tiny_llama()
        by_entry = {"generate": "a field", "serve": "an option"}

        def advice():
            return advice_for(state_of(model).entry, by_entry)

        self.assertEqual(advice(), "a field")
        state_of(model).entry = "serve"
        with self.assertRaises(RuntimeError), called_by(model, "precompile"):
            self.assertEqual(state_of(model).entry, "precompile")
            self.assertEqual(advice(), "a field")
            raise RuntimeError
        self.assertEqual(advice(), "an option")


class StateInOnePlaceTest(unittest.TestCase):
    def test_no_module_keeps_its_own_holder(self):
        found = {}
        for path in sorted(PACKAGE.rglob("*.py")):
            relative = path.relative_to(PACKAGE).as_posix()
            holders = module_holders(path)
            if holders:
                found[relative] = sorted(holders)
        self.assertEqual(found, {}, "module-level state: make it a field of `state.ProcessState`")

    def test_the_scan_finds_a_holder(self):
        # The positive control: the scan sees each form a holder takes.
        folder = Path(self.enterContext(tempfile.TemporaryDirectory()))
        path = folder / "module.py"
        path.write_text("import weakref\n_seen: dict = {}\n_live = weakref.WeakSet()\n_names = []\nLIMITS = [8]\n")
        self.assertEqual(module_holders(path), {"_seen", "_live", "_names"})

    def test_as_new_process_forgets_and_restores(self):
        model = tiny_llama()
        prefill_buckets.generate(model, torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=2, prefill_buckets=[8])
        verdicts, raised = PROCESS.upstream_verdicts, PROCESS.raised_recompile_limit
        self.assertIn(type(model), verdicts)  # the version gate keeps its verdict for the class
        with as_new_process() as process:
            self.assertIs(process, PROCESS)
            self.assertEqual(PROCESS.upstream_verdicts, {})
            self.assertIs(PROCESS.self_test_verdict, SELF_TEST_PENDING)
            self.assertEqual(checks.sliding_layer_problem.cache_info().currsize, 0)
            aot_forward.stage([({"fingerprint": "f", "key": "k"}, b"")], "a file")
            self.assertEqual(PROCESS.staged_from, ["a file"])
            PROCESS.raised_recompile_limit = (8, 64)
        self.assertIs(PROCESS.upstream_verdicts, verdicts)
        self.assertNotIn("a file", PROCESS.staged_from)
        self.assertNotIn("f", PROCESS.staged_forwards)
        self.assertEqual(PROCESS.raised_recompile_limit, raised)

    def test_enable_stays_as_the_test_left_it(self):
        self.addCleanup(prefill_buckets.disable)
        prefill_buckets.enable()
        with as_new_process():
            self.assertTrue(prefill_buckets.is_enabled())
        self.assertTrue(prefill_buckets.is_enabled())


class ModelStateTest(unittest.TestCase):
    def test_a_pickled_or_copied_model_starts_afresh(self):
        # Upstream's model pickles (`torch.save(model)`) and deep-copies after `generate`; so does one after bucketed
        # calls, whose state (hooked methods, kept cache tensors, graph accounts) is about the original object.
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        model = tiny_llama()
        model.compile(backend=GraphCounter(), dynamic=False, fullgraph=True)
        config = GenerationConfig(
            cache_implementation="static", max_new_tokens=4, min_new_tokens=4, do_sample=False, prefill_buckets=[16]
        )
        prompt = torch.arange(5, 12).unsqueeze(0)
        expected = prefill_buckets.generate(model, prompt, generation_config=config)
        self.assertIsNotNone(state_of(model).kept_cache)  # the premise: what the state holds
        self.assertNotEqual(state_of(model).hooked, {})
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        for other in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
            self.assertIsNone(state_of(other).kept_cache)
            self.assertEqual(state_of(other).hooked, {})
            self.assertEqual(
                prefill_buckets.generate(other, prompt, generation_config=config).tolist(), expected.tolist()
            )


if __name__ == "__main__":
    unittest.main()

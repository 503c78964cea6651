# How much of the package one call needs: the modules whose functions a compiled, bucketed `generate` enters (counted
# with `sys.setprofile`), per padding side. Issue 34's target is at most 12; the bound here is what the layout needs
# now, so a change that spreads a call over more modules fails, and one that gathers it lowers the bound.

import sys
import unittest
from pathlib import Path

import torch
from parameterized import parameterized
from transformers import GenerationConfig

import prefill_buckets
from prefill_buckets import GraphCounter

from .tiny_models import tiny_llama


PACKAGE = Path(prefill_buckets.__file__).parent
# The modules a second call (warm: nothing compiles) on each side enters, at most.
MODULES_PER_CALL = {"left": 18, "right": 19}


def modules_entered(call) -> dict[str, int]:
    """The package's modules (paths relative to it) whose functions `call()` enters, with how many calls each."""
    entered = {}
    prefix = str(PACKAGE) + "/"

    def profile(frame, event, arg):
        filename = frame.f_code.co_filename
        if event == "call" and filename.startswith(prefix):
            module = filename[len(prefix) :]
            entered[module] = entered.get(module, 0) + 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered


class ModulesPerCallTest(unittest.TestCase):
    @parameterized.expand([("left",), ("right",)])
    def test_a_warm_compiled_bucketed_call(self, side):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        model = tiny_llama()
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = GenerationConfig(
            cache_implementation="static",
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
            prefill_buckets=[16],
            prefill_padding_side=side,
        )
        prompt = torch.arange(5, 12).unsqueeze(0)
        expected = prefill_buckets.generate(model, prompt, generation_config=config)  # compiles: not counted
        calls = counter.calls
        output = []
        entered = modules_entered(
            lambda: output.append(prefill_buckets.generate(model, prompt, generation_config=config))
        )
        self.assertTrue(torch.equal(output[0], expected))
        self.assertEqual(counter.calls - calls, 4, "every forward ran compiled")
        self.assertIn("call/generation.py", entered)  # the positive control: the profile sees the package
        report = ", ".join(f"{module} {count}" for module, count in sorted(entered.items(), key=lambda e: -e[1]))
        self.assertLessEqual(len(entered), MODULES_PER_CALL[side], report)


if __name__ == "__main__":
    unittest.main()

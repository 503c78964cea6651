# `generate` (`call/generation.py`): the warnings of a call on a compiled forward, one new token per call (prefill
# only): a second prompt length of an unbucketed call recompiles, and a prompt longer than the largest bucket; and the
# warning of a call that ran unpadded, on upstream's path, past torch's recompile limit.
#
# The model, the counting backend and `CompilationTestCase` are shared (`tiny_models.py`): `GraphCounter` (eager
# backend) counts graphs and compiled calls, every compile uses `dynamic=False, fullgraph=True` unless a test says
# otherwise, and `min_new_tokens == max_new_tokens`, so "compiled calls == forwards" proves no forward ran eagerly.

import unittest

import torch
from parameterized import parameterized
from transformers.testing_utils import CaptureLogger

import prefill_buckets
from prefill_buckets import GraphCounter

from .tiny_models import BUCKETS, CompilationTestCase, logger, make_config, make_model, make_prompt, make_reference


# ---------------------------------------------------------------------------------------------------------------------
# Warnings
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
    # test_compiled_calls.py's `CompileEntryPointTest.test_compiled_wrapper`, on the same calls that count its compiled forwards.

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


class UnpaddedCallTest(CompilationTestCase):
    """A call with bucket fields that runs unpadded is upstream's: torch's refusals at its limit are said all the same."""

    @parameterized.expand([("at_the_limit", 2, True), ("under_it", 64, False)])
    def test_refusals_are_said(self, _, limit, refused):
        # Without a cache every step's forward runs the whole sequence, a token longer than the last: a graph per step
        # on a forward compiled with `dynamic=False`, which the package leaves to upstream (unpadded).
        model = make_model()
        reference = make_reference(model)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False)
        config = make_config(use_cache=False, prefill_buckets=BUCKETS)
        with torch._dynamo.config.patch(recompile_limit=limit), CaptureLogger(logger) as captured:
            got = prefill_buckets.generate(model, make_prompt(5), generation_config=config)
        expected = reference.generate(make_prompt(5), generation_config=make_config(use_cache=False))
        self.assertEqual(got.tolist(), expected.tolist())
        self.assertIn("are ignored for this call", captured.out)
        self.assertEqual("Torch refused to compile the forward of" in captured.out, refused, captured.out)
        self.assertEqual(counter.graphs, limit if refused else len(expected[0]) - 5)


if __name__ == "__main__":
    unittest.main()

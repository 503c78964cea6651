# Tests `upstream/gate.py`'s `check_upstream`, as `call/hooks.py` binds it to the declared hooks (`hooks.check_upstream`):
# a missing or reshaped hook target, or a model's own step that can't take or pass on the mask, raises a clear error
# instead of being skipped; a class that passed is not asked again. Moved from test_checks.py, which keeps the private
# torch names (`upstream/checks.py`) and the torch range's self-test.

import unittest
from unittest import mock

import torch
from transformers import LlamaForCausalLM

import prefill_buckets
from prefill_buckets.call import hooks
from prefill_buckets.state import PROCESS
from prefill_buckets.testing_utils import as_new_process
from prefill_buckets.upstream.gate import SELF_TEST_RUNNING

from .tiny_models import random_ids, tiny_llama, tiny_llama_config


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


if __name__ == "__main__":
    unittest.main()

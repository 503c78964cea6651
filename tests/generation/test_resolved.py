"""`call/resolved.py`: a call's generation values are those of upstream's own preparation step, made once a call; and
the BOS prompt upstream starts from without one (`bos_prompt`)."""

import unittest
from unittest import mock

import torch
from transformers import GenerationConfig, LlamaForCausalLM

import prefill_buckets
from prefill_buckets.call.resolved import bind_call, bos_prompt, prompt_rows, resolve_call, resolve_settings

from .tiny_models import assert_same_generation, single_thread_module, static_config, tiny_llama, tiny_llama_config


setUpModule, tearDownModule = single_thread_module()


class ThreeTokens(LlamaForCausalLM):
    """A model whose own preparation step generates 3 tokens, whatever the call asks: a rule upstream's step knows."""

    def _prepare_generation_config(self, generation_config, **kwargs):
        config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        config.max_new_tokens = config.min_new_tokens = 3
        return config, model_kwargs


def _resolved(model, **kwargs):
    arguments, model_kwargs, field_kwargs = bind_call(model, (), kwargs)
    return resolve_call(model, None, arguments, model_kwargs, field_kwargs)


class PreparedConfigTest(unittest.TestCase):
    def test_the_settings_are_read_off_upstreams_step_override_included(self):
        torch.manual_seed(0)
        model = ThreeTokens(tiny_llama_config()).eval()
        ids = torch.randint(3, 100, (1, 10))
        call = _resolved(model, input_ids=ids, generation_config=static_config(8), prefill_buckets=[16])
        self.assertEqual(call.settings.max_new_tokens, 3)  # the step's, not the argument's 8
        self.assertEqual(call.settings.new_tokens(10), 3)
        ours = prefill_buckets.generate(
            model,
            input_ids=ids,
            generation_config=static_config(8),
            prefill_buckets=[16],
            return_dict_in_generate=True,
        )
        theirs = model.generate(input_ids=ids, generation_config=static_config(8), return_dict_in_generate=True)
        self.assertEqual(ours.sequences.shape[1], 13)
        assert_same_generation(ours, theirs, scores=False)

    def test_the_global_default_max_length_is_upstreams(self):
        model = tiny_llama()
        model.generation_config = GenerationConfig()
        call = _resolved(model, input_ids=torch.ones(1, 4, dtype=torch.long), prefill_buckets=[16])
        self.assertEqual(call.settings.max_length, GenerationConfig._get_default_generation_params()["max_length"])

    def test_a_bucketed_call_prepares_its_config_once(self):
        # Upstream's step runs once for the call (in step 1); its hook hands upstream `generate` the same config.
        model = tiny_llama()
        ids = torch.randint(3, 100, (2, 9))
        step = LlamaForCausalLM._prepare_generation_config
        with mock.patch.object(LlamaForCausalLM, "_prepare_generation_config", autospec=True, side_effect=step) as spy:
            ours = prefill_buckets.generate(
                model,
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                generation_config=static_config(4),
                prefill_buckets=[16],
                output_scores=True,
                return_dict_in_generate=True,
            )
        self.assertEqual(spy.call_count, 1)
        theirs = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=static_config(4),
            output_scores=True,
            return_dict_in_generate=True,
        )
        assert_same_generation(ours, theirs)

    def test_an_unbucketed_eager_call_does_not_prepare_a_config_of_its_own(self):
        model = tiny_llama()
        step = LlamaForCausalLM._prepare_generation_config
        with mock.patch.object(LlamaForCausalLM, "_prepare_generation_config", autospec=True, side_effect=step) as spy:
            prefill_buckets.generate(model, input_ids=torch.ones(1, 4, dtype=torch.long), max_new_tokens=2)
        self.assertEqual(spy.call_count, 1)  # upstream's own


class BosPromptTest(unittest.TestCase):
    def test_one_bos_token_per_row(self):
        model = tiny_llama()
        settings = resolve_settings(model, model.generation_config, {}, {})
        mask = torch.ones(3, 5, dtype=torch.long)
        self.assertEqual(prompt_rows({"attention_mask": mask}), 3)
        self.assertEqual(prompt_rows({}), 1)
        prompt = bos_prompt(model, settings, {"attention_mask": mask})
        self.assertTrue(torch.equal(prompt, torch.full((3, 1), settings.bos_token_id, dtype=torch.long)))

    def test_without_bos_token_id(self):
        model = tiny_llama()
        model.generation_config.bos_token_id = None
        model.config.bos_token_id = None
        settings = resolve_settings(model, model.generation_config, {}, {})
        with self.assertRaisesRegex(ValueError, "`bos_token_id` has to be defined when no `input_ids` are provided"):
            bos_prompt(model, settings, {})


if __name__ == "__main__":
    unittest.main()

# Unit tests of `upstream/candidates.py`: which candidate generator a call gets (`is_prompt_lookup`,
# `is_assistant_model`), the most candidates one check holds (`most_drafted`), the drafters padding would change
# (`drafter_padding_changes`, `drafts_from_padding`), and the assistant's processor merge (`processors_merged_by`), on
# upstream's own generators and a tiny Llama.

import dataclasses
import unittest

import torch
from transformers import GenerationConfig, LogitsProcessorList, MinLengthLogitsProcessor
from transformers.generation.candidate_generator import (
    AssistedCandidateGenerator,
    AssistedCandidateGeneratorDifferentTokenizers,
    PromptLookupCandidateGenerator,
)

from prefill_buckets.call.resolved import resolve_settings
from prefill_buckets.upstream import candidates

from .tiny_models import tiny_llama


class GeneratorsTest(unittest.TestCase):
    def test_most_drafted_per_generator(self):
        # The most candidates a check holds, as each of upstream's generators drafts them, never past what remains.
        lookup = PromptLookupCandidateGenerator(num_output_tokens=4, max_length=64)
        self.assertEqual(candidates.most_drafted(lookup, 10), 4)
        self.assertEqual(candidates.most_drafted(lookup, 2), 2)
        assistant = tiny_llama()
        assistant.generation_config.num_assistant_tokens = 6
        for schedule, expected in (("constant", 6), ("heuristic", 10), ("heuristic_transient", 10)):
            assistant.generation_config.num_assistant_tokens_schedule = schedule
            ids = torch.ones(1, 3, dtype=torch.long)
            generator = AssistedCandidateGenerator(ids, assistant, GenerationConfig(), {"attention_mask": ids})
            self.assertEqual(candidates.most_drafted(generator, 10), expected, schedule)

    def test_kinds(self):
        lookup = PromptLookupCandidateGenerator(num_output_tokens=4, max_length=64)
        ids = torch.ones(1, 3, dtype=torch.long)
        assistant = AssistedCandidateGenerator(ids, tiny_llama(), GenerationConfig(), {"attention_mask": ids})
        self.assertEqual((candidates.is_prompt_lookup(lookup), candidates.is_assistant_model(lookup)), (True, False))
        self.assertEqual(
            (candidates.is_prompt_lookup(assistant), candidates.is_assistant_model(assistant)), (False, True)
        )
        # Neither drafts from what padding changes.
        self.assertFalse(candidates.drafts_from_padding(lookup))
        self.assertFalse(candidates.drafts_from_padding(assistant))

    def test_most_drafted_of_another_generator(self):
        # A generator that says nothing of itself may draft every remaining token; never fewer than none.
        self.assertEqual(candidates.most_drafted(object(), 7), 7)
        self.assertEqual(candidates.most_drafted(object(), -2), 0)


class DrafterPaddingChangesTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        model = tiny_llama()
        cls.settings = resolve_settings(model, GenerationConfig(do_sample=False), {}, {})
        cls.assistant = tiny_llama(seed=1)

    def changes(self, assistant=None, tokenizers=False, **settings):
        return candidates.drafter_padding_changes(
            dataclasses.replace(self.settings, **settings), assistant, tokenizers
        )

    def test_drafters_padding_changes(self):
        self.assertIn("`use_mtp`", self.changes(use_mtp=True))
        self.assertIn("DFlash", self.changes(speculation_type="dflash"))
        self.assertIn("`assistant_tokenizer`", self.changes(self.assistant, tokenizers=True))
        gemma4 = type("Gemma4AssistantForCausalLM", (), {})()
        self.assertIn("Gemma4AssistantForCausalLM assistant", self.changes(gemma4))

    def test_drafters_padding_does_not_change(self):
        self.assertIsNone(self.changes())
        self.assertIsNone(self.changes(self.assistant))  # same tokenizer: it drafts from the padded ids, masked
        self.assertIsNone(self.changes(tokenizers=True))  # tokenizers without an assistant

    def test_drafts_from_padding(self):
        # A drafter that reads the target's outputs at every position, and an assistant with another tokenizer.
        reads_outputs = type("Drafter", (), {"requires_model_outputs": True})()
        self.assertTrue(candidates.drafts_from_padding(reads_outputs))
        other_tokenizer = object.__new__(AssistedCandidateGeneratorDifferentTokenizers)
        self.assertTrue(candidates.drafts_from_padding(other_tokenizer))


class ProcessorsMergedByTest(unittest.TestCase):
    def test_generate_merges_through_the_wrap_while_open(self):
        model, merged = tiny_llama(), []

        def wrap(merge):
            def merging(default, custom):
                merged.append(len(custom))
                return merge(default, custom)

            return merging

        ids = torch.arange(3, 8)[None]
        passed = LogitsProcessorList([MinLengthLogitsProcessor(2, eos_token_id=1)])
        with candidates.processors_merged_by(model, wrap):
            with_wrap = model.generate(ids, max_new_tokens=2, do_sample=False, logits_processor=passed)
        self.assertIn(1, merged)  # the processor passed in went through the wrap, into upstream's merge
        self.assertNotIn("_merge_criteria_processor_list", model.__dict__)  # upstream's own again
        calls = len(merged)
        without = model.generate(ids, max_new_tokens=2, do_sample=False, logits_processor=passed)
        self.assertEqual(len(merged), calls)
        self.assertEqual(with_wrap.tolist(), without.tolist())

    def test_an_instance_merge_is_put_back(self):
        model = tiny_llama()
        own = model._merge_criteria_processor_list
        object.__setattr__(model, "_merge_criteria_processor_list", own)
        with candidates.processors_merged_by(model, lambda merge: "wrapped"):
            self.assertEqual(model._merge_criteria_processor_list, "wrapped")
        self.assertIs(model.__dict__["_merge_criteria_processor_list"], own)


if __name__ == "__main__":
    unittest.main()

"""Logits processors and stopping criteria that read token content see the user's ids, never the added padding
(`call/views.py`: the views of the objects upstream `generate` hands the padded ids to). `PromptReadingProcessorsTest`
(upstream's processors that read the prompt, where the pad token is eos) moved whole from test_equivalence.py, whose
models, ids and forward recorder it shares (in tiny_models.py)."""

import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria

import prefill_buckets

from .tiny_models import ForwardRecorder, get_model, random_batch_ids, tiny_llama


class RecordingProcessor(LogitsProcessor):
    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores):
        self.seen.append(input_ids.clone())
        return scores


class RecordingCriterion(StoppingCriteria):
    def __init__(self):
        self.seen = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(input_ids.clone())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


class ProcessorViewTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_llama()
        cls.prompt = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))

    def test_custom_processor_and_criterion_see_unpadded_ids(self):
        processor, criterion = RecordingProcessor(), RecordingCriterion()
        reference_processor, reference_criterion = RecordingProcessor(), RecordingCriterion()
        config = GenerationConfig(max_new_tokens=4, do_sample=False)
        ours = prefill_buckets.generate(
            self.model,
            self.prompt,
            generation_config=config,
            logits_processor=[processor],
            stopping_criteria=[criterion],
            prefill_buckets=[16],
        )
        theirs = self.model.generate(
            self.prompt,
            generation_config=config,
            logits_processor=[reference_processor],
            stopping_criteria=[reference_criterion],
        )
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        for got, want in [(processor.seen, reference_processor.seen), (criterion.seen, reference_criterion.seen)]:
            self.assertEqual(len(got), len(want))
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)

    def test_prefix_allowed_tokens_fn_sees_unpadded_ids(self):
        seen = {}

        def allow(batch_id, sent):
            seen.setdefault("ours" if recording["ours"] else "theirs", []).append(sent.clone())
            return list(range(3, 64))

        config = GenerationConfig(max_new_tokens=3, do_sample=False)
        recording = {"ours": True}
        ours = prefill_buckets.generate(
            self.model, self.prompt, generation_config=config, prefix_allowed_tokens_fn=allow, prefill_buckets=[16]
        )
        recording["ours"] = False
        theirs = self.model.generate(self.prompt, generation_config=config, prefix_allowed_tokens_fn=allow)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        self.assertEqual([s.shape[-1] for s in seen["ours"]], [s.shape[-1] for s in seen["theirs"]])

    def test_no_repeat_ngram_with_pad_as_eos(self):
        # The pad id fills the added columns; a 1-gram ban over the padded ids would ban it, here eos.
        config = GenerationConfig(max_new_tokens=6, do_sample=False)
        first = int(self.model.generate(self.prompt[:1], generation_config=config)[0, 5])
        config = GenerationConfig(
            max_new_tokens=6, do_sample=False, no_repeat_ngram_size=1, pad_token_id=first, eos_token_id=first
        )
        ours = prefill_buckets.generate(self.model, self.prompt[:1], generation_config=config, prefill_buckets=[8])
        theirs = self.model.generate(self.prompt[:1], generation_config=config)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)

    def test_min_length_and_forced_eos_keep_counting_the_unpadded_prompt(self):
        config = GenerationConfig(max_length=12, min_length=11, forced_eos_token_id=1, do_sample=False)
        ours = prefill_buckets.generate(self.model, self.prompt, generation_config=config, prefill_buckets=[16])
        theirs = self.model.generate(self.prompt, generation_config=config)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        self.assertEqual(int(ours[0, -1]), 1)


def repetitive_prompt(length: int, seed: int) -> torch.Tensor:
    """A prompt of `length` ids that repeats 4 of them: prompt lookup finds candidates in it."""
    base = torch.randint(3, 20, (1, 4), generator=torch.Generator().manual_seed(seed))
    return base.repeat(1, length // 4 + 1)[:, :length]


class PromptLookupProcessorsTest(unittest.TestCase):
    """Prompt lookup checks each candidate against the logits processors: they see the ids an unpadded run has there too."""

    @classmethod
    def setUpClass(cls):
        cls.model = tiny_llama()

    def test_the_candidate_search_shows_processors_the_unpadded_ids(self):
        prompt = repetitive_prompt(5, seed=0)  # bucket 8: 3 columns added
        seen = {}
        for name, run in [
            ("ours", lambda **kwargs: prefill_buckets.generate(self.model, prompt, prefill_buckets=[8, 16], **kwargs)),
            ("theirs", lambda **kwargs: self.model.generate(prompt, **kwargs)),
        ]:
            processor = RecordingProcessor()
            seen[name] = (
                run(max_new_tokens=6, do_sample=False, prompt_lookup_num_tokens=3, logits_processor=[processor]),
                processor.seen,
            )
        torch.testing.assert_close(seen["ours"][0], seen["theirs"][0], rtol=0, atol=0)
        ours, theirs = seen["ours"][1], seen["theirs"][1]
        self.assertGreater(len(theirs), 8)  # the candidate search called it too, not only the 6 steps
        self.assertEqual([ids.tolist() for ids in ours], [ids.tolist() for ids in theirs])

    @parameterized.expand(
        [
            (f"{name}_{length}", processors, length, seed)
            for name, processors in [
                ("repetition_penalty", {"repetition_penalty": 1.5}),
                ("no_repeat_ngram", {"no_repeat_ngram_size": 3}),
                ("min_new_tokens", {"min_new_tokens": 6, "eos_token_id": 9}),
            ]
            for length, seed in [(5, 0), (17, 4)]
        ]
    )
    def test_sampled_with_processors_as_unpadded(self, _, processors, length, seed):
        # Sampling draws once per position the target model checks: other candidates, other draws.
        prompt = repetitive_prompt(length, seed)
        config = GenerationConfig(max_new_tokens=8, do_sample=True, prompt_lookup_num_tokens=3, **processors)
        torch.manual_seed(seed)
        theirs = self.model.generate(prompt, generation_config=config)
        torch.manual_seed(seed)
        ours = prefill_buckets.generate(self.model, prompt, generation_config=config, prefill_buckets=[8, 32])
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


class InputsEmbedsProcessorsTest(unittest.TestCase):
    def test_repetition_penalty_skips_the_users_padding_only(self):
        # From transformers 5.23 the penalty skips as many ids as the mask has leading zeros. From `inputs_embeds`
        # alone the ids hold only the new tokens, so the added positions must not count: they would exempt the first
        # new tokens from the penalty.
        model = get_model("gpt2_no_pad")
        embeds = model.get_input_embeddings()(random_batch_ids(1, 13)).detach()
        config = GenerationConfig(max_new_tokens=6, do_sample=False, repetition_penalty=1.5)
        theirs = model.generate(inputs_embeds=embeds, generation_config=config)
        ours = prefill_buckets.generate(model, inputs_embeds=embeds, generation_config=config, prefill_buckets=[16])
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


class PromptReadingProcessorsTest(unittest.TestCase):
    """
    Logits processors that read the whole `input_ids`, prompt included, must not see the added padding: in the
    common setup where the pad token is the eos token, a processor that bans prompt tokens would ban eos.
    """

    @classmethod
    def setUpClass(cls):
        cls.model = get_model("llama")

    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)

    @parameterized.expand(
        [
            ("repetition_penalty", {"repetition_penalty": 1e6}),
            ("no_repeat_ngram_size_1", {"no_repeat_ngram_size": 1}),
            ("no_repeat_ngram_size_2", {"no_repeat_ngram_size": 2}),
        ]
    )
    def test_pad_token_is_eos(self, _, processor_kwargs):
        input_ids = random_batch_ids(1, 5, seed=3)
        # The token the model emits first is made pad and eos: unpadded, generation stops after one token.
        eos = self.model.generate(input_ids, max_new_tokens=1, do_sample=False)[0, -1].item()
        kwargs = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": eos, "eos_token_id": eos}
        plain = self.model.generate(input_ids, **kwargs, **processor_kwargs)
        with ForwardRecorder(self.model) as recorder:
            bucketed = prefill_buckets.generate(
                self.model, input_ids, prefill_buckets=[8], **kwargs, **processor_kwargs
            )
        self.assertEqual(recorder.first_length, 8)
        self.assertEqual(plain[0, 5:].tolist(), [eos])
        self.assertEqual(bucketed.tolist(), plain.tolist())

    def test_repetition_penalty_with_left_padding(self):
        # From transformers 5.23 on, upstream's repetition penalty skips the left padding it reads off the mask.
        input_ids = random_batch_ids(2, 7, seed=4)
        attention_mask = torch.ones_like(input_ids)
        attention_mask[0, :3] = 0
        kwargs = {
            "max_new_tokens": 10,
            "do_sample": False,
            "repetition_penalty": 5.0,
            "attention_mask": attention_mask,
        }
        plain = self.model.generate(input_ids, **kwargs)
        bucketed = prefill_buckets.generate(self.model, input_ids, prefill_buckets=[16], **kwargs)
        self.assertEqual(bucketed.tolist(), plain.tolist())


if __name__ == "__main__":
    unittest.main()

# The one decision of how a call is padded (`call/decision.py`): every reason a call runs unpadded is decided there,
# before anything is padded, and is the reason the log names; `UNSUPPORTED` is data that the docs show.

import unittest
from unittest import mock

import torch
from transformers import GenerationConfig, StaticCache
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets.call import decision, generation
from prefill_buckets.call.decision import UNSUPPORTED, unsupported_table

from .test_equivalence import get_model
from .test_padding_rule import REFERENCE
from .tiny_models import CACHE, tiny_llama


def outcome_rows(text: str) -> list[str]:
    """The rows of the `| case | outcome |` table in `text`, as lines."""
    lines = text.splitlines()
    start = lines.index("| case | outcome |")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


class UnsupportedTableTest(unittest.TestCase):
    expected = unsupported_table().splitlines()[2:]

    def test_reference_page_shows_the_table(self):
        self.assertEqual(outcome_rows(REFERENCE.read_text(encoding="utf-8")), self.expected)

    def test_docstring_shows_the_table(self):
        self.assertEqual(outcome_rows(decision.__doc__), self.expected)

    def test_positive_control(self):
        text = REFERENCE.read_text(encoding="utf-8")
        broken = text.replace(self.expected[1] + "\n" + self.expected[2], self.expected[2] + "\n" + self.expected[1])
        self.assertNotEqual(broken, text)
        self.assertNotEqual(outcome_rows(broken), self.expected)

    def test_the_table_is_well_formed(self):
        self.assertEqual(len({case.case for case in UNSUPPORTED}), len(UNSUPPORTED), "each case once")
        self.assertTrue(UNSUPPORTED[0].error)  # an encoder-decoder model raises before any other case is read


class OneDecisionTest(unittest.TestCase):
    """A call that runs unpadded is decided so in `choose_side`: the reason logged is its reason, nothing is planned."""

    def setUp(self):
        self.decisions = []
        original = generation.choose_side

        def spy(*args, **kwargs):
            self.decisions.append(original(*args, **kwargs))
            return self.decisions[-1]

        for patcher in (
            mock.patch.object(generation, "choose_side", spy),
            mock.patch.object(generation, "plan_call", side_effect=AssertionError("an unpadded call is not planned")),
        ):
            patcher.start()
            self.addCleanup(patcher.stop)
        logging.get_logger("prefill_buckets").warning_once.cache_clear()  # each test's reason is logged again

    def assert_unpadded(self, model, prompt, expected, **kwargs) -> None:
        logger = logging.get_logger("prefill_buckets.call.generation")
        with CaptureLogger(logger) as captured:
            tokens = prefill_buckets.generate(model, prompt, **kwargs)
        self.assertEqual(tokens.tolist(), expected.tolist())
        self.assertEqual(self.decisions[-1].side, "unpadded")
        self.assertIn(f"are ignored for this call: {self.decisions[-1].reason}.", captured.out)

    def test_left_padding_in_front_of_an_unpadded_calls_tokens(self):
        model = tiny_llama()
        config = GenerationConfig(max_new_tokens=3, do_sample=False)
        prompt = torch.arange(3, 13).unsqueeze(0)
        expected_cache = StaticCache(config=model.config, max_cache_len=64)
        first = model.generate(prompt, generation_config=config, **{CACHE: expected_cache})
        turn = torch.cat([first, torch.arange(20, 25).unsqueeze(0)], dim=1)
        expected = model.generate(turn, generation_config=config, **{CACHE: expected_cache})

        cache = StaticCache(config=model.config, max_cache_len=64)
        model.generate(prompt, generation_config=config, **{CACHE: cache})  # unpadded: no bucket fields
        fields = {"prefill_buckets": [32], "prefill_padding_side": "left"}
        self.assert_unpadded(model, turn, expected, generation_config=config, **{CACHE: cache}, **fields)
        self.assertIn("already holds tokens from an unpadded call", self.decisions[-1].reason)

    def test_no_room_in_the_cache_passed_in(self):
        model = tiny_llama()
        config = GenerationConfig(max_new_tokens=3, do_sample=False)
        prompt = torch.arange(3, 13).unsqueeze(0)
        expected = model.generate(
            prompt, generation_config=config, **{CACHE: StaticCache(config=model.config, max_cache_len=32)}
        )
        cache = StaticCache(config=model.config, max_cache_len=32)  # fewer than a 64-token bucket needs
        fields = {"prefill_buckets": [64], "prefill_padding_side": "left"}
        self.assert_unpadded(model, prompt, expected, generation_config=config, **{CACHE: cache}, **fields)
        self.assertIn("the cache passed in has 32 slots", self.decisions[-1].reason)

    def test_prompt_lookup_from_inputs_embeds_alone(self):
        # Upstream cuts the mask to the ids (the candidates): padded, the prompt's mask would be lost, and the tokens.
        model = tiny_llama()
        embeds = model.get_input_embeddings()(torch.arange(3, 8).unsqueeze(0)).detach()
        config = GenerationConfig(max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)
        expected = model.generate(inputs_embeds=embeds, generation_config=config)
        self.assert_unpadded(
            model, None, expected, inputs_embeds=embeds, generation_config=config, prefill_buckets=[16]
        )
        self.assertIn("decoding from `inputs_embeds` alone", self.decisions[-1].reason)

    def test_assisted_decoding_from_inputs_embeds_alone(self):
        # One new token: upstream's assisted decoding from embeddings runs (it fails past one), on the mask cut to
        # the ids; padded, the pad position would be attended.
        model = tiny_llama()
        embeds = model.get_input_embeddings()(torch.tensor([[47]])).detach()
        config = GenerationConfig(max_new_tokens=1, do_sample=False)
        expected = model.generate(inputs_embeds=embeds, generation_config=config, assistant_model=tiny_llama(seed=1))
        self.assert_unpadded(
            model, None, expected, inputs_embeds=embeds, generation_config=config, assistant_model=tiny_llama(seed=1),
            prefill_buckets=[2],
        )  # fmt: skip
        self.assertIn("assisted and prompt-lookup decoding from `inputs_embeds` alone", self.decisions[-1].reason)

    def test_prompt_lookup_on_a_static_cache_with_sliding_window_layers(self):
        # Unpadded, the cache (2 + 3 slots) fits the window of 8, so upstream can crop it; padded to 10 it would not.
        model = get_model.__wrapped__("mistral_sliding")  # a fresh one: upstream keeps a longer cache a call made
        prompt = torch.arange(20, 22).unsqueeze(0)
        config = GenerationConfig(
            max_new_tokens=3, do_sample=False, prompt_lookup_num_tokens=3, cache_implementation="static"
        )
        expected = model.generate(prompt, generation_config=config)
        self.assert_unpadded(model, prompt, expected, generation_config=config, prefill_pad_to_multiple_of=10)
        self.assertIn("static sliding-window layer allows only", self.decisions[-1].reason)


if __name__ == "__main__":
    unittest.main()

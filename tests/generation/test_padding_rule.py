# How a call is padded is data: `decision.DECISION`, one table of rows (condition, outcome, why, reason), checked in
# order, the first that applies deciding. The docs' What runs exactly page shows that table as `decision_table`
# renders it: a hand edit of the page, or a row changed in the code and not on the page, fails here.

import dataclasses
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import torch
from transformers import GenerationConfig, StaticCache

import prefill_buckets
from prefill_buckets.call import decision, generation
from prefill_buckets.call.decision import DECISION, OUTCOMES, decision_table
from prefill_buckets.call.padding_side import RuleFacts

from .tiny_models import tiny_llama


REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "source" / "en" / "reference.md"  # What runs exactly
HEADER = "| case | outcome | why |"


def shown_table(text: str) -> str:
    """The `| case | outcome | why |` table of `text`: its header and the rows after it, up to the first other line."""
    lines = text.splitlines()
    if lines.count(HEADER) != 1:
        raise AssertionError(f"the page has {lines.count(HEADER)} `{HEADER}` tables, not one")
    start = lines.index(HEADER)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


class DecisionTableTest(unittest.TestCase):
    def test_reference_page_shows_the_table(self):
        shown = shown_table(REFERENCE.read_text(encoding="utf-8"))
        self.assertEqual(
            shown,
            decision_table(),
            "the reference page shows `decision_table()`: paste `python -m prefill_buckets.call.decision` there",
        )

    def test_the_table_is_well_formed(self):
        self.assertEqual(len({row.case for row in DECISION}), len(DECISION), "each case once")
        self.assertTrue(all(row.outcome in OUTCOMES for row in DECISION))
        self.assertTrue(all("|" not in row.case + row.why for row in DECISION), "a cell holds no column separator")
        self.assertEqual(DECISION[0].outcome, "raise")  # an encoder-decoder model raises before any other row is read
        # The last row takes every call the others leave, and it is the only one that does: no row hides behind it.
        self.assertEqual(DECISION[-1].outcome, "right")
        self.assertIs(DECISION[-1].condition(None), True)

    def test_positive_control(self):
        # A page whose table lost a row, swapped two, changed an outcome, or reworded a cell does not show the table.
        text = REFERENCE.read_text(encoding="utf-8")
        rows = decision_table().splitlines()[2:]
        for broken in (
            text.replace(rows[3] + "\n", ""),
            text.replace(rows[3] + "\n" + rows[4], rows[4] + "\n" + rows[3]),
            text.replace(rows[1], rows[1].replace("| unpadded |", "| left |")),
            text.replace(rows[-1], rows[-1].replace("exact", "exact, always")),
        ):
            self.assertNotEqual(broken, text)
            self.assertNotEqual(shown_table(broken), decision_table())


def settings(**changes):
    return lambda facts: {"settings": dataclasses.replace(facts.settings, **changes)}


def breaks(name: str):
    """A model that breaks the side assumption `name` (a predicate of `side_assumptions`), and no other."""
    return lambda facts: {"breaks": lambda assumption: assumption.__name__ == name}


def takes_no(parameter: str):
    return mock.patch.object(decision, "forward_takes", lambda model, name: name != parameter)


LEFT_ONLY = {"not_right": "a `left` row applies"}
# A local window counted from the cache's end (known by class name), of 4 tokens.
GPT_NEO = type(
    "GPTNeoForCausalLM",
    (),
    {"config": SimpleNamespace(is_encoder_decoder=False, window_size=4, attention_layers=["global", "local"])},
)
STATIC = {"cache": "static"}  # a `StaticCache` passed in (made per case, with `SLOTS` slots)
RECORD = SimpleNamespace(columns=0, padded_rows=1, rows=1)  # a right-padded call's record: no padding in front


# One call per row of `DECISION`, in its order: the facts that differ from a plain one (a right-padded call on a
# static cache), as attributes of `RuleFacts` (a dict, or a function of the plain facts that returns one), and a patch.
CASES = [
    ({"model": SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=True))}, None),
    ({"arguments": {"custom_generate": "custom"}}, None),
    ({"model_kwargs": {"cache_implementation": "paged"}}, None),
    ({"passed": SimpleNamespace(tokens=None, recurrent_only=False)}, None),
    ({}, takes_no("attention_mask")),
    ({"decodes_candidates": True, "embeds_only": True}, None),
    ({"decodes_candidates": True, "drafter_padding_changes": "an assistant with another tokenizer"}, None),
    (lambda f: {"decodes_candidates": True, **settings(output_attentions=True)(f)}, None),
    ({"decodes_candidates": True, "sliding_static_cache": True}, None),
    (settings(token_healing=True), None),
    (lambda f: {"user_compiled": "`torch.compile`", **settings(guidance_scale=2.0)(f)}, None),
    (lambda f: {"user_compiled": "`torch.compile`", **settings(use_cache=False)(f)}, None),
    (lambda f: {"peft_from_the_end": "alora_offsets", **settings(prefill_chunk_size=4)(f)}, None),
    (
        lambda f: {"model": GPT_NEO(), **settings(max_cache_len=64)(f)},
        mock.patch.object(decision, "forward_takes", lambda model, name: True),
    ),
    (breaks("attention_is_bidirectional"), None),
    (breaks("masks_from_keys"), None),
    (breaks("counts_no_tokens"), None),
    *[
        ({**LEFT_ONLY, **breaks(name)(None)}, None)
        for name in (
            "positions_count_from_the_cache",
            "drops_the_mask",
            "ignores_the_mask",
            "adds_the_cache_length_to_positions",
        )
    ],
    ({"ragged": True, **breaks("adds_the_cache_length_to_positions")(None)}, None),
    *[({**LEFT_ONLY, **breaks(name)(None)}, None) for name in ("compresses_the_cache", "repeated_key_heads")],
    ({**LEFT_ONLY, "filled_unpadded": "an unpadded call"}, None),
    ({**LEFT_ONLY, "ids_not_paddable": "not [batch, length]"}, None),
    ({**LEFT_ONLY, "prompt_length": 0}, None),
    ({"ids_outside_vocabulary": "an id outside the vocabulary"}, None),
    ({**LEFT_ONLY, "room": ("no room, and padding in the cache", None)}, None),
    ({**LEFT_ONLY, "room": (None, "no room")}, None),
    ({"continued_rows": "other rows"}, None),
    ({"continued": RECORD, "continued_rows": 1, "wanted_batch": 2, "batch_kept_reason": "beam search"}, None),
    ({"finished_rows_error": "a pad id outside the vocabulary"}, None),
    (settings(padding_side="left"), None),
    *[(breaks(name), None) for name in ("positions_from_the_mask", "keeps_a_state_on_its_modules")],
    ({"decodes_candidates": True}, None),
    (settings(prefill_chunk_size=4), None),
    (settings(use_cache=False), None),
    (settings(output_hidden_states=True), None),
    ({"attention": "flash_attention_2"}, None),
    ({}, takes_no("logits_to_keep")),
    ({"other_inputs": ["pixel_values"]}, None),
    ({"peft_from_the_end": "alora_offsets"}, None),
    ({"prompt": torch.zeros(3, dtype=torch.long)}, None),
    (lambda f: {**settings(cache_implementation=None)(f), "static_cache": False}, None),
    ({"cache": object(), "static_cache": False}, None),
    ({**STATIC, "continued": SimpleNamespace(columns=2, padded_rows=1, rows=1), "continued_rows": 1}, None),
    (
        {
            **STATIC,
            "continued": RECORD,
            "continued_rows": 1,
            "past_length": 5,
            "passed": SimpleNamespace(tokens=5, recurrent_only=False, ragged_rows=[5, 3]),
        },
        None,
    ),
    (
        lambda f: {
            **STATIC,
            "continued": RECORD,
            "continued_rows": 1,
            "past_length": 5,
            "model_kwargs": {**f.model_kwargs, "inputs_embeds": torch.zeros(1, 10, 8)},
        },
        None,
    ),
    ({"past_length": 10}, None),
    (settings(max_positions=8), None),
    ({"layers_reason": "a sliding window of 8 slots is shorter than the 16 the padded prompt fills"}, None),
    (settings(max_cache_len=8), None),
    ({**STATIC, "continued": RECORD, "continued_rows": 1, "past_length": 40, "prompt_length": 42}, None),
    ({"ragged_reason": "the attention mask has zeros between a row's tokens"}, None),
    ({}, None),
]
SLOTS = 50


class DecisionRowsTest(unittest.TestCase):
    """Each row of `DECISION` decides a case of its own: no row is hidden behind the rows before it."""

    @classmethod
    def setUpClass(cls):
        # A plain call, as `generate` resolves it: one prompt of 10 tokens, a static cache, a bucket of 16.
        cls.model, calls = tiny_llama(), []
        decide = generation.choose_side
        with mock.patch.object(generation, "choose_side", lambda call: calls.append(call) or decide(call)):
            config = GenerationConfig(max_new_tokens=4, do_sample=False, cache_implementation="static")
            prefill_buckets.generate(
                cls.model, torch.arange(3, 13)[None], generation_config=config, prefill_buckets=[16]
            )
        cls.call = calls[0]

    def decided(self, case) -> "decision.Row":
        changes, patch = case
        facts = RuleFacts(self.call, DECISION)
        changes = changes(facts) if callable(changes) else dict(changes)
        if changes.get("cache") == "static":
            changes["cache"] = StaticCache(config=self.model.config, max_cache_len=SLOTS)
        for name, value in changes.items():
            setattr(facts, name, value)
        with patch or mock.patch.object(decision, "DECISION", DECISION):
            return next(row for row in DECISION if row.check(facts))

    def test_each_row_decides_a_case(self):
        self.assertEqual(len(CASES), len(DECISION), "a case for every row")
        for index, (row, case) in enumerate(zip(DECISION, CASES, strict=True)):
            with self.subTest(index, case=row.case):
                self.assertIs(self.decided(case), row)

    def test_positive_control(self):
        # The plain call is padded on the right; a case moved after a row that hides it decides that row instead.
        self.assertIs(self.decided(({}, None)), DECISION[-1])
        self.assertIsNot(
            self.decided(({**LEFT_ONLY, "room": (None, "no room")}, takes_no("attention_mask"))), DECISION[29]
        )


if __name__ == "__main__":
    unittest.main()

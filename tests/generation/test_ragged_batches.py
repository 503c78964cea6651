# Ragged batches right-padded per row (issue 24): a batch whose rows have different lengths, as a tokenizer pads it
# (`padding=True`, on the left, with its mask), runs its prefill with each row's tokens at the start and no mask, its
# first tokens gathered per row, and decode masks each row's pad slots. The contract is the package's: every output
# equals upstream `generate` on the same batch, unpadded. Here also: where it is not exact it goes left (and why), its
# graphs (one prefill graph per bucket and batch size, whatever the lengths), and that its prefill runs SDPA with no
# mask.

import unittest

import torch
from parameterized import parameterized
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

import prefill_buckets
from prefill_buckets import GraphCounter

from .tiny_models import (
    CACHE,
    MODEL_SPECS,
    PAD,
    CompiledLlamaTestCase,
    SideSpy,
    assert_same,
    first_right_turn,
    get_model,
    left_padded_batch,
    random_batch_ids,
    right_padding_config,
    run,
    run_bucketed,
    sdpa_recording_backend,
    skip_unless_sdpa_skips_while_compiling,
)


package_logger = transformers_logging.get_logger("prefill_buckets")

BUCKETS = [8, 16, 32]
MODES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "top_k": 0},
    "beam": {"do_sample": False, "num_beams": 2, "num_return_sequences": 2},
}
# A row of one token beside a row that fills its bucket (16), and two between.
LENGTHS = (1, 16, 9, 5)
# A sliding window counts cache slots, which a ragged batch lays out differently: left (`test_where_it_is_not_exact`).
ARCHITECTURES = tuple(arch for arch in MODEL_SPECS if arch != "mistral_sliding")


def right_padded_batch(lengths, pad_id: int, seed: int = 0):
    """A batch padded on the right, as a tokenizer with `padding_side="right"` would: (input_ids, attention_mask)."""
    input_ids, attention_mask = left_padded_batch(lengths, pad_id, seed=seed)
    for row, length in enumerate(lengths):
        input_ids[row] = input_ids[row].roll(length)
        attention_mask[row] = attention_mask[row].roll(length)
    return input_ids, attention_mask


class EndsRowsAtSteps(StoppingCriteria):
    """Ends row r after `1 + r` new tokens: rows finish at different steps."""

    def __init__(self, prompt_width: int):
        self.prompt_width = prompt_width

    def __call__(self, input_ids, scores, **kwargs):
        new_tokens = input_ids.shape[1] - self.prompt_width
        return torch.arange(input_ids.shape[0], device=input_ids.device) + 1 <= new_tokens


class RaggedEquivalenceTest(unittest.TestCase):
    def setUp(self):
        self.spy = SideSpy(self)

    def check(self, side, model, input_ids, attention_mask, generation_config, fields=None, **kwargs):
        want = run(model, input_ids, generation_config, attention_mask=attention_mask, **kwargs)
        got = run_bucketed(
            model,
            input_ids,
            generation_config,
            attention_mask=attention_mask,
            prefill_buckets=BUCKETS,
            **(fields or {}),
            **kwargs,
        )
        self.assertEqual(self.spy.last(), side, self.spy.sides[-1].reason)
        assert_same(self, got, want, "output")
        return got

    @parameterized.expand([(f"{arch}_{mode}", arch, mode) for arch in ARCHITECTURES for mode in MODES])
    def test_every_field_equals_unpadded(self, _, arch, mode):
        model = get_model(arch)
        input_ids, attention_mask = left_padded_batch(LENGTHS, PAD, seed=7)
        got = self.check("right", model, input_ids, attention_mask, right_padding_config(**MODES[mode]))
        self.assertTrue(
            torch.equal(
                got.sequences[:, : input_ids.shape[1]],
                input_ids.repeat_interleave(MODES[mode].get("num_return_sequences", 1), dim=0),
            )
        )

    @parameterized.expand([(arch,) for arch in ("llama", "gpt2_pad", "qwen3")])
    def test_rows_that_finish_early(self, arch):
        model = get_model(arch)
        input_ids, attention_mask = left_padded_batch(LENGTHS, PAD, seed=7)
        # An eos that row 0 emits at its second step; the others go on.
        first = run(model, input_ids, right_padding_config(eos_token_id=None), attention_mask=attention_mask).sequences
        eos = first[0, input_ids.shape[1] + 1].item()
        got = self.check(
            "right", model, input_ids, attention_mask, right_padding_config(eos_token_id=eos, max_new_tokens=6)
        )
        self.assertTrue(bool((got.sequences[0, input_ids.shape[1] + 2 :] == PAD).all()))
        # A stopping criterion that ends each row at its own step.
        criteria = StoppingCriteriaList([EndsRowsAtSteps(input_ids.shape[1])])
        got = self.check("right", model, input_ids, attention_mask, right_padding_config(), stopping_criteria=criteria)
        self.assertEqual(got.sequences.shape[1], input_ids.shape[1] + len(LENGTHS))

    @parameterized.expand([(arch,) for arch in ("llama", "qwen3", "gpt2_pad")])
    def test_first_token_logits_fp32(self, arch):
        # Each row's first-step logits against the row alone, at its exact length: the gather reads each row's last
        # token, and nothing of another row or of the pads.
        model = get_model(arch)
        input_ids, attention_mask = left_padded_batch((3, 16, 1, 9, 12, 16), PAD, seed=5)
        got = run_bucketed(
            model,
            input_ids,
            right_padding_config(max_new_tokens=1),
            attention_mask=attention_mask,
            prefill_buckets=BUCKETS,
        ).logits[0]
        self.assertEqual(self.spy.last(), "right")
        self.assertEqual(got.dtype, torch.float32)
        for row in range(input_ids.shape[0]):
            alone = input_ids[row : row + 1, attention_mask[row].bool()]
            want = run(model, alone, right_padding_config(max_new_tokens=1)).logits[0]
            self.assertLess((got[row] - want[0]).abs().max().item(), 1e-4, f"row {row}")

    def test_beam_search_returned_sequences_and_dummy_rows(self):
        model = get_model("llama")
        input_ids, attention_mask = left_padded_batch((4, 11, 2), PAD, seed=9)
        self.check(
            "right", model, input_ids, attention_mask, right_padding_config(num_beams=3, num_return_sequences=2)
        )
        self.check("right", model, input_ids, attention_mask, right_padding_config(num_beams=2, length_penalty=0.5))
        self.check(
            "right",
            model,
            input_ids,
            attention_mask,
            right_padding_config(do_sample=True, top_k=0, num_return_sequences=3),
        )
        # Three rows padded to four by a dummy row, which finishes at once (and an eos that finishes the others).
        self.check(
            "right", model, input_ids, attention_mask, right_padding_config(), fields={"prefill_batch_buckets": [4]}
        )

    def test_mask_inferred_from_pad_tokens_and_inputs_embeds(self):
        model = get_model("llama")
        input_ids, attention_mask = left_padded_batch((6, 2, 13), PAD, seed=4)
        self.check(
            "right", model, input_ids, None, right_padding_config()
        )  # upstream infers the mask from the pad tokens
        embeds = model.get_input_embeddings()(input_ids)
        generation_config = right_padding_config()
        torch.manual_seed(11)
        want = model.generate(inputs_embeds=embeds, attention_mask=attention_mask, generation_config=generation_config)
        torch.manual_seed(11)
        got = prefill_buckets.generate(
            model,
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            generation_config=generation_config,
            prefill_buckets=BUCKETS,
        )
        self.assertEqual(self.spy.last(), "right")
        assert_same(self, got, want, "output")

    def test_where_it_is_not_exact(self):
        model = get_model("llama")
        # Padded on the right by the tokenizer: upstream's first token of a short row comes from a pad position.
        input_ids, attention_mask = right_padded_batch((6, 2, 13), PAD, seed=4)
        self.check("left", model, input_ids, attention_mask, right_padding_config())
        self.assertIn("padded on the right", self.spy.sides[-1].reason)
        # Zeros between a row's tokens.
        holes = torch.ones(2, 9, dtype=torch.long)
        holes[0, 4] = 0
        self.check("left", model, random_batch_ids(2, 9), holes, right_padding_config())
        self.assertIn("between a row's tokens", self.spy.sides[-1].reason)
        # A sliding window (8, which holds bucket 8).
        self.check(
            "left", get_model("mistral_sliding"), *left_padded_batch((6, 2), PAD, seed=4), right_padding_config()
        )
        self.assertIn("sliding window", self.spy.sides[-1].reason)
        # The rule's other cases still apply: here per-position outputs.
        input_ids, attention_mask = left_padded_batch((6, 2, 13), PAD, seed=4)
        self.check("left", model, input_ids, attention_mask, right_padding_config(output_hidden_states=True))
        # Asked for "right" where it is not exact: says why, pads on the left.
        input_ids, attention_mask = right_padded_batch((6, 2), PAD, seed=4)
        with CaptureLogger(package_logger) as captured:
            self.check(
                "left",
                model,
                input_ids,
                attention_mask,
                right_padding_config(),
                fields={"prefill_padding_side": "right"},
            )
        self.assertIn("padded on the right", captured.out)


class RaggedContinuationTest(unittest.TestCase):
    """A conversation continued from the cache of a ragged call: its rows sit at the start of their slots."""

    def setUp(self):
        self.spy = SideSpy(self)
        self.model = get_model("llama")

    def test_continued_conversation(self):
        first_config = right_padding_config(max_cache_len=96)
        later_config = right_padding_config(cache_implementation=None)
        input_ids, attention_mask = left_padded_batch((9, 3), PAD, seed=1)
        ours = run_bucketed(
            self.model, input_ids, first_config, attention_mask=attention_mask, prefill_buckets=BUCKETS
        )
        self.assertEqual(self.spy.last(), "right")
        theirs = run(self.model, input_ids, first_config, attention_mask=attention_mask)
        assert_same(self, ours, theirs, "first turn")
        mask = attention_mask
        for turn in range(2):
            user = random_batch_ids(2, 4 + turn, seed=turn + 2)
            mask = torch.cat([mask, torch.ones(2, ours.sequences.shape[1] - mask.shape[1] + user.shape[1])], dim=1)
            mask = mask.long()
            ours = run_bucketed(
                self.model,
                torch.cat([ours.sequences, user], dim=1),
                later_config,
                attention_mask=mask,
                prefill_buckets=BUCKETS,
                **{CACHE: ours[CACHE]},
            )
            self.assertEqual(self.spy.last(), "left")
            self.assertIn("rows of different lengths", self.spy.sides[-1].reason)
            theirs = run(
                self.model,
                torch.cat([theirs.sequences, user], dim=1),
                later_config,
                attention_mask=mask,
                **{CACHE: theirs[CACHE]},
            )
            assert_same(self, ours, theirs, f"turn {turn}")
        # The first call's mask is how the cache lines up: another one is an error, not a wrong answer.
        wrong = torch.ones_like(mask)
        with self.assertRaisesRegex(ValueError, "must be masked as that call's were"):
            run_bucketed(
                self.model,
                ours.sequences,
                later_config,
                attention_mask=wrong[:, : ours.sequences.shape[1]],
                prefill_buckets=BUCKETS,
                **{CACHE: ours[CACHE]},
            )

    def test_ragged_rows_continuing_an_unpadded_cache(self):
        # Equal rows right-padded first (an unpadded cache), then a turn whose rows differ: a mask is needed, so left,
        # which can't pad in front of an unpadded cache: the call runs unpadded, exactly.
        ours, theirs, later_config = first_right_turn(self, rows=2)
        user = random_batch_ids(2, 4, seed=3)
        sequences = torch.cat([ours.sequences, user], dim=1)
        mask = torch.ones_like(sequences)
        mask[1, -2:] = 0
        ours = run_bucketed(
            self.model, sequences, later_config, attention_mask=mask, prefill_buckets=BUCKETS, **{CACHE: ours[CACHE]}
        )
        # The one decision (`decision.choose_side`) says so: the rule's left, then no room in front of the cached tokens
        # (a right-padded call's: it left no padding), with why the right side was out.
        self.assertEqual(self.spy.last(), "unpadded")
        self.assertIn("already holds tokens from a right-padded call", self.spy.sides[-1].reason)
        self.assertIn("not padded on the right: rows of different lengths", self.spy.sides[-1].reason)
        theirs = run(self.model, sequences, later_config, attention_mask=mask, **{CACHE: theirs[CACHE]})
        self.assertTrue(torch.equal(ours.sequences, theirs.sequences))


class RaggedGraphsTest(CompiledLlamaTestCase):
    def test_one_prefill_graph_per_bucket_and_batch_size(self):
        counter = GraphCounter()
        model = self.compiled_llama(counter)
        reference = get_model("llama")
        generation_config = right_padding_config(max_cache_len=96, output_scores=False, output_logits=False)
        mixes = [(16, 1, 9, 5), (12, 12, 12, 12), (3, 14, 16, 10), (2, 2, 2, 9), (11, 16, 16, 1), (7, 4), (9, 9)]
        for lengths in mixes:
            input_ids, attention_mask = left_padded_batch(lengths, PAD, seed=sum(lengths))
            got = run_bucketed(
                model, input_ids, generation_config, attention_mask=attention_mask, prefill_buckets=[16]
            )
            self.assertEqual(self.spy.last(), "right")
            want = run(reference, input_ids, generation_config, attention_mask=attention_mask)
            self.assertTrue(torch.equal(got.sequences, want.sequences), lengths)
        # Bucket 16 at batch 4 and at batch 2, a decode graph per batch size: ragged and equal rows alike.
        self.assertEqual(counter.graphs, 4, counter.shapes)
        self.assertEqual(counter.calls, len(mixes) * generation_config.max_new_tokens)  # every forward compiled

    @skip_unless_sdpa_skips_while_compiling
    def test_prefill_runs_causal_sdpa_without_a_mask(self):
        backend, sdpa_calls = sdpa_recording_backend()
        model = self.compiled_llama(backend)
        generation_config = right_padding_config(
            max_cache_len=96, max_new_tokens=2, output_scores=False, output_logits=False
        )
        input_ids, attention_mask = left_padded_batch((11, 3, 16), PAD, seed=2)
        run_bucketed(model, input_ids, generation_config, attention_mask=attention_mask, prefill_buckets=[16])
        self.assertEqual(self.spy.last(), "right")
        prefill = [call for call in sdpa_calls if call[0] == 16]
        self.assertTrue(prefill)
        self.assertEqual(set(prefill), {(16, True, True)})  # no mask, is_causal
        sdpa_calls.clear()
        run_bucketed(
            model,
            input_ids,
            generation_config,
            attention_mask=attention_mask,
            prefill_buckets=[16],
            prefill_padding_side="left",
        )
        self.assertEqual({call[1] for call in sdpa_calls if call[0] == 16}, {False})  # the left path's mask


if __name__ == "__main__":
    unittest.main()

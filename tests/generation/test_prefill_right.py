# Right padding (issue 12): where it is exact, a bucketed call pads after the prompt and prefills with no mask. The
# contract is the one of the left path: every output equals upstream `generate` on the unpadded prompt. Here also:
# which side each call takes (the rule in `padding_side.py`), the graphs it compiles, and that its prefill graph runs
# SDPA with `is_causal` and no mask, as upstream's unpadded prefill does.

import unittest

import torch
from parameterized import parameterized
from transformers import StaticCache
from transformers.generation.streamers import BaseStreamer
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.config import PREFILL_PADDING_SIDE, validate_fields

from .tiny_models import (
    CACHE,
    EOS,
    MODEL_SPECS,
    PAD,
    RIGHT_PADDING_BUCKETS,
    RIGHT_PADDING_NEW_TOKENS,
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

MODES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "top_k": 0},
    "beam": {"do_sample": False, "num_beams": 2, "num_return_sequences": 2},
}
# Every decoder-only architecture of the equivalence suite. Mistral's window (8) holds the bucket of 5 tokens.
ARCHITECTURES = tuple(MODEL_SPECS)


class RightPaddingEquivalenceTest(unittest.TestCase):
    def setUp(self):
        self.spy = SideSpy(self)

    @parameterized.expand(
        [(f"{arch}_{mode}_{batch}", arch, mode, batch) for arch in ARCHITECTURES for mode in MODES for batch in (1, 2)]
    )
    def test_every_field_equals_unpadded(self, _, arch, mode, batch):
        model = get_model(arch)
        for length in (5, 8, 1):  # padded, an exact fit, one token
            with self.subTest(length=length):
                input_ids = random_batch_ids(batch, length, seed=length)
                generation_config = right_padding_config(**MODES[mode])
                want = run(model, input_ids, generation_config)
                got = run_bucketed(model, input_ids, generation_config, prefill_buckets=RIGHT_PADDING_BUCKETS)
                self.assertEqual(self.spy.last(), "right", self.spy.sides[-1].reason)
                assert_same(self, got, want, "output")

    @parameterized.expand([(arch,) for arch in ("llama", "qwen3", "gpt2_pad")])
    def test_first_token_logits_fp32(self, arch):
        # The logits the first token is chosen from, against an exact-length run: a kernel bug of this kind (reading
        # the wrong position of a padded prefill) has been seen in production servers.
        model = get_model(arch)
        for length in (3, 9, 16, 17, 31):
            input_ids = random_batch_ids(2, length, seed=length)
            generation_config = right_padding_config(max_new_tokens=1)
            want = run(model, input_ids, generation_config).logits[0]
            got = run_bucketed(model, input_ids, generation_config, prefill_buckets=RIGHT_PADDING_BUCKETS).logits[0]
            self.assertEqual(self.spy.last(), "right")
            self.assertEqual(got.dtype, torch.float32)
            self.assertLess((got - want).abs().max().item(), 1e-4, f"length {length}")


class SideTest(unittest.TestCase):
    """Each case of the rule takes the side chosen for it, and its output is exact."""

    def setUp(self):
        self.spy = SideSpy(self)
        self.model = get_model("llama")

    def check(self, side, input_ids, generation_config=None, model=None, fields=None, **kwargs):
        """Runs unpadded and bucketed (with `fields` too), checks the side taken and that every output is equal."""
        model = model if model is not None else self.model
        generation_config = generation_config if generation_config is not None else right_padding_config()
        want = run(model, input_ids, generation_config, **kwargs)
        got = run_bucketed(
            model, input_ids, generation_config, prefill_buckets=RIGHT_PADDING_BUCKETS, **(fields or {}), **kwargs
        )
        self.assertEqual(self.spy.last(), side, self.spy.sides[-1].reason)
        assert_same(self, got, want, "output")
        return self.spy.sides[-1]

    def test_rows_of_different_lengths(self):
        # Left-padded by the user: each row right-padded after its own end (issue 24, `test_ragged_batches.py`).
        input_ids, attention_mask = left_padded_batch((7, 3), PAD, seed=3)
        self.check("right", input_ids, attention_mask=attention_mask)
        # No mask: upstream infers one from the pad tokens.
        self.check("right", input_ids)
        # An all-ones mask: one length.
        self.check("right", random_batch_ids(2, 6), attention_mask=torch.ones(2, 6, dtype=torch.long))
        # Padded on the right by the user: left.
        side = self.check("left", input_ids.flip(1), attention_mask=attention_mask.flip(1))
        self.assertIn("padded on the right", side.reason)

    def test_dynamic_cache_and_no_cache(self):
        self.check("left", random_batch_ids(1, 6), right_padding_config(cache_implementation=None))
        self.check("left", random_batch_ids(1, 6), right_padding_config(cache_implementation=None, use_cache=False))

    def test_chunked_prefill(self):
        self.check("left", random_batch_ids(1, 11), right_padding_config(prefill_chunk_size=4))

    def test_per_position_outputs(self):
        self.check("left", random_batch_ids(1, 6), right_padding_config(output_hidden_states=True))
        self.check("left", random_batch_ids(1, 6), right_padding_config(output_attentions=True))

    def test_scores_and_lengths(self):
        self.check(
            "right", random_batch_ids(1, 6), right_padding_config(max_new_tokens=None, max_length=12, min_length=10)
        )
        self.check("right", random_batch_ids(2, 6), right_padding_config(min_new_tokens=4))

    def test_beam_search_and_returned_sequences(self):
        self.check("right", random_batch_ids(2, 6), right_padding_config(num_beams=3, num_return_sequences=2))
        self.check(
            "right", random_batch_ids(1, 6), right_padding_config(do_sample=True, top_k=0, num_return_sequences=3)
        )

    def test_assisted_and_prompt_lookup(self):
        input_ids = random_batch_ids(1, 9).repeat(1, 2)  # repeated n-grams for prompt lookup to find
        self.check(
            "left",
            input_ids,
            right_padding_config(prompt_lookup_num_tokens=3, output_scores=False, output_logits=False),
        )
        self.check(
            "left",
            random_batch_ids(1, 6),
            right_padding_config(output_scores=False, output_logits=False),
            assistant_model=self.model,
        )
        # Self-speculative decoding, the model's first layer drafting: assisted too (it was padded on the right, and
        # then ran unpadded, as `generate` made no static cache for it).
        self.check(
            "left",
            random_batch_ids(1, 6),
            right_padding_config(output_scores=False, output_logits=False, assistant_early_exit=1),
        )

    def test_streamer(self):
        class Recorder(BaseStreamer):
            def __init__(self):
                self.values = []

            def put(self, value):
                self.values.append(value.tolist())

            def end(self):
                pass

        input_ids = random_batch_ids(1, 6)
        recorded = []
        for bucketed in (False, True):
            streamer = Recorder()
            call = run_bucketed if bucketed else run
            fields = {"prefill_buckets": RIGHT_PADDING_BUCKETS} if bucketed else {}
            call(
                self.model, input_ids, right_padding_config(return_dict_in_generate=False), streamer=streamer, **fields
            )
            recorded.append(streamer.values)
        self.assertEqual(self.spy.last(), "right")
        self.assertEqual(recorded[1], recorded[0])

    def test_sliding_window(self):
        model = get_model("mistral_sliding")  # window 8
        # Bucket 8 fits the window, and decode passes it (the ring buffer rolls): right.
        self.check("right", random_batch_ids(1, 5), right_padding_config(max_new_tokens=12), model=model)
        # Bucket 16 would push real tokens out of the window: left.
        side = self.check("left", random_batch_ids(1, 11), right_padding_config(max_new_tokens=12), model=model)
        self.assertIn("sliding window of 8", side.reason)

    def test_recurrent_layers(self):
        from transformers import AutoConfig, AutoModelForCausalLM

        values = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "pad_token_id": PAD}
        values.update(eos_token_id=EOS, bos_token_id=2, intermediate_size=64, num_attention_heads=4)
        model_config = AutoConfig.for_model("lfm2", **values, num_key_value_heads=2, layer_types=None)
        model_config.layer_types = ["conv", "full_attention"]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config).eval()
        side = self.check("left", random_batch_ids(1, 6), right_padding_config(), model=model)
        self.assertIn("layers", side.reason)

    def test_inputs_embeds_and_batch_buckets(self):
        input_ids = random_batch_ids(2, 6)
        embeds = self.model.get_input_embeddings()(input_ids)
        generation_config = right_padding_config()
        torch.manual_seed(11)
        want = self.model.generate(inputs_embeds=embeds, generation_config=generation_config)
        torch.manual_seed(11)
        got = prefill_buckets.generate(
            self.model,
            inputs_embeds=embeds,
            generation_config=generation_config,
            prefill_buckets=RIGHT_PADDING_BUCKETS,
        )
        self.assertEqual(self.spy.last(), "right")
        assert_same(self, got, want, "output")
        # Three prompts, padded to four rows by a dummy row.
        self.check("right", random_batch_ids(3, 6), right_padding_config(), fields={"prefill_batch_buckets": [4]})

    def test_continued_conversation(self):
        ours, theirs, later_config = first_right_turn(self, rows=1)
        for turn in range(2):
            user = random_batch_ids(1, 5 + turn, seed=turn + 2)
            ours = run_bucketed(
                self.model,
                torch.cat([ours.sequences, user], dim=1),
                later_config,
                prefill_buckets=RIGHT_PADDING_BUCKETS,
                **{CACHE: ours[CACHE]},
            )
            self.assertEqual(self.spy.last(), "right")
            self.assertGreater(self.spy.calls[-1].past_length, 0)
            theirs = run(
                self.model,
                torch.cat([theirs.sequences, user], dim=1),
                later_config,
                **{CACHE: theirs[CACHE]},
            )
            self.assertTrue(torch.equal(ours.sequences, theirs.sequences))

    def test_continued_from_a_left_padded_cache(self):
        generation_config = right_padding_config(max_cache_len=96, output_scores=False, output_logits=False)
        later_config = right_padding_config(cache_implementation=None, output_scores=False, output_logits=False)
        first = random_batch_ids(1, 9, seed=1)
        cache = StaticCache(config=self.model.config, max_cache_len=96)
        ours = run_bucketed(
            self.model, first, generation_config, prefill_buckets=RIGHT_PADDING_BUCKETS, prefill_padding_side="left"
        )
        self.assertEqual(self.spy.last(), "left")
        theirs = run(self.model, first, later_config, **{CACHE: cache})
        user = random_batch_ids(1, 4, seed=5)
        ours = run_bucketed(
            self.model,
            torch.cat([ours.sequences, user], dim=1),
            later_config,
            prefill_buckets=RIGHT_PADDING_BUCKETS,
            **{CACHE: ours[CACHE]},
        )
        self.assertEqual(self.spy.last(), "left")
        self.assertIn("left-padded", self.spy.sides[-1].reason)
        theirs = run(self.model, torch.cat([theirs.sequences, user], dim=1), later_config, **{CACHE: cache})
        self.assertTrue(torch.equal(ours.sequences, theirs.sequences))

    def test_explicit_sides(self):
        input_ids = random_batch_ids(1, 6)
        self.check("left", input_ids, right_padding_config(), fields={"prefill_padding_side": "left"})
        self.check("right", input_ids, right_padding_config(), fields={"prefill_padding_side": "right"})
        # "right" where it is not exact: says why, then pads on the left.
        with CaptureLogger(package_logger) as captured:
            self.check(
                "left",
                input_ids,
                right_padding_config(cache_implementation=None),
                fields={"prefill_padding_side": "right"},
            )
        self.assertIn("`prefill_padding_side='right'` is not exact for this call", captured.out)
        self.assertIn("not a static cache", captured.out)

    def test_invalid_side(self):
        with self.assertRaisesRegex(ValueError, r"`prefill_padding_side` must be one of \('auto', 'left', 'right'\)"):
            validate_fields(prefill_padding_side="top")
        with self.assertRaisesRegex(ValueError, PREFILL_PADDING_SIDE):
            prefill_buckets.generate(self.model, random_batch_ids(1, 4), prefill_buckets=[8], prefill_padding_side=1)


class RightPaddingGraphsTest(CompiledLlamaTestCase):
    def test_one_prefill_graph_per_bucket(self):
        reference = get_model("llama")
        counter = GraphCounter()
        model = self.compiled_llama(counter)
        generation_config = right_padding_config(max_cache_len=96, output_scores=False, output_logits=False)
        for length in (20, 32, 25, 17, 31, 5, 16, 9, 1, 33, 64, 40):  # exact fits 16, 32 and 64 included
            input_ids = random_batch_ids(1, length, seed=length)
            got = run_bucketed(model, input_ids, generation_config, prefill_buckets=[16, 32, 64])
            self.assertEqual(self.spy.last(), "right")
            self.assertTrue(torch.equal(got.sequences, run(reference, input_ids, generation_config).sequences))
        self.assertEqual(counter.graphs, 4)  # one prefill graph per bucket, one decode graph
        # Every forward ran compiled: one prefill and RIGHT_PADDING_NEW_TOKENS - 1 decode steps per call.
        self.assertEqual(counter.calls, 12 * RIGHT_PADDING_NEW_TOKENS)
        # An unpadded upstream call with the same cache length shares the decode graph: only its prefill is new.
        run(model, random_batch_ids(1, 20, seed=20), generation_config)
        self.assertEqual(counter.graphs, 5)

    def test_mixed_workload(self):
        counter = GraphCounter()
        model = self.compiled_llama(counter)
        reference = get_model("llama")
        generation_config = right_padding_config(max_cache_len=96, output_scores=False, output_logits=False)
        uneven_ids, uneven_mask = left_padded_batch((12, 7), PAD, seed=3)
        even_ids = random_batch_ids(2, 12)
        calls = [
            (even_ids, None),
            (uneven_ids, uneven_mask),
            (random_batch_ids(2, 9), None),
            (uneven_ids, uneven_mask),
        ]
        for input_ids, attention_mask in calls:
            got = run_bucketed(
                model, input_ids, generation_config, attention_mask=attention_mask, prefill_buckets=[16]
            )
            want = run(reference, input_ids, generation_config, attention_mask=attention_mask)
            self.assertTrue(torch.equal(got.sequences, want.sequences))
        self.assertEqual([side.side for side in self.spy.sides], ["right", "right", "right", "right"])
        got = run_bucketed(
            model,
            uneven_ids,
            generation_config,
            attention_mask=uneven_mask,
            prefill_buckets=[16],
            prefill_padding_side="left",
        )
        want = run(reference, uneven_ids, generation_config, attention_mask=uneven_mask)
        self.assertTrue(torch.equal(got.sequences, want.sequences))
        # A prefill graph of bucket 16 per side (the left one takes the mask), and one decode graph that both share:
        # rows of one length and ragged rows share the right one (issue 24).
        self.assertEqual(counter.graphs, 3, counter.shapes)
        self.assertEqual(sorted(shapes[0] for shapes in counter.shapes), [(2, 1), (2, 16), (2, 16)])

    @skip_unless_sdpa_skips_while_compiling
    def test_prefill_runs_causal_sdpa_without_a_mask(self):
        backend, sdpa_calls = sdpa_recording_backend()
        model = self.compiled_llama(backend)
        generation_config = right_padding_config(
            max_cache_len=96, max_new_tokens=2, output_scores=False, output_logits=False
        )
        run_bucketed(model, random_batch_ids(1, 11), generation_config, prefill_buckets=[16])
        self.assertEqual(self.spy.last(), "right")
        prefill = [call for call in sdpa_calls if call[0] == 16]
        self.assertTrue(prefill)
        self.assertEqual(set(prefill), {(16, True, True)})  # no mask, is_causal
        sdpa_calls.clear()
        run_bucketed(
            model, random_batch_ids(1, 11), generation_config, prefill_buckets=[16], prefill_padding_side="left"
        )
        self.assertEqual({call[1] for call in sdpa_calls if call[0] == 16}, {False})  # the left path's mask

    def test_precompile_warms_the_right_graphs(self):
        counter = GraphCounter()
        model = self.compiled_llama(counter)
        generation_config = right_padding_config(output_scores=False, output_logits=False, prefill_buckets=[8, 16])
        compiled = prefill_buckets.precompile(model, generation_config, progress=False)
        self.assertEqual([shape.prompt_length for shape in compiled], [16, 8])
        self.assertEqual(self.spy.last(), "right")
        graphs = counter.graphs
        self.assertEqual(graphs, 3)  # bucket 16, bucket 8, one decode graph
        for length in (3, 8, 13, 16):
            run_bucketed(model, random_batch_ids(1, length), generation_config)
        self.assertEqual(counter.graphs, graphs)


if __name__ == "__main__":
    unittest.main()


class NoFalsePaddingWarningTest(unittest.TestCase):
    def test_gpt2_with_a_mask_logs_no_attention_mask_warning(self):
        # A right-padded prefill runs with no mask; its added positions used to be pad tokens, so GPT-2's check for
        # unmasked padding ("We strongly recommend passing in an `attention_mask`") fired on a call that passed one.
        import logging as std_logging

        from transformers import GPT2Config, GPT2LMHeadModel
        from transformers.testing_utils import CaptureLogger
        from transformers.utils import logging

        torch.manual_seed(0)
        config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=256, pad_token_id=0)
        model = GPT2LMHeadModel(config).eval()
        input_ids = torch.randint(3, 128, (1, 11), generator=torch.Generator().manual_seed(0))
        kwargs = {"attention_mask": torch.ones_like(input_ids), "max_new_tokens": 3, "do_sample": False}
        kwargs["cache_implementation"] = "static"
        std_logging.Logger.warning_once.cache_clear()
        with CaptureLogger(logging.get_logger("transformers")) as captured:
            ours = prefill_buckets.generate(
                model, input_ids, prefill_buckets=[16], prefill_padding_side="right", **kwargs
            )
        self.assertNotIn("attention_mask", captured.out)
        torch.testing.assert_close(ours, model.generate(input_ids, **kwargs), rtol=0, atol=0)

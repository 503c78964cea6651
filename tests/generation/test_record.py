"""Multi-turn chat: continuing from a cache that a bucketed call filled gives the tokens of an unpadded conversation."""

import logging as std_logging
import unittest

import torch
from parameterized import parameterized
from transformers import CompileConfig, DynamicCache, GenerationConfig, StaticCache
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.kvcache.record import cache_record
from prefill_buckets.state import PROCESS, state_of

from .tiny_models import CACHE, make_model, make_prompt, tiny_llama


class ContinuationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_llama()

    def ids(self, batch, length, seed):
        return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))

    def ragged_batch(self, seed):
        """Three prompts of 7 tokens, the second left-padded by the user by 2, and their mask."""
        ids, mask = self.ids(3, 7, seed), torch.ones(3, 7, dtype=torch.long)
        ids[1, :2], mask[1, :2] = 0, 0
        return ids, mask

    @parameterized.expand([("dynamic", None, None), ("static", "static", 64)])
    def test_three_turns(self, _, cache_implementation, max_cache_len):
        # A static cache must hold the whole conversation (and, for ours, the padding in front of it).
        first = GenerationConfig(
            max_new_tokens=4,
            do_sample=False,
            return_dict_in_generate=True,
            cache_implementation=cache_implementation,
            max_cache_len=max_cache_len,
        )
        later = GenerationConfig(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        ours = prefill_buckets.generate(self.model, self.ids(1, 9, 0), generation_config=first, prefill_buckets=[16])
        theirs = self.model.generate(self.ids(1, 9, 0), generation_config=first)
        torch.testing.assert_close(ours.sequences, theirs.sequences, rtol=0, atol=0)
        for turn in range(2):
            user = self.ids(1, 5 + turn, turn + 1)
            ours = prefill_buckets.generate(
                self.model,
                torch.cat([ours.sequences, user], dim=1),
                **{CACHE: ours[CACHE]},
                generation_config=later,
                prefill_buckets=[16],
            )
            theirs = self.model.generate(
                torch.cat([theirs.sequences, user], dim=1), **{CACHE: theirs[CACHE]}, generation_config=later
            )
            torch.testing.assert_close(ours.sequences, theirs.sequences, rtol=0, atol=0)

    def test_three_turns_static_cache_compile_config(self):
        # A passed static cache with `compile_config`: the first turn prefills the padded prompt in one compiled chunk,
        # later turns prefill the tokens the cache lacks (eagerly before transformers 5.21, whose chunked prefill
        # always starts at position 0).
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        model = tiny_llama()  # same weights as `self.model`, its own compiled state
        compile_config = CompileConfig(backend="eager", fullgraph=False, dynamic=False, mode=None)
        ours_config = GenerationConfig(
            max_new_tokens=4, do_sample=False, return_dict_in_generate=True, compile_config=compile_config
        )
        theirs_config = GenerationConfig(max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
        ours_cache = StaticCache(config=model.config, max_cache_len=128)
        theirs_cache = StaticCache(config=self.model.config, max_cache_len=128)
        ours_ids = theirs_ids = self.ids(1, 9, 0)
        for turn in range(3):
            ours = prefill_buckets.generate(
                model, ours_ids, generation_config=ours_config, prefill_buckets=[16], **{CACHE: ours_cache}
            )
            theirs = self.model.generate(theirs_ids, generation_config=theirs_config, **{CACHE: theirs_cache})
            torch.testing.assert_close(ours.sequences, theirs.sequences, rtol=0, atol=0)
            user = self.ids(1, 5 + turn, turn + 1)
            ours_ids = torch.cat([ours.sequences, user], dim=1)
            theirs_ids = torch.cat([theirs.sequences, user], dim=1)
        # Prefill lengths are plain ints (a static cache's `get_seq_length()` is a tensor): each is one graph shape.
        self.assertTrue(all(type(length) is int for _, length, *_ in state_of(model).budget.prefill))

    def test_user_cache_object_is_marked(self):
        cache = DynamicCache(config=self.model.config)
        config = GenerationConfig(max_new_tokens=3, do_sample=False)
        prompt = self.ids(1, 6, 3)
        out = prefill_buckets.generate(
            self.model, prompt, **{CACHE: cache}, generation_config=config, prefill_buckets=[8]
        )
        follow_up = torch.cat([out, self.ids(1, 2, 4)], dim=1)
        ours = prefill_buckets.generate(
            self.model, follow_up, **{CACHE: cache}, generation_config=config, prefill_buckets=[8]
        )
        torch.testing.assert_close(ours, self.model.generate(follow_up, generation_config=config), rtol=0, atol=0)

    def test_unpadded_cache_runs_unpadded(self):
        config = GenerationConfig(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        first = self.model.generate(self.ids(1, 6, 5), generation_config=config)
        follow_up = torch.cat([first.sequences, self.ids(1, 2, 6)], dim=1)
        ours = prefill_buckets.generate(
            self.model, follow_up, **{CACHE: first[CACHE]}, generation_config=config, prefill_buckets=[8]
        )
        torch.testing.assert_close(
            ours.sequences, self.model.generate(follow_up, generation_config=config).sequences, rtol=0, atol=0
        )

    @parameterized.expand([("auto", False), ("right", False), ("left", True)])
    def test_an_unpadded_cache_continues_on_the_right_and_can_not_on_the_left(self, side, warns):
        # The docs: a right-padded call continues a cache an unpadded call filled (exact, bucketed, no warning); a
        # left-padded one can't put padding in front of its tokens, so it runs unpadded with a warning.
        first_config = GenerationConfig(
            max_new_tokens=3, do_sample=False, return_dict_in_generate=True, cache_implementation="static",
            max_cache_len=64,
        )  # fmt: skip
        config = GenerationConfig(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        first = self.model.generate(self.ids(1, 6, 5), generation_config=first_config)
        follow_up = torch.cat([first.sequences, self.ids(1, 2, 6)], dim=1)
        seen = []
        handle = self.model.register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
        )
        self.addCleanup(handle.remove)
        std_logging.Logger.warning_once.cache_clear()
        with CaptureLogger(logging.get_logger("prefill_buckets")) as captured:
            ours = prefill_buckets.generate(
                self.model, follow_up, **{CACHE: first[CACHE]}, generation_config=config, prefill_buckets=[16],
                prefill_padding_side=side,
            )  # fmt: skip
        handle.remove()
        self.assertEqual("already holds tokens from an unpadded call" in captured.out, warns, captured.out)
        # The tokens the cache lacks (the last new token of the first call, and the 2 of the turn) alone, or padded after
        # them to the bucket.
        self.assertEqual(seen[0], 3 if warns else 16)
        expected = self.model.generate(follow_up, max_new_tokens=3, do_sample=False)
        torch.testing.assert_close(ours.sequences, expected, rtol=0, atol=0)

    def test_continuing_without_fields_still_pads(self):
        # The cache holds the first call's padding: the follow-up must be padded the same way, fields or not.
        config = GenerationConfig(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        first = prefill_buckets.generate(self.model, self.ids(1, 6, 8), generation_config=config, prefill_buckets=[8])
        follow_up = torch.cat([first.sequences, self.ids(1, 3, 9)], dim=1)
        ours = prefill_buckets.generate(self.model, follow_up, **{CACHE: first[CACHE]}, generation_config=config)
        torch.testing.assert_close(
            ours.sequences, self.model.generate(follow_up, generation_config=config).sequences, rtol=0, atol=0
        )

    def test_batch_buckets_on_a_cache_filled_without_them(self):
        config = GenerationConfig(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        first = prefill_buckets.generate(self.model, self.ids(1, 6, 10), generation_config=config, prefill_buckets=[8])
        follow_up = torch.cat([first.sequences, self.ids(1, 2, 11)], dim=1)
        ours = prefill_buckets.generate(
            self.model, follow_up, **{CACHE: first[CACHE]}, generation_config=config, prefill_batch_buckets=[4]
        )
        torch.testing.assert_close(
            ours.sequences, self.model.generate(follow_up, generation_config=config).sequences, rtol=0, atol=0
        )

    def test_batch_padded_cache_with_other_prompts_raises(self):
        # The cache holds the first call's row, then a dummy row whose tokens the user doesn't have: two prompts don't
        # line up with them (before, two prompts ran, the second continuing the dummy row).
        config = GenerationConfig(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        first = prefill_buckets.generate(
            self.model, self.ids(1, 6, 7), generation_config=config, prefill_buckets=[8], prefill_batch_buckets=[2]
        )
        follow_up = torch.cat([first.sequences, self.ids(1, 2, 8)], dim=1).repeat(2, 1)
        with self.assertRaisesRegex(ValueError, r"holds 2 rows \(the 1 row .*, then 1 dummy row of `prefill_batch_"):
            prefill_buckets.generate(
                self.model, follow_up, **{CACHE: first[CACHE]}, generation_config=config, prefill_buckets=[8]
            )

    def test_a_turn_that_cant_bring_back_the_dummy_rows_raises(self):
        # Beam search ranks rows together, so no dummy row joins it: the cache's dummy row can't be lined up. (Two
        # rows per prompt first, so that the later turn's beams, two per prompt, line up with the cache's rows.)
        config = GenerationConfig(max_new_tokens=3, min_new_tokens=3, return_dict_in_generate=True)
        first = prefill_buckets.generate(
            self.model, self.ids(3, 7, 40), generation_config=config, do_sample=True, num_return_sequences=2,
            prefill_buckets=[16], prefill_batch_buckets=[4],
        )  # fmt: skip
        conversation = torch.cat([first.sequences[::2], self.ids(3, 2, 41)], dim=1)
        with self.assertRaisesRegex(ValueError, "1 dummy row of `prefill_batch_buckets` .* beam search"):
            prefill_buckets.generate(
                self.model, conversation, **{CACHE: first[CACHE]}, generation_config=config, num_beams=2
            )

    @parameterized.expand([("left_padded", None), ("with_a_dummy_row", [4])])
    def test_continues_rows_selected_with_batch_select_indices(self, _, batch_buckets):
        # A finished conversation dropped from the batch, as upstream does it: the cache keeps the other rows
        # (`batch_select_indices`, which drops the dummy row too), and the later turn passes theirs.
        config = GenerationConfig(max_new_tokens=3, min_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        ids, mask = self.ragged_batch(seed=30)
        first = prefill_buckets.generate(
            self.model,
            ids,
            attention_mask=mask,
            generation_config=config,
            prefill_buckets=[16],
            prefill_batch_buckets=batch_buckets,
        )
        keep = torch.tensor([0, 2])
        cache = first[CACHE]
        cache.batch_select_indices(keep)
        conversation = torch.cat([first.sequences[keep], self.ids(2, 2, 31)], dim=1)
        conversation_mask = torch.cat([mask[keep], torch.ones(2, conversation.shape[1] - 7, dtype=torch.long)], dim=1)
        ours = prefill_buckets.generate(
            self.model, conversation, attention_mask=conversation_mask, **{CACHE: cache}, generation_config=config
        )
        theirs = self.model.generate(conversation, attention_mask=conversation_mask, generation_config=config)
        torch.testing.assert_close(ours.sequences, theirs.sequences, rtol=0, atol=0)

    @parameterized.expand([("one_prompt", 1, None), ("with_a_dummy_row", 2, [3])])
    def test_continues_the_rows_of_num_return_sequences(self, _, prompts, batch_buckets):
        # Two rows per prompt (sampled), left-padded in a dynamic cache: the later turn passes the rows the first
        # returned, one prompt each, and gets the tokens of the whole conversation run unbucketed (a misleading
        # `ValueError` before: the cache's rows were counted as prompts).
        first = GenerationConfig(
            max_new_tokens=3, do_sample=True, num_return_sequences=2, return_dict_in_generate=True, top_k=5
        )
        torch.manual_seed(0)
        ours = prefill_buckets.generate(
            self.model,
            self.ids(prompts, 7, 20),
            generation_config=first,
            prefill_buckets=[16],
            prefill_batch_buckets=batch_buckets,
        )
        conversation = torch.cat([ours.sequences, self.ids(2 * prompts, 2, 21)], dim=1)
        later = GenerationConfig(max_new_tokens=3, do_sample=False)
        continued = prefill_buckets.generate(self.model, conversation, **{CACHE: ours[CACHE]}, generation_config=later)
        expected = self.model.generate(conversation, generation_config=later)
        torch.testing.assert_close(continued, expected, rtol=0, atol=0)

    @parameterized.expand([("one_prompt", 1), ("two_prompts", 2)])
    def test_beam_search_continues_beam_search(self, _, prompts):
        # The cache holds each prompt's beams; the later turn passes the sequences returned, and beam search expands
        # each again into as many rows (a `ValueError` before: its prompts were compared with the cache's rows).
        config = GenerationConfig(max_new_tokens=3, do_sample=False, num_beams=2, return_dict_in_generate=True)
        prompt = self.ids(prompts, 9, 22)
        runs = {}
        for name, generate in [
            (
                "ours",
                lambda ids, **kwargs: prefill_buckets.generate(self.model, ids, prefill_buckets=[16, 32], **kwargs),
            ),
            ("theirs", lambda ids, **kwargs: self.model.generate(ids, **kwargs)),
        ]:
            first = generate(prompt, generation_config=config)
            conversation = torch.cat([first.sequences, self.ids(prompts, 4, 23)], dim=1)
            runs[name] = generate(conversation, **{CACHE: first[CACHE]}, generation_config=config).sequences
        torch.testing.assert_close(runs["ours"], runs["theirs"], rtol=0, atol=0)

    @parameterized.expand(
        [
            ("dynamic_cache", "left", None, None),
            ("static_cache_left", "left", "static", 64),
            ("static_cache_right_ragged_rows", "auto", "static", 64),
        ]
    )
    def test_later_turns_bring_back_the_dummy_rows(self, _, side, cache_implementation, max_cache_len):
        # Three prompts (one left-padded by the user) padded to four rows by `prefill_batch_buckets`: the cache holds
        # the dummy row, and each later turn, with the same prompts and no field of its own, brings it back.
        common = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False, "return_dict_in_generate": True}
        first = GenerationConfig(cache_implementation=cache_implementation, max_cache_len=max_cache_len, **common)
        later = GenerationConfig(**common)
        ids, mask = self.ragged_batch(seed=12)
        fields = {"prefill_buckets": [16], "prefill_batch_buckets": [4], "prefill_padding_side": side}
        ours = prefill_buckets.generate(self.model, ids, attention_mask=mask, generation_config=first, **fields)
        theirs = self.model.generate(ids, attention_mask=mask, generation_config=first)
        record = cache_record(ours[CACHE])
        self.assertEqual((record.padding.rows, record.padding.padded_rows), (3, 4))
        # On the right, each row's tokens sit at the start of its slots: the record keeps the mask of the user's rows.
        self.assertEqual(record.ragged_rows is not None, side == "auto")
        for turn in range(2):
            user = self.ids(3, 2 + turn, 13 + turn)
            ours_mask = torch.cat([mask, torch.ones(3, ours.sequences.shape[1] - 7 + user.shape[1])], dim=1)
            ours = prefill_buckets.generate(
                self.model,
                torch.cat([ours.sequences, user], dim=1),
                attention_mask=ours_mask.long(),
                **{CACHE: ours[CACHE]},
                generation_config=later,
            )
            theirs = self.model.generate(
                torch.cat([theirs.sequences, user], dim=1),
                attention_mask=ours_mask.long(),
                **{CACHE: theirs[CACHE]},
                generation_config=later,
            )
            torch.testing.assert_close(ours.sequences, theirs.sequences, rtol=0, atol=0, msg=f"turn {turn}")
            self.assertEqual(ours[CACHE].layers[0].keys.shape[0], 4)


class ConversationStaysBucketedTest(unittest.TestCase):
    """
    The docs' chat recipe, compiled: later turns set no bucket field and are bucketed by the policy the first turn
    recorded with its cache. Every turn gives upstream's tokens, all its forwards run compiled, and it compiles at most
    the graphs upstream compiles by then.
    """

    TURNS = 5
    NEW_TOKENS = 4

    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        # The highest limit raised is said once per process: start from none, whatever tests ran before in it.
        self.addCleanup(setattr, PROCESS, "raised_recompile_limit", PROCESS.raised_recompile_limit)
        PROCESS.raised_recompile_limit = (None, 0)

    def converse(self, bucketed: bool, side: str, later_fields: dict | None = None):
        """Runs the conversation; returns each turn's sequences, graphs compiled so far and the package's warnings."""
        torch._dynamo.reset()
        model = make_model()
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        fields = {"prefill_buckets": [16, 64], "prefill_padding_side": side} if bucketed else {}
        common = {"max_new_tokens": self.NEW_TOKENS, "min_new_tokens": self.NEW_TOKENS, "do_sample": False}
        first = GenerationConfig(
            cache_implementation="static", max_cache_len=256, return_dict_in_generate=True, **common, **fields
        )
        later = GenerationConfig(return_dict_in_generate=True, **common)

        def generate(*args, **kwargs):
            if not bucketed:
                return model.generate(*args, **kwargs)
            return prefill_buckets.generate(model, *args, **kwargs, **(later_fields or {}))

        std_logging.Logger.warning_once.cache_clear()
        sequences, graphs = [], []
        with CaptureLogger(logging.get_logger("prefill_buckets")) as captured:
            out = prefill_buckets.generate(model, make_prompt(9), generation_config=first) if bucketed else None
            out = out if out is not None else model.generate(make_prompt(9), generation_config=first)
            for turn in range(self.TURNS):
                if turn:
                    conversation = torch.cat([out.sequences, make_prompt(2 + turn, seed=turn)], dim=1)
                    calls = counter.calls
                    out = generate(
                        conversation,
                        attention_mask=torch.ones_like(conversation),
                        **{CACHE: out[CACHE]},
                        generation_config=later,
                    )
                    self.assertEqual(counter.calls - calls, self.NEW_TOKENS, f"turn {turn}: a forward ran eagerly")
                sequences.append(out.sequences)
                graphs.append(counter.graphs)
        return sequences, graphs, captured.out

    @parameterized.expand([("auto",), ("left",), ("right",)])
    def test_five_turns_exact_with_at_most_upstreams_graphs(self, side):
        upstream, upstream_graphs, _ = self.converse(bucketed=False, side=side)
        ours, our_graphs, warnings = self.converse(bucketed=True, side=side)
        for turn, (mine, theirs) in enumerate(zip(ours, upstream)):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=f"turn {turn}")
        for turn, (mine, theirs) in enumerate(zip(our_graphs, upstream_graphs)):
            self.assertLessEqual(mine, theirs, f"turn {turn}: {our_graphs} graphs, upstream {upstream_graphs}")
        self.assertNotIn("Set `prefill_buckets`", warnings)

    @parameterized.expand([("auto",), ("right",)])
    def test_right_padded_turns_share_their_bucket_graph(self, side):
        # Every later turn's conversation (13 to 33 tokens) lies in bucket 64: one prefill graph, compiled once.
        _, graphs, _ = self.converse(bucketed=True, side=side)
        self.assertEqual(graphs[2:], [graphs[1]] * (self.TURNS - 2), graphs)

    def test_a_right_padded_turn_onto_cached_tokens_makes_room_for_its_graph(self):
        # A right-padded prefill onto an empty cache and one onto cached tokens are two graphs, of one length (the
        # first reads its query offset as 0). With torch's limit at the first turn's two graphs, the second turn makes
        # room for its prefill graph in the budget: with `fullgraph=True`, a graph torch refused would raise.
        with torch._dynamo.config.patch(recompile_limit=2):
            sequences, graphs, warnings = self.converse(bucketed=True, side="right")
            self.assertEqual(torch._dynamo.config.recompile_limit, 2)  # the user's again once no call is in flight
        self.assertEqual(graphs[:2], [2, 3], graphs)
        self.assertIn("Raised the limit", warnings)
        upstream, _, _ = self.converse(bucketed=False, side="right")
        for turn, (mine, theirs) in enumerate(zip(sequences, upstream)):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0, msg=f"turn {turn}")

    def test_a_turn_that_sets_its_own_fields_keeps_them(self):
        # `prefill_buckets=None` on the later turns: they are not bucketed by the cache's policy (each new length of
        # the turn is a prefill graph of its own, as upstream's).
        _, graphs, _ = self.converse(bucketed=True, side="right", later_fields={"prefill_buckets": None})
        self.assertEqual(graphs[2:], [graphs[1] + turn for turn in range(1, self.TURNS - 1)], graphs)


if __name__ == "__main__":
    unittest.main()

"""Multi-turn chat: continuing from a cache that a bucketed call filled gives the tokens of an unpadded conversation."""

import unittest

import torch
from parameterized import parameterized
from transformers import DynamicCache, GenerationConfig

import prefill_buckets

from .tiny_models import tiny_llama


class ContinuationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_llama()

    def ids(self, batch, length, seed):
        return torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))

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
                cache=ours.cache,
                generation_config=later,
                prefill_buckets=[16],
            )
            theirs = self.model.generate(
                torch.cat([theirs.sequences, user], dim=1), cache=theirs.cache, generation_config=later
            )
            torch.testing.assert_close(ours.sequences, theirs.sequences, rtol=0, atol=0)

    def test_user_cache_object_is_marked(self):
        cache = DynamicCache(config=self.model.config)
        config = GenerationConfig(max_new_tokens=3, do_sample=False)
        prompt = self.ids(1, 6, 3)
        out = prefill_buckets.generate(self.model, prompt, cache=cache, generation_config=config, prefill_buckets=[8])
        follow_up = torch.cat([out, self.ids(1, 2, 4)], dim=1)
        ours = prefill_buckets.generate(
            self.model, follow_up, cache=cache, generation_config=config, prefill_buckets=[8]
        )
        torch.testing.assert_close(ours, self.model.generate(follow_up, generation_config=config), rtol=0, atol=0)

    def test_unpadded_cache_runs_unpadded(self):
        config = GenerationConfig(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        first = self.model.generate(self.ids(1, 6, 5), generation_config=config)
        follow_up = torch.cat([first.sequences, self.ids(1, 2, 6)], dim=1)
        ours = prefill_buckets.generate(
            self.model, follow_up, cache=first.cache, generation_config=config, prefill_buckets=[8]
        )
        torch.testing.assert_close(
            ours.sequences, self.model.generate(follow_up, generation_config=config).sequences, rtol=0, atol=0
        )

    def test_continuing_without_fields_still_pads(self):
        # The cache holds the first call's padding: the follow-up must be padded the same way, fields or not.
        config = GenerationConfig(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        first = prefill_buckets.generate(self.model, self.ids(1, 6, 8), generation_config=config, prefill_buckets=[8])
        follow_up = torch.cat([first.sequences, self.ids(1, 3, 9)], dim=1)
        ours = prefill_buckets.generate(self.model, follow_up, cache=first.cache, generation_config=config)
        torch.testing.assert_close(
            ours.sequences, self.model.generate(follow_up, generation_config=config).sequences, rtol=0, atol=0
        )

    def test_batch_buckets_on_a_cache_filled_without_them(self):
        config = GenerationConfig(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        first = prefill_buckets.generate(self.model, self.ids(1, 6, 10), generation_config=config, prefill_buckets=[8])
        follow_up = torch.cat([first.sequences, self.ids(1, 2, 11)], dim=1)
        ours = prefill_buckets.generate(
            self.model, follow_up, cache=first.cache, generation_config=config, prefill_batch_buckets=[4]
        )
        torch.testing.assert_close(
            ours.sequences, self.model.generate(follow_up, generation_config=config).sequences, rtol=0, atol=0
        )

    def test_batch_padded_cache_with_other_batch_raises(self):
        config = GenerationConfig(max_new_tokens=3, do_sample=False, return_dict_in_generate=True)
        first = prefill_buckets.generate(
            self.model, self.ids(1, 6, 7), generation_config=config, prefill_buckets=[8], prefill_batch_buckets=[2]
        )
        with self.assertRaisesRegex(ValueError, "prefill_batch_buckets"):
            prefill_buckets.generate(
                self.model, first.sequences, cache=first.cache, generation_config=config, prefill_buckets=[8]
            )


if __name__ == "__main__":
    unittest.main()

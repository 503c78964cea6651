# Every field of what `generate` returns, bucketed against unpadded, over the matrix of generation modes, caches and
# output flags: sizes, shapes and values. Catches the class of bug where one output keeps the padding (issue 15:
# without a cache, every step re-runs the padded sequence).
#
# Attention weights come from eager attention (sdpa returns none). Both runs of a static cache pin one
# `max_cache_len`, so a static cache's key axis (the cache's slots) is the same length in both, and every attention
# weight is compared. The only values excluded are the hidden states at the user's own pad positions, which the mask
# does not define (`hide_user_pads`), and the returned cache, which holds the padding (documented).

import itertools
import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig

import prefill_buckets

from .tiny_models import EOS, PAD, assert_same, get_model, hide_user_pads, left_padded_batch


ARCHITECTURES = ("llama", "gpt2_pad", "mistral_sliding")  # rotary, absolute positions, sliding window (8)
MODES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "top_k": 0},
    "beam": {"do_sample": False, "num_beams": 2, "num_return_sequences": 2},
    "beam_sample": {"do_sample": True, "num_beams": 2, "top_k": 0},
}
# (use_cache, cache_implementation)
CACHES = {"no_cache": (False, None), "dynamic": (True, None), "static": (True, "static")}
STATIC_SLOTS = 16  # both runs' static cache: the bucket (8) and the new tokens fit
FLAGS = {
    "all": {"output_scores": True, "output_logits": True, "output_attentions": True, "output_hidden_states": True},
    "states": {"output_hidden_states": True},
    "attentions": {"output_attentions": True},
}
LENGTHS = (7, 3)  # a batch of two, the user's own left padding on the second row; bucket 8 (7 + 1 added)
NEW_TOKENS = 3

CASES = [
    (f"{arch}_{mode}_{cache}_{flags}", arch, mode, cache, flags)
    for arch, mode, cache, flags in itertools.product(ARCHITECTURES, MODES, CACHES, FLAGS)
    if not (cache == "static" and mode == "beam_sample")  # one beam mode is enough with a static cache
]


def generate(model, input_ids, attention_mask, mode: str, cache: str, flags: str, seed: int, **fields):
    use_cache, cache_implementation = CACHES[cache]
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        use_cache=use_cache,
        cache_implementation=cache_implementation,
        max_cache_len=STATIC_SLOTS if cache_implementation == "static" else None,
        return_dict_in_generate=True,
        pad_token_id=PAD,
        eos_token_id=EOS,
        **MODES[mode],
        **FLAGS[flags],
    )
    torch.manual_seed(seed)
    return prefill_buckets.generate(
        model, input_ids, attention_mask=attention_mask, generation_config=config, **fields
    )


class AllOutputsTest(unittest.TestCase):
    @parameterized.expand(CASES)
    def test_every_field_equals_unpadded(self, _, arch, mode, cache, flags):
        # Only eager attention returns attention weights (sdpa returns none, and says so).
        model = get_model(arch, "eager" if FLAGS[flags].get("output_attentions") else None)
        input_ids, attention_mask = left_padded_batch(LENGTHS, PAD, seed=3)
        want = generate(model, input_ids, attention_mask, mode, cache, flags, seed=11)
        got = generate(model, input_ids, attention_mask, mode, cache, flags, seed=11, prefill_buckets=[8, 16])
        self.assertEqual(got.sequences.shape, want.sequences.shape)
        if "attentions" in flags or flags == "all":
            self.assertGreater(len(want.attentions[0]), 0)  # eager attention: weights to compare
        for output in (got, want):
            hide_user_pads(output, attention_mask)
        assert_same(self, got, want, "output")

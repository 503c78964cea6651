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
from transformers.utils import ModelOutput

import prefill_buckets

from .tiny_models import EOS, PAD, get_model, left_padded_batch


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
ATOL = 1e-5

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


def assert_same(test: unittest.TestCase, got, want, path: str):
    """Recursively compares two outputs: same structure, shapes and values (ids exactly, floats within ATOL)."""
    if isinstance(want, ModelOutput):
        ignored = {"cache", "past_key_values"}  # the returned cache holds the padding: documented
        test.assertEqual(set(got.keys()) - ignored, set(want.keys()) - ignored, path)
        for key in set(want.keys()) - ignored:
            assert_same(test, got[key], want[key], f"{path}.{key}")
        return
    if isinstance(want, tuple):
        test.assertIsInstance(got, tuple, path)
        test.assertEqual(len(got), len(want), path)
        for index, (g, w) in enumerate(zip(got, want)):
            assert_same(test, g, w, f"{path}[{index}]")
        return
    if isinstance(want, torch.Tensor):
        test.assertEqual(got.shape, want.shape, path)
        if want.dtype.is_floating_point:
            finite = torch.isfinite(want)
            test.assertTrue(torch.equal(finite, torch.isfinite(got)), path)
            torch.testing.assert_close(got[finite], want[finite], atol=ATOL, rtol=0, msg=path)
        else:
            test.assertTrue(torch.equal(got, want), f"{path}: {got.tolist()} != {want.tolist()}")
        return
    test.assertEqual(got, want, path)


def hide_user_pads(output, attention_mask) -> None:
    """
    Zeroes the hidden states at the user's own pad positions of the prompt: a query that attends to nothing averages
    the values of every slot its layer reads, which the mask does not define (`test_equivalence.py` skips them too).
    Their attention weights are compared: a row masked everywhere is `1 / keys` on every key, in both runs.
    """
    if output.get("hidden_states") is None:
        return
    width = attention_mask.shape[1]
    hidden = []
    for layers in output.hidden_states:  # without a cache, every step re-runs the prompt
        if layers[0].shape[1] >= width:
            # Rows per prompt: beams (beam search runs `num_beams` rows whatever `num_return_sequences` is).
            pads = ~attention_mask.bool().repeat_interleave(layers[0].shape[0] // attention_mask.shape[0], dim=0)
            layers = tuple(
                torch.cat([h[:, :width].masked_fill(pads[..., None], 0.0), h[:, width:]], 1) for h in layers
            )
        hidden.append(layers)
    output["hidden_states"] = tuple(hidden)


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

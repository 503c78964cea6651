# Every field of what `generate` returns, bucketed against unpadded, over the matrix of generation modes, caches and
# output flags: sizes, shapes and values. Catches the class of bug where one output keeps the padding (issue 15:
# without a cache, every step re-runs the padded sequence).
#
# The only positions excluded are those the guide's "Generation modes" table names: a static cache's key axis is the
# cache itself (its length is the bucketed cache length, not the sequence), and the returned cache holds the padding.

import itertools
import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig
from transformers.utils import ModelOutput

import prefill_buckets

from .test_equivalence import EOS, PAD, get_model, left_padded_batch


ARCHITECTURES = ("llama", "gpt2_pad", "mistral_sliding")  # rotary, absolute positions, sliding window (8)
MODES = {
    "greedy": {"do_sample": False},
    "sample": {"do_sample": True, "top_k": 0},
    "beam": {"do_sample": False, "num_beams": 2, "num_return_sequences": 2},
    "beam_sample": {"do_sample": True, "num_beams": 2, "top_k": 0},
}
# (use_cache, cache_implementation)
CACHES = {"no_cache": (False, None), "dynamic": (True, None), "static": (True, "static")}
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


def static_cache_slots(attentions, first_slot: int, prompt_length: int):
    """
    A static cache's attentions `[rows, heads, query, slots]` cut to the slots the sequence wrote: the slot axis is the
    cache, whose length bucketing sizes, and a bucketed call's sequence starts after its padding slots.
    """
    return tuple(
        tuple(layer[..., first_slot : first_slot + prompt_length + step] for layer in layers)
        for step, layers in enumerate(attentions)
    )


class AllOutputsTest(unittest.TestCase):
    @parameterized.expand(CASES)
    def test_every_field_equals_unpadded(self, _, arch, mode, cache, flags):
        model = get_model(arch)
        input_ids, attention_mask = left_padded_batch(LENGTHS, PAD, seed=3)
        want = generate(model, input_ids, attention_mask, mode, cache, flags, seed=11)
        got = generate(model, input_ids, attention_mask, mode, cache, flags, seed=11, prefill_buckets=[8, 16])
        self.assertEqual(got.sequences.shape, want.sequences.shape)
        if cache == "static" and want.get("attentions") is not None:
            prompt_length, added = max(LENGTHS), 8 - max(LENGTHS)
            for output, first_slot in ((want, 0), (got, added)):
                full = output.attentions
                output["attentions"] = static_cache_slots(full, first_slot, prompt_length)
                # Nothing attends to a slot outside the sequence: its padding, and the slots not written yet.
                for step, layers in enumerate(full):
                    for layer, kept in zip(layers, output["attentions"][step]):
                        torch.testing.assert_close(kept.sum(-1), layer.sum(-1), atol=ATOL, rtol=0)
        assert_same(self, got, want, "output")

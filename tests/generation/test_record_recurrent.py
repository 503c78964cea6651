# Tests `kvcache/record.py` on a cache of only recurrent layers (Mamba's), in a conversation: the cache a bucketed call
# filled reads as holding only recurrent layers, so a later turn runs unpadded (`PassedCache.recurrent_only`, the
# reason `call/decision.py` logs), and the pads a left-padded turn ran are uncounted after it (`record_call`), so a
# later turn runs every token of its own. Moved whole from test_equivalence.py (`RecurrentCacheTest`), whose ids and
# special tokens it shares (in tiny_models.py); kept apart from test_record.py, whose compiled conversations take minutes, so that it runs
# at both ends of the tested range (RANGE_TESTS), as it did there.

import functools
import unittest

import torch
from transformers import GenerationConfig, MambaConfig, MambaForCausalLM
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging as transformers_logging

import prefill_buckets

from .tiny_models import BOS, CACHE, EOS, PAD, VOCAB, random_batch_ids, single_thread_module


package_logger = transformers_logging.get_logger("prefill_buckets")  # every module of the package logs under it


setUpModule, tearDownModule = single_thread_module()


class RecurrentCacheTest(unittest.TestCase):
    """A conversation on a model whose cache holds only recurrent layers (Mamba): a later turn runs unpadded, exact."""

    # Before 5.24 upstream's own later turn of a Mamba conversation refuses the cache it returned (`past_key_values` is
    # "not used by the model"); the case this pins comes with 5.25.
    @unittest.skipIf(CACHE != "cache", "transformers < 5.24 continues no Mamba conversation itself")
    def test_a_later_turn_runs_upstreams_call(self):
        # From transformers 5.25 such a cache tells how many tokens it holds, and a later turn of a conversation a
        # bucketed call started was lined up with its padding: the forward raised a size mismatch. It holds a state and
        # no keys: the turn runs unpadded, as it did where the cache could not tell its length.
        config = MambaConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        )  # fmt: skip
        torch.manual_seed(0)
        model = MambaForCausalLM(config).eval()
        config = GenerationConfig(do_sample=False, max_new_tokens=4, min_new_tokens=4, return_dict_in_generate=True)
        prompt, reply = random_batch_ids(1, 6), random_batch_ids(1, 3, seed=1)
        cache_keyword = CACHE
        for first_fields in ({}, {"prefill_buckets": [16]}):
            with self.subTest(first_fields=first_fields):
                first = model.generate(prompt, generation_config=config)
                expected = model.generate(
                    torch.cat([first.sequences, reply], dim=1),
                    generation_config=config,
                    **{CACHE: getattr(first, CACHE)},
                )
                ours = prefill_buckets.generate(model, prompt, generation_config=config, **first_fields)
                self.assertEqual(ours.sequences.tolist(), first.sequences.tolist())
                package_logger.warning_once.cache_clear()  # each subtest's reason is logged again
                with CaptureLogger(package_logger) as captured:
                    turn = prefill_buckets.generate(
                        model,
                        torch.cat([ours.sequences, reply], dim=1),
                        generation_config=config,
                        prefill_buckets=[16],
                        **{cache_keyword: getattr(ours, CACHE)},
                    )
                self.assertEqual(turn.sequences.tolist(), expected.sequences.tolist())
                if first_fields:  # the turn that continues a bucketed call's cache says why it is not padded
                    self.assertIn("only recurrent (linear-attention) layers", captured.out)

    @unittest.skipIf(CACHE != "cache", "transformers < 5.24 continues no Mamba conversation itself")
    def test_a_later_turn_after_a_left_padded_turn(self):
        # From transformers 5.25 a recurrent layer counts the tokens it ran, and upstream slices a later turn's ids by
        # that count: a first turn padded on the left counted its pads, and the later turn ran too few of its tokens
        # (other logits from its first step). The pads are uncounted after the call.
        config = MambaConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
            pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS,
        )  # fmt: skip
        torch.manual_seed(0)
        model = MambaForCausalLM(config).eval()
        prompt, reply = random_batch_ids(1, 11), random_batch_ids(1, 5, seed=1)
        options = {"do_sample": False, "max_new_tokens": 4, "return_dict_in_generate": True, "pad_token_id": PAD}
        for cache in ({"cache_implementation": "static", "max_cache_len": 64}, {}):
            turns = []
            for generate in (model.generate, functools.partial(prefill_buckets.generate, model)):
                first = generate(prompt, **options, **cache, **({"prefill_buckets": [16]} if turns else {}))
                later = generate(
                    torch.cat([first.sequences, reply], dim=1),
                    output_logits=True,
                    **options,
                    **{CACHE: getattr(first, CACHE)},
                )
                turns.append((first.sequences, later.sequences, torch.stack(later.logits)))
            with self.subTest(cache=cache):
                (first, later, logits), (our_first, our_later, our_logits) = turns
                self.assertEqual(our_first.tolist(), first.tolist())
                self.assertEqual(our_later.tolist(), later.tolist())
                torch.testing.assert_close(our_logits, logits)


if __name__ == "__main__":
    unittest.main()

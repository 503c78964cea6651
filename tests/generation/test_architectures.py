# Architectures whose layout breaks an assumption of the package, each exact against upstream `generate` (issue 27):
# a config that misstates its key/value heads (the early cache allocation), a model with buffers as long as its
# positions (the cache length), a model for which generate makes no cache object, and models that can't be padded on
# one side or on either (`side_assumptions.py`, rows of `decision.DECISION`).

import logging as std_logging
import unittest

import torch
from parameterized import parameterized
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets


package_logger = logging.get_logger("prefill_buckets")
SPECIAL_TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
NEW_TOKENS = 4


def tiny(model_type: str, **values):
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, vocab_size=128, **SPECIAL_TOKENS, **values)
    return AutoModelForCausalLM.from_config(config).eval()


def prompts():
    generator = torch.Generator().manual_seed(0)
    one = torch.randint(3, 128, (1, 11), generator=generator)
    batch = torch.randint(3, 128, (2, 11), generator=generator)
    mask = torch.ones_like(batch)
    batch[1, :4], mask[1, :4] = 0, 0  # ragged: left-padded by the user
    return [("one_prompt", one, torch.ones_like(one)), ("batch_of_2", batch, mask)]


class ArchitectureTestBase(unittest.TestCase):
    def assertExact(self, model, cache_implementation="static", max_cache_len=None, **fields):
        """
        Bucketed `generate` gives upstream's tokens, and each step's logits within 1e-5, on one prompt and a ragged
        batch; returns the package's logs. (A tiny random model often repeats one token whatever it attends to: the
        logits show a difference its tokens hide.)
        """
        logs = []
        for name, input_ids, attention_mask in prompts():
            kwargs = {
                "attention_mask": attention_mask,
                "max_new_tokens": NEW_TOKENS,
                "do_sample": False,
                "cache_implementation": cache_implementation,
                "output_logits": True,
                "return_dict_in_generate": True,
            }
            if max_cache_len is not None:
                kwargs["max_cache_len"] = max_cache_len
            expected = model.generate(input_ids, **kwargs)
            std_logging.Logger.warning_once.cache_clear()
            with CaptureLogger(package_logger) as captured:
                actual = prefill_buckets.generate(model, input_ids, prefill_buckets="pow2", **kwargs, **fields)
            logs.append(captured.out)
            self.assertTrue(
                torch.equal(actual.sequences, expected.sequences),
                f"{name}:\n{actual.sequences}\n!=\n{expected.sequences}",
            )
            for step, (ours, theirs) in enumerate(zip(actual.logits, expected.logits)):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5, msg=f"{name}, logits of step {step}")
        return logs


class MisstatedHeadsTest(ArchitectureTestBase):
    @parameterized.expand(
        [
            # GPT-NeoX attends with every head, whatever `num_key_value_heads` its config carries.
            ("gpt_neox_unused_kv_heads", "gpt_neox", {"num_key_value_heads": 1}),
            # Multi-query: one key/value head, where the config's head count says 4.
            ("gpt_bigcode_multi_query", "gpt_bigcode", {"multi_query": True}),
            # BART's decoder has its own head count; `num_attention_heads` maps to the encoder's.
            ("bart_decoder_heads", "bart", {"decoder_attention_heads": 2, "encoder_attention_heads": 8}),
        ]
    )
    def test_exact(self, _, model_type, values):
        sizes = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64}
        if model_type == "bart":
            sizes = {"d_model": 32, "decoder_layers": 2, "encoder_layers": 2, "decoder_ffn_dim": 64}
        if model_type == "gpt_bigcode":
            sizes = {"n_embd": 32, "n_head": 4, "n_layer": 2}
        model = tiny(model_type, **sizes, **values)
        self.assertExact(model)

    def test_held_shapes_come_from_the_modules(self):
        from prefill_buckets.kvcache.kv_shapes import held_kv_shapes

        model = tiny("gpt_neox", hidden_size=32, num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=1)
        self.assertEqual(held_kv_shapes(model), {0: {(4, 8)}, 1: {(4, 8)}})  # 4 heads of 8, not the config's 1
        model = tiny("gpt_bigcode", n_embd=32, n_head=4, n_layer=2, multi_query=True)
        self.assertEqual(held_kv_shapes(model), {0: {(1, 8)}, 1: {(1, 8)}})


class CacheLengthTest(ArchitectureTestBase):
    def test_never_past_the_positions(self):
        # GPT-Neo's causal mask is a buffer of `max_position_embeddings` rows: a cache longer than that can't run.
        model = tiny(
            "gpt_neo",
            hidden_size=32,
            num_heads=4,
            num_layers=2,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=100,
            window_size=256,  # longer than any cache here: upstream's local layers then don't depend on its length
        )
        self.assertExact(model)

    @parameterized.expand([("mpt", {"d_model": 32, "n_heads": 4, "n_layers": 2, "expansion_ratio": 2})])
    def test_model_without_a_cache_object(self, model_type, values):
        # `generate` makes no cache object for MPT (the model keeps its own state): left-padded, exact.
        self.assertExact(tiny(model_type, **values))

    def test_right_padding_without_a_cache_object(self):
        # Nor for RWKV: one prompt, sent right, runs unpadded (nothing to rewind after the pads) and says so.
        model = tiny("rwkv", hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64)
        logs = self.assertExact(model)
        self.assertIn("made no static cache", logs[0])


class NeitherSideTest(ArchitectureTestBase):
    def test_positions_from_the_cache_length(self):
        # TrOCR counts positions from the cache and takes no `logits_to_keep`: padded on neither side.
        model = tiny("trocr", d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=64)
        logs = self.assertExact(model)
        for log in logs:
            self.assertIn("are ignored for this call", log)
            self.assertIn("takes no `position_ids`", log)

    def test_bidirectional_attention(self):
        # Without `is_decoder`, XLM-RoBERTa-XL attends both ways: padded on neither side.
        model = tiny(
            "xlm-roberta-xl", hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64
        )
        logs = self.assertExact(model)
        self.assertIn("is_decoder=False", logs[0])

    def test_right_where_left_shifts_positions(self):
        # BART's decoder counts positions from the cache: one prompt goes right (exact), a ragged batch unpadded.
        model = tiny("bart", d_model=32, decoder_layers=2, encoder_layers=2, decoder_attention_heads=4)
        logs = self.assertExact(model)
        self.assertNotIn("are ignored for this call", logs[0])
        self.assertIn("takes no `position_ids`", logs[1])

    def test_recurrent_state_on_the_modules(self):
        # RecurrentGemma's recurrent blocks keep their state on their modules, outside the cache: right padding would
        # run the pads into it (on transformers 5.17, whose static cache holds only attention layers for it, the right
        # side took other logits). Asked for the right, it pads on the left and says why.
        model = tiny(
            "recurrent_gemma",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            lru_width=32,
            attention_window_size=16,
            block_types=["recurrent", "attention"],
        )
        logs = self.assertExact(model, prefill_padding_side="right")
        self.assertIn("keep their state on their modules", logs[0])

    def test_padding_read_from_the_ids(self):
        # CPM-Ant ignores the attention mask and reads padding from its ids: every id 0 hides one position from the
        # front. Padded in front with another id, the pads were attended (other tokens); with pads of 0, the step after
        # it generated a 0 had other logits (5.3 off; upstream's own call on the same pads has them too). Unpadded.
        model = tiny("cpmant", hidden_size=32, num_attention_heads=4, dim_head=8, dim_ff=64, num_hidden_layers=2)
        prompt = torch.tensor([[28, 18, 107, 99, 87, 77, 82, 23, 104, 67, 124, 98, 40]])
        for pad_token_id in (5, 0):
            fields = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": pad_token_id}
            expected = model.generate(prompt, output_logits=True, return_dict_in_generate=True, **fields)
            std_logging.Logger.warning_once.cache_clear()
            with CaptureLogger(package_logger) as captured:
                actual = prefill_buckets.generate(
                    model, prompt, prefill_buckets="pow2", output_logits=True, return_dict_in_generate=True, **fields
                )
            self.assertEqual(actual.sequences.tolist(), expected.sequences.tolist())
            for ours, theirs in zip(actual.logits, expected.logits, strict=True):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
            self.assertIn("ignores the attention mask", captured.out)

    def test_mask_dropped_by_the_model(self):
        # XLNet's own `prepare_inputs_for_generation` builds its inputs without the mask: a ragged batch runs
        # unpadded, one prompt right-padded (no mask needed).
        model = tiny("xlnet", d_model=32, n_head=4, n_layer=2, d_inner=64)
        logs = self.assertExact(model)
        self.assertIn("does not pass the attention mask on", logs[1])


class Issue36Test(ArchitectureTestBase):
    """The three rows of issue 36's hidden sweep (part 3), each exact against upstream where upstream runs."""

    def test_model_that_keeps_no_cache(self):
        # OpenAI GPT takes the static cache and writes nothing to it: every decode step runs the whole sequence, as the
        # user passed it. A ragged batch's mask must stay the user's (the cache layout's mask hid its last tokens).
        model = tiny("openai-gpt", n_embd=32, n_head=4, n_layer=2, n_positions=64)
        logs = self.assertExact(model)
        self.assertIn("keeps no cache", logs[1])

    def test_local_window_from_the_cache_end(self):
        # GPT-Neo's local layers place their window from the cache's last slot: with a window shorter than the static
        # cache, upstream's tokens depend on the cache's length, so the call runs unpadded and says why.
        model = tiny(
            "gpt_neo",
            hidden_size=32,
            num_heads=4,
            num_layers=2,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=128,
            window_size=8,
            initializer_range=0.2,  # tokens that follow what the local window attends to
        )
        for log in self.assertExact(model):
            self.assertIn("are ignored for this call", log)
            self.assertIn("place their window of 8 tokens from the end of the static cache", log)
        # A cache no longer than the window: the local layers attend to every token, so the call is bucketed.
        model = tiny(
            "gpt_neo",
            hidden_size=32,
            num_heads=4,
            num_layers=2,
            attention_types=[[["global", "local"], 1]],
            max_position_embeddings=128,
            window_size=64,
            initializer_range=0.2,
        )
        for log in self.assertExact(model, max_cache_len=48):
            self.assertNotIn("are ignored for this call", log)
        # A dynamic cache reads the window from each token: bucketed (left), exact.
        self.assertExact(tiny("gpt_neo", hidden_size=32, num_heads=4, num_layers=2, window_size=8,
                              attention_types=[[["global", "local"], 1]], max_position_embeddings=128),
                         cache_implementation=None)  # fmt: skip

    @unittest.skipUnless("glm4_moe_lite" in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "GLM-4-MoE-Lite is newer")
    def test_latent_attention_with_fewer_key_value_heads(self):
        # Latent attention builds one key head per query head; with `num_key_value_heads` below the query heads,
        # upstream's masked attention repeats them too often and fails. Unmasked, one row runs upstream: a bucketed
        # call (which needs the mask) runs it unpadded and says why.
        model = tiny(
            "glm4_moe_lite",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            intermediate_size=64,
        )
        one_prompt = prompts()[0][1]
        kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False}
        expected = model.generate(one_prompt, **kwargs)
        std_logging.Logger.warning_once.cache_clear()
        with CaptureLogger(package_logger) as captured:
            actual = prefill_buckets.generate(model, one_prompt, prefill_buckets="pow2", **kwargs)
        self.assertTrue(torch.equal(actual, expected))
        self.assertIn("repeats its keys `num_key_value_groups` times", captured.out)

# Unit tests of `call/side_assumptions.py`: each predicate of a model's property that a row of `decision.DECISION`
# tests, on tiny models of the architectures it names (and on one that doesn't break it), checked against what the
# model does where that is cheap to see; the cache-dependent reasons (`window_reason`, `cache_layers_reason`,
# `cache_has_sliding_layers`); and `model_breaks`, which asks each predicate once per model.

import functools
import sys
import types
import unittest
from unittest import mock

import torch
import transformers
from transformers import (
    BartConfig,
    BartForCausalLM,
    BertConfig,
    BertLMHeadModel,
    BertModel,
    BloomConfig,
    BloomForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    RecurrentGemmaConfig,
    RecurrentGemmaForCausalLM,
    StaticCache,
    TrOCRConfig,
    TrOCRForCausalLM,
    XLNetConfig,
    XLNetLMHeadModel,
)

from prefill_buckets.call import side_assumptions
from prefill_buckets.call.decision import DECISION
from prefill_buckets.call.padding_side import RuleFacts
from prefill_buckets.call.resolved import bind_call, resolve_call
from prefill_buckets.upstream import transformers_api

from .tiny_models import single_thread_module, tiny_llama


setUpModule, tearDownModule = single_thread_module()

VOCAB = 64
WINDOW = 4  # GPT-Neo's local window


def tiny(model_class, config, attn_implementation=None):
    torch.manual_seed(0)
    if attn_implementation is not None:
        return model_class._from_config(config, attn_implementation=attn_implementation).eval()
    return model_class(config).eval()


def bert(is_decoder: bool):
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        is_decoder=is_decoder,
    )
    return tiny(BertLMHeadModel if is_decoder else BertModel, config)


def gpt_neo(attention_types=(("global", "local"), 1)):
    config = GPTNeoConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_layers=2,
        num_heads=2,
        attention_types=[list(attention_types)],
        window_size=WINDOW,
        max_position_embeddings=32,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return tiny(GPTNeoForCausalLM, config)


def latent_attention(num_key_value_heads: int):
    """A one-layer DeepSeek-V3 (multi-head latent attention: one key head per query head) of 4 query heads."""
    config = DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=2,
        num_experts_per_tok=1,
        first_k_dense_replace=1,
        max_position_embeddings=32,
    )
    return tiny(DeepseekV3ForCausalLM, config, attn_implementation="eager")


def mistral_sliding(window: int = 8):
    config = MistralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=window,
        max_position_embeddings=64,
    )
    return tiny(MistralForCausalLM, config)


def recurrent_gemma():
    config = RecurrentGemmaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        lru_width=16,
        attention_window_size=8,
        block_types=["recurrent", "attention"],
    )
    return tiny(RecurrentGemmaForCausalLM, config)


def first_position_output(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return (out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits)[:, 0]


class AttentionIsBidirectionalTest(unittest.TestCase):
    def test_bert_encoder_is_bidirectional(self):
        model = bert(is_decoder=False)
        self.assertTrue(side_assumptions.attention_is_bidirectional(model))
        # What the predicate says: the first token's output depends on the last token.
        ids = torch.tensor([[3, 4, 5, 6]])
        changed = torch.tensor([[3, 4, 5, 7]])
        self.assertFalse(torch.allclose(first_position_output(model, ids), first_position_output(model, changed)))

    def test_causal_models(self):
        # A BERT decoder (`is_decoder=True`), a Llama (no `is_decoder` at all), and a GPT-NeoX, whose config says
        # `is_decoder=False` but whose attention modules say they are causal.
        neox = tiny(
            GPTNeoXForCausalLM,
            GPTNeoXConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=32,
                max_position_embeddings=32,
            ),
        )
        for name, model in (("bert decoder", bert(is_decoder=True)), ("llama", tiny_llama()), ("gpt-neox", neox)):
            with self.subTest(name):
                self.assertFalse(side_assumptions.attention_is_bidirectional(model))
                ids = torch.tensor([[3, 4, 5, 6]])
                changed = torch.tensor([[3, 4, 5, 7]])
                torch.testing.assert_close(first_position_output(model, ids), first_position_output(model, changed))


class PositionsTest(unittest.TestCase):
    def test_positions_from_the_mask(self):
        # BLOOM: ALiBi biases from the mask, no `position_ids`, no `max_position_embeddings`.
        bloom = tiny(BloomForCausalLM, BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=1, n_head=2))
        self.assertTrue(side_assumptions.positions_from_the_mask(bloom))
        gpt2 = tiny(GPT2LMHeadModel, GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32))
        for model in (tiny_llama(), gpt2):
            self.assertFalse(side_assumptions.positions_from_the_mask(model), type(model).__name__)

    def test_positions_count_from_the_cache(self):
        bart = tiny(
            BartForCausalLM,
            BartConfig(
                vocab_size=VOCAB,
                d_model=16,
                decoder_layers=1,
                encoder_layers=1,
                decoder_attention_heads=2,
                encoder_attention_heads=2,
                decoder_ffn_dim=32,
                encoder_ffn_dim=32,
                max_position_embeddings=32,
            ),
        )
        trocr = tiny(
            TrOCRForCausalLM,
            TrOCRConfig(vocab_size=VOCAB, d_model=16, decoder_layers=1, decoder_attention_heads=2, decoder_ffn_dim=32),
        )
        for model in (bart, trocr):
            self.assertTrue(side_assumptions.positions_count_from_the_cache(model), type(model).__name__)
        # What it means: a masked pad in front shifts the position of the token after it, and so its logits.
        with torch.no_grad():
            alone = bart(torch.tensor([[5]])).logits[0, -1]
            after_a_pad = bart(torch.tensor([[1, 5]]), attention_mask=torch.tensor([[0, 1]])).logits[0, -1]
        self.assertFalse(torch.allclose(alone, after_a_pad))
        # Llama takes `position_ids`; BLOOM has none to count.
        bloom = tiny(BloomForCausalLM, BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=1, n_head=2))
        for model in (tiny_llama(), bloom):
            self.assertFalse(side_assumptions.positions_count_from_the_cache(model), type(model).__name__)


class ByClassNameTest(unittest.TestCase):
    def test_the_named_classes_are_upstreams(self):
        # A class renamed upstream would silently never match.
        named = (
            *side_assumptions.MASK_IGNORED_BY,
            *side_assumptions.MASK_FROM_KEYS,
            *side_assumptions.POSITIONS_PLUS_CACHE,
            *side_assumptions.WINDOW_FROM_THE_CACHE_END,
        )
        for name in named:
            with self.subTest(name):
                self.assertTrue(hasattr(transformers, name))
        for name, field in side_assumptions.WINDOW_FROM_THE_CACHE_END.items():
            config_class = getattr(transformers, name).config_class
            self.assertIsInstance(getattr(config_class(), field), int, f"{name}'s config has `{field}`")

    def test_other_models_break_none(self):
        model = tiny_llama()
        for predicate in (
            side_assumptions.ignores_the_mask,
            side_assumptions.masks_from_keys,
            side_assumptions.adds_the_cache_length_to_positions,
        ):
            self.assertFalse(predicate(model), predicate.__name__)


class WindowFromTheCacheEndTest(unittest.TestCase):
    def test_gpt_neo_with_local_layers(self):
        self.assertEqual(side_assumptions.window_from_the_cache_end(gpt_neo()), gpt_neo().config.window_size)

    def test_no_local_layers_or_another_model(self):
        self.assertIsNone(side_assumptions.window_from_the_cache_end(gpt_neo(attention_types=(("global",), 2))))
        self.assertIsNone(side_assumptions.window_from_the_cache_end(tiny_llama()))

    def call_facts(self, model, **kwargs):
        ids = torch.arange(3, 9)[None]  # 6 tokens, one bucket of 8
        kwargs = {"max_new_tokens": 2, "do_sample": False, "prefill_buckets": [8], **kwargs}
        call = resolve_call(model, None, *bind_call(model, (ids,), kwargs))
        return RuleFacts(call, DECISION)

    def test_window_reason(self):
        model = gpt_neo()
        # A cache longer than the window: the padded call would get other tokens.
        reason = side_assumptions.window_reason(
            self.call_facts(model, cache_implementation="static", max_cache_len=16)
        )
        self.assertIn(f"window of {WINDOW} tokens", reason)
        self.assertIn("16 slots", reason)
        passed = StaticCache(config=model.config, max_cache_len=12)
        self.assertIn("12 slots", side_assumptions.window_reason(self.call_facts(model, past_key_values=passed)))
        # A cache no longer than the window, a dynamic one, or no cache: padded as any other call.
        for kwargs in (
            {"cache_implementation": "static", "max_cache_len": WINDOW},
            {"cache_implementation": "dynamic"},
            {"cache_implementation": "static", "max_cache_len": 16, "use_cache": False},
            {"past_key_values": StaticCache(config=model.config, max_cache_len=WINDOW)},
        ):
            with self.subTest(**{k: str(v) for k, v in kwargs.items()}):
                self.assertIsNone(side_assumptions.window_reason(self.call_facts(model, **kwargs)))
        # Another model's window counts from each token.
        facts = self.call_facts(tiny_llama(), cache_implementation="static", max_cache_len=16)
        self.assertIsNone(side_assumptions.window_reason(facts))


class OtherPredicatesTest(unittest.TestCase):
    def test_drops_the_mask(self):
        xlnet = tiny(XLNetLMHeadModel, XLNetConfig(vocab_size=VOCAB, d_model=16, n_layer=1, n_head=2, d_inner=32))
        self.assertTrue(side_assumptions.drops_the_mask(xlnet))
        self.assertFalse(side_assumptions.drops_the_mask(tiny_llama()))

    def test_keeps_a_state_on_its_modules(self):
        self.assertTrue(side_assumptions.keeps_a_state_on_its_modules(recurrent_gemma()))
        self.assertFalse(side_assumptions.keeps_a_state_on_its_modules(tiny_llama()))
        self.assertFalse(side_assumptions.counts_no_tokens(tiny_llama()))

    def test_compresses_the_cache(self):
        self.assertFalse(side_assumptions.compresses_the_cache(tiny_llama()))
        model = tiny_llama()
        model.config.compress_rates = [4]
        self.assertTrue(side_assumptions.compresses_the_cache(model))

    def test_repeated_key_heads(self):
        # Latent attention builds one key head per query head; `num_key_value_heads=2` of 4 repeats each twice.
        model = latent_attention(num_key_value_heads=2)
        heads = model.config.num_attention_heads
        groups = heads // model.config.num_key_value_heads
        self.assertEqual(side_assumptions.repeated_key_heads(model), (heads * groups, heads))
        # What it means: upstream's eager attention with a mask fails on it, and runs on the config that repeats none.
        ids, mask = torch.tensor([[3, 4, 5, 6]]), torch.tensor([[0, 1, 1, 1]])
        with self.assertRaises(RuntimeError), torch.no_grad():
            model(ids, attention_mask=mask)
        fitting = latent_attention(num_key_value_heads=4)
        self.assertIsNone(side_assumptions.repeated_key_heads(fitting))
        with torch.no_grad():
            fitting(ids, attention_mask=mask)
        self.assertIsNone(side_assumptions.repeated_key_heads(tiny_llama()))  # no latent projection

    def test_peft_row_arguments(self):
        # PEFT passes per-row arguments to the layers by forward pre-hooks with kwargs, `functools.partial` objects.
        def pass_on(module, args, kwargs, **row_arguments):
            return args, {**kwargs, **row_arguments}

        model = tiny_llama()
        layer = model.model.layers[0].self_attn.q_proj
        layer.register_forward_pre_hook(
            functools.partial(pass_on, alora_offsets=[2], adapter_names=["a"], other=1), with_kwargs=True
        )
        with mock.patch.dict(sys.modules, {"peft": types.ModuleType("peft")}):
            self.assertEqual(
                side_assumptions.peft_row_arguments(model), {"adapter_names": False, "alora_offsets": True}
            )
            self.assertEqual(side_assumptions.peft_row_arguments(tiny_llama()), {})  # no hooks
        with mock.patch.dict(sys.modules):
            sys.modules.pop("peft", None)
            self.assertEqual(side_assumptions.peft_row_arguments(model), {})  # only PEFT registers them


class ModelBreaksTest(unittest.TestCase):
    def test_asked_once_per_model(self):
        asked = []

        def breaks_it(model):
            asked.append(model)
            return 1  # truthy: stored as a bool

        first, second = tiny_llama(), tiny_llama()
        for _ in range(3):
            self.assertIs(side_assumptions.model_breaks(first, breaks_it), True)
        self.assertEqual(len(asked), 1)
        self.assertIs(side_assumptions.model_breaks(second, breaks_it), True)
        self.assertEqual(asked, [first, second])


class CacheLayersTest(unittest.TestCase):
    def test_sliding_window_shorter_than_the_slots(self):
        model = mistral_sliding(window=8)
        cache = StaticCache(config=model.config, max_cache_len=32)
        self.assertTrue(side_assumptions.cache_has_sliding_layers(model, cache, 16))
        self.assertIn("window of 8 slots", side_assumptions.cache_layers_reason(model, cache, 16))
        self.assertIsNone(side_assumptions.cache_layers_reason(model, cache, 8))  # the prompt fits the window
        # The cache `generate` would make: the same answer.
        self.assertIn("16", side_assumptions.cache_layers_reason(model, None, 16))
        self.assertTrue(side_assumptions.cache_has_sliding_layers(model, None, 16))

    def test_full_attention_layers(self):
        model = tiny_llama()
        cache = StaticCache(config=model.config, max_cache_len=32)
        self.assertFalse(side_assumptions.cache_has_sliding_layers(model, cache, 16))
        self.assertIsNone(side_assumptions.cache_layers_reason(model, cache, 16))
        self.assertIsNone(side_assumptions.cache_layers_reason(model, None, 16))

    def test_layers_that_cant_forget_the_pads(self):
        model = recurrent_gemma()
        kinds = {type(layer).__name__ for layer in StaticCache(config=model.config, max_cache_len=4).layers}
        other = kinds - set(transformers_api.RIGHT_PADDED_LAYERS)
        if not other:
            self.skipTest(f"this transformers' RecurrentGemma static cache has only {sorted(kinds)} layers")
        reason = side_assumptions.cache_layers_reason(model, None, 4)
        self.assertIn("can't forget the pads", reason)
        self.assertTrue(any(kind in reason for kind in other))

    def test_the_cache_generate_makes_is_built_once_per_slot_count(self):
        model = mistral_sliding()
        build = mock.Mock(wraps=transformers_api.lazy_static_cache)
        with mock.patch.object(transformers_api, "lazy_static_cache", build):
            for _ in range(2):
                side_assumptions.cache_layers_reason(model, None, 16)
            self.assertEqual(build.call_count, 1)
            side_assumptions.cache_layers_reason(model, None, 4)
            self.assertEqual(build.call_count, 2)

    def test_a_cache_that_cant_be_built(self):
        with mock.patch.object(transformers_api, "lazy_static_cache", side_effect=TypeError("no cache")):
            reason = side_assumptions.cache_layers_reason(tiny_llama(), None, 16)
        self.assertIn("can't be checked (TypeError)", reason)


if __name__ == "__main__":
    unittest.main()

# Unit tests of `kvcache/kv_shapes.py`: the `(key/value heads, head_dim)` each attention module holds, read from its
# own projections (`held_kv_shapes`), equal to what upstream's cache holds after a forward, by layer, on tiny models
# whose config states those shapes or misstates them (an unused `num_key_value_heads`, multi-query attention).

import unittest

import torch
from transformers import (
    FalconConfig,
    FalconForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from prefill_buckets.kvcache.kv_shapes import held_kv_shapes

from .tiny_models import single_thread_module, tiny_llama


setUpModule, tearDownModule = single_thread_module()

VOCAB = 64
MODELS = {
    "llama": lambda: tiny_llama(),
    # Fused query/key/value projection (GPT-2's transposed `Conv1D`).
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32)),
    # Multi-query: one key/value head, in a fused projection.
    "gpt_bigcode": lambda: GPTBigCodeForCausalLM(
        GPTBigCodeConfig(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=4, n_positions=32, multi_query=True)
    ),
    "falcon": lambda: FalconForCausalLM(
        FalconConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
            new_decoder_architecture=False,
        )
    ),
    # A `num_key_value_heads` the model doesn't use: it holds a head per query head.
    "gpt_neox": lambda: GPTNeoXForCausalLM(
        GPTNeoXConfig(
            vocab_size=VOCAB,
            hidden_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=32,
            num_key_value_heads=1,
        )
    ),
    # A head size of its own, not `hidden_size // num_attention_heads`.
    "qwen3": lambda: Qwen3ForCausalLM(
        Qwen3Config(
            vocab_size=VOCAB,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
        )
    ),
}


def cached_kv_shapes(model) -> dict[int, set[tuple[int, int]]]:
    """`(heads, head_dim)` of the keys upstream's cache holds after a forward, by layer."""
    with torch.no_grad():
        cache = model(torch.tensor([[3, 4, 5]]), use_cache=True).past_key_values
    return {index: {(layer.keys.shape[1], layer.keys.shape[-1])} for index, layer in enumerate(cache.layers)}


class HeldKvShapesTest(unittest.TestCase):
    def test_what_upstreams_cache_holds(self):
        for name, make in MODELS.items():
            with self.subTest(name):
                torch.manual_seed(0)
                model = make().eval()
                self.assertEqual(held_kv_shapes(model), cached_kv_shapes(model))

    def test_not_from_the_config(self):
        # The premise of reading the modules: GPT-NeoX's config states one key/value head, the modules hold two.
        model = MODELS["gpt_neox"]()
        self.assertEqual(model.config.num_key_value_heads, 1)
        self.assertEqual({heads for shapes in held_kv_shapes(model).values() for heads, _ in shapes}, {2})

    def test_read_once_per_model(self):
        model = tiny_llama()
        held = held_kv_shapes(model)
        model.model.layers[0].self_attn.k_proj = torch.nn.Linear(32, 4 * 8, bias=False)  # changed after the read
        self.assertIs(held_kv_shapes(model), held)
        self.assertIsNot(held_kv_shapes(tiny_llama()), held)  # another model: read again

    def test_modules_that_dont_say_their_layer(self):
        class Attention(torch.nn.Module):
            def __init__(self, heads: int):
                super().__init__()
                self.head_dim = 4
                self.k_proj = torch.nn.Linear(16, heads * self.head_dim)

        model = torch.nn.Sequential(Attention(3), Attention(1), torch.nn.Linear(16, 16))
        self.assertEqual(held_kv_shapes(model), {None: {(3, 4), (1, 4)}})

    def test_nothing_held(self):
        self.assertEqual(held_kv_shapes(torch.nn.Sequential(torch.nn.Linear(4, 4))), {})


if __name__ == "__main__":
    unittest.main()

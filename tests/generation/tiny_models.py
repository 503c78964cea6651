"""Tiny randomly initialised models built from configs, shared by the test files. Never a hub download."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.generation.utils import GenerateDecoderOnlyOutput


# `generate` takes and returns the cache as `cache` from transformers 5.24 on, as `past_key_values` before.
CACHE = "cache" if "cache" in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A 2-layer Llama config: vocab 128, hidden 32, GQA (4 heads, 2 kv heads); pad 0, eos 1, bos 2."""
    values = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A `tiny_llama_config` model in eval mode; the same `seed` gives the same weights."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()

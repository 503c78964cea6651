"""Per-call overhead of a bucketed call against upstream `generate`: tiny Llama, eager, 1 thread, side by side.

    python utils/measure_call_overhead.py [--rounds 200]

A prompt that exactly fits its bucket (16 tokens, bucket 16) and 4 new tokens, so both calls run the same forwards
on the same shapes: the difference is what bucketing adds around upstream `generate` (resolving, padding, hooks,
stripping). The two alternate; the medians and their difference are printed.
"""

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    import prefill_buckets

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    generation_config = GenerationConfig(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    calls = {
        "upstream": lambda: model.generate(input_ids, generation_config=generation_config),
        "bucketed": lambda: prefill_buckets.generate(
            model, input_ids, generation_config=generation_config, prefill_buckets=[16]
        ),
    }
    times = {name: [] for name in calls}
    for name, call in calls.items():
        call()  # warm-up
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
    for name, median in medians.items():
        print(f"{name:9s} median {median:.2f} ms per call")
    print(
        f"overhead: {medians['bucketed'] - medians['upstream']:.2f} ms per call ({medians['bucketed'] / medians['upstream']:.3f}x)"
    )


if __name__ == "__main__":
    main()

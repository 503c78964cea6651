"""Decode time per token against the static cache's length, side by side in one process.

    python utils/measure_cache_length.py [--lengths 1024 2048 4096 8192] [--rounds 3]

SmolLM2-135M-Instruct (converted once by `python -m prefill_buckets bench`), `model.forward` compiled with inductor
(`dynamic=False`), one 100-token prompt, upstream `generate` with `max_cache_len` pinned to each length in turn. A static
cache's decode step attends over every slot, so a longer cache is slower decode, and more memory: this is the price of
sizing the cache for the longest prompt up front (see the guide's "Cache sizing"). The lengths alternate after one
warm-up call each; the per-token time is read from a streamer's timestamps (first new token to last).
"""

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-length", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the benchmark: spinning threads distort a shared CPU

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from prefill_buckets.compilation import GraphCounter
    from prefill_buckets.testing_utils import smollm2_folder

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    counter = GraphCounter("inductor")
    model.forward = torch.compile(model.forward, backend=counter, dynamic=False)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * len(args.lengths))
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(100, model.config.vocab_size, (1, args.prompt_length), generator=generator)
    config = GenerationConfig(
        cache_implementation="static",
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=0,
    )

    class Timestamps:
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def decode_ms_per_token(cache_length: int) -> float:
        streamer = Timestamps()
        model.generate(input_ids, generation_config=config, streamer=streamer, max_cache_len=cache_length)
        # The streamer gets the prompt, then each new token: the decode steps run between the first and the last.
        first, last = streamer.times[1], streamer.times[-1]
        return (last - first) / (len(streamer.times) - 2) * 1000

    for length in args.lengths:
        start = time.perf_counter()
        decode_ms_per_token(length)
        print(
            f"cache {length}: first call (compiles) {time.perf_counter() - start:.1f} s, graphs so far {counter.graphs}"
        )
    results = {length: [] for length in args.lengths}
    for _ in range(args.rounds):
        for length in args.lengths:
            results[length].append(decode_ms_per_token(length))
    config_kv = model.config
    bytes_per_slot = (
        2
        * config_kv.num_hidden_layers
        * config_kv.num_key_value_heads
        * (config_kv.hidden_size // config_kv.num_attention_heads)
        * 4
    )
    base = statistics.median(results[args.lengths[0]])
    print(
        f"\n| cache slots | decode ms/token (median of {args.rounds}) | vs {args.lengths[0]} | cache MB per row (fp32) |"
    )
    print("| --- | --- | --- | --- |")
    for length in args.lengths:
        median = statistics.median(results[length])
        print(f"| {length} | {median:.1f} | {median / base:.2f}x | {length * bytes_per_slot / 1e6:.0f} |")
    print(f"graphs: {counter.graphs}")


if __name__ == "__main__":
    main()

"""Per-token decode time of upstream `generate` and of a bucketed call, side by side in one process.

    python utils/measure_decode_overhead.py [--rounds 4] [--prompt-length 100] [--bucket 128]
    python utils/measure_decode_overhead.py --cache-lengths 1024 2048 4096 8192

With `--cache-lengths`, it measures decode time against the static cache's length instead (each length pinned with
`max_cache_len` in turn), upstream's and the bucketed call's side by side: upstream's decode step attends over every
slot, so a longer cache is slower decode; a bucketed call's attends over a window of the slots that hold tokens
(`prefill_buckets/kvcache/windows.py`), so its cache costs memory, not time (the guide's "Cache sizing").

SmolLM2-135M-Instruct (converted once by `python -m prefill_buckets bench`, see its `--help`), `model.forward`
compiled with inductor (`dynamic=False`; `--eager`: not compiled), a static cache pinned at 1088 slots. One prompt runs through upstream
`generate` unpadded and through `prefill_buckets.generate` padded to one bucket; both share the decode graph (same
shapes), so the difference is what bucketing adds per step outside the graph. The calls alternate, after one warm-up
call each, and the per-token time is read from a streamer's timestamps (first new token to last).
"""

import argparse
import os
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=100)
    parser.add_argument("--bucket", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--cache-lengths", type=int, nargs="+", help="compare these pinned cache lengths instead")
    parser.add_argument("--eager", action="store_true", help="don't compile the forward (no inductor compile time)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the benchmark: spinning threads distort a shared CPU

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import prefill_buckets
    from prefill_buckets import GraphCounter
    from prefill_buckets.testing_utils import TokenClock, smollm2_folder

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    counter = GraphCounter("inductor")
    if not args.eager:
        model.forward = torch.compile(model.forward, backend=counter, dynamic=False)
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(100, model.config.vocab_size, (1, args.prompt_length), generator=generator)
    config = GenerationConfig(
        cache_implementation="static",
        max_cache_len=1088,
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        pad_token_id=0,
    )

    def decode_ms_per_token(kind) -> float:
        way, cache_length = kind
        streamer = TokenClock()
        if way == "bucketed":
            prefill_buckets.generate(
                model,
                input_ids,
                generation_config=config,
                streamer=streamer,
                prefill_buckets=[args.bucket],
                max_cache_len=cache_length,
            )
        else:
            model.generate(input_ids, generation_config=config, streamer=streamer, max_cache_len=cache_length)
        return streamer.decode_seconds_per_token() * 1000  # the decode steps: first new token to the last

    lengths = tuple(args.cache_lengths) if args.cache_lengths else (config.max_cache_len,)
    kinds = tuple((way, length) for length in lengths for way in ("upstream", "bucketed"))
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 3 * len(kinds))
    for kind in kinds:
        start = time.perf_counter()
        decode_ms_per_token(kind)
        print(f"{kind}: first call (compiles) {time.perf_counter() - start:.1f} s, graphs so far {counter.graphs}")
    results = {kind: [] for kind in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            results[kind].append(decode_ms_per_token(kind))
    medians = {kind: statistics.median(values) for kind, values in results.items()}
    for kind in kinds:
        print(
            f"{kind!s:22s} decode ms/token: {', '.join(f'{v:.1f}' for v in results[kind])}  median {medians[kind]:.1f}"
        )
    if not args.cache_lengths:
        ratio = medians[("bucketed", lengths[0])] / medians[("upstream", lengths[0])]
        print(f"bucketed / upstream: {ratio:.3f}; graphs: {counter.graphs}")
        return
    text = model.config
    bytes_per_slot = 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * model.dtype.itemsize
    first = lengths[0]
    print(f"\n| cache slots | upstream ms/token | vs {first} | bucketed ms/token | vs {first} | cache MB per row |")
    print("| --- | --- | --- | --- | --- | --- |")
    for length in lengths:
        upstream, bucketed = medians[("upstream", length)], medians[("bucketed", length)]
        print(
            f"| {length} | {upstream:.1f} | {upstream / medians[('upstream', first)]:.2f}x | {bucketed:.1f} | "
            f"{bucketed / medians[('bucketed', first)]:.2f}x | {length * bytes_per_slot / 1e6:.0f} |"
        )


if __name__ == "__main__":
    main()

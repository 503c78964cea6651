"""Steady-state latency of a tiny Llama's `generate` per strategy, once every graph a workload needs is compiled.

    python utils/measure_steady_state.py [--calls 20] [--new-tokens 8] [--layers 2] [--strategies eager ...]

A tiny Llama (`prefill_buckets.testing_utils.tiny_llama`, `--layers` layers, 4,096 positions), `--calls` prompts of 5
to 700 tokens in a random order, `--new-tokens` greedy new tokens, one process per strategy with an empty inductor
cache, inductor, one thread. Reported per strategy: the graphs compiled, the total time, and the median latency of the
last 10 calls (calls that compile nothing: each strategy runs the workload twice, and the second pass is timed).
Strategies:

- `eager`: upstream, a static cache sized per call, not compiled.
- `dynamic-none`: `model.compile(dynamic=None)`, no buckets, a static cache sized per call.
- `pow2`: `prefill_buckets="pow2"`, no `max_cache_len`, `model.compile(dynamic=False)`.
- `pow2-precompiled`: the same after `precompile(max_prompt_length=700)`.
- `pow2-quarters`: `prefill_buckets="pow2-quarters"` (4 buckets per doubling), no `max_cache_len`, `dynamic=False`.
- `chunked`: `prefill_chunk_size=128`, `prefill_pad_to_multiple_of=128`, no `max_cache_len`.
- `pow2-no-windows`, `chunked-no-windows`: `pow2` and `chunked` with the attention windows off (every forward reads
  every slot: `kvcache/windows.py`'s `MIN_WINDOW` set past the cache) and `max_cache_len` pinned to the longest
  padded prompt plus the new tokens, as a cache without windows must be to decode at the cost of the tokens it holds.
  Side by side with `pow2` and `chunked`, they show what the windows cost in graphs and compile time and what they
  buy in the steady state (`--layers 4` is the workload the guide's "Cache sizing" reports).
"""

import argparse
import copy
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


STRATEGIES = (
    "eager",
    "dynamic-none",
    "pow2",
    "pow2-precompiled",
    "pow2-quarters",
    "chunked",
    "pow2-no-windows",
    "chunked-no-windows",
)


def run_strategy(strategy: str, calls: int, new_tokens: int, layers: int) -> dict:
    import torch
    from transformers import GenerationConfig

    import prefill_buckets
    from prefill_buckets import GraphCounter
    from prefill_buckets.testing_utils import tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(max_position_embeddings=4096, num_hidden_layers=layers)
    lengths = random.Random(0).sample(range(5, 701), calls)
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    config = GenerationConfig(
        cache_implementation="static", max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    counter = GraphCounter("inductor")
    fields = {}
    if strategy != "eager":
        model.compile(backend=counter, dynamic=None if strategy == "dynamic-none" else False)
    if strategy == "pow2-quarters":
        fields = {"prefill_buckets": "pow2-quarters"}
    elif strategy.startswith("pow2"):
        fields = {"prefill_buckets": "pow2"}
    elif strategy.startswith("chunked"):
        fields = {"prefill_chunk_size": 128, "prefill_pad_to_multiple_of": 128}
    if strategy.endswith("-no-windows"):
        from prefill_buckets.kvcache import windows

        windows.MIN_WINDOW = 1 << 30  # no cache is longer: every layer stays upstream's, reading every slot
        longest = 1024 if strategy.startswith("pow2") else -(-max(lengths) // 128) * 128
        config.max_cache_len = longest + new_tokens
    start = time.perf_counter()
    if strategy == "pow2-precompiled":
        warm_config = copy.deepcopy(config)
        warm_config.prefill_buckets = "pow2"
        prefill_buckets.precompile(model, warm_config, max_prompt_length=700, progress=False)
    outputs, latencies = [], []
    for _ in range(2):
        for prompt in prompts:
            begin = time.perf_counter()
            if fields:
                out = prefill_buckets.generate(model, prompt, generation_config=config, **fields)
            else:
                out = model.generate(prompt, generation_config=config)
            latencies.append(time.perf_counter() - begin)
            outputs.append(out[0, prompt.shape[1] :].tolist())
    return {
        "strategy": strategy,
        "graphs": counter.graphs,
        "total_s": time.perf_counter() - start,
        "steady_median_s": statistics.median(latencies[-10:]),
        "tokens": outputs[:calls],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2, help="the tiny Llama's layers")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_strategy(args.worker, args.calls, args.new_tokens, args.layers)))
        return
    results = []
    start_load = os.getloadavg()[0]
    for strategy in args.strategies:
        # An empty inductor cache per strategy: its compile time is its own, never a hit on another run's graphs.
        inductor_cache = tempfile.mkdtemp(prefix="inductor-")
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
        command = [sys.executable, __file__, "--worker", strategy, "--calls", str(args.calls)]
        command += ["--new-tokens", str(args.new_tokens), "--layers", str(args.layers)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        shutil.rmtree(inductor_cache, ignore_errors=True)
        print(f"{strategy}: done", file=sys.stderr)
    load_end = os.getloadavg()[0]
    reference = next((r["tokens"] for r in results if r["strategy"] == "eager"), None)
    print(f"load average {start_load:.1f} at the start, {load_end:.1f} at the end")
    print("| strategy | graphs | total s | steady-state median s | tokens == eager |")
    print("| --- | --- | --- | --- | --- |")
    for r in results:
        same = "reference" if r["strategy"] == "eager" else ("-" if reference is None else r["tokens"] == reference)
        print(f"| {r['strategy']} | {r['graphs']} | {r['total_s']:.1f} | {r['steady_median_s']:.4f} | {same} |")


if __name__ == "__main__":
    main()

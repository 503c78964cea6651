"""Steady-state latency of a tiny Llama's `generate` per strategy, once every graph a workload needs is compiled.

    python utils/measure_steady_state.py [--calls 20] [--new-tokens 8] [--strategies eager dynamic-none ...]

A 2-layer tiny Llama (`prefill_buckets.testing_utils.tiny_llama`, 4,096 positions), `--calls` prompts of 5 to 700
tokens in a random order, `--new-tokens` greedy new tokens, one process per strategy, inductor, one thread. Reported
per strategy: the graphs compiled, the total time, and the median latency of the last 10 calls (calls that compile
nothing: each strategy runs the workload twice, and the second pass is timed). Strategies:

- `eager`: upstream, a static cache sized per call, not compiled.
- `dynamic-none`: `model.compile(dynamic=None)`, no buckets, a static cache sized per call.
- `pow2`: `prefill_buckets="pow2"`, no `max_cache_len`, `model.compile(dynamic=False)`.
- `pow2-precompiled`: the same after `precompile(max_prompt_length=700)`.
- `pow2-quarters`: `prefill_buckets="pow2-quarters"` (4 buckets per doubling), no `max_cache_len`, `dynamic=False`.
- `chunked`: `prefill_chunk_size=128`, `prefill_pad_to_multiple_of=128`, no `max_cache_len`.
"""

import argparse
import copy
import json
import os
import random
import statistics
import subprocess
import sys
import time


STRATEGIES = ("eager", "dynamic-none", "pow2", "pow2-precompiled", "pow2-quarters", "chunked")


def run_strategy(strategy: str, calls: int, new_tokens: int) -> dict:
    import torch
    from transformers import GenerationConfig

    import prefill_buckets
    from prefill_buckets import GraphCounter
    from prefill_buckets.testing_utils import tiny_llama

    torch.set_num_threads(1)
    model = tiny_llama(max_position_embeddings=4096)
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
    elif strategy == "chunked":
        fields = {"prefill_chunk_size": 128, "prefill_pad_to_multiple_of": 128}
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
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_strategy(args.worker, args.calls, args.new_tokens)))
        return
    results = []
    start_load = os.getloadavg()[0]
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    for strategy in args.strategies:
        command = [sys.executable, __file__, "--worker", strategy, "--calls", str(args.calls)]
        command += ["--new-tokens", str(args.new_tokens)]
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
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

"""Steady-state latency of a tiny Llama's `generate` per strategy, once every graph a workload needs is compiled.

    python utils/measure_steady_state.py [--calls 20] [--new-tokens 8] [--layers 2] [--breakdown] [--strategies eager ...]

A tiny Llama (`prefill_buckets.testing_utils.tiny_llama`, `--layers` layers, 4,096 positions), `--calls` prompts of 5
to 700 tokens in a random order, `--new-tokens` greedy new tokens, one process per strategy with an empty inductor
cache, inductor, one thread. Reported per strategy: the graphs compiled, the total time, and the median latency of the
last 10 calls (calls that compile nothing: each strategy runs the workload twice, and the second pass is timed).
`--side-by-side` runs them in one process instead, in turn, once warm (`side_by_side`): the figures to compare on
a busy machine, where separate processes' medians move with the load. With `--breakdown`, where the second pass's
time goes, in CPU time per call (steadier on a shared machine): the forwards of the prompt, the decode forwards
(1 token), and the rest, the Python around them (upstream's `generate`, the package's steps and hooks, the cache's
allocation where it is made outside a forward).
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


def workload(calls: int) -> list:
    """`calls` prompts of 5 to 700 tokens, in a random order (the same for every strategy)."""
    import torch

    lengths = random.Random(0).sample(range(5, 701), calls)
    return [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]


def setup(strategy: str, lengths: list[int], new_tokens: int, layers: int, own_class: bool = False) -> tuple:
    """
    `(model, graph counter, generation config, bucket fields)` of `strategy`. With `own_class`, the model is an
    instance of a subclass of its own, so its graphs are never another copy's in this process (dynamo's guards check
    the class).
    """
    from transformers import GenerationConfig

    from prefill_buckets import GraphCounter
    from prefill_buckets.testing_utils import tiny_llama

    model = tiny_llama(max_position_embeddings=4096, num_hidden_layers=layers)
    if own_class:
        model.__class__ = type(f"{type(model).__name__}_{strategy.replace('-', '_')}", (type(model),), {})
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
    return model, counter, config, fields


def generate(model, prompt, config, fields: dict) -> list[int]:
    """The new tokens of one call: bucketed with `fields`, else upstream's `generate`."""
    import prefill_buckets

    if fields:
        out = prefill_buckets.generate(model, prompt, generation_config=config, **fields)
    else:
        out = model.generate(prompt, generation_config=config)
    return out[0, prompt.shape[1] :].tolist()


def run_strategy(strategy: str, calls: int, new_tokens: int, layers: int, breakdown: bool = False) -> dict:
    import torch

    import prefill_buckets

    torch.set_num_threads(1)
    prompts = workload(calls)
    model, counter, config, fields = setup(strategy, [p.shape[1] for p in prompts], new_tokens, layers)
    forwards = []  # with `breakdown`: (tokens, CPU seconds) of each forward
    if breakdown:
        _time_forwards(model, forwards)
    start = time.perf_counter()
    if strategy == "pow2-precompiled":
        warm_config = copy.deepcopy(config)
        warm_config.prefill_buckets = "pow2"
        prefill_buckets.precompile(model, warm_config, max_prompt_length=700, progress=False)
    outputs, latencies = [], []
    for pass_ in range(2):
        forwards.clear()
        cpu_start = time.process_time()
        for prompt in prompts:
            begin = time.perf_counter()
            outputs.append(generate(model, prompt, config, fields))
            latencies.append(time.perf_counter() - begin)
    cpu_ms = (time.process_time() - cpu_start) / calls * 1000  # the second pass's, per call
    prefill_ms, decode_ms = (seconds / calls * 1000 for seconds in _prompt_and_decode(forwards))
    return {
        "strategy": strategy,
        "graphs": counter.graphs,
        "total_s": time.perf_counter() - start,
        "steady_median_s": statistics.median(latencies[-10:]),
        "tokens": outputs[:calls],
        "breakdown_ms": (cpu_ms, prefill_ms, decode_ms, cpu_ms - prefill_ms - decode_ms) if breakdown else None,
    }


def side_by_side(strategies: list[str], calls: int, new_tokens: int, layers: int, rounds: int) -> None:
    """
    The strategies in one process, each on its own copy of the model (its own class, so its own graphs): each runs the
    workload once, alone (its graphs, its cold seconds), then `rounds` rounds in which every prompt runs through every
    strategy in turn, rotating who goes first, so a busy machine slows them alike. Prints the median call once warm
    (wall time), its ratio to `dynamic-none`'s and eager's, and the median CPU time per call of its prompt forwards,
    decode forwards and the rest.
    """
    import torch

    torch.set_num_threads(1)
    # The copies' graphs are cache entries of one code object, and torch's limits count them together.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096
    prompts = workload(calls)
    lengths = [p.shape[1] for p in prompts]
    runs = {}
    for strategy in strategies:
        if strategy.endswith("-no-windows") or strategy == "pow2-precompiled":
            raise SystemExit(f"--side-by-side runs {strategy} in a process of its own: leave --side-by-side off")
        model, counter, config, fields = setup(strategy, lengths, new_tokens, layers, own_class=True)
        forwards = []
        _time_forwards(model, forwards)
        begin = time.perf_counter()
        tokens = [generate(model, p, config, fields) for p in prompts]
        runs[strategy] = {"call": (model, config, fields), "counter": counter, "forwards": forwards, "tokens": tokens}
        runs[strategy].update(cold_s=time.perf_counter() - begin, graphs=counter.graphs, wall=[], cpu=[])
        print(f"{strategy}: {counter.graphs} graphs, {runs[strategy]['cold_s']:.1f} s cold", file=sys.stderr)
    for round_ in range(rounds):
        for index, prompt in enumerate(prompts):
            turn = (round_ * len(prompts) + index) % len(strategies)
            for strategy in strategies[turn:] + strategies[:turn]:
                run = runs[strategy]
                model, config, fields = run["call"]
                run["forwards"].clear()
                wall, cpu = time.perf_counter(), time.process_time()
                out = generate(model, prompt, config, fields)
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                prefill, decode = _prompt_and_decode(run["forwards"])
                run["wall"].append(wall)
                run["cpu"].append((cpu, prefill, decode, cpu - prefill - decode))
                if out != run["tokens"][index]:
                    raise AssertionError(f"{strategy}: other tokens once warm, prompt of {prompt.shape[1]} tokens")
    medians = {strategy: statistics.median(run["wall"]) * 1000 for strategy, run in runs.items()}
    print(f"{rounds} rounds of {calls} prompts, every strategy in turn; CPU ms: the median call's parts")
    print(
        "| strategy | graphs | cold s | warm median ms | vs dynamic-none | vs eager | CPU ms | prompt forwards "
        "| decode forwards | the rest |"
    )
    print("| --- " * 10 + "|")
    for strategy, run in runs.items():
        ratios = [f"{medians[strategy] / medians[b]:.2f}x" if b in medians else "-" for b in ("dynamic-none", "eager")]
        parts = [statistics.median(part) * 1000 for part in zip(*run["cpu"])]
        more = run["counter"].graphs - run["graphs"]
        graphs = f"{run['graphs']}" + (f" (+{more} once warm)" if more else "")
        print(
            f"| {strategy} | {graphs} | {run['cold_s']:.1f} | {medians[strategy]:.1f} | {' | '.join(ratios)} | "
            + " | ".join(f"{ms:.2f}" for ms in parts)
            + " |"
        )
    reference = runs[strategies[0]]["tokens"]
    print(f"tokens equal across strategies: {all(run['tokens'] == reference for run in runs.values())}")


def _prompt_and_decode(forwards: list) -> tuple[float, float]:
    """The seconds of the timed `forwards` (`_time_forwards`) of more than one token, and of one token."""
    return (
        sum(seconds for tokens, seconds in forwards if tokens > 1),
        sum(seconds for tokens, seconds in forwards if tokens == 1),
    )


def _time_forwards(model, record: list) -> None:
    """Times each forward of `model` (its compiled call, or its forward when not compiled) in CPU time, into `record`."""
    import torch

    name = "_compiled_call_impl" if model.__dict__.get("_compiled_call_impl") is not None else "forward"
    inner = getattr(model, name)

    def timed(*args, **kwargs):
        tokens = kwargs.get("input_ids")
        tokens = tokens if tokens is not None else kwargs.get("inputs_embeds")
        begin = time.process_time()
        output = inner(*args, **kwargs)
        record.append((tokens.shape[1] if isinstance(tokens, torch.Tensor) else 0, time.process_time() - begin))
        return output

    object.__setattr__(model, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2, help="the tiny Llama's layers")
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--breakdown", action="store_true", help="the second pass's CPU time: prefill, decode, rest")
    parser.add_argument("--side-by-side", action="store_true", help="the strategies in one process, in turn")
    parser.add_argument("--rounds", type=int, default=3, help="with --side-by-side: rounds of the workload once warm")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_strategy(args.worker, args.calls, args.new_tokens, args.layers, args.breakdown)))
        return
    if args.side_by_side:
        side_by_side(args.strategies, args.calls, args.new_tokens, args.layers, args.rounds)
        return
    results = []
    start_load = os.getloadavg()[0]
    for strategy in args.strategies:
        # An empty inductor cache per strategy: its compile time is its own, never a hit on another run's graphs.
        inductor_cache = tempfile.mkdtemp(prefix="inductor-")
        env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "TORCHINDUCTOR_CACHE_DIR": inductor_cache}
        command = [sys.executable, __file__, "--worker", strategy, "--calls", str(args.calls)]
        command += ["--new-tokens", str(args.new_tokens), "--layers", str(args.layers)]
        command += ["--breakdown"] if args.breakdown else []
        done = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        shutil.rmtree(inductor_cache, ignore_errors=True)
        print(f"{strategy}: done", file=sys.stderr)
    load_end = os.getloadavg()[0]
    reference = next((r["tokens"] for r in results if r["strategy"] == "eager"), None)
    print(f"load average {start_load:.1f} at the start, {load_end:.1f} at the end")
    extra = " CPU ms per call | prompt forwards | decode forwards | the rest |" if args.breakdown else ""
    print("| strategy | graphs | total s | steady-state median s | tokens == eager |" + extra)
    print("| --- | --- | --- | --- | --- |" + " --- |" * (4 if args.breakdown else 0))
    for r in results:
        same = "reference" if r["strategy"] == "eager" else ("-" if reference is None else r["tokens"] == reference)
        row = f"| {r['strategy']} | {r['graphs']} | {r['total_s']:.1f} | {r['steady_median_s']:.4f} | {same} |"
        if r["breakdown_ms"] is not None:
            row += "".join(f" {ms:.2f} |" for ms in r["breakdown_ms"])
        print(row)


if __name__ == "__main__":
    main()

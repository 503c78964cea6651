"""What the attention windows cost at compile time and buy once warm, windows on and off side by side in one process.

    PYTHONPATH=src python utils/measure_window_trade.py [--layers 4] [--calls 20] [--new-tokens 8] [--rounds 3]

A tiny Llama (`prefill_buckets.testing_utils.tiny_llama`, `--layers` layers, 4,096 positions), `--calls` prompts of 5
to 700 tokens in a random order (`utils/measure_steady_state.py`'s workload), `--new-tokens` greedy new tokens,
inductor, `dynamic=False`, one thread. Four copies of the model (the same weights), each compiled on its own:

- `pow2`: `prefill_buckets="pow2"`, no `max_cache_len` (8,192 slots, read through windows);
- `pow2-no-windows`: the same with the windows off (every forward reads every slot: `kvcache/windows.py`'s
  `MIN_WINDOW` set past the cache for its calls) and `max_cache_len` pinned to the largest bucket plus the new tokens,
  as a cache without windows must be to decode at the cost of the tokens it holds;
- `chunked`, `chunked-no-windows`: `prefill_chunk_size=128`, `prefill_pad_to_multiple_of=128`, likewise.

First each strategy runs the workload once, alone (its graphs and the seconds they took, compiles included); then
`--rounds` rounds in which every prompt runs through every strategy in turn (rotating who goes first), so a noisy
machine slows them alike. Printed: graphs, cold seconds, the median call once warm and its ratio to the strategy
without windows, and whether every strategy's tokens are equal.
"""

import argparse
import random
import statistics
import sys
import time

import torch
from transformers import GenerationConfig

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.kvcache import windows
from prefill_buckets.testing_utils import tiny_llama


STRATEGIES = ("pow2", "pow2-no-windows", "chunked", "chunked-no-windows")
WINDOWS_ON = windows.MIN_WINDOW


def settings(strategy: str, lengths: list[int], new_tokens: int) -> dict:
    """The bucket fields (and pinned `max_cache_len`) of `strategy`."""
    if strategy.startswith("pow2"):
        fields, longest = {"prefill_buckets": "pow2"}, 1 << (max(lengths) - 1).bit_length()
    else:
        fields, longest = {"prefill_chunk_size": 128, "prefill_pad_to_multiple_of": 128}, -(-max(lengths) // 128) * 128
    if strategy.endswith("-no-windows"):
        fields["max_cache_len"] = longest + new_tokens
    return fields


def run(model, strategy: str, prompt, config, fields: dict) -> list[int]:
    windows.MIN_WINDOW = 1 << 30 if strategy.endswith("-no-windows") else WINDOWS_ON  # no cache is longer: no windows
    try:
        out = prefill_buckets.generate(model, prompt, generation_config=config, **fields)
    finally:
        windows.MIN_WINDOW = WINDOWS_ON
    return out[0, prompt.shape[1] :].tolist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = random.Random(0).sample(range(5, 701), args.calls)
    prompts = [torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    config = GenerationConfig(
        cache_implementation="static", max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False
    )
    models, counters, cold, tokens = {}, {}, {}, {}
    for strategy in STRATEGIES:
        models[strategy] = tiny_llama(max_position_embeddings=4096, num_hidden_layers=args.layers)
        counters[strategy] = GraphCounter("inductor")
        models[strategy].forward = torch.compile(models[strategy].forward, backend=counters[strategy], dynamic=False)
        fields = settings(strategy, lengths, args.new_tokens)
        begin = time.perf_counter()
        tokens[strategy] = [run(models[strategy], strategy, p, config, fields) for p in prompts]
        cold[strategy] = time.perf_counter() - begin
        print(f"{strategy}: {counters[strategy].graphs} graphs, {cold[strategy]:.1f} s cold", file=sys.stderr)
    warm = {strategy: [] for strategy in STRATEGIES}
    graphs_before = {strategy: counters[strategy].graphs for strategy in STRATEGIES}
    for round_ in range(args.rounds):
        for index, prompt in enumerate(prompts):
            turn = (round_ * len(prompts) + index) % len(STRATEGIES)
            for strategy in STRATEGIES[turn:] + STRATEGIES[:turn]:
                fields = settings(strategy, lengths, args.new_tokens)
                begin = time.perf_counter()
                out = run(models[strategy], strategy, prompt, config, fields)
                warm[strategy].append(time.perf_counter() - begin)
                if out != tokens[strategy][index]:
                    raise AssertionError(f"{strategy}: other tokens once warm, prompt of {prompt.shape[1]} tokens")
    print("| strategy | graphs | cold s | warm median ms | warm vs no windows |")
    print("| --- | --- | --- | --- | --- |")
    for strategy in STRATEGIES:
        median = statistics.median(warm[strategy]) * 1000
        base = strategy if strategy.endswith("-no-windows") else f"{strategy}-no-windows"
        ratio = median / (statistics.median(warm[base]) * 1000)
        more = counters[strategy].graphs - graphs_before[strategy]
        graphs = f"{counters[strategy].graphs}" + (f" (+{more} once warm)" if more else "")
        print(f"| {strategy} | {graphs} | {cold[strategy]:.1f} | {median:.1f} | {ratio:.2f}x |")
    equal = all(tokens[strategy] == tokens[STRATEGIES[0]] for strategy in STRATEGIES)
    print(f"tokens equal across strategies: {equal}")
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())

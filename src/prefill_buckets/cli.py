"""`python -m prefill_buckets ...` (also the `prefill-buckets` console script).

`demo` (graph counts on a tiny config-built Llama, no download), `bench` (compile strategies side by side on a real
model, `benchmark/`), `env` (what a bug report needs, `env.py`) and `serve` (transformers serve with bucketed,
precompiled generate, `serving.py`); see `prefill-buckets COMMAND --help`.
"""

import argparse
import copy

import torch

from . import benchmark, env, generate, serving
from .buckets import next_power_of_two
from .compile.compiled_calls import GraphCounter
from .testing_utils import tiny_llama
from .upstream import torch_api


DEMO_LENGTHS = (5, 11, 23, 40, 57, 64, 90, 130, 200, 250, 17, 33)


def demo_rows(lengths=DEMO_LENGTHS, new_tokens: int = 4, backend: str = "eager") -> list[tuple]:
    """
    The demo's table: `(strategy, graphs, compiled calls, eager fallbacks, tokens == eager)` per strategy, each on a
    freshly compiled tiny Llama that serves `lengths` in order. The guide shows this table (a slow test checks it).
    """
    from transformers import GenerationConfig

    reference = tiny_llama()
    config = GenerationConfig(
        cache_implementation="static", max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False
    )
    prompts = [
        torch.randint(3, reference.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        for length in lengths
    ]
    expected = [reference.generate(ids, generation_config=config) for ids in prompts]

    # A pinned `max_cache_len` gives one cache shape, so one decode graph; without it the cache grows with the prompt.
    ceiling = next_power_of_two(next_power_of_two(max(lengths)) + new_tokens)
    strategies = {
        "upstream static": {},
        f"upstream static, max_cache_len={ceiling}": {"max_cache_len": ceiling},
        'prefill_buckets="pow2"': {"prefill_buckets": "pow2"},
        "prefill_pad_to_multiple_of=64": {"prefill_pad_to_multiple_of": 64},
        f'prefill_buckets="pow2", max_cache_len={ceiling}': {"prefill_buckets": "pow2", "max_cache_len": ceiling},
    }
    rows = []
    for name, fields in strategies.items():
        torch.compiler.reset()  # each strategy from no graphs (bucketed calls put torch's limit back when they end)
        model = tiny_llama()
        counter = GraphCounter(backend)
        model.compile(backend=counter, dynamic=False)
        equal = True
        run_config = copy.deepcopy(config)
        run_config.max_cache_len = fields.pop("max_cache_len", None)
        for ids, want in zip(prompts, expected):
            out = generate(model, ids, generation_config=run_config, **fields)
            equal &= torch.equal(out, want)
        forwards = new_tokens * len(prompts)
        rows.append((name, counter.graphs, counter.calls, forwards - counter.calls, equal))
    return rows


def demo(args) -> int:
    lengths = list(args.lengths)
    print(f"Tiny Llama, static cache, model.compile(dynamic=False), {len(lengths)} prompt lengths {lengths}")
    rows = demo_rows(lengths, args.max_new_tokens, args.backend)
    print(f"{'strategy':<48} {'graphs':>6} {'compiled calls':>15} {'eager fallbacks':>16} {'tokens == eager':>16}")
    for name, graphs, calls, fallbacks, equal in rows:
        print(f"{name:<48} {graphs:>6} {calls:>15} {fallbacks:>16} {str(equal):>16}")
    print(
        "\nEach forward is one compiled call when it runs compiled; past torch's recompile limit "
        f"({torch_api.recompile_limit()} graphs per function) the rest run eagerly: the 'eager fallbacks'. "
        "With buckets set, the graphs are bounded, and when they need more than the limit it is raised (with a "
        "warning), so they never fall back."
    )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="prefill-buckets", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "demo",
        help="graph counts on a tiny model, in about a minute",
        description="Graphs compiled, compiled calls and eager fallbacks of upstream generate and of bucketed "
        "generate, on a tiny config-built Llama compiled with model.compile(dynamic=False). No download.",
    )
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=DEMO_LENGTHS,
        help=f"prompt lengths, in the order they are served (default: {' '.join(map(str, DEMO_LENGTHS))})",
    )
    p.add_argument("--max-new-tokens", type=int, default=4, help="new tokens per prompt (default: 4)")
    p.add_argument(
        "--backend",
        default="eager",
        help="torch.compile backend the counter wraps (default: eager, which counts graphs and generates no code; "
        "inductor compiles for real)",
    )
    sub.add_parser("env", help="versions, device and tested range, for a bug report", description=env.__doc__)
    p = sub.add_parser(
        "bench",
        help="compile strategies side by side on a real model: table, JSON and plot (compiles take minutes)",
        description=benchmark.BENCH_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    benchmark.add_arguments(p)
    serve_parser = sub.add_parser(
        "serve",
        help="transformers serve (OpenAI-compatible) with bucketed, precompiled generate",
        description=serving.SERVE_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serving.add_arguments(serve_parser)
    # `serve` passes the options it doesn't know to transformers serve; the other commands take none.
    args, rest = parser.parse_known_args(argv)
    if args.command == "serve":
        return serving.main(args, serve_parser, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "bench":
        return benchmark.bench(args)
    if args.command == "env":
        return env.main()
    return demo(args)

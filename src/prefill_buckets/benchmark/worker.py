"""
One strategy of the benchmark, in its own process: `python -m prefill_buckets.benchmark.worker SPEC.json`.

The driver (`command.py`) writes the spec (strategy, model folder, workload file, new tokens) and reads back the
record this writes: per call its tokens, wall time, graphs compiled, time to first token and decode time per token;
over the run the graphs, compiled calls, forwards, graph breaks and inductor cache hits.

A "generate" strategy runs the workload twice: the first (cold) pass compiles and is the strategy's total time; the
second (`second_calls`) is its steady state. With `spec["reply_fd"]`, the second pass runs as the driver asks
(`second_pass.py`): the cold pass's record is written, the process answers `ready` on that file descriptor, then runs
one prompt per line it reads on stdin (the prompt's index in the workload file), answering `done` after each, until
an empty line; then it writes its whole record. The driver interleaves the second passes of several strategies that
way, prompt by prompt, so a load that comes and goes on the machine weighs on each of them alike. Without it, the
second pass follows the first, on the same prompts in the same order.
"""

import copy
import json
import logging
import os
import sys
import time

import torch
from transformers import CompileConfig

from .. import GraphCounter, aot_forward, load_compile_cache, precompile, save_compile_cache
from .. import generate as bucketed_generate
from ..buckets import round_up
from ..kvcache.sizing import CACHE_ALIGNMENT
from ..testing_utils import TokenClock
from ..upstream import torch_api
from ..upstream.transformers_api import compile_on_all_devices
from .batched import run_batched
from .strategies import CHUNK, SHUFFLE_SEED, STRATEGIES, bucket_policy
from .workload import shuffled


def inductor_counter(name: str) -> int:
    return int(torch_api.compile_counters()["inductor"][name])


def load_model(spec: dict):
    """The spec's model on its device in eval mode, and the seconds loading took."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=getattr(torch, spec["dtype"]))
    return model.to(torch.device(spec["device"])).eval(), time.perf_counter() - start


def greedy_config(model, new_tokens: int, **overrides):
    """
    The model's generation config, greedy, with exactly `new_tokens` new tokens per prompt and a pad token.

    No eos token (on the model's configs too, which `generate` falls back to): every strategy decodes the same number
    of steps. `min_new_tokens` would do that for `generate`, but continuous batching drops its logits processor, so
    its requests would stop at eos where `generate` goes on.
    """
    config = copy.deepcopy(model.generation_config)
    config.update(max_new_tokens=new_tokens, do_sample=False, **overrides)
    eos = config.eos_token_id if config.eos_token_id is not None else model.config.eos_token_id
    if config.pad_token_id is None:
        config.pad_token_id = eos if isinstance(eos, int) else 0
    config.eos_token_id = model.generation_config.eos_token_id = model.config.eos_token_id = None
    return config


class AOTCounter:
    """`GraphCounter`'s two counts for a forward of `aot_forward`, which compiles with inductor itself."""

    def __init__(self, forward):
        self.forward = forward

    @property
    def graphs(self) -> int:
        return self.forward.graphs_compiled

    @property
    def calls(self) -> int:
        return self.forward.calls

    @property
    def graphs_loaded(self) -> int:
        return self.forward.graphs_loaded


class DynamoCounter:
    """
    `GraphCounter`'s two counts where `generate` compiles with upstream's `CompileConfig` (backend `"inductor"`, as the
    recipe has it: a backend object would be copied with the config on every call, and compiled again): the graphs
    dynamo compiled in this process (`torch_api.graphs_compiled`, from counters cleared at its start). Calls into
    the compiled decode step are not counted (0).
    """

    calls = 0

    def __init__(self):
        self.start = torch_api.graphs_compiled()

    @property
    def graphs(self) -> int:
        return torch_api.graphs_compiled() - self.start


def run_counters(counter: GraphCounter | AOTCounter, forwards: int) -> dict:
    """What the process compiled and ran, for the record."""
    graph_breaks = torch_api.compile_counters()["graph_break"]
    return {
        "graphs": counter.graphs,
        "graphs_loaded": getattr(counter, "graphs_loaded", None),  # from a compile cache file (`AOTCounter` only)
        "compiled_calls": counter.calls,
        "forwards": forwards,
        "graph_breaks": int(sum(graph_breaks.values())),
        "graph_break_reasons": sorted(graph_breaks)[:10],
        "unique_graphs": int(torch_api.graphs_compiled()),
        "fxgraph_cache_hits": inductor_counter("fxgraph_cache_hit"),
        "fxgraph_cache_misses": inductor_counter("fxgraph_cache_miss"),
        "recompile_limit": torch_api.recompile_limit(),
        "recompile_limit_hits": RECOMPILE_LIMIT_HITS.count,
    }


class RecompileLimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings: a function that hit it runs its new shapes eagerly."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record):
        if "hit config.recompile_limit" in record.getMessage():
            self.count += 1


RECOMPILE_LIMIT_HITS = RecompileLimitHits()


def start_process(spec: dict) -> None:
    """A clean compile state, a count of recompile-limit hits, and no progress bars unless asked."""
    logging.getLogger("torch._dynamo.convert_frame").addHandler(RECOMPILE_LIMIT_HITS)
    if not spec["progress"]:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    torch.compiler.reset()
    torch_api.compile_counters().clear()


def load_artifacts(path: str) -> dict:
    """Torch's own compile artifacts, saved by an earlier process (`save_artifacts`), loaded into this one."""
    begin = time.perf_counter()
    with open(path, "rb") as f:
        loaded = torch.compiler.load_cache_artifacts(f.read())
    return {"artifacts_loaded": loaded is not None, "artifacts_load_seconds": time.perf_counter() - begin}


def save_artifacts(path: str) -> dict:
    """What torch's caches compiled in this process (`torch.compiler.save_cache_artifacts`), written to `path`."""
    saved = torch.compiler.save_cache_artifacts()
    data = saved[0] if saved is not None else b""
    with open(path, "wb") as f:
        f.write(data)
    return {"artifacts_bytes": len(data)}


def run_worker(spec: dict) -> dict:
    """Runs one strategy (or, with `phase == "prepare"`, builds the compile cache of a warm one); returns its record."""
    strategy = STRATEGIES[spec["strategy"]]
    device = torch.device(spec["device"])
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    progress = spec["progress"]
    start_process(spec)
    model, load_seconds = load_model(spec)
    with open(spec["workload"], encoding="utf-8") as f:
        prompts = workload = json.load(f)  # `prompts`: in the file's order, which the driver's indices count in
    if strategy.shuffled:
        workload = shuffled(workload, SHUFFLE_SEED)
    new_tokens = spec["max_new_tokens"]

    if strategy.kind == "continuous":  # `generate_batch` uses its own paged cache
        config = greedy_config(model, new_tokens)
    else:
        config = greedy_config(
            model, new_tokens, cache_implementation="static", prefill_chunk_size=strategy.prefill_chunk_size
        )
    max_length = max(item["length"] for item in workload)
    min_length = min(item["length"] for item in workload)
    fields = dict(strategy.fields)
    for name, value in fields.items():
        setattr(config, name, value)  # read by `prefill_buckets.generate` and `precompile`
    if strategy.pin_cache:
        # One cache shape for the whole workload: the longest (padded) prompt and its new tokens, rounded up to a
        # multiple of the chunk (bucketed) or of 64 slots (unpadded, as `precompile` pins a cache).
        policy = bucket_policy(strategy)
        longest = policy.bucket(max_length) if policy is not None else max_length
        config.max_cache_len = round_up(longest + new_tokens - 1, CHUNK if policy is not None else CACHE_ALIGNMENT)
    if strategy.compile_config is not None:
        # Upstream's own recipe: `generate` compiles the decode step itself (`model.get_compiled_call`) and runs
        # prefill eagerly. On CPU only with the private `_compile_all_devices`.
        config.compile_config = CompileConfig(**strategy.compile_config)
        if device.type not in ("cuda", "xpu"):
            compile_on_all_devices(config.compile_config)

    forwards = [0]
    if strategy.compile_config is None:
        # Not where `generate` compiles `model.__call__` itself: the compiled call would trace the hook, and guard on
        # (and recompile for) every new count. Those strategies count no fallbacks (prefill is eager by design).
        model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
    counter = GraphCounter("inductor")
    if strategy.compile_config is not None:
        counter = DynamoCounter()
    elif strategy.warm:
        # Graphs compiled ahead of time, which the compile cache file carries whole: the warm process traces nothing.
        model.forward = aot_forward(model)
        counter = AOTCounter(model.forward)
    elif strategy.compiled and strategy.kind != "continuous":  # continuous batching compiles its own step function
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
    if strategy.kind != "generate":
        record.update(run_batched(strategy, spec, model, workload, config, counter, run, synchronize, progress))
        graphs = record["graphs"]
        record.update(run_counters(counter, forwards[0]), graphs=graphs)
        return record
    begin = time.perf_counter()
    if strategy.artifacts_from is not None:
        record.update(load_artifacts(spec["artifacts_file"]))
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
        record["calls"] = run_workload(workload, model, run, config, counter, forwards, synchronize, progress, spec)
    record["total_seconds"] = time.perf_counter() - begin
    # The forwards (and compiled calls) of the cold pass, precompile included: its eager fallbacks.
    record["cold_forwards"], record["cold_compiled_calls"] = forwards[0], counter.calls
    if spec.get("save_artifacts"):  # what the cold pass compiled: the steady state compiles nothing more
        record.update(save_artifacts(spec["save_artifacts"]))
    if spec["phase"] == "run" and spec.get("reply_fd") is not None:
        # The cold pass's record, for the driver to report while the second pass waits.
        write_record(dict(record, **run_counters(counter, forwards[0])), spec)

        def run_one(index):
            return run_workload([prompts[index]], model, run, config, counter, forwards, synchronize, False, spec)[0]

        record["second_calls"], record["idle_seconds"] = second_pass_on_request(run_one, spec["reply_fd"])
        record["second_pass_seconds"] = sum(call["seconds"] for call in record["second_calls"])
    elif spec["phase"] == "run":
        second = time.perf_counter()
        record["second_calls"] = run_workload(
            workload, model, run, config, counter, forwards, synchronize, progress, spec
        )
        record["second_pass_seconds"] = time.perf_counter() - second
    record.update(run_counters(counter, forwards[0]))
    return record


def run_workload(workload, model, run, config, counter, forwards, synchronize, progress, spec) -> list[dict]:
    """One `generate` call per prompt, in the workload's order; a record per call."""
    from tqdm.auto import tqdm

    calls = []
    bar = tqdm(workload, desc=spec["strategy"], unit="prompt", disable=not progress, dynamic_ncols=True)
    for item in bar:
        input_ids = torch.tensor([item["ids"]], dtype=torch.long, device=model.device)
        clock = TokenClock(synchronize)
        graphs, compiled_calls, forward_count = counter.graphs, counter.calls, forwards[0]
        synchronize()
        started_at, start = time.time(), time.perf_counter()  # the wall clock, which other processes share
        output = run(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, streamer=clock)
        synchronize()
        end = time.perf_counter()
        calls.append(
            {
                "name": item["name"],
                "length": item["length"],
                "started_at": started_at,
                "seconds": end - start,
                "ttft_seconds": clock.first_token_seconds(since=start),
                "decode_seconds_per_token": clock.decode_seconds_per_token(),
                "graphs": counter.graphs - graphs,
                "compiled_calls": counter.calls - compiled_calls,
                "forwards": forwards[0] - forward_count,
                "tokens": output[0, input_ids.shape[1] :].tolist(),
            }
        )
        bar.set_postfix_str(f"{item['length']} tokens, {counter.graphs} graphs")
    return calls


def second_pass_on_request(run_one, reply_fd: int) -> tuple[list[dict], float]:
    """
    The second pass as the driver asks for it (the module docstring): `(a record per call, in the order asked; the
    seconds spent waiting to be asked)`.
    """
    calls, idle = [], 0.0
    with os.fdopen(reply_fd, "w", buffering=1) as reply:
        reply.write("ready\n")
        while True:
            waiting = time.perf_counter()
            line = sys.stdin.readline().strip()
            idle += time.perf_counter() - waiting
            if not line:
                return calls, idle
            calls.append(run_one(int(line)))
            reply.write(f"done {line}\n")


def write_record(record: dict, spec: dict) -> None:
    with open(spec["result"], "w", encoding="utf-8") as f:
        json.dump(record, f)


def main(argv: list[str]) -> int:
    (spec_path,) = argv
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    write_record(run_worker(spec), spec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

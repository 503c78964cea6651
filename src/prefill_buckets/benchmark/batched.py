"""
Strategies that hand every prompt over at once, batch against batch:

- "batch": one `generate` call for the whole workload, its rows left-padded to the longest prompt (bucketed strategies
  pad that to its bucket, and the rows to their batch bucket, after `precompile` for that one shape);
- "continuous": transformers' continuous batching, `model.generate_batch(inputs=[...])`, which packs the prompts
  into steps of at most `max_batch_tokens` tokens over a paged cache.

Each runs the workload at least twice in its process: the first pass is cold (it compiles, and is the strategy's total
time), the next are warm (repeated, up to twice, until one compiles nothing; the last one's per-request times and
throughput are reported, and its tokens must equal the first pass's). Times to first token: a batch's rows all get their first token at the same step, timed from
the call; a continuous-batching request's from its creation to its first token (`record_timestamps=True`), so a
request that waits for others' prefill counts the wait.
"""

import math
import time

import torch

from .. import BucketPolicy, precompile
from ..buckets import round_up
from ..testing_utils import TokenClock
from ..upstream import torch_api


MAX_WARM_PASSES = 2


def left_padded(workload: list[dict], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """`input_ids` and `attention_mask` of the workload as one batch, left-padded to its longest prompt.  # [B, L]"""
    longest = max(item["length"] for item in workload)
    input_ids = torch.full((len(workload), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(workload), longest), dtype=torch.long)
    for row, item in enumerate(workload):
        input_ids[row, longest - item["length"] :] = torch.tensor(item["ids"])
        attention_mask[row, longest - item["length"] :] = 1
    return input_ids.to(device), attention_mask.to(device)


def batch_pad_tokens(strategy, workload: list[dict]) -> int:
    """Pad tokens in the batch's prefill: every row padded to the (bucketed) longest prompt, plus dummy rows."""
    lengths = [item["length"] for item in workload]
    length, rows = max(lengths), len(lengths)
    if strategy.fields.get("prefill_buckets") is not None:
        length = BucketPolicy(buckets=strategy.fields["prefill_buckets"]).bucket(length)
    if strategy.fields.get("prefill_batch_buckets") is not None:
        rows = BucketPolicy(buckets=strategy.fields["prefill_batch_buckets"]).bucket(rows)
    return rows * length - sum(lengths)


def run_batch_pass(workload, model, run, config, synchronize) -> tuple[float, list[dict]]:
    """One `generate` call with every prompt; its seconds and a record per prompt."""
    input_ids, attention_mask = left_padded(workload, config.pad_token_id, model.device)
    clock = TokenClock(synchronize)
    synchronize()
    start = time.perf_counter()
    output = run(input_ids, attention_mask=attention_mask, generation_config=config, streamer=clock)
    synchronize()
    seconds = time.perf_counter() - start
    calls = [
        {
            "name": item["name"],
            "length": item["length"],
            "ttft_seconds": clock.first_token_seconds(since=start),
            "decode_seconds_per_token": clock.decode_seconds_per_token(),
            "tokens": output[row, input_ids.shape[1] :].tolist(),
        }
        for row, item in enumerate(workload)
    ]
    return seconds, calls


def continuous_batching_config(strategy, workload: list[dict], new_tokens: int, counter):
    """
    The strategy's `ContinuousBatchingConfig`, sized for the workload: a cache of `num_blocks` pages that holds every
    request at once, and steps of at most `max_batch_tokens` (the longest prompt, so no prompt is split). Left to
    itself on a CPU, continuous batching sizes both from the free system memory (8192 batch tokens and an attention
    mask of 8192 x cache rows), which costs more to allocate and fill than the whole workload runs.
    """
    from transformers import CompileConfig, ContinuousBatchingConfig

    fields = dict(strategy.cb_config)
    if "varlen_compile_config" in fields:  # counted like every other strategy's compiles
        fields["varlen_compile_config"] = CompileConfig(backend=counter, **fields["varlen_compile_config"])
    page_size = ContinuousBatchingConfig.page_size
    num_blocks = sum(math.ceil((item["length"] + new_tokens) / page_size) for item in workload) + 1
    max_batch_tokens = round_up(max(item["length"] for item in workload), 64)
    return ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, **fields)


def run_continuous_pass(workload, model, config, cb_config) -> tuple[float, list[dict]]:
    """One `generate_batch` call with every prompt; its seconds and a record per prompt."""
    start = time.perf_counter()
    outputs = model.generate_batch(
        inputs=[item["ids"] for item in workload],
        generation_config=config,
        continuous_batching_config=cb_config,
        record_timestamps=True,
        progress_bar=False,
        persistent_manager=True,  # the warm pass reuses the manager, and its compiled forward
    )
    seconds = time.perf_counter() - start
    by_prompt = {tuple(output.prompt_ids): output for output in outputs.values()}
    calls = []
    for item in workload:
        output = by_prompt[tuple(item["ids"])]
        if output.error is not None:
            raise RuntimeError(f"continuous batching failed on {item['name']}: {output.error}")
        times = output.timestamps or []
        calls.append(
            {
                "name": item["name"],
                "length": item["length"],
                "ttft_seconds": times[0] - output.created_time if times else None,
                "decode_seconds_per_token": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
                "tokens": list(output.generated_tokens),
            }
        )
    return seconds, calls


def dynamo_graphs() -> int:
    """Graphs dynamo handed to a backend in this process, whichever backend: `default_compile_level` compiles with
    inductor itself, not through a `GraphCounter`."""
    return int(torch_api.graphs_compiled())


def run_batched(strategy, spec, model, workload, config, counter, run, synchronize, progress) -> dict:
    """The record of a "batch" or "continuous" strategy: a cold pass, then a warm one."""
    graph_count = dynamo_graphs if strategy.kind == "continuous" else (lambda: counter.graphs)
    new_tokens = spec["max_new_tokens"]
    record = {"batch_size": len(workload)}
    begin = time.perf_counter()
    if strategy.kind == "batch":
        record["pad_tokens"] = batch_pad_tokens(strategy, workload)
        if strategy.fields:
            longest = max(item["length"] for item in workload)
            shapes = precompile(
                model,
                config,
                batch_sizes=[len(workload)],
                max_prompt_length=longest,
                min_prompt_length=longest,
                progress=progress,
            )
            record["precompile_seconds"] = time.perf_counter() - begin
            record["precompile"] = [{"prompt_length": s.prompt_length, "graphs": s.graphs} for s in shapes]

        def one_pass():
            return run_batch_pass(workload, model, run, config, synchronize)
    else:
        cb_config = continuous_batching_config(strategy, workload, new_tokens, counter)
        record["cb_config"] = {
            name: getattr(cb_config, name)
            for name in ("num_blocks", "max_batch_tokens", "page_size", "default_compile_level")
        }

        def one_pass():
            return run_continuous_pass(workload, model, config, cb_config)

    graphs = graph_count()
    cold_seconds, cold = one_pass()
    record["total_seconds"] = time.perf_counter() - begin
    record["cold_pass_seconds"] = cold_seconds
    record["graphs_per_pass"] = [graph_count() - graphs]
    # Warm passes until one compiles nothing (continuous batching may schedule the second pass into new step shapes),
    # at most MAX_WARM_PASSES; the last one is reported.
    for _ in range(MAX_WARM_PASSES):
        graphs = graph_count()
        warm_seconds, warm = one_pass()
        record["graphs_per_pass"].append(graph_count() - graphs)
        if record["graphs_per_pass"][-1] == 0:
            break
    record["warm_seconds"] = warm_seconds
    record["warm_tokens_equal_cold"] = [c["tokens"] for c in warm] == [c["tokens"] for c in cold]
    record["calls"] = [
        dict(w, tokens=c["tokens"], graphs=record["graphs_per_pass"][-1], seconds=warm_seconds)
        for c, w in zip(cold, warm)
    ]
    record["graphs"] = graph_count()
    return record

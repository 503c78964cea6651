"""The benchmark on CUDA: upstream's compiled decode vs bucketed prefill + decode, side by side, in one process.

    python utils/gpu_bench.py [--output DIR] [--quick]

A Llama-3.2-1B-shaped model with random weights in bf16 (the weights don't matter for speed), compiled with
inductor `mode="reduce-overhead"` (CUDA graphs), 100 prompt lengths drawn from 16 to 2048, 32 greedy new tokens:

- `upstream-auto`: a static cache pinned to 2048 + 32 slots and the default `compile_config`: upstream compiles the
  decode step (one graph) and runs every prefill eagerly.
- `buckets`: the same, plus `prefill_buckets=[128, 256, 512, 1024, 2048]`: prefill also runs compiled, one graph per
  bucket, all compiled up front by `precompile`.

Prints a table (graphs, warm-up and workload time, time to first token and decode time per token, agreement with the
eager tokens) and writes it as JSON to --output. `--quick` runs a tiny model on whatever device there is, with the
eager counting backend, in seconds: it exercises this script, not the GPU.
"""

import argparse
import copy
import json
import os
import random
import statistics
import time

import torch
from torch._dynamo.backends.registry import register_backend
from transformers import CompileConfig, GenerationConfig, LlamaConfig, LlamaForCausalLM

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.testing_utils import tiny_llama


def build_model(quick: bool, device: str) -> LlamaForCausalLM:
    if quick:
        return tiny_llama().to(device)
    torch.manual_seed(0)
    config = LlamaConfig(  # Llama-3.2-1B's shapes
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def progress(message: str) -> None:
    """A line as each part ends, so that a run stopped at its time limit still says where the time went."""
    print(message, flush=True)


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def run_strategy(name, model, prompts, config, counter, warm_up) -> dict:
    prep = 0.0
    if warm_up is not None:
        _, prep = timed(warm_up)
        progress(f"{name}: warm-up (precompile) {prep:.1f} s, {counter.graphs} graphs")
    graphs_before = counter.graphs
    first_token = copy.deepcopy(config)  # time to first token: the same call, stopped after one token
    first_token.max_new_tokens = first_token.min_new_tokens = 1
    ttft, decode, outputs = [], [], []
    total_start = time.perf_counter()
    for ids in prompts:
        _, t1 = timed(lambda: model.generate(ids, generation_config=first_token))
        out, tn = timed(lambda: model.generate(ids, generation_config=config))
        ttft.append(t1 * 1000)
        decode.append((tn - t1) * 1000 / (config.max_new_tokens - 1))
        outputs.append(out[:, ids.shape[1] :].cpu())
    total = time.perf_counter() - total_start

    def p90(values):
        return sorted(values)[int(0.9 * (len(values) - 1))]

    return {
        "strategy": name,
        "graphs_warm_up": graphs_before,
        "graphs_workload": counter.graphs - graphs_before,
        "warm_up_s": prep,
        "workload_s": total,
        "ttft_ms_median": statistics.median(ttft),
        "ttft_ms_p90": p90(ttft),
        "decode_ms_per_token_median": statistics.median(decode),
        "decode_ms_per_token_p90": p90(decode),
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default=os.environ.get("OUT", "gpu_results"))
    parser.add_argument("--quick", action="store_true", help="tiny model, 5 prompts, eager counting backend")
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.quick and device != "cuda":
        raise SystemExit("gpu_bench.py needs a CUDA device (use --quick to exercise it on CPU)")
    count = 5 if args.quick else args.prompts
    max_length = 64 if args.quick else 2048
    buckets = [16, 32, 64] if args.quick else [128, 256, 512, 1024, 2048]
    rng = random.Random(0)
    lengths = [rng.randint(16, max_length) for _ in range(count)]
    model = build_model(args.quick, device)
    vocab_size = min(256, model.config.vocab_size)
    prompts = [
        torch.randint(3, vocab_size, (1, n), generator=torch.Generator().manual_seed(n)).to(device) for n in lengths
    ]
    eager_config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens, do_sample=False
    )
    start = time.perf_counter()
    expected = [model.generate(ids, generation_config=eager_config)[:, ids.shape[1] :].cpu() for ids in prompts]
    progress(f"eager reference: {count} prompts in {time.perf_counter() - start:.1f} s")

    torch._dynamo.config.recompile_limit = 64
    rows = []
    for name, fields in [("upstream-auto", {}), ("buckets", {"prefill_buckets": buckets})]:
        torch._dynamo.reset()
        counter = GraphCounter("eager" if args.quick else "inductor")
        backend = f"gpu_bench_{name.replace('-', '_')}"
        register_backend(name=backend, compiler_fn=counter)
        compile_config = CompileConfig(
            backend=backend, fullgraph=True, dynamic=False, mode=None if args.quick else "reduce-overhead"
        )
        config = GenerationConfig(
            cache_implementation="static",
            max_cache_len=max_length + args.max_new_tokens,
            max_new_tokens=args.max_new_tokens,
            min_new_tokens=args.max_new_tokens,
            do_sample=False,
            compile_config=compile_config,
            **fields,
        )
        if args.quick:
            config.compile_config._compile_all_devices = True  # upstream auto-compiles on CUDA/XPU only
        if fields:
            prefill_buckets.enable()

            def warm_up(config=config):
                prefill_buckets.precompile(model, config, max_prompt_length=max_length, progress=False)

        else:
            warm_up = None
        try:
            row = run_strategy(name, model, prompts, config, counter, warm_up)
        finally:
            prefill_buckets.disable()
        progress(
            f"{name}: warm-up {row['warm_up_s']:.1f} s, workload {row['workload_s']:.1f} s, {counter.graphs} graphs"
        )
        outputs = row.pop("outputs")
        row["exact"] = sum(torch.equal(a, b) for a, b in zip(outputs, expected))
        row["prompts"] = count
        rows.append(row)

    header = f"{'strategy':<14} {'graphs':>6} {'warm-up s':>9} {'workload s':>10} {'TTFT ms med/p90':>17} "
    header += f"{'decode ms/tok med/p90':>22} {'tokens == eager':>15}"
    print(
        f"{'tiny Llama' if args.quick else 'Llama-3.2-1B-shaped, bf16'} on {device}, {count} prompts of 16-{max_length}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['strategy']:<14} {r['graphs_warm_up'] + r['graphs_workload']:>6} {r['warm_up_s']:>9.1f} "
            f"{r['workload_s']:>10.1f} {r['ttft_ms_median']:>8.1f}/{r['ttft_ms_p90']:<8.1f} "
            f"{r['decode_ms_per_token_median']:>10.2f}/{r['decode_ms_per_token_p90']:<11.2f} "
            f"{r['exact']:>8}/{r['prompts']}"
        )
    os.makedirs(args.output, exist_ok=True)
    info = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}
    with open(os.path.join(args.output, "gpu_bench.json"), "w") as f:
        json.dump({"machine": info, "lengths": lengths, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()

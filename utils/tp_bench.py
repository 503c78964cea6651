"""Bucketed generate under tensor parallelism (CPU with gloo, or one GPU per rank with NCCL): a cold launch that
compiles and saves each rank's compile cache, then a warm launch that loads it, side by side.

    torchrun --nproc-per-node 3 utils/tp_bench.py              # SmolLM2-135M-Instruct: 9 heads, 3 kv heads
    torchrun --nproc-per-node 2 utils/tp_bench.py --tiny       # a config-built Llama whose heads split in 2
    torchrun --nproc-per-node 3 utils/tp_bench.py              # again: the warm launch, and the table

Each launch loads the model with `distributed_config=DistributedConfig(tp_plan="auto")`, compiles it with inductor
(`prefill_buckets.aot_forward`, or `model.compile(dynamic=False)` with `--compile model.compile`), runs `precompile`
for `prefill_buckets="pow2"` over the workload's prompt lengths, then serves the workload (prompts of the packaged
benchmark set up to `--max-prompt-length` tokens; random ids with `--tiny`). The first launch in `--cache-dir` is cold
(its own empty inductor cache directory) and saves one compile cache file per rank (`compile-cache-{rank}.zip`); a
later launch with the same model and number of ranks is warm: another empty inductor directory, and
`load_compile_cache` of its rank's file before compiling. Rank 0 also runs the workload on the unsharded model in
eager mode, unpadded (the reference), and every rank compares its tokens with it.

Each launch prints, per rank: graphs compiled by `precompile` and afterwards (0 expected), the time to the first
token (process start to the first token of the first request: loading, precompile included), the workload time,
and whether the tokens equal the reference. The warm launch adds the cold launch's figures and the ratio.
`--fresh` starts over (a cold launch).
"""

import argparse
import datetime
import json
import os
import shutil
import sys
import time


START = time.perf_counter()

TINY_CONFIG = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
TINY_LENGTHS = (10, 13, 19, 32)


def parse_args():
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="a config-built tiny Llama instead of SmolLM2-135M")
    parser.add_argument("--cache-dir", default="tp_bench_output", help="compile caches and figures of each launch")
    parser.add_argument("--fresh", action="store_true", help="delete --cache-dir first: a cold launch")
    parser.add_argument("--max-prompt-length", type=int, default=32, help="the workload's longest prompt (tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument(
        "--compile",
        choices=["model.compile", "aot_forward"],
        default="aot_forward",
        help="`prefill_buckets.aot_forward` (default), whose saved graphs a warm launch loads without tracing, or\n"
        "`model.compile(dynamic=False)`, which a warm launch traces again (use another --cache-dir per choice)",
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    directory = os.path.abspath(args.cache_dir)
    if args.fresh and rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
    # Decided before anything compiles; every rank sees the same files (one machine, or a shared folder).
    import torch
    import torch.distributed as dist

    # CUDA: NCCL, one GPU per rank (transformers puts rank r on `cuda:{LOCAL_RANK}`); otherwise gloo on the CPU.
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=60))
    dist.barrier()  # `--fresh` done
    cache_path = os.path.join(directory, "compile-cache-{rank}.zip")
    files = [cache_path.replace("{rank}", str(r)) for r in range(world_size)]
    launch = "warm" if all(os.path.isfile(f) for f in files) else "cold"
    dist.barrier()  # every rank decided before rank 0's cold launch writes anything
    # A new empty inductor cache directory per launch, as on a new machine: the warm launch has only the saved files.
    inductor_dir = os.path.join(directory, f"inductor-{launch}")
    if rank == 0:
        shutil.rmtree(inductor_dir, ignore_errors=True)
    dist.barrier()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir

    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.distributed import DistributedConfig
    from transformers.generation.streamers import BaseStreamer

    import prefill_buckets
    from prefill_buckets.benchmark.workload import load_prompts, tokenize_prompts
    from prefill_buckets.distributed import rank_path
    from prefill_buckets.testing_utils import smollm2_folder

    # The model, its workload and the reference tokens.
    if args.tiny:
        model_dir = os.path.join(directory, "tiny-llama")
        if rank == 0 and not os.path.isdir(model_dir):
            from transformers import LlamaConfig, LlamaForCausalLM

            torch.manual_seed(0)
            LlamaForCausalLM(LlamaConfig(**TINY_CONFIG)).save_pretrained(model_dir)
        dist.barrier()
        workload = [
            {
                "name": f"random-{n}",
                "length": n,
                "ids": torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist(),
            }
            for n in TINY_LENGTHS
        ]
    else:
        model_dir = str(smollm2_folder()) if rank == 0 else None
        holder = [model_dir]
        dist.broadcast_object_list(holder)  # rank 0 converts the model once; every rank loads the folder
        model_dir = holder[0]
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        workload = tokenize_prompts(tokenizer, load_prompts(None))
        workload = [item for item in workload if item["length"] <= args.max_prompt_length]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    for name in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, name) % world_size:
            raise SystemExit(
                f"{model_dir}: `{name}` ({getattr(config, name)}) does not split across {world_size} ranks. Run with "
                f"a `--nproc-per-node` that divides it (SmolLM2-135M: 3 or 9), or `--tiny` (2 or 4)."
            )

    generation_config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        min_new_tokens=args.max_new_tokens,
        do_sample=False,
        cache_implementation="static",
        prefill_buckets="pow2",
    )
    lengths = [item["length"] for item in workload]

    # The launch: load the cache (warm), compile, precompile, then serve the workload.
    figures = {"launch": launch, "rank": rank, "backend": backend}
    if launch == "warm":
        prefill_buckets.load_compile_cache(rank_path(cache_path))
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan="auto")
    ).eval()
    if args.compile == "aot_forward":
        model.forward = prefill_buckets.aot_forward(model)
    else:
        model.compile(dynamic=False)
    figures["compile"] = args.compile
    shapes = prefill_buckets.precompile(
        model,
        generation_config,
        max_prompt_length=max(lengths),
        min_prompt_length=min(lengths),
        progress=False,
    )
    figures["precompile_graphs"] = sum(shape.graphs for shape in shapes)
    figures["precompile_s"] = sum(shape.seconds for shape in shapes)
    figures["buckets"] = sorted({shape.prompt_length for shape in shapes})

    class FirstToken(BaseStreamer):
        def __init__(self):
            self.calls, self.at = 0, None

        def put(self, value):
            self.calls += 1
            if self.calls == 2 and self.at is None:  # the first `put` is the prompt
                self.at = time.perf_counter()

        def end(self):
            pass

    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    served = time.perf_counter()
    tokens = []
    for index, item in enumerate(workload):
        streamer = FirstToken() if index == 0 else None
        out = prefill_buckets.generate(
            model,
            torch.tensor([item["ids"]], device=model.device),
            generation_config=generation_config,
            streamer=streamer,
        )
        tokens.append(out[0, item["length"] :].tolist())
        if streamer is not None:
            figures["first_token_s"] = streamer.at - START
    figures["workload_s"] = time.perf_counter() - served
    figures["graphs_after_precompile"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    figures["prompts"] = len(workload)
    figures["total_s"] = time.perf_counter() - START
    if launch == "cold":
        saved = prefill_buckets.save_compile_cache(rank_path(cache_path))
        figures["cache_bytes"] = saved.size if saved is not None else 0

    # After the launch's clock: the reference.
    reference = None
    if rank == 0:  # one process, unsharded, eager, unpadded
        single = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(model.device).eval()
        reference_config = GenerationConfig(**{**generation_config.to_diff_dict(), "prefill_buckets": None})
        reference = [
            single.generate(torch.tensor([item["ids"]], device=model.device), generation_config=reference_config)[
                0, item["length"] :
            ].tolist()
            for item in workload
        ]
        del single
    holder = [reference]
    dist.broadcast_object_list(holder)
    reference = holder[0]

    figures["tokens_equal_single_process"] = sum(t == r for t, r in zip(tokens, reference))

    gathered = [None] * world_size
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        with open(os.path.join(directory, f"launch-{launch}.json"), "w") as f:
            json.dump(gathered, f, indent=1)
        report(directory, gathered, lengths, "tiny Llama (config-built)" if args.tiny else "SmolLM2-135M-Instruct")
    dist.destroy_process_group()
    return 0


def report(directory: str, ranks: list[dict], lengths: list[int], model_name: str) -> None:
    launch = ranks[0]["launch"]
    print(
        f"\n{model_name}, {len(ranks)} ranks (tp_plan='auto', {ranks[0]['backend']}), pow2 buckets {ranks[0]['buckets']}, "
        f"{ranks[0]['prompts']} prompts of {min(lengths)}-{max(lengths)} tokens, compiled with "
        f"{ranks[0].get('compile', 'model.compile')}, {launch} launch\n"
    )
    rows = [("", ranks)]
    cold_path = os.path.join(directory, "launch-cold.json")
    if launch == "warm" and os.path.isfile(cold_path):
        with open(cold_path) as f:
            rows = [("cold", json.load(f)), ("warm", ranks)]
    header = (
        f"{'launch':<6} {'rank':>4} {'graphs':>6} {'later':>5} {'precompile s':>12} {'first token s':>13} "
        f"{'workload s':>10} {'total s':>8} {'tokens = 1 process':>18}"
    )
    print(header)
    for name, launch_ranks in rows:
        for r in launch_ranks:
            print(
                f"{name or r['launch']:<6} {r['rank']:>4} {r['precompile_graphs']:>6} {r['graphs_after_precompile']:>5} "
                f"{r['precompile_s']:>12.1f} {r['first_token_s']:>13.1f} {r['workload_s']:>10.2f} {r['total_s']:>8.1f} "
                f"{r['tokens_equal_single_process']:>12}/{r['prompts']}"
            )
    if len(rows) == 2:
        for cold, warm in zip(rows[0][1], rows[1][1]):
            print(
                f"rank {cold['rank']}: first token {cold['first_token_s'] / warm['first_token_s']:.1f}x sooner warm, "
                f"precompile {cold['precompile_s'] / warm['precompile_s']:.1f}x faster"
            )
    else:
        print(f"\nSaved each rank's compile cache in {directory}; launch again for the warm launch.")


if __name__ == "__main__":
    sys.exit(main())

"""Cold vs warm start of `precompile`, side by side: each in a fresh process with an empty inductor cache.

    python utils/measure_warm_start.py [--max-prompt-length 64] [--compile aot_forward|model.compile|reduce-overhead]
                                       [--device cpu|cuda] [--buckets pow2|pow2-quarters]

1. cold: compiles every graph of a bucket config (`--buckets`, default `"pow2"`) with inductor, then saves the compile cache with
   `prefill_buckets.save_compile_cache`, and publishes its SHA-256;
2. warm: a new process (a replica), a new empty inductor cache directory, `load_compile_cache` with that hash, then the
   same `precompile`.
Prints both times, their ratio, and, from torch's own counters (`torch._dynamo.utils.counters`), in each process: the
frames dynamo traced through `torch.compile`'s frame hook, the graphs and ops dynamo traced by any path (`aot_compile`
traces without the frame hook), the graphs inductor compiled (FX graph cache misses); and whether both generate the
same tokens.
`--compile aot_forward` (default) compiles with `prefill_buckets.aot_forward`, whose graphs the file carries whole;
`--compile model.compile` with `model.compile(dynamic=False)`, where the warm process still traces every graph;
`--compile reduce-overhead` (CUDA) with `model.compile(dynamic=False, mode="reduce-overhead")`, where the warm process
also records every CUDA graph again. `--device cuda` runs on the GPU (in bfloat16; the tokens are compared between
the two processes, which run the same graphs).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(
    mode: str,
    artifacts: str,
    max_prompt_length: int,
    compile_with: str,
    sha256: str | None,
    device: str,
    buckets: str = "pow2",
) -> None:
    start = time.perf_counter()
    import torch
    from torch._dynamo.utils import counters
    from transformers import GenerationConfig

    import prefill_buckets
    from prefill_buckets.testing_utils import tiny_llama

    loaded, load_seconds = None, 0.0
    if mode == "warm":
        begin = time.perf_counter()
        loaded = prefill_buckets.load_compile_cache(artifacts, sha256=sha256)
        load_seconds = time.perf_counter() - begin
    model = tiny_llama().to(device, torch.bfloat16 if device == "cuda" else torch.float32)
    if compile_with == "aot_forward":
        model.forward = prefill_buckets.aot_forward(model)
    elif compile_with == "reduce-overhead":
        model.compile(dynamic=False, mode="reduce-overhead")
    else:
        model.compile(dynamic=False)
    gc = GenerationConfig(cache_implementation="static", max_new_tokens=8, prefill_buckets=buckets)
    setup = time.perf_counter() - start
    shapes = prefill_buckets.precompile(model, gc, max_prompt_length=max_prompt_length, progress=False)
    first_call = shapes[0].seconds
    compile_seconds = sum(s.seconds for s in shapes)
    prompt = (torch.arange(3, 3 + max_prompt_length - 5).view(1, -1) % 100 + 3).to(device)
    tokens = prefill_buckets.generate(model, prompt, generation_config=gc).tolist()
    saved = None
    if mode == "cold":
        saved = prefill_buckets.save_compile_cache(artifacts)
    print(
        json.dumps(
            {
                "mode": mode,
                "loaded": loaded,
                "sha256": saved.sha256 if saved else None,
                "import_and_setup_s": setup,
                "load_s": load_seconds,
                "precompile_s": compile_seconds,
                "first_call_s": first_call,
                "graphs": sum(s.graphs for s in shapes),
                "buckets": len(shapes),
                "frames_traced": counters["frames"]["total"],
                "dynamo_graphs_traced": counters["stats"]["unique_graphs"],
                "dynamo_ops_captured": counters["stats"]["calls_captured"],
                # Graphs compiled: AOTAutograd cache misses (`aot_compile` bypasses inductor's FX graph cache) plus
                # FX graph cache misses (`model.compile()`, whose AOTAutograd entries the file also carries).
                "inductor_compiled": counters["aot_autograd"]["autograd_cache_miss"]
                + counters["inductor"]["fxgraph_cache_miss"],
                "aot_autograd_compiled": counters["aot_autograd"]["total"],
                "tokens": tokens,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument(
        "--compile", choices=["aot_forward", "model.compile", "reduce-overhead"], default="aot_forward"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--buckets", default="pow2", help="a named bucket set: pow2 or pow2-quarters")
    parser.add_argument("--child", choices=["cold", "warm"])
    parser.add_argument("--artifacts")
    parser.add_argument("--sha256")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.artifacts, args.max_prompt_length, args.compile, args.sha256, args.device, args.buckets)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = os.path.join(tmp, "compile_cache.bin")
        for mode in ("cold", "warm"):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, f"inductor-{mode}"))
            cmd = [sys.executable, __file__, "--child", mode, "--artifacts", artifacts, "--compile", args.compile]
            cmd += ["--max-prompt-length", str(args.max_prompt_length), "--device", args.device]
            cmd += ["--buckets", args.buckets]
            if mode == "warm":
                cmd += ["--sha256", results["cold"]["sha256"]]  # as a replica gets it, with the file
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode:
                sys.exit(f"The {mode} process failed:\n{done.stderr[-5000:]}")
            results[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    cold, warm = results["cold"], results["warm"]
    print(
        f"compile: {args.compile}, device {args.device}, {args.buckets} buckets up to {args.max_prompt_length}, "
        f"load average {os.getloadavg()[0]:.1f}, cache loaded "
        f"warm: {warm['loaded']}"
    )
    columns = ("frames traced", "graphs traced", "ops captured", "graphs compiled", "load s", "precompile s")
    print(" | ".join(("", *columns, "first call s", "start to first call s")))
    for row in (cold, warm):
        # From the process's start (imports, the load, the model) to the end of precompile's first call.
        start_to_first = row["import_and_setup_s"] + row["first_call_s"]
        print(
            f"{row['mode']:<6} | {row['frames_traced']:>13} | {row['dynamo_graphs_traced']:>13} | "
            f"{row['dynamo_ops_captured']:>12} | {row['inductor_compiled']:>15} | {row['load_s']:>6.2f} | "
            f"{row['precompile_s']:>12.2f} | {row['first_call_s']:>12.2f} | {start_to_first:>21.2f}"
        )
    print(
        f"warm/cold precompile: {warm['precompile_s'] / cold['precompile_s']:.3f}x, "
        f"first call {cold['first_call_s'] / warm['first_call_s']:.1f}x sooner warm "
        f"({(cold['import_and_setup_s'] + cold['first_call_s']) / (warm['import_and_setup_s'] + warm['first_call_s']):.1f}x "
        "counted from the process's start), "
        f"tokens equal: {warm['tokens'] == cold['tokens']}"
    )


if __name__ == "__main__":
    main()

"""Cold vs warm start of `precompile`, side by side: each in a fresh process with an empty inductor cache.

    python utils/measure_warm_start.py [--max-prompt-length 64]

1. cold: compiles every graph of a pow2 bucket config with inductor, then saves the artifacts with
   `prefill_buckets.save_compile_cache`;
2. warm: a new process, a new empty inductor cache directory, `load_compile_cache`, then the same `precompile`.
Prints both times, their ratio, and the graphs each compiled (dynamo still traces every graph when warm).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def child(mode: str, artifacts: str, max_prompt_length: int) -> None:
    start = time.perf_counter()
    from transformers import GenerationConfig

    import prefill_buckets
    from prefill_buckets.testing_utils import tiny_llama

    if mode == "warm":
        prefill_buckets.load_compile_cache(artifacts)
    model = tiny_llama()
    model.compile(dynamic=False)
    gc = GenerationConfig(cache_implementation="static", max_new_tokens=8, prefill_buckets="pow2")
    setup = time.perf_counter() - start
    shapes = prefill_buckets.precompile(model, gc, max_prompt_length=max_prompt_length, progress=False)
    first_token = shapes[0].seconds
    compile_seconds = sum(s.seconds for s in shapes)
    if mode == "cold":
        prefill_buckets.save_compile_cache(artifacts)
    print(
        json.dumps(
            {
                "mode": mode,
                "import_and_setup_s": setup,
                "precompile_s": compile_seconds,
                "first_call_s": first_token,
                "graphs": sum(s.graphs for s in shapes),
                "buckets": len(shapes),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-prompt-length", type=int, default=64)
    parser.add_argument("--child", choices=["cold", "warm"])
    parser.add_argument("--artifacts")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.artifacts, args.max_prompt_length)
        return
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = os.path.join(tmp, "artifacts.bin")
        for mode in ("cold", "warm"):
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, f"inductor-{mode}"))
            cmd = [sys.executable, __file__, "--child", mode, "--artifacts", artifacts]
            cmd += ["--max-prompt-length", str(args.max_prompt_length)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            results[mode] = json.loads(out.strip().splitlines()[-1])
    cold, warm = results["cold"], results["warm"]
    print(f"{'':<10} {'graphs':>6} {'precompile s':>13} {'first call s':>13}")
    for row in (cold, warm):
        print(f"{row['mode']:<10} {row['graphs']:>6} {row['precompile_s']:>13.1f} {row['first_call_s']:>13.1f}")
    print(
        f"warm/cold precompile: {warm['precompile_s'] / cold['precompile_s']:.2f}x, "
        f"first call {cold['first_call_s'] / warm['first_call_s']:.1f}x sooner warm"
    )


if __name__ == "__main__":
    main()

"""The same bucketed `generate` through three compiled forwards, side by side: `torch.compile` vs `aot_forward`.

    PYTHONPATH=src python utils/measure_aot_forward.py [--layers 4] [--hidden 256] [--prompt 200] [--bucket 256]
                                                       [--max-cache-len 320] [--new-tokens 16] [--rounds 15]
                                                       [--model FOLDER] [--threads N] [--folder DIR]

A Llama built from a config (`--layers`, `--hidden`: large enough that its kernels, not Python, take most of a call),
one prompt (`--prompt` tokens, padded to the one bucket `--bucket`) and a pinned static cache (`--max-cache-len`), so
every strategy runs the very same shapes. Strategies:

- `torch.compile`: `model.forward = torch.compile(model.forward, dynamic=False)`, as the benchmark's `pow2-default`;
- `aot (here)`: `model.forward = prefill_buckets.aot_forward(model)`, compiled in the process that runs it;
- `aot (file)`: the same, its graphs loaded from a compile cache file that an earlier process saved (a replica, as
  the benchmark's `pow2-warm`).

A first process compiles the `aot_forward` graphs and saves the file; a second one (a fresh inductor cache directory)
loads it, builds the three models (the same weights), runs one warm-up call each, then `--rounds` rounds in which
each strategy runs one `generate` call in turn (alternating, so a noisy machine slows them alike). Printed: the
median time to first token (the prefill) and decode time per token of each, and their ratios to `torch.compile`'s.
The forward calls alone are timed too (a forward pre-hook and hook on each model): the prefill's, and the median
decode step's, in wall time and in the process's CPU time (`decode_cpu_ms`: less sensitive to other jobs on the
machine than wall time, most of all with `--threads 1`). `--folder DIR` keeps the file and the inductor caches there, and a later run with it compiles nothing.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def build_model(args):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 32),
        num_key_value_heads=max(1, args.hidden // 64),
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def generation_config(args):
    from transformers import GenerationConfig

    return GenerationConfig(
        cache_implementation="static",
        max_new_tokens=args.new_tokens,
        min_new_tokens=args.new_tokens,
        do_sample=False,
        prefill_buckets=[args.bucket],
        max_cache_len=args.max_cache_len,
        pad_token_id=0,
    )


def prompt(args):
    import torch

    return torch.randint(3, 2000, (1, args.prompt), generator=torch.Generator().manual_seed(1))


def set_threads(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)


def prepare(args) -> None:
    """Compiles the `aot_forward` graphs of the workload and saves them to `args.cache_file`."""
    import prefill_buckets

    set_threads(args)
    prefill_buckets.enable()
    model = build_model(args)
    model.forward = prefill_buckets.aot_forward(model)
    ids = prompt(args)
    prefill_buckets.generate(
        model, ids, attention_mask=ids.new_ones(ids.shape), generation_config=generation_config(args)
    )
    prefill_buckets.save_compile_cache(args.cache_file)


def run(args) -> None:
    """Loads the file, builds the three strategies, and times them in alternating rounds."""
    import torch

    import prefill_buckets
    from prefill_buckets.testing_utils import TokenClock

    set_threads(args)
    prefill_buckets.enable()
    assert prefill_buckets.load_compile_cache(args.cache_file)
    models = {}
    models["aot (file)"] = build_model(args)  # first: it takes the file's graphs
    models["aot (file)"].forward = prefill_buckets.aot_forward(models["aot (file)"])
    models["torch.compile"] = build_model(args)
    models["torch.compile"].forward = torch.compile(models["torch.compile"].forward, dynamic=False)
    models["aot (here)"] = build_model(args)
    models["aot (here)"].forward = prefill_buckets.aot_forward(models["aot (here)"])
    order = ["torch.compile", "aot (here)", "aot (file)"]
    warmup_order = [
        "aot (file)",
        "torch.compile",
        "aot (here)",
    ]  # the first `aot_forward` called takes the file's graphs
    config = generation_config(args)
    ids = prompt(args)
    mask = ids.new_ones(ids.shape)
    tokens = {}
    for name in warmup_order:  # warm-up: compiles the two that are not loaded
        begin = time.perf_counter()
        out = prefill_buckets.generate(models[name], ids, attention_mask=mask, generation_config=config)
        tokens[name] = out[0].tolist()
        print(f"warm-up {name}: {time.perf_counter() - begin:.1f} s", file=sys.stderr)
    for name in order:
        forward = models[name].forward
        if hasattr(forward, "graphs_loaded"):
            print(
                f"{name}: graphs loaded {forward.graphs_loaded}, compiled {forward.graphs_compiled}", file=sys.stderr
            )
    # The forward calls alone, by a pre-hook and a hook: the first of a `generate` call is its prefill.
    spans = []
    for model in models.values():
        model.register_forward_pre_hook(lambda module, a: spans.append([time.perf_counter(), time.process_time()]))
        model.register_forward_hook(
            lambda module, a, out: spans[-1].extend([time.perf_counter(), time.process_time()])
        )
    measured = {
        name: {key: [] for key in ("ttft_ms", "decode_ms", "prefill_forward_ms", "decode_forward_ms", "decode_cpu_ms")}
        for name in order
    }
    for round_ in range(args.rounds):
        for name in order[round_ % 3 :] + order[: round_ % 3]:  # rotate who goes first
            clock = TokenClock()
            spans.clear()
            start = time.perf_counter()
            prefill_buckets.generate(models[name], ids, attention_mask=mask, generation_config=config, streamer=clock)
            row = measured[name]
            row["ttft_ms"].append(clock.first_token_seconds(since=start) * 1000)
            row["decode_ms"].append(clock.decode_seconds_per_token() * 1000)
            row["prefill_forward_ms"].append((spans[0][2] - spans[0][0]) * 1000)
            row["decode_forward_ms"].extend((span[2] - span[0]) * 1000 for span in spans[1:])
            row["decode_cpu_ms"].extend((span[3] - span[1]) * 1000 for span in spans[1:])
    result = {name: {k: statistics.median(v) for k, v in row.items()} for name, row in measured.items()}
    result["tokens_equal"] = len({json.dumps(t) for t in tokens.values()}) == 1
    print(json.dumps(result))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a local Llama folder instead of one built from --layers and --hidden")
    parser.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's own)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=200)
    parser.add_argument("--bucket", type=int, default=256)
    parser.add_argument("--max-cache-len", type=int, default=320)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--folder", help="keep the compile cache file and inductor caches here, and reuse them")
    parser.add_argument("--phase", choices=("prepare", "run"), help=argparse.SUPPRESS)
    parser.add_argument("--cache-file", help=argparse.SUPPRESS)
    args, _ = parser.parse_known_args()
    if args.phase == "prepare":
        prepare(args)
        return 0
    if args.phase == "run":
        run(args)
        return 0
    with tempfile.TemporaryDirectory() as temporary:
        folder = args.folder or temporary
        cache_file = os.path.join(folder, "aot_cache.zip")
        for phase in ("prepare", "run"):
            if phase == "prepare" and args.folder and os.path.exists(cache_file):
                continue  # kept from an earlier run with the same --folder
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": os.path.join(folder, f"inductor-{phase}")}
            command = [sys.executable, __file__, *sys.argv[1:], "--phase", phase, "--cache-file", cache_file]
            done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
        result = json.loads(done.stdout.strip().splitlines()[-1])
    reference = result["torch.compile"]
    columns = ("ttft_ms", "decode_ms", "prefill_forward_ms", "decode_forward_ms", "decode_cpu_ms")
    print(f"{'median (ratio)':<16}" + "".join(f"{c:>24}" for c in columns))
    for name in ("torch.compile", "aot (here)", "aot (file)"):
        row = result[name]
        cells = [f"{row[c]:.2f} ({row[c] / reference[c]:.3f})" for c in columns]
        print(f"{name:<16}" + "".join(f"{c:>24}" for c in cells))
    print(f"tokens equal: {result['tokens_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

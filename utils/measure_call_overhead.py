"""Per-call overhead of a bucketed call against upstream `generate`: tiny Llama, eager, 1 thread, side by side.

    python utils/measure_call_overhead.py [--rounds 200] [--cache dynamic|static] [--profile N]

A prompt that exactly fits its bucket (16 tokens, bucket 16) and 4 new tokens, so both calls run the same forwards
on the same shapes: the difference is what bucketing adds around upstream `generate` (resolving, padding, hooks,
stripping). The two alternate; the medians and their difference are printed.

- `--cache dynamic` (the default): upstream's default cache, a `DynamicCache` per call. The bucketed call runs the
  left-padded path (a dynamic cache is not compiled, so no side is shared).
- `--cache static`: `cache_implementation="static"` on both calls. The bucketed call takes the static-cache path
  (right padding, the cache sized by the package's rule); upstream's call then makes a cache of the same length
  (upstream keeps the model's largest static cache length), so both run the same forwards on the same cache shape.
- `--clock cpu`: times each call by the process's CPU time, which other processes on a busy machine don't add to.
- `--profile N`: after the timing, profiles N bucketed calls with `sys.setprofile` and prints the package's own time
  per function, per call (torch and standard-library code it calls included, upstream's code excluded).
"""

import argparse
import statistics
import sys
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile N bucketed calls")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time (steadier on a busy machine)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    import prefill_buckets

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    input_ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = {"cache_implementation": "static"} if args.cache == "static" else {}
    generation_config = GenerationConfig(max_new_tokens=4, min_new_tokens=4, do_sample=False, **cache)
    calls = {
        "upstream": lambda: model.generate(input_ids, generation_config=generation_config),
        "bucketed": lambda: prefill_buckets.generate(
            model, input_ids, generation_config=generation_config, prefill_buckets=[16]
        ),
    }
    times = {name: [] for name in calls}
    outputs = {name: call() for name, call in calls.items()}  # warm-up
    outputs = {name: call() for name, call in calls.items()}  # a static cache of the bucketed call's length on both
    if not torch.equal(outputs["upstream"], outputs["bucketed"]):
        raise SystemExit("the bucketed call's tokens differ from upstream's")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    for _ in range(args.rounds):
        for name, call in calls.items():
            start = clock()
            call()
            times[name].append(clock() - start)
    medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
    if args.cache == "static":
        print(f"static cache of {model._previous_max_cache_length} slots on both calls")
    for name, median in medians.items():
        print(f"{name:9s} median {median:.2f} ms per call")
    print(
        f"overhead: {medians['bucketed'] - medians['upstream']:.2f} ms per call ({medians['bucketed'] / medians['upstream']:.3f}x)"
    )
    if args.profile:
        print_profile(calls, args.profile)


def _own_time(call, times: int) -> tuple[dict, float]:
    """
    Runs `call` `times` times under `sys.setprofile` and returns the time spent in the package's own code, per call,
    by function: each moment is the package's when the innermost frame of the package or of transformers on the stack
    is the package's (torch and the standard library called from the package count as the package's; a forward the
    package runs counts as upstream's). Returns `({(function, caller): (seconds, calls)}, total seconds)`.
    """
    own, last = {}, [time.perf_counter()]

    def owner(frame):
        while frame is not None:
            path = frame.f_code.co_filename
            if "prefill_buckets" in path:
                return frame
            if "transformers" in path:
                return None
            frame = frame.f_back
        return None

    def profiler(frame, event, arg):
        now = time.perf_counter()
        package = owner(frame)
        if package is not None:
            key = f"{package.f_code.co_filename.split('prefill_buckets/')[-1]}:{package.f_code.co_name}"
            seconds, count = own.get(key, (0.0, 0))
            own[key] = (seconds + now - last[0], count + (event == "call" and frame is package))
        last[0] = time.perf_counter()

    start = time.perf_counter()
    sys.setprofile(profiler)
    try:
        for _ in range(times):
            call()
    finally:
        sys.setprofile(None)
    total = (time.perf_counter() - start) / times
    return {key: (seconds / times, count / times) for key, (seconds, count) in own.items()}, total


def print_profile(calls: dict, times: int) -> None:
    """The package's own time in a bucketed call, by function (`_own_time`; the profiler inflates every figure)."""
    own, total = _own_time(calls["bucketed"], times)
    package = sum(seconds for seconds, _ in own.values())
    print(f"\nprofiled bucketed call: {total * 1000:.2f} ms, {package * 1000:.2f} ms of it the package's own code")
    print(f"{'own ms':>7} {'share':>6} {'calls':>6}  function (with torch and stdlib it calls)")
    for key, (seconds, count) in sorted(own.items(), key=lambda item: -item[1][0])[:40]:
        print(f"{seconds * 1000:7.3f} {seconds / package:6.1%} {count:6.1f}  {key}")


if __name__ == "__main__":
    main()

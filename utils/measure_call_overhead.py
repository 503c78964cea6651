"""Per-call overhead of a bucketed call against upstream `generate`: tiny Llama, eager, 1 thread, side by side.

    python utils/measure_call_overhead.py [--rounds 200] [--cache dynamic|static] [--compile] [--clock wall|cpu]
        [--new-tokens 4] [--side auto|left|right] [--profile N]

A prompt that exactly fits its bucket (16 tokens, bucket 16) and 4 new tokens, so both calls run the same forwards
on the same shapes: the difference is what bucketing adds around upstream `generate` (resolving, padding, hooks,
stripping). The two alternate, each first every other round; the medians and their difference are printed, then the
median of each round's difference and ratio (steadier on a shared machine).

- `--cache dynamic` (the default): upstream's default cache, a `DynamicCache` per call. The bucketed call runs the
  left-padded path (a dynamic cache is not compiled, so no side is shared).
- `--cache static`: `cache_implementation="static"` on both calls. The bucketed call takes the static-cache path
  (right padding, the cache sized by the package's rule); upstream's call then makes a cache of the same length
  (upstream keeps the model's largest static cache length), so both run the same forwards on the same cache shape.
- `--compile`: `model.compile(backend="eager", dynamic=False)` first (implies `--cache static`): dynamo's guards and
  graphs with torch's eager kernels, so the difference is what bucketing adds around compiled forwards, the path a
  bucketed static-cache call takes (inductor's kernels would cost the same on both sides). The bucketed call's
  forwards get the mask its bucket compiles with; upstream's exact prompt gets none. The time inside the compiled
  forwards is measured apart (the same forwards on both sides, but for that mask), so the rest is what each call does
  around them; runs with `--new-tokens 1` and a larger count split that rest into per call and per decode step.
- `--new-tokens`: the tokens each call generates (4 by default); `--side`: the bucketed call's
  `prefill_padding_side` (`auto` by default, which pads a static-cache call on the right here).
- `--clock cpu`: times each call by the process's CPU time, which other processes on a busy machine don't add to.
- `--profile N`: after the timing, samples the stack (by CPU time) while the two calls alternate N more times, and
  prints the package's own time per function and per call (torch and standard-library code it calls included,
  upstream's code excluded), then the upstream functions whose time the bucketed call changes.
"""

import argparse
import collections
import signal
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    parser.add_argument("--compile", action="store_true", help="compiled forwards (dynamo, eager backend)")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--side", choices=("auto", "left", "right"), default="auto")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="sample the stacks of N more rounds")
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: the process's CPU time (steadier on a busy machine)",
    )
    args = parser.parse_args()
    if args.compile:
        args.cache = "static"
    torch.set_num_threads(1)

    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    import prefill_buckets

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    if args.compile:
        model.compile(backend="eager", dynamic=False, fullgraph=True)
    input_ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    cache = {"cache_implementation": "static"} if args.cache == "static" else {}
    new_tokens = args.new_tokens
    generation_config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **cache
    )
    calls = {
        "upstream": lambda: model.generate(input_ids, generation_config=generation_config),
        "bucketed": lambda: prefill_buckets.generate(
            model, input_ids, generation_config=generation_config, prefill_buckets=[16], prefill_padding_side=args.side
        ),
    }
    times = {name: [] for name in calls}
    outputs = {name: call() for name, call in calls.items()}  # warm-up
    outputs = {name: call() for name, call in calls.items()}  # a static cache of the bucketed call's length on both
    if not torch.equal(outputs["upstream"], outputs["bucketed"]):
        raise SystemExit("the bucketed call's tokens differ from upstream's")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    forwards = _time_compiled_forwards(model, clock) if args.compile else None
    inside = {name: [] for name in calls}
    for round_ in range(args.rounds):
        for name in sorted(calls, reverse=round_ % 2 == 1):  # each goes first every other round
            if forwards is not None:
                forwards[0] = 0.0
            start = clock()
            calls[name]()
            times[name].append(clock() - start)
            if forwards is not None:
                inside[name].append(forwards[0])
    medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
    if args.cache == "static":
        print(f"static cache of {model._previous_max_cache_length} slots on both calls")
    for name, median in medians.items():
        print(f"{name:9s} median {median:.2f} ms per call")
    print(
        f"overhead: {medians['bucketed'] - medians['upstream']:.2f} ms per call ({medians['bucketed'] / medians['upstream']:.3f}x)"
    )
    # Each round's two calls run back to back, so a load that comes and goes adds to both: the median of the rounds'
    # differences and ratios is steadier on a shared machine than the difference of the medians.
    pairs = list(zip(times["bucketed"], times["upstream"]))
    paired = statistics.median(b - u for b, u in pairs) * 1000
    ratio = statistics.median(b / u for b, u in pairs)
    print(f"overhead, median of the rounds' pairs: {paired:.2f} ms per call ({ratio:.3f}x)")
    if forwards is not None:
        for name in calls:
            within = statistics.median(inside[name]) * 1000
            print(
                f"{name:9s} inside the compiled forwards {within:.2f} ms, around them {medians[name] - within:.2f} ms"
            )
        rounds = list(zip(times["bucketed"], inside["bucketed"], times["upstream"], inside["upstream"]))
        around = statistics.median((b - bi) - (u - ui) for b, bi, u, ui in rounds) * 1000
        within = statistics.median(bi - ui for _, bi, _, ui in rounds) * 1000
        print(f"median of the rounds' pairs: {around:+.2f} ms around the forwards, {within:+.2f} ms inside them")
    if args.profile:
        print_profile(calls, args.profile)


def _time_compiled_forwards(model, clock) -> list[float]:
    """
    Wraps `model`'s compiled call so that the time spent in it adds up in the returned `[seconds]` (a bucketed call
    runs the same compiled call, inside the eager fallback it puts around it).
    """
    from prefill_buckets.upstream import torch_api

    compiled, spent = torch_api.compiled_call_impl(model), [0.0]

    def timed(*args, **kwargs):
        start = clock()
        try:
            return compiled(*args, **kwargs)
        finally:
            spent[0] += clock() - start

    timed.__wrapped__ = compiled  # still reads as compiled with `fullgraph=True` (the eager fallback's fast path)
    torch_api.set_compiled_call_impl(model, timed)
    return spent


def _owner(frame) -> tuple[str, str]:
    """
    `("package" | "upstream", function)`: whose moment a sampled frame is. The package's when the innermost frame of
    the package or of transformers on the stack is the package's (torch and the standard library it calls count as
    its own; a forward it runs counts as upstream's), named by that frame's function; else upstream's, named by the
    innermost transformers function (or the innermost frame's, outside both).
    """
    inner = frame
    while frame is not None:
        path = frame.f_code.co_filename
        if "prefill_buckets" in path or "transformers" in path:
            owner = "package" if "prefill_buckets" in path else "upstream"
            return owner, f"{path.split('site-packages/')[-1].split('src/')[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "upstream", f"(outside) {inner.f_code.co_filename.split('/')[-1]}:{inner.f_code.co_name}"


def print_profile(calls: dict, rounds: int, interval: float = 0.0002) -> None:
    """
    Samples the stack every `interval` seconds of the process's CPU time (`ITIMER_PROF`: other processes don't count)
    while the two calls alternate `rounds` times, and prints, per call: the package's own time by function, and the
    upstream functions that take more (or less) time in the bucketed call than in upstream's.
    """
    samples = {name: collections.Counter() for name in calls}
    cpu = dict.fromkeys(calls, 0.0)
    current = [None]
    signal.signal(signal.SIGPROF, lambda signum, frame: samples[current[0]].update([_owner(frame)]))
    signal.setitimer(signal.ITIMER_PROF, interval, interval)
    try:
        for _ in range(rounds):
            for name, call in calls.items():
                current[0] = name
                start = time.process_time()
                call()
                cpu[name] += time.process_time() - start
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)

    def ms(name, count):  # a function's share of the samples, as CPU time per call
        return count / max(1, sum(samples[name].values())) * cpu[name] / rounds * 1000

    bucketed, upstream = samples["bucketed"], samples["upstream"]
    package = sum(count for (owner, _), count in bucketed.items() if owner == "package")
    print(
        f"\nsampled CPU time per call: upstream {cpu['upstream'] / rounds * 1000:.2f} ms, bucketed "
        f"{cpu['bucketed'] / rounds * 1000:.2f} ms, of which the package's own code {ms('bucketed', package):.3f} ms"
    )
    print("the package's own time per call, by function (with the torch and standard-library code it calls):")
    own = sorted(((count, key) for key, count in bucketed.items() if key[0] == "package"), reverse=True)
    for count, (_, where) in own[:30]:
        print(f"  {ms('bucketed', count):7.3f} ms  {where}")
    print("upstream's code, bucketed minus upstream's call, per call (sampling noise: a few hundredths of a ms):")
    keys = {key for key in (*bucketed, *upstream) if key[0] == "upstream"}
    diff = sorted(
        ((ms("bucketed", bucketed[k]) - ms("upstream", upstream[k]), k[1]) for k in keys), key=lambda d: -abs(d[0])
    )
    for extra, where in diff[:15]:
        print(f"  {extra:+7.3f} ms  {where}")


if __name__ == "__main__":
    main()

"""Time to first token of a prompt padded to a multiple of 64, on the left and on the right, against its exact length.

    python utils/measure_padding_cost.py [--lengths 100 300 600 900] [--rounds 5] [--multiple 64]

SmolLM2-135M-Instruct (converted once by `python -m prefill_buckets bench`), `model.forward` compiled with inductor
(`dynamic=False`), one static cache pinned for the longest prompt, so every call of a length shares it. For each
length, in one process: upstream `generate` on the exact prompt (its own prefill graph), and `prefill_buckets.generate`
with `prefill_pad_to_multiple_of`, with `prefill_padding_side="left"` (masked prefill) and `"right"` (no mask). After
one compiling call each, the three alternate and the median time to first token is compared: the steady-state cost of
the padding, compiles excluded. Beside wall time, the process's CPU time (`time.process_time`, with passive OpenMP
threads that don't spin while waiting): on a shared, loaded machine wall time mostly measures the other load.
The target (issue 12): padded / exact <= 1.05 x padded tokens / real tokens.

    python utils/measure_padding_cost.py --batch [--batch-lengths 72 88 104 120] [--rounds 5] [--multiple 64]

Batch mode (issue 24): a batch of rows of different lengths within one bucket, left-padded with its mask as a tokenizer
does (`padding=True`), against the same prompts run one by one at their exact lengths (the sum of their times to first
token: the exact per-row compute). `prefill_buckets.generate` right-pads each row after its own end (no mask) or pads
the batch on the left (masked); upstream `generate` on the batch (its width, masked) is beside them. The target:
ragged right / exact rows <= 1.05 x padded tokens / real tokens (rows x bucket / the rows' tokens).
"""

import argparse
import os
import statistics
import time


SIDES = ("left", "right")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 300, 600, 900])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--multiple", type=int, default=64)
    parser.add_argument("--batch", action="store_true", help="a ragged batch against its rows one by one")
    parser.add_argument("--batch-lengths", type=int, nargs="+", default=[72, 88, 104, 120])
    args = parser.parse_args()
    if args.batch:
        args.lengths = [max(args.batch_lengths)]  # sizes the cache
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the benchmark: spinning threads distort a shared CPU

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import prefill_buckets
    from prefill_buckets.buckets import round_up
    from prefill_buckets.testing_utils import smollm2_folder

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    model.forward = torch.compile(model.forward, dynamic=False)
    torch._dynamo.config.recompile_limit = 6 * len(args.lengths) + 6
    new_tokens = 2
    cache_length = round_up(round_up(max(args.lengths), args.multiple) + new_tokens, 64)
    config = GenerationConfig(
        cache_implementation="static",
        max_cache_len=cache_length,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )

    class FirstToken:
        def __init__(self):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()
            self.times = []

        def put(self, value):
            self.times.append((time.perf_counter(), time.process_time()))

        def end(self):
            pass

    def ttft_ms(input_ids, variant: str, attention_mask=None):
        """`(wall ms, cpu ms, sequences)` of one call: `variant` is "exact" or a padding side."""
        streamer = FirstToken()
        with torch.no_grad():
            if variant == "exact":
                out = model.generate(
                    input_ids, attention_mask=attention_mask, generation_config=config, streamer=streamer
                )
            else:
                out = prefill_buckets.generate(
                    model,
                    input_ids,
                    attention_mask=attention_mask,
                    generation_config=config,
                    streamer=streamer,
                    prefill_pad_to_multiple_of=args.multiple,
                    prefill_padding_side=variant,
                )
        wall, cpu = streamer.times[1]  # times[0]: the prompt; times[1]: the first new token
        return (wall - streamer.start) * 1000, (cpu - streamer.cpu_start) * 1000, out

    generator = torch.Generator().manual_seed(0)
    if args.batch:
        measure_batch(args, torch, model, ttft_ms, generator, round_up, cache_length)
        return
    variants = ("exact", *SIDES)
    print(
        f"static cache {cache_length} slots, {args.rounds} rounds, median time to first token (ms), torch threads "
        f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'length':>6} {'padded':>6} {'pad/real':>8} {'target':>6} {'clock':>5} "
        + " ".join(f"{v:>8}" for v in variants)
        + "   "
        + " ".join(f"{v + '/exact':>12}" for v in SIDES)
        + "  tokens"
    )
    for length in args.lengths:
        input_ids = torch.randint(100, model.config.vocab_size, (1, length), generator=generator)
        outputs = {variant: ttft_ms(input_ids, variant)[2] for variant in variants}  # compiles this length's graphs
        same = all(torch.equal(outputs[side], outputs["exact"]) for side in SIDES)
        times = {variant: [] for variant in variants}
        for _ in range(args.rounds):
            for variant in variants:
                times[variant].append(ttft_ms(input_ids, variant)[:2])
        padded = round_up(length, args.multiple)
        tokens = padded / length
        for clock, index in (("wall", 0), ("cpu", 1)):
            median = {v: statistics.median(t[index] for t in times[v]) for v in variants}
            print(
                f"{length:6d} {padded:6d} {tokens:8.2f} {1.05 * tokens:6.2f} {clock:>5} "
                + " ".join(f"{median[v]:8.1f}" for v in variants)
                + "   "
                + " ".join(f"{median[side] / median['exact']:12.2f}" for side in SIDES)
                + f"  {'equal' if same else 'DIFFER'}",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f}")


def measure_batch(args, torch, model, ttft_ms, generator, round_up, cache_length) -> None:
    """Batch mode (see the module docstring): one table row per clock."""
    lengths = args.batch_lengths
    rows = [torch.randint(100, model.config.vocab_size, (1, length), generator=generator) for length in lengths]
    width = max(lengths)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)  # left-padded with the pad id 0, as a tokenizer does
    attention_mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, prompt in enumerate(rows):
        input_ids[row, width - prompt.shape[1] :] = prompt[0]
        attention_mask[row, width - prompt.shape[1] :] = 1
    calls = {
        "exact rows": lambda: [ttft_ms(prompt, "exact") for prompt in rows],
        "upstream batch": lambda: [ttft_ms(input_ids, "exact", attention_mask)],
        **{side: (lambda side=side: [ttft_ms(input_ids, side, attention_mask)]) for side in SIDES},
    }
    outputs = {name: [result[2] for result in call()] for name, call in calls.items()}  # compiles the graphs
    same = all(torch.equal(outputs[side][0], outputs["upstream batch"][0]) for side in SIDES)
    times = {name: [] for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            results = call()
            times[name].append((sum(r[0] for r in results), sum(r[1] for r in results)))
    padded = round_up(width, args.multiple)
    tokens = len(rows) * padded / sum(lengths)
    print(
        f"static cache {cache_length} slots, {args.rounds} rounds, median time to first token (ms), torch threads "
        f"{torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}"
    )
    print(f"rows of {lengths} tokens, bucket {padded}; exact rows: the {len(rows)} prompts one by one (sum)")
    print(
        f"{'pad/real':>8} {'target':>6} {'clock':>5} "
        + " ".join(f"{name:>14}" for name in calls)
        + "   "
        + " ".join(f"{name + '/rows':>14}" for name in ("upstream batch", *SIDES))
        + "  tokens"
    )
    for clock, index in (("wall", 0), ("cpu", 1)):
        median = {name: statistics.median(t[index] for t in times[name]) for name in calls}
        print(
            f"{tokens:8.2f} {1.05 * tokens:6.2f} {clock:>5} "
            + " ".join(f"{median[name]:14.1f}" for name in calls)
            + "   "
            + " ".join(f"{median[name] / median['exact rows']:14.2f}" for name in ("upstream batch", *SIDES))
            + f"  {'equal' if same else 'DIFFER'}",
            flush=True,
        )
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

"""Time to first token of a prompt padded to a multiple of 64 against the same prompt at its exact length.

    python utils/measure_padding_cost.py [--lengths 100 300 600 900] [--rounds 3] [--multiple 64]

SmolLM2-135M-Instruct (converted once by `python -m prefill_buckets bench`), `model.forward` compiled with inductor
(`dynamic=False`), one static cache pinned for the longest prompt, so both calls of a length share it. For each
length, in one process: upstream `generate` on the exact prompt (its own prefill graph), and `prefill_buckets.generate`
with `prefill_pad_to_multiple_of` (the padded prefill graph). After one compiling call each, the two alternate and
the median time to first token is compared: the steady-state cost of the padding, compiles excluded.
"""

import argparse
import os
import statistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[100, 300, 600, 900])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--multiple", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the benchmark: spinning threads distort a shared CPU

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import prefill_buckets
    from prefill_buckets.buckets import round_up
    from prefill_buckets.testing_utils import TokenClock, smollm2_folder

    model = AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()
    model.forward = torch.compile(model.forward, dynamic=False)
    torch._dynamo.config.recompile_limit = 4 * len(args.lengths) + 4
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

    def ttft_ms(input_ids, padded: bool) -> float:
        streamer = TokenClock()
        if padded:
            prefill_buckets.generate(
                model,
                input_ids,
                generation_config=config,
                streamer=streamer,
                prefill_pad_to_multiple_of=args.multiple,
            )
        else:
            model.generate(input_ids, generation_config=config, streamer=streamer)
        return streamer.first_token_seconds() * 1000

    generator = torch.Generator().manual_seed(0)
    print(f"static cache {cache_length} slots, {args.rounds} rounds, median time to first token")
    print(f"{'length':>7} {'padded':>7} {'exact ms':>9} {'padded ms':>10} {'ratio':>6}")
    for length in args.lengths:
        input_ids = torch.randint(100, model.config.vocab_size, (1, length), generator=generator)
        for padded in (False, True):
            ttft_ms(input_ids, padded)  # compiles this length's prefill graph
        times = {False: [], True: []}
        for _ in range(args.rounds):
            for padded in (False, True):
                times[padded].append(ttft_ms(input_ids, padded))
        exact, padded = statistics.median(times[False]), statistics.median(times[True])
        print(f"{length:7d} {round_up(length, args.multiple):7d} {exact:9.1f} {padded:10.1f} {padded / exact:6.2f}")


if __name__ == "__main__":
    main()

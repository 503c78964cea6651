"""How often a bucketed call's greedy tokens differ from the unpadded call's in low precision, beside upstream's own.

    python utils/measure_low_precision.py [--dtypes float32 bfloat16] [--prompts 12] [--new-tokens 32]

About 7 minutes on a 2-core CPU with the defaults.

"Exact" (the reference's word) is checked in fp32. In bf16 or fp16 a kernel's rounding depends on the shapes it runs:
a prompt padded to its bucket is a longer matrix than the prompt, as a prompt batched beside a longer one is in
upstream's own `generate`. This script measures what that does to greedy tokens, on SmolLM2-135M-Instruct (converted
once by `python -m prefill_buckets bench`), eager (no compile), a static cache, the bench's chat prompts.

For each dtype and prompt, the reference is upstream `generate` on the prompt alone. Beside it:
- `bucketed right` and `bucketed left`: `prefill_buckets.generate` with `"pow2-quarters"` on each padding side;
- `upstream batched`: upstream `generate` on the prompt in a batch of two, beside the prompt's second half, which a
  tokenizer left-pads (with its mask): the same prompt, at another shape, with no package involved;
- `upstream longer cache`: upstream `generate` with a static cache 256 slots longer.

Per variant: the prompts whose new tokens differ from the reference's, the index of each one's first differing new
token, and the largest absolute difference of the first token's logits over all prompts.
"""

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=12, help="the first N of the bench's prompts")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import prefill_buckets
    from prefill_buckets.benchmark.workload import load_prompts, tokenize_prompts
    from prefill_buckets.testing_utils import smollm2_folder

    folder = smollm2_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    workload = tokenize_prompts(tokenizer, load_prompts(None))[: args.prompts]

    def config(max_cache_len: int) -> GenerationConfig:
        return GenerationConfig(
            max_new_tokens=args.new_tokens,
            do_sample=False,
            cache_implementation="static",
            cache_config={"max_cache_len": max_cache_len},
            pad_token_id=0,
            eos_token_id=None,  # every call decodes the same number of steps
            output_logits=True,
            return_dict_in_generate=True,
        )

    def variants(model, ids: torch.Tensor) -> dict:
        """`{variant: (new tokens [new_tokens], first token's logits [vocab])}` of the prompt `ids` `[1, length]`."""
        length = ids.shape[1]
        cache_len = length + args.new_tokens
        calls = {
            "unpadded (reference)": lambda: model.generate(ids, generation_config=config(cache_len)),
            "bucketed right": lambda: prefill_buckets.generate(
                model, ids, generation_config=config(cache_len), prefill_buckets="pow2-quarters",
                prefill_padding_side="right",
            ),
            "bucketed left": lambda: prefill_buckets.generate(
                model, ids, generation_config=config(cache_len), prefill_buckets="pow2-quarters",
                prefill_padding_side="left",
            ),
            "upstream batched": lambda: _batched_with_its_half(model, ids, config(cache_len)),
            "upstream longer cache": lambda: model.generate(ids, generation_config=config(cache_len + 256)),
        }  # fmt: skip
        results = {}
        for name, call in calls.items():
            output = call()
            results[name] = (output.sequences[0, length:], output.logits[0][0].float())
        return results

    print(
        f"SmolLM2-135M-Instruct, eager, {len(workload)} prompts of {min(w['length'] for w in workload)} to "
        f"{max(w['length'] for w in workload)} tokens, {args.new_tokens} greedy new tokens, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'dtype':9s} {'variant':22s} {'prompts differing':>18s}  {'first differing new token':26s} max |d logits|")
    for dtype in args.dtypes:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        differing, largest = {}, {}
        for item in workload:
            results = variants(model, torch.tensor([item["ids"]]))
            tokens, logits = results.pop("unpadded (reference)")
            for name, (other_tokens, other_logits) in results.items():
                different = (tokens != other_tokens).nonzero()
                if len(different):
                    differing.setdefault(name, []).append(int(different[0]))
                largest[name] = max(largest.get(name, 0.0), (logits - other_logits).abs().max().item())
        for name in largest:
            firsts = differing.get(name, [])
            print(
                f"{dtype:9s} {name:22s} {len(firsts):>8d} of {len(workload):<7d}  "
                f"{', '.join(map(str, firsts)) or '-':26s} {largest[name]:.3g}"
            )


def _batched_with_its_half(model, ids, generation_config):
    """Upstream `generate` on `ids` `[1, length]` in a batch beside its second half, left-padded with a mask."""
    import torch

    length = ids.shape[1]
    half = ids[:, length // 2 :]
    pad = torch.zeros(1, length - half.shape[1], dtype=ids.dtype)
    batch = torch.cat([ids, torch.cat([pad, half], dim=1)])
    mask = torch.cat([torch.ones_like(ids), torch.cat([torch.zeros_like(pad), torch.ones_like(half)], dim=1)])
    output = model.generate(batch, attention_mask=mask, generation_config=generation_config)
    output.sequences, output.logits = output.sequences[:1], tuple(step[:1] for step in output.logits)
    return output


if __name__ == "__main__":
    main()

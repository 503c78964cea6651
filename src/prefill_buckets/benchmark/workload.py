"""The benchmark's workload: prompts from a JSON file (or random ids for the tiny model), tokenized once."""

import json
import os
import random
from importlib import resources
from pathlib import Path

import torch


# `--quick`: three lengths in one pow2 bucket (64), so bucketed, one prefill and one decode graph serve all three.
QUICK_LENGTHS = (57, 40, 33)
# The default run uses 16 of the file's 32 prompts, evenly spread over their lengths (shortest and longest included).
DEFAULT_NUM_PROMPTS = 16


def load_prompts(path: str | os.PathLike | None) -> list[dict]:
    """The prompts of a JSON file (default: the packaged `data/bench_prompts.json`)."""
    if path is None:
        text = resources.files("prefill_buckets").joinpath("data", "bench_prompts.json").read_text(encoding="utf-8")
    else:
        text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text)
    prompts = data["prompts"] if isinstance(data, dict) else data
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, dict) or ("messages" not in prompt and "text" not in prompt):
            raise SystemExit(f"Prompt {i} of {path or 'bench_prompts.json'} needs `messages` (chat) or `text`.")
        prompt.setdefault("name", f"prompt-{i}")
    return prompts


def tokenize_prompts(tokenizer, prompts: list[dict]) -> list[dict]:
    """Token ids of each prompt: `messages` through the tokenizer's chat template, `text` as a plain completion."""
    workload = []
    for prompt in prompts:
        if "messages" in prompt:
            if tokenizer.chat_template is None:
                raise SystemExit(f"Prompt {prompt['name']!r} is a chat, but the tokenizer has no chat template.")
            text = tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt["text"])["input_ids"]
        workload.append({"name": prompt["name"], "length": len(ids), "ids": list(ids)})
    return workload


def spread_by_length(workload: list[dict], count: int) -> list[dict]:
    """`count` prompts whose lengths are evenly spread over the workload's sorted lengths, kept in arrival order."""
    if count >= len(workload):
        return workload
    ranked = sorted(range(len(workload)), key=lambda i: workload[i]["length"])
    keep = {ranked[round(k * (len(ranked) - 1) / max(count - 1, 1))] for k in range(count)}
    return [item for i, item in enumerate(workload) if i in keep]


def shuffled(workload: list[dict], seed: int) -> list[dict]:
    """The workload in a random order that depends only on `seed`."""
    order = list(workload)
    random.Random(seed).shuffle(order)
    return order


def quick_workload(vocab_size: int) -> list[dict]:
    """Random token ids (the tiny model has no tokenizer), one prompt per length of `QUICK_LENGTHS`."""
    workload = []
    for length in QUICK_LENGTHS:
        ids = torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(length)).tolist()
        workload.append({"name": f"random-{length}", "length": length, "ids": ids})
    return workload

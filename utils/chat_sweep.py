"""Every causal-LM architecture, in a two-turn chat: the first turn's cache passed back, bucketed against upstream.

    python utils/chat_sweep.py [llama gemma3_text ...]

For each `model_type` of transformers' causal-LM auto mapping, a tiny model (`arch_sweep.build_tiny_model`, eager) runs
a conversation of two turns, on one prompt and on a ragged batch of 2 with its mask (`arch_sweep._prompts`): the first
turn generates 4 tokens into a static cache of 64 slots (the model's default cache where upstream takes no static one),
and the second passes that cache back with the first turn's sequences plus 5 new tokens each, and no bucket field (the
cache's record buckets it, as the guide's "Continuing a conversation from the cache" says). Upstream's two unpadded
turns are compared with `prefill_buckets.generate(..., prefill_buckets="pow2")`'s on a fresh copy of the model: the
tokens of both turns and the second turn's logits. Each cell names the outcome and each turn's side:

- `ok (CACHE; FIRST/SECOND)`: the same tokens and logits, each turn padded as shown (`right`, `left`, `unpadded: ...`);
- `DIFFERS ...` / `CRASH: ...`: other tokens or logits, or a raise where upstream ran (a bug);
- `upstream fails (CACHE): ...`: upstream's own conversation raises (nothing to compare); `no tiny config`.

`utils/arch_sweep.py` checks one call per architecture; this checks what a chat adds: the record a filled cache carries
and the padding a later turn must line up with.
"""

import copy
import sys
import time
import warnings
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

import arch_sweep  # noqa: E402  (beside this script)


NEW_TOKENS = 4
USER_TOKENS = 5
STATIC = {"cache_implementation": "static", "max_cache_len": 64}


def two_turns(generate, model, ids, mask, user, first_options: dict):
    """Both turns of one conversation through `generate(model, ids, **kwargs)`: `(first output, second output)`."""
    import torch

    from prefill_buckets.upstream.transformers_api import cache_argument

    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True}
    first = generate(model, ids, attention_mask=mask, **options, **first_options)
    conversation = torch.cat([first.sequences, user[: ids.shape[0]]], 1)
    turn_mask = torch.cat([mask, torch.ones_like(conversation[:, mask.shape[1] :])], 1)
    name, cache = cache_argument(first)
    later = generate(model, conversation, attention_mask=turn_mask, output_logits=True, **{name: cache}, **options)
    return first, later


def conversation_cell(model, pristine, ids, mask, user) -> str:
    """One conversation's cell (see the module docstring)."""
    import torch

    import prefill_buckets

    def upstream(model, ids, **kwargs):
        return model.generate(ids, **kwargs)

    sides = []

    def bucketed(model, ids, **kwargs):
        recorder = arch_sweep._SideRecorder()
        with recorder.recording():
            output = prefill_buckets.generate(model, ids, **kwargs)
        sides.append(arch_sweep._bucketed_cell(recorder))
        return output

    cell = "no cache"
    for first_options in (STATIC, {}):
        cache = "static" if first_options else "default"
        try:
            expected = two_turns(upstream, model, ids, mask, user, first_options)
        except arch_sweep.ArchitectureTimeout:
            raise
        except Exception as error:
            cell = f"upstream fails ({cache}): {arch_sweep._short(error, 50)}"
            continue
        sides.clear()
        try:
            actual = two_turns(
                bucketed, copy.deepcopy(pristine), ids, mask, user, {**first_options, "prefill_buckets": "pow2"}
            )
        except arch_sweep.ArchitectureTimeout:
            raise
        except Exception as error:
            return f"CRASH ({cache}): {arch_sweep._short(error, 80)}"
        turns = "/".join(sides)
        same = all(
            ours.sequences.shape == theirs.sequences.shape and torch.equal(ours.sequences, theirs.sequences)
            for ours, theirs in zip(actual, expected)
        )
        if not same:
            return f"DIFFERS tokens ({cache}; {turns})"
        differs = arch_sweep.logits_difference(actual[1].logits, expected[1].logits)
        if differs is not None:
            return f"DIFFERS (logits by {differs[1]:.1e} at step {differs[0]}; {cache}; {turns})"
        return f"ok ({cache}; {turns})"
    return cell


def sweep_one(model_type: str, timeout: float = 120.0) -> str:
    """The line of one `model_type`: a cell per conversation."""
    import torch

    with arch_sweep.time_limit(timeout):
        try:
            model = arch_sweep.build_tiny_model(model_type, arch_sweep.tiny_config(model_type))
        except arch_sweep.ArchitectureTimeout:
            raise
        except Exception as error:
            return f"no tiny config: {arch_sweep._short(error, 60)}"
        pristine = copy.deepcopy(model)  # each bucketed conversation runs on a copy of it: a first call
        user = torch.randint(3, arch_sweep.VOCAB, (2, USER_TOKENS), generator=torch.Generator().manual_seed(1))
        cells = []
        for name, (ids, mask) in arch_sweep._prompts().items():
            if mask is not None:  # a conversation passes its mask on
                cells.append(f"{name}: {conversation_cell(model, pristine, ids, mask, user)}")
        return " | ".join(cells)


def main(argv=None) -> int:
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()
    torch.set_num_threads(1)
    model_types = (sys.argv[1:] if argv is None else argv) or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    failed = 0
    for model_type in model_types:
        start = time.time()
        try:
            line = sweep_one(model_type)
        except arch_sweep.ArchitectureTimeout as error:
            line = f"timeout ({error})"
        failed += "DIFFERS" in line or "CRASH" in line
        print(f"{model_type:28s} {time.time() - start:5.1f}s {line}", flush=True)
    print(f"{failed} of {len(model_types)} types with a DIFFERS or CRASH cell")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

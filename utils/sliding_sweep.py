"""What a bucketed call compiles on every sliding-window and chunked-attention architecture: one table row per
`model_type` whose tiny static cache has such layers.

    python utils/sliding_sweep.py [--only gemma3_text mistral ...] [--timeout 120] [--write table.md]

The tiny models are `utils/arch_sweep.py`'s (its `tiny_config`: 2 layers, hidden 32, a 16-token sliding window), with
the attention chunk shrunk to 16 tokens too. Each is compiled in place (`model.compile(dynamic=False)`, the counting
backend `GraphCounter`: tracing only) and runs `prefill_buckets.generate(..., prefill_buckets="pow2")` with a static
cache on prompts of `PROMPT_LENGTHS` tokens (shorter and longer than the window), `NEW_TOKENS` greedy new tokens each,
then the same workload again. A row says:

- `graphs`: the graphs compiled in the first pass, and `+N` where the second pass compiled more;
- `compiled`: the forwards that ran a compiled graph, of all the forwards (the rest ran eagerly: torch's recompile
  limit, a graph break);
- `layers`: what served the sliding layers: `ring` (`prefill_buckets/ring.py`), or `upstream` and why;
- `tokens`: whether every call returned upstream's eager tokens (`same`), or `DIFFERS` / `CRASH: <error>`.

`docs/source/en/architectures.md` publishes the table. The target: every forward compiled, no graph in the second
pass, the same tokens.
"""

import argparse
import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path


_spec = importlib.util.spec_from_file_location("arch_sweep", Path(__file__).resolve().parent / "arch_sweep.py")
arch_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arch_sweep)

WINDOW = 16  # arch_sweep's `sliding_window`; the attention chunk is shrunk to it as well
PROMPT_LENGTHS = (12, 40)  # pow2 buckets 16 and 64: the window, and past it
NEW_TOKENS = 20


@dataclass
class SlidingRow:
    model_type: str
    model_class: str
    kinds: str = ""  # the attention kinds of its layers: "sliding", "chunked", "full"
    graphs: str = ""
    compiled: str = ""
    layers: str = ""
    tokens: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.tokens.startswith(("DIFFERS", "CRASH"))


def sliding_kinds(model) -> str:
    """The attention kinds of `model`'s layers ("sliding", "chunked", "full"), or "" when none slides."""
    from transformers import StaticCache

    from prefill_buckets import _compat

    try:
        layers = StaticCache(config=model.config, max_cache_len=64).layers
    except Exception:  # no static cache for this config
        return ""
    if not any(type(layer) is _compat.StaticSlidingWindowLayer for layer in layers):
        return ""
    text_config = model.config.get_text_config(decoder=True)
    types = set(getattr(text_config, "layer_types", None) or ())
    kinds = [kind for kind in ("sliding", "chunked", "full") if f"{kind}_attention" in types]
    if not kinds or kinds == ["full"]:  # no layer list: a window or a chunk for every layer
        kinds = ["chunked" if getattr(text_config, "attention_chunk_size", None) else "sliding"]
    return ", ".join(kinds)


def _tiny_model(model_type: str):
    import torch

    model_class = arch_sweep._model_class(model_type)
    config = arch_sweep.tiny_config(model_type)
    for sub_config in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
        if getattr(sub_config, "attention_chunk_size", None):
            sub_config.attention_chunk_size = WINDOW
    torch.manual_seed(0)
    return model_class(config).eval()


def sweep_one(model_type: str, timeout: float = 120.0) -> SlidingRow | None:
    """The row of one `model_type`, or `None` when its static cache has no sliding-window or chunked layers."""
    from unittest import mock

    import torch
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import prefill_buckets
    from prefill_buckets.call import ring
    from prefill_buckets.compilation import GraphCounter

    start = time.perf_counter()
    try:
        model = _tiny_model(model_type)
    except Exception:
        return None
    kinds = sliding_kinds(model)
    if not kinds:
        return None
    row = SlidingRow(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?"), kinds)
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, arch_sweep.VOCAB, (1, n), generator=generator) for n in PROMPT_LENGTHS]
    fields = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    try:
        with arch_sweep.time_limit(timeout), torch.no_grad():
            try:
                expected = [model.generate(p, **fields) for p in prompts]
            except arch_sweep.ArchitectureTimeout:
                raise
            except Exception as error:
                row.tokens = f"upstream fails: {arch_sweep._short(error)}"
                return row
            counter = GraphCounter()
            model.compile(backend=counter, dynamic=False)
            config = GenerationConfig(cache_implementation="static", prefill_buckets="pow2", **fields)
            rings = []
            opened = ring.SlidingWindowRing.open

            def recording(layer):
                rings.append(layer)
                opened(layer)

            same, graphs = True, []
            try:
                with mock.patch.object(ring.SlidingWindowRing, "open", recording):
                    for _ in range(2):
                        for prompt, tokens in zip(prompts, expected):
                            same &= torch.equal(
                                prefill_buckets.generate(model, prompt, generation_config=config), tokens
                            )
                        graphs.append(counter.graphs)
            except arch_sweep.ArchitectureTimeout:
                raise
            except Exception as error:
                row.tokens = f"CRASH: {arch_sweep._short(error)}"
                return row
            row.tokens = "same" if same else "DIFFERS"
            row.graphs = f"{graphs[0]}" + (f" +{graphs[1] - graphs[0]}" if graphs[1] > graphs[0] else "")
            row.compiled = f"{counter.calls} of {2 * len(prompts) * NEW_TOKENS}"
            row.layers = "ring" if rings else "upstream"
    except arch_sweep.ArchitectureTimeout as error:
        row.tokens = row.tokens or f"timeout ({error})"
    finally:
        row.seconds = time.perf_counter() - start
    return row


def markdown_table(rows: list[SlidingRow]) -> str:
    import torch
    import transformers

    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}, `model.compile(dynamic=False)`, "
        f'`prefill_buckets="pow2"`, a {WINDOW}-token window (or chunk), prompts of '
        f"{', '.join(map(str, PROMPT_LENGTHS))} tokens with {NEW_TOKENS} new tokens each, twice:",
        "",
        "| model_type | class | layers | graphs | forwards compiled | sliding layers served by | tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.model_type}` | `{r.model_class}` | {r.kinds} | {r.graphs or '-'} | {r.compiled or '-'} | "
            f"{r.layers or '-'} | {r.tokens} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", help="model types to run (default: all of the causal-LM mapping)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    parser.add_argument("--write", help="also write the markdown table to this file")
    args = parser.parse_args(argv)

    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.get_logger("prefill_buckets").propagate = False
    torch.set_num_threads(1)
    rows = []
    for model_type in args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        row = sweep_one(model_type, timeout=args.timeout)
        if row is None:
            continue
        print(
            f"{model_type}: {row.kinds} | {row.graphs} | {row.compiled} | {row.layers} | {row.tokens} "
            f"({row.seconds:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    table = markdown_table(rows)
    print(table)
    if args.write:
        with open(args.write, "w", encoding="utf-8") as file:
            file.write(table)
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

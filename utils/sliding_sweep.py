"""What a bucketed call compiles on every sliding-window and chunked-attention architecture: one table row per
`model_type` whose tiny static cache has such layers (with `--every-type`, per `model_type` of the causal-LM mapping).

    python utils/sliding_sweep.py [--only gemma3_text mistral ...] [--every-type] [--timeout 120] [--write table.md]

The tiny models are `utils/arch_sweep.py`'s (its `tiny_config`: 2 layers, hidden 32, a 16-token sliding window), with
the attention chunk shrunk to 16 tokens too. Each is compiled in place (`model.compile(dynamic=False)`, the counting
backend `GraphCounter`: tracing only) and runs `prefill_buckets.generate(..., prefill_buckets="pow2")` with a static
cache on prompts of `PROMPT_LENGTHS` tokens (shorter and longer than the window), `NEW_TOKENS` greedy new tokens each,
then on prompts of `SECOND_PASS_LENGTHS` tokens, other lengths in the same buckets. A row says:

- `padded`: the side each call was padded on (`right`, `left`), or that it ran unpadded and why (it then compiles what
  upstream compiles: a graph per prompt length);
- `graphs`: the graphs compiled in the first pass, and `+N` where the second pass compiled more;
- `compiled`: the forwards that ran a compiled graph, of all the forwards (the rest ran eagerly: torch's recompile
  limit, a graph break);
- `layers`: what served the sliding layers: `ring` (`prefill_buckets/kvcache/ring.py`), or `upstream` and why;
- `tokens`: whether every call returned upstream's eager tokens on the same static cache (`same`), or `DIFFERS` /
  `CRASH: <error>`. (Upstream's own tokens can differ by cache: Moshi's static sliding layer and its dynamic one
  give other tokens on a 36-token prompt.)

`--every-type` runs the types without such layers too (`layers`: `full`, or `-` where no static cache can be made
from the config, or upstream's call on one fails; both calls then take the cache upstream takes): what a compiled
bucketed call compiles on every architecture. `docs/source/en/architectures.md` publishes both tables. The target:
every forward compiled, no graph in the second pass, the same tokens.
"""

import copy
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path


_spec = importlib.util.spec_from_file_location("arch_sweep", Path(__file__).resolve().parent / "arch_sweep.py")
arch_sweep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(arch_sweep)

WINDOW = 16  # arch_sweep's `sliding_window`; the attention chunk is shrunk to it as well
PROMPT_LENGTHS = (12, 40)  # pow2 buckets 16 and 64: the window, and past it
SECOND_PASS_LENGTHS = (10, 36)  # other prompt lengths in the same buckets: nothing new to compile
NEW_TOKENS = 20


@dataclass
class SlidingRow:
    model_type: str
    model_class: str
    kinds: str = ""  # the attention kinds of its layers: "sliding", "chunked", "full"
    padded: str = ""  # how its calls were padded: "right", "left", "unpadded: <why>" (each once, in order)
    graphs: str = ""
    compiled: str = ""
    layers: str = ""
    tokens: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return self.tokens.startswith(("DIFFERS", "CRASH"))


def sliding_kinds(config) -> str:
    """
    The attention kinds of the layers of `config`'s static cache ("sliding", "chunked", "full", "linear and sliding"
    for a hybrid layer), or "" when none slides. Raises where no static cache can be made from `config`.
    """
    from transformers import StaticCache

    from prefill_buckets.upstream import transformers_api

    layers = StaticCache(config=config, max_cache_len=64).layers
    sliding = [layer for layer in layers if transformers_api.sliding_window_slots(layer) is not None]
    if not sliding:
        return ""
    if not any(type(layer) is transformers_api.StaticSlidingWindowLayer for layer in sliding):
        return "linear and sliding"  # hybrid layers: not rings (`kvcache/windows.py`)
    text_config = config.get_text_config(decoder=True)
    types = set(getattr(text_config, "layer_types", None) or ())
    kinds = [kind for kind in ("sliding", "chunked", "full") if f"{kind}_attention" in types]
    if not kinds or kinds == ["full"]:  # no layer list: a window or a chunk for every layer
        kinds = ["chunked" if getattr(text_config, "attention_chunk_size", None) else "sliding"]
    return ", ".join(kinds)


def _tiny_config(model_type: str):
    config = arch_sweep.tiny_config(model_type)
    for sub_config in {id(c): c for c in (config, config.get_text_config(decoder=True))}.values():
        if getattr(sub_config, "attention_chunk_size", None):
            sub_config.attention_chunk_size = WINDOW
    return config


def _slides_by_default(model_type: str) -> bool:
    """Whether the default config of `model_type` (whose tiny one can't be built) has sliding or chunked layers."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.for_model(model_type).get_text_config(decoder=True)
    except Exception:
        return False
    types = getattr(config, "layer_types", None) or ()
    return bool(
        getattr(config, "sliding_window", None)
        or getattr(config, "attention_chunk_size", None)
        or any(kind in ("sliding_attention", "chunked_attention") for kind in types)
    )


def _upstream_tokens(model, passes: list, fields: dict) -> list:
    """Upstream's eager tokens for each prompt of each pass, on a copy: the model under test starts fresh."""
    reference = copy.deepcopy(model)  # upstream leaves its static cache's length on the model
    return [[reference.generate(prompt, **fields) for prompt in prompts] for prompts in passes]


def sweep_one(model_type: str, timeout: float = 120.0, every_type: bool = False) -> SlidingRow | None:
    """
    The row of one `model_type`, or `None` when its static cache has no sliding-window or chunked layers (unless
    `every_type`).
    """
    from unittest import mock

    import torch
    from transformers import GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import prefill_buckets
    from prefill_buckets import GraphCounter
    from prefill_buckets.kvcache import ring

    row = SlidingRow(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?"))
    try:
        config = _tiny_config(model_type)
    except Exception as error:
        if not (every_type or _slides_by_default(model_type)):
            return None
        row.tokens = f"no tiny config: {arch_sweep._short(error)}"
        return row
    try:
        row.kinds = sliding_kinds(config) or ("full" if every_type else "")
    except Exception as error:  # no static cache for this config
        if every_type:
            row.kinds = "-"
        elif not _slides_by_default(model_type):
            return None
        else:
            row.tokens = f"no static cache: {arch_sweep._short(error)}"
            return row
    if not row.kinds:
        return None
    try:
        model = arch_sweep.build_tiny_model(model_type, config)
    except Exception as error:
        row.tokens = f"no tiny model: {arch_sweep._short(error)}"
        return row
    torch._dynamo.reset()
    generator = torch.Generator().manual_seed(0)
    passes = [
        [torch.randint(3, arch_sweep.VOCAB, (1, n), generator=generator) for n in lengths]
        for lengths in (PROMPT_LENGTHS, SECOND_PASS_LENGTHS)
    ]
    fields = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    # The reference runs on the cache the bucketed call gets: upstream's own tokens can differ by cache.
    if row.kinds != "-":
        fields["cache_implementation"] = "static"

    def timed_out(error):
        row.tokens = row.tokens or f"timeout ({error})"

    with arch_sweep.timed_row(row, timeout, timed_out):
        try:
            expected = _upstream_tokens(model, passes, fields)
        except arch_sweep.ArchitectureTimeout:
            raise
        except Exception as error:
            if not every_type or "cache_implementation" not in fields:
                row.tokens = f"upstream fails: {arch_sweep._short(error)}"
                return row
            row.kinds, fields = "-", {k: v for k, v in fields.items() if k != "cache_implementation"}
            try:  # upstream's static cache fails on this model: both calls take its default cache
                expected = _upstream_tokens(model, passes, fields)
            except arch_sweep.ArchitectureTimeout:
                raise
            except Exception as error:
                row.tokens = f"upstream fails: {arch_sweep._short(error)}"
                return row
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False)
        config = GenerationConfig(prefill_buckets="pow2", **fields)
        rings = []
        opened = ring.SlidingWindowRing.open

        def recording(layer):
            rings.append(layer)
            opened(layer)

        same, graphs, padded = True, [], {}
        try:
            with mock.patch.object(ring.SlidingWindowRing, "open", recording):
                for prompts, tokens_of_pass in zip(passes, expected):
                    for prompt, tokens in zip(prompts, tokens_of_pass):
                        recorder = arch_sweep._SideRecorder()  # the side each call took, and why
                        with recorder.recording():
                            output = prefill_buckets.generate(model, prompt, generation_config=config)
                        same &= torch.equal(output, tokens)
                        padded[arch_sweep._bucketed_cell(recorder)] = None
                    graphs.append(counter.graphs)
        except arch_sweep.ArchitectureTimeout:
            raise
        except Exception as error:
            row.tokens = f"CRASH: {arch_sweep._short(error)}"
            return row
        row.tokens = "same" if same else "DIFFERS"
        row.padded = ", ".join(padded)
        row.graphs = f"{graphs[0]}" + (f" +{graphs[1] - graphs[0]}" if graphs[1] > graphs[0] else "")
        row.compiled = f"{counter.calls} of {sum(map(len, passes)) * NEW_TOKENS}"
        row.layers = "ring" if rings else "upstream" if row.kinds not in ("full", "-") else "-"
    return row


def markdown_table(rows: list[SlidingRow]) -> str:
    import torch
    import transformers

    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}, `model.compile(dynamic=False)`, "
        f'`prefill_buckets="pow2"`, a {WINDOW}-token window (or chunk), prompts of '
        f"{', '.join(map(str, PROMPT_LENGTHS))} tokens, then of {', '.join(map(str, SECOND_PASS_LENGTHS))}, with "
        f"{NEW_TOKENS} new tokens each:",
        "",
        "| model_type | class | layers | padded | graphs | forwards compiled | sliding layers served by | tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.model_type}` | `{r.model_class}` | {r.kinds} | {r.padded or '-'} | {r.graphs or '-'} | "
            f"{r.compiled or '-'} | {r.layers or '-'} | {r.tokens} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = arch_sweep.sweep_arguments(__doc__.split("\n")[0], argv, every_type=True)

    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.get_logger("prefill_buckets").propagate = False
    torch.set_num_threads(1)
    rows = []
    for model_type in args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        row = sweep_one(model_type, timeout=args.timeout, every_type=args.every_type)
        if row is None:
            continue
        print(
            f"{model_type}: {row.kinds} | {row.padded} | {row.graphs} | {row.compiled} | {row.layers} | {row.tokens} "
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

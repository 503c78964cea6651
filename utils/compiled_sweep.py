"""Every causal-LM architecture, compiled as a user compiles it (`model.compile()`), bucketed against eager upstream.

    python utils/compiled_sweep.py [--only llama gpt2 ...] [--timeout 180] [--write table.md]
        [--fullgraph] [--dynamic-false] [--upstream-compiled]

For each `model_type` of transformers' causal-LM auto mapping, a tiny model (`arch_sweep.build_tiny_model`) runs a
sequence of calls: single prompts of `PROMPT_LENGTHS` tokens (5, 13, 27, 45: four `pow2-quarters` buckets, 8, 14, 28
and 48), one more of 6 tokens (bucket 8 again: it must compile no graph), and the ragged batch of 2 with its mask of
`arch_sweep._prompts`. The reference is upstream `generate`, unpadded and eager, on a fresh copy of the model (greedy,
4 new tokens, a static cache where upstream takes one, else its default cache, as `arch_sweep` decides). The bucketed
calls run on another fresh copy compiled in place, `model.compile(backend=GraphCounter())` (torch's default
`dynamic=None`, `fullgraph=False`; `GraphCounter` wraps the "eager" backend: no code generation, it counts graphs and
compiled calls), through `prefill_buckets.generate(..., prefill_buckets="pow2-quarters")` with the same options in the
same order; dynamo is reset between types. Each row's cell is:

- `ok (G graphs, C compiled calls)`: every call's tokens as the reference's, its logits within
  `arch_sweep.LOGITS_TOLERANCE`;
- `DIFFERS (...)` / `CRASH: <error>`: other tokens or logits, or a raise where the reference ran (a bug, unless the
  same compile of upstream's unpadded call fails alike: `--upstream-compiled`);
- `WARN: <message>`: the package warned that torch may have run forwards eagerly, or of torch's recompile limits;
- `NEW GRAPH`: the call at an already-used bucket compiled a graph (also flagged beside another cell; not with
  `--upstream-compiled`, whose calls have no buckets);
- `upstream fails: <error>`: the eager reference raises (nothing to compare); `no tiny config: <why>`.

The notes column lists the graphs each call compiled, the side each call took (`arch_sweep._bucketed_cell`), the
package's other warnings and torch's recompile-limit refusals. `--fullgraph` and `--dynamic-false` compile with
`fullgraph=True` / `dynamic=False` instead; `--upstream-compiled` runs plain `model.generate` (unpadded) on the compiled
copy in place of the bucketed call: whether a failure is upstream's own.
"""

import argparse
import contextlib
import copy
import logging as std_logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))

import arch_sweep  # noqa: E402  (beside this script)


POLICY = "pow2-quarters"
PROMPT_LENGTHS = (5, 13, 27, 45, 6)  # buckets 8, 14, 28, 48, then 8 again
REPEATED = 4  # the index of the call whose bucket an earlier call used: it must compile nothing
NEW_TOKENS = 4
# What the package says when torch may have run forwards eagerly, or of its recompile limits.
EAGER_WARNINGS = ("eagerly", "recompile_limit")
KINDS = ("ok", "DIFFERS", "CRASH", "WARN", "NEW GRAPH", "upstream fails", "no tiny config", "timeout")


@dataclass
class Row:
    model_type: str
    cache: str = ""  # "static", or "dynamic" where upstream takes no static cache
    cell: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def kind(self) -> str:
        return next((kind for kind in KINDS if self.cell.startswith(kind)), "?")


class _TorchLog(std_logging.Handler):
    """Records dynamo's warnings (a recompile limit hit, a frame skipped)."""

    def __init__(self):
        super().__init__(std_logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def torch_log():
    handler = _TorchLog()
    logger = std_logging.getLogger("torch._dynamo")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def _clip(text: str, limit: int = 100) -> str:
    text = text.replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def calls():
    """The sequence of `(label, input_ids, attention_mask)` each model runs, in order."""
    import torch

    generator = torch.Generator().manual_seed(1)
    sequence = []
    for length in PROMPT_LENGTHS:
        ids = torch.randint(3, arch_sweep.VOCAB, (1, length), generator=generator)
        sequence.append((f"{length} tokens", ids, torch.ones_like(ids)))
    batch, mask = arch_sweep._prompts()["batch_of_2"]
    sequence.append((f"batch of 2, {batch.shape[1]} tokens", batch, mask))
    return sequence


def _options(cache_implementation, mask) -> dict:
    options = {
        "attention_mask": mask,
        "max_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "pad_token_id": 0,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    if cache_implementation is not None:
        options["cache_implementation"] = cache_implementation
    return options


def reference(pristine, sequence):
    """`(cache, outputs)`: upstream's eager unpadded outputs, with a static cache where it takes one (else `None`)."""
    error = None
    for cache_implementation in ("static", None):
        model = copy.deepcopy(pristine)
        try:
            return cache_implementation, [
                model.generate(ids, **_options(cache_implementation, mask)) for _, ids, mask in sequence
            ]
        except arch_sweep.ArchitectureTimeout:
            raise
        except Exception as caught:  # this cache, or the model, fails upstream
            error = caught
    raise error


def compare(actual, expected) -> str | None:
    """Why `actual` is not `expected` (tokens, then logits), or `None`."""
    import torch

    ours, theirs = actual.sequences, expected.sequences
    if ours.shape != theirs.shape or not torch.equal(ours, theirs):
        return "tokens"
    differs = arch_sweep.logits_difference(actual.logits, expected.logits)
    if differs is not None:
        return f"logits by {differs[1]:.1e} at step {differs[0]}"
    return None


def sweep_one(model_type: str, timeout: float, args) -> Row:
    """The row of one `model_type` (see the module docstring)."""
    import torch

    import prefill_buckets
    from prefill_buckets.upstream import torch_api

    row = Row(model_type)

    def timed_out(error):
        row.cell = row.cell or f"timeout ({error})"

    torch._dynamo.reset()
    with arch_sweep.timed_row(row, timeout, timed_out):
        try:
            pristine = arch_sweep.build_tiny_model(model_type)
        except arch_sweep.ArchitectureTimeout:
            raise
        except Exception as error:
            row.cell = f"no tiny config: {arch_sweep._short(error)}"
            return row
        sequence = calls()
        try:
            cache_implementation, expected = reference(pristine, sequence)
        except arch_sweep.ArchitectureTimeout:
            raise
        except Exception as error:
            row.cell = f"upstream fails: {arch_sweep._short(error)}"
            return row
        row.cache = cache_implementation or "dynamic"

        model = copy.deepcopy(pristine)
        counter = prefill_buckets.GraphCounter()
        model.compile(backend=counter, fullgraph=args.fullgraph, **({"dynamic": False} if args.dynamic_false else {}))
        refused_before = torch_api.limit_refusals()
        per_call, sides, warned, differs, new_graph, crash = [], [], [], [], False, None
        with torch_log() as dynamo_log:
            for index, ((label, ids, mask), theirs) in enumerate(zip(sequence, expected)):
                graphs = counter.graphs
                recorder = arch_sweep._SideRecorder()
                try:
                    with recorder.recording():
                        options = _options(cache_implementation, mask)
                        if args.upstream_compiled:
                            ours = model.generate(ids, **options)
                        else:
                            ours = prefill_buckets.generate(model, ids, prefill_buckets=POLICY, **options)
                except arch_sweep.ArchitectureTimeout:
                    raise
                except Exception as error:
                    crash = f"CRASH: {label}: {arch_sweep._short(error, 90)}"
                    break
                finally:
                    per_call.append(counter.graphs - graphs)
                    warned += [m for m in recorder.logs if any(word in m for word in EAGER_WARNINGS)]
                    row.notes += [
                        f"{label}: {_clip(m)}"
                        for m in recorder.logs
                        if not any(word in m for word in EAGER_WARNINGS) and "are ignored for this call" not in m
                    ]
                if not args.upstream_compiled:
                    sides.append(arch_sweep._bucketed_cell(recorder))
                if index == REPEATED and counter.graphs > graphs and not args.upstream_compiled:
                    new_graph = True
                why = compare(ours, theirs)
                if why is not None:
                    differs.append(f"{label}: {why}")
        refused = torch_api.limit_refusals() - refused_before
        totals = f"{counter.graphs} graphs, {counter.calls} compiled calls"
        flag = "; NEW GRAPH" if new_graph else ""
        if crash is not None:
            row.cell = crash + flag
        elif differs:
            row.cell = f"DIFFERS ({'; '.join(differs)}; {totals}){flag}"
        elif warned:
            row.cell = f"WARN: {warned[0][:80].replace('|', '/')} ({totals}){flag}"
        elif new_graph:
            row.cell = f"NEW GRAPH ({totals})"
        else:
            row.cell = f"ok ({totals})"
        row.notes.insert(0, "graphs per call " + "/".join(map(str, per_call)))
        if sides:
            row.notes.insert(1, "sides " + "/".join(sides))
        if refused:
            row.notes.append(f"torch refused {refused} compiles at its recompile limit")
        row.notes += [f"torch: {_clip(m)}" for m in dynamo_log.messages[:2]]
    torch._dynamo.reset()
    return row


def markdown_table(rows: list[Row], args) -> str:
    import torch
    import transformers

    compiled = f"fullgraph={args.fullgraph}, dynamic={'False' if args.dynamic_false else 'None'}"
    call = "plain `model.generate` (unpadded)" if args.upstream_compiled else f'`prefill_buckets="{POLICY}"`'
    lines = [
        f"transformers {transformers.__version__}, torch {torch.__version__}, `model.compile(backend=GraphCounter(), "
        f"{compiled})`, {call}; prompts of {', '.join(map(str, PROMPT_LENGTHS))} tokens and a ragged batch of 2, "
        f"{NEW_TOKENS} greedy new tokens, against eager unpadded upstream:",
        "",
        "| model_type | cache | cell | notes | seconds |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        notes = "; ".join(row.notes).replace("|", "/")
        lines.append(f"| `{row.model_type}` | {row.cache or '-'} | {row.cell} | {notes} | {row.seconds:.0f} |")
    return "\n".join(lines) + "\n"


def summary(rows: list[Row]) -> str:
    counts = {}
    for row in rows:
        counts[row.kind] = counts.get(row.kind, 0) + 1
    new_graph = sum("NEW GRAPH" in row.cell for row in rows)
    return (
        f"{len(rows)} model types; cells: "
        + ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
        + f"; NEW GRAPH flagged on {new_graph}"
    )


def main(argv=None) -> int:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True")
    extra.add_argument("--dynamic-false", action="store_true", help="compile with dynamic=False")
    extra.add_argument("--upstream-compiled", action="store_true", help="plain model.generate on the compiled copy")
    options, rest = extra.parse_known_args(argv)
    args = arch_sweep.sweep_arguments(__doc__.split("\n")[0], rest)
    for name, value in vars(options).items():
        setattr(args, name, value)

    import warnings

    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    warnings.filterwarnings("ignore")
    logging.set_verbosity_error()  # upstream's own advice, once per architecture, would bury the table
    std_logging.getLogger("prefill_buckets").setLevel(std_logging.WARNING)
    std_logging.getLogger("prefill_buckets").propagate = False  # the table says what it logged
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model_types = args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows, start = [], time.perf_counter()
    for model_type in model_types:
        row = sweep_one(model_type, args.timeout, args)
        print(f"{model_type}: {row.cache or '-'} | {row.cell} | {'; '.join(row.notes)} ({row.seconds:.1f} s)",
              file=sys.stderr, flush=True)  # fmt: skip
        rows.append(row)
        if args.write:  # as it goes: a long sweep stopped early keeps its rows
            with open(args.write, "w", encoding="utf-8") as file:
                file.write(markdown_table(rows, args) + "\n" + summary(rows) + "\n")
    table = markdown_table(rows, args)
    print(table)
    print(summary(rows) + f"; {time.perf_counter() - start:.0f} s")
    return 1 if any(row.kind in ("DIFFERS", "CRASH", "WARN", "NEW GRAPH") for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

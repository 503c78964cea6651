"""Every causal-LM architecture transformers ships, bucketed against upstream: one table row per `model_type`.

    python utils/arch_sweep.py [--only llama gpt2 ...] [--timeout 60] [--write table.md] [--large]

For each `model_type` of transformers' causal-LM auto mapping (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), a tiny model is
built from its default config, shrunk (`tiny_config`: 2 layers, hidden 32, 4 heads, vocab 128, at most 512
positions, every layer kind of a hybrid kept). On one prompt, on a ragged batch of 2 (the second row left-padded by
the user) with its mask, and on the same batch without a mask (inferred from the pad tokens, as upstream infers it),
upstream `generate` (greedy, a few new tokens, a static cache where upstream takes one, else its default cache) is
compared with `prefill_buckets.generate(..., prefill_buckets="pow2")`, tokens and each step's logits. Eager, no
compile. The bucketed call runs on a fresh copy of the model, as a user's first call does: no cache of upstream's to
reuse, so the package sizes it (for most models past the shortest window, 256 slots, which full-attention layers
then read). A tiny random model often repeats one token whatever it attends to, so equal tokens alone would hide a wrong
mask or window: the logits show it. A multi-head latent attention config also gets a second row, `TYPE (fewer kv
heads)`, with the generic shrink's key/value heads (2 of 4): upstream then runs only without a mask (`VARIANTS`).
Each cell is:

- `right` / `left`: bucketed on that side, the same tokens and logits as upstream;
- `unpadded: <reason>`: the package ran upstream's unpadded call and said why (exact by construction);
- `DIFFERS` / `CRASH: <error>`: the bucketed call returned other tokens or logits (`DIFFERS (logits by X at step N;
  side)`), or raised where upstream ran (a bug);
- `upstream fails: <error>`: upstream `generate` itself raises on this tiny model (nothing to compare);
- `no tiny config: <why>`: no small model could be built from the default config.

The target: no `DIFFERS` or `CRASH` cell. `tests/generation/test_arch_sweep.py` runs a fixed sample in CI, and all of
it with `RUN_SLOW=1`. The guide's "Architectures" section publishes the table.
"""

import argparse
import contextlib
import copy
import logging as std_logging
import re
import signal
import sys
import time
from dataclasses import dataclass


# Config attributes shrunk to a tiny model's size, by name, wherever a config (or a sub-config) has them.
TINY_SIZES = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"), 2),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "embed_dim", "dim", "word_embed_proj_dim"), 32),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "num_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_kv_heads"), 2),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff", "d_inner"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 16),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim"), 8),
    **dict.fromkeys(("rotary_dim", "rotary_emb_dim"), 4),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("vocab_size", "n_vocab"), 128),
    **dict.fromkeys(("sliding_window", "attention_window_size"), 16),
    **dict.fromkeys(("n_group", "topk_group", "n_shared_experts", "num_shared_experts", "n_groups"), 1),
    **dict.fromkeys(("mamba_n_groups",), 1),
}
# At most this many positions (a learned position table of a few hundred rows; also the pad positions' ceiling).
MAX_POSITIONS = 512
POSITION_FIELDS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length")
SPECIAL_TOKENS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
LAYER_LISTS = ("layer_types", "block_types", "layers_block_type", "hybrid_override_pattern")
# What the generic shrinking above can't derive, by `model_type`.
MODEL_OVERRIDES = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "num_layers": 2},
    "bamba": {"attn_layer_indices": [1]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
}
# Rows besides the default shrink, for the model types whose config they apply to: name -> (applies to the default
# config's values, what the variant changes in the shrunk kwargs). Multi-head latent attention builds one key head per
# query head: the default row states as many key/value heads (upstream then runs with a static cache and a mask); this
# one keeps the generic shrink's fewer heads, as a shrunken default config does (upstream runs only without a mask).
VARIANTS = {
    "fewer kv heads": (
        lambda values: "kv_lora_rank" in values and "num_key_value_heads" in values,
        lambda kwargs: {**kwargs, "num_key_value_heads": TINY_SIZES["num_key_value_heads"]},
    ),
}
MAX_PARAMETERS = 20_000_000  # a shrunk config still bigger than this is not tiny: its row says so
VOCAB = 128
NEW_TOKENS = 4
PROMPT_LENGTH = 11  # pow2: bucket 16
RAGGED_PAD = 4  # the batch's second row is left-padded by the user with this many masked pads
# Each step's logits may differ from upstream's by float rounding (another sequence length, another reduction order):
# at most this much, relative to the largest logit (or 1).
LOGITS_TOLERANCE = 1e-4


@dataclass
class Row:
    model_type: str
    model_class: str
    cache: str = ""  # "static", or "dynamic" where upstream takes no static cache
    one_prompt: str = ""
    batch_of_2: str = ""
    batch_no_mask: str = ""
    seconds: float = 0.0

    @property
    def cells(self) -> tuple[str, str, str]:
        return self.one_prompt, self.batch_of_2, self.batch_no_mask

    @property
    def failed(self) -> bool:
        """Whether the bucketed call crashed or differed where upstream ran."""
        return any(cell.startswith(("DIFFERS", "CRASH")) for cell in self.cells)


class ArchitectureTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raises `ArchitectureTimeout` in the main thread after `seconds` (no limit off the main thread)."""
    import threading

    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise ArchitectureTimeout(f"over {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def timed_row(row, timeout: float, on_timeout):
    """
    Runs one row's sweep without gradients and within `timeout` seconds: a timeout calls `on_timeout(error)`, and
    `row.seconds` says how long it took either way.
    """
    import torch

    start = time.perf_counter()
    try:
        with time_limit(timeout), torch.no_grad():
            yield
    except ArchitectureTimeout as error:
        on_timeout(error)
    finally:
        row.seconds = time.perf_counter() - start


def _short(error: BaseException, limit: int = 70) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _tiny_layer_list(kinds: list) -> list:
    """Each layer kind of a layer list once, in order of first appearance (a hybrid keeps all its kinds)."""
    seen = []
    for kind in kinds:
        if kind not in seen:
            seen.append(kind)
    return seen


def _tiny_kwargs(config) -> dict:
    """The keyword arguments that shrink `config` (a `PretrainedConfig`), its sub-configs included."""
    values = config.to_dict()
    kwargs = {}
    for name, size in TINY_SIZES.items():
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            if name in ("num_key_value_heads", "num_kv_heads", "n_kv_heads") and value == 1:
                size = 1  # multi-query stays multi-query
            kwargs[name] = min(value, size) if name not in ("num_experts_per_tok", "moe_topk", "top_k") else size
    for name, size in (("head_dim", 8), ("num_key_value_heads", 4)):  # unset by default, and read as ints
        if name in values and values[name] is None:
            kwargs[name] = size
    if "kv_lora_rank" in values:  # multi-head latent attention: its head_dim is the rotary part of each head
        kwargs.pop("head_dim", None)
    for name in POSITION_FIELDS:
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_POSITIONS:
            kwargs[name] = MAX_POSITIONS
    for name in LAYER_LISTS:
        kinds = values.get(name)
        if isinstance(kinds, (list, tuple)) and len(kinds) > 0:
            kwargs[name] = _tiny_layer_list(list(kinds))
            for layers in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
                if layers in kwargs:
                    kwargs[layers] = len(kwargs[name])
        elif isinstance(kinds, str) and kinds:  # a pattern string, one character a layer (Nemotron-H)
            kwargs[name] = "".join(_tiny_layer_list(list(kinds)))
            for layers in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
                if layers in kwargs:
                    kwargs[layers] = len(kwargs[name])
    for name, token in SPECIAL_TOKENS.items():
        if name in values:
            kwargs[name] = token
    experts = [kwargs[name] for name in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
               if name in kwargs]  # fmt: skip
    for name in ("num_experts_per_tok", "moe_topk", "top_k"):
        if name in kwargs and not experts:
            kwargs.pop(name)
    if "kv_lora_rank" in values and "num_key_value_heads" in kwargs:  # multi-head latent attention: one kv per head
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", values["num_key_value_heads"])
    for expand in ("expand", "mamba_expand"):  # Mamba-2 heads tile the expanded hidden size
        heads, head_dim = {"expand": ("num_heads", "head_dim"), "mamba_expand": ("mamba_n_heads", "mamba_d_head")}[
            expand
        ]
        if isinstance(values.get(expand), int) and heads in values and head_dim in values:
            kwargs[heads] = 4
            kwargs[head_dim] = kwargs.get("hidden_size", 32) * values[expand] // 4
            if isinstance(values.get("mamba_d_ssm"), int):  # Falcon-H1 states the expanded size itself
                kwargs["mamba_d_ssm"] = kwargs.get("hidden_size", 32) * values[expand]
    kwargs.update(MODEL_OVERRIDES.get(config.model_type, {}))
    for name in getattr(config, "sub_configs", {}) or {}:
        sub_config = getattr(config, name, None)
        if sub_config is not None and hasattr(sub_config, "to_dict"):
            kwargs[name] = {**sub_config.to_dict(), **_tiny_kwargs(sub_config)}
    return kwargs


def variants_of(model_type: str) -> list[str]:
    """The `VARIANTS` that apply to `model_type`'s default config (none when it can't be built)."""
    from transformers import AutoConfig

    try:
        values = AutoConfig.for_model(model_type).to_dict()
    except Exception:
        return []
    return [name for name, (applies, _) in VARIANTS.items() if applies(values)]


def tiny_config(model_type: str, variant: str | None = None):
    """The default config of `model_type`, shrunk to a tiny model (see `TINY_SIZES`), in `variant` (see `VARIANTS`)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type)
    kwargs = _tiny_kwargs(default)
    if variant is not None:
        kwargs = VARIANTS[variant][1](kwargs)
    config = AutoConfig.for_model(model_type, **kwargs)
    for name, token in SPECIAL_TOKENS.items():  # on the text config too, where generate reads them
        setattr(config, name, token)
    config._attn_implementation = None
    return config


def _model_class(model_type: str):
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def build_tiny_model(model_type: str, config=None):
    """
    A tiny random model of `model_type` (of `config`, default `tiny_config(model_type)`) in eval mode, fp32, on CPU.
    Raises `ValueError` when none is tiny.
    """
    import torch

    model_class = _model_class(model_type)
    config = tiny_config(model_type) if config is None else config
    with torch.device("meta"):
        parameters = sum(p.numel() for p in model_class(config).parameters())
    if parameters > MAX_PARAMETERS:
        raise ValueError(f"{parameters / 1e6:.0f}M parameters after shrinking")
    torch.manual_seed(0)
    return model_class(config).eval()


def _prompts():
    import torch

    generator = torch.Generator().manual_seed(0)
    one = torch.randint(3, VOCAB, (1, PROMPT_LENGTH), generator=generator)
    batch = torch.randint(3, VOCAB, (2, PROMPT_LENGTH), generator=generator)
    mask = torch.ones_like(batch)
    batch[1, :RAGGED_PAD], mask[1, :RAGGED_PAD] = 0, 0
    return {"one_prompt": (one, torch.ones_like(one)), "batch_of_2": (batch, mask), "batch_no_mask": (batch, None)}


class _SideRecorder:
    """Records what `padding_side.choose_side` decided, and the package's 'ignored for this call' reason."""

    def __init__(self):
        self.sides = []
        self.logs = []

    @contextlib.contextmanager
    def recording(self):
        from unittest import mock

        from transformers.utils import logging

        import prefill_buckets.call.generation as generation

        original = generation.choose_side

        def choose_side(*args, **kwargs):
            side = original(*args, **kwargs)
            self.sides.append(side)
            return side

        package_logger = logging.get_logger("prefill_buckets")
        recorder = self

        class Handler(std_logging.Handler):
            def emit(self, record):
                recorder.logs.append(record.getMessage())

        handler = Handler()
        package_logger.addHandler(handler)
        std_logging.Logger.warning_once.cache_clear()  # each call says its reasons again
        try:
            with mock.patch.object(generation, "choose_side", choose_side):
                yield self
        finally:
            package_logger.removeHandler(handler)


_UNPADDED = re.compile(r"are ignored for this call: (.*)", re.S)
# The package's reasons for an unpadded call, as the table's short labels (the first that matches; else the reason).
SHORT_REASONS = (
    ("is_decoder=False", "bidirectional attention"),
    ("counts positions from the cache", "positions from the cache length"),
    ("does not pass the attention mask on", "its step drops the mask"),
    ("made no static cache", "no cache object to pad"),
    ("takes no `attention_mask`", "no attention mask"),
    ("only recurrent", "recurrent cache"),
    ("which counts none", "a cache that counts no tokens"),
    ("compresses the cached tokens", "compressed attention"),
    ("ignores the attention mask", "the mask is ignored"),
    ("builds a dynamic mask from the keys", "a mask built from the keys"),
    ("adds the cache length to the positions", "positions plus the cache length"),
    ("repeats its keys", "keys repeated past the query heads"),
    ("place their window of", "a local window from the cache's end"),
)


def short_reason(reason: str) -> str:
    label = next((label for key, label in SHORT_REASONS if key in reason), None)
    if label is None:
        reason = reason.split(". ")[0].rstrip(".")
        label = reason if len(reason) <= 80 else reason[:79] + "…"
    return label.replace("|", "/")


def _bucketed_cell(recorder: _SideRecorder) -> str:
    for message in recorder.logs:
        found = _UNPADDED.search(message)
        if found:
            return "unpadded: " + short_reason(found.group(1))
        if "made no static cache" in message:
            return "unpadded: " + short_reason(message)
    if not recorder.sides:
        return "unpadded"
    return recorder.sides[-1].side


def compare(model, input_ids, attention_mask, cache_implementation, fresh=None) -> tuple[str, str]:
    """
    `(upstream's outcome or "", the cell)`: one bucketed call against upstream on the same inputs; the bucketed call
    on `fresh`, a copy of `model` that has run nothing (`model` itself when `None`).
    """
    import torch

    import prefill_buckets

    kwargs = {
        "max_new_tokens": NEW_TOKENS,
        "do_sample": False,
        "cache_implementation": cache_implementation,
        "pad_token_id": 0,
        "output_logits": True,
        "return_dict_in_generate": True,
    }
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    expected = model.generate(input_ids, **kwargs)
    recorder = _SideRecorder()
    try:
        with recorder.recording():
            actual = prefill_buckets.generate(
                model if fresh is None else fresh, input_ids, prefill_buckets="pow2", **kwargs
            )
    except ArchitectureTimeout:
        raise
    except Exception as error:
        return "", f"CRASH: {_short(error)}"
    cell = _bucketed_cell(recorder)
    ours, theirs = actual.sequences, expected.sequences
    if ours.shape != theirs.shape or not torch.equal(ours, theirs):
        return "", f"DIFFERS ({cell})"
    differs = logits_difference(actual.logits, expected.logits)
    if differs is not None:
        return "", f"DIFFERS (logits by {differs[1]:.1e} at step {differs[0]}; {cell})"
    return "", cell


def logits_difference(ours, theirs) -> tuple[int, float] | None:
    """`(step, largest difference)` of the first step whose logits differ past `LOGITS_TOLERANCE`, or `None`."""
    for step, (a, b) in enumerate(zip(ours, theirs)):
        difference = (a.float() - b.float()).abs().nan_to_num(0.0).max().item()
        scale = max(1.0, b.float().abs().nan_to_num(0.0).max().item())
        if difference > LOGITS_TOLERANCE * scale:
            return step, difference
    return None


def sweep_one(model_type: str, timeout: float = 120.0, variant: str | None = None) -> Row:
    """The row of one `model_type` (in `variant`, see `VARIANTS`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    label = model_type if variant is None else f"{model_type} ({variant})"
    row = Row(label, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "?"))

    def timed_out(error):
        for name in ("one_prompt", "batch_of_2", "batch_no_mask"):
            if not getattr(row, name):
                setattr(row, name, f"timeout ({error})")

    with timed_row(row, timeout, timed_out):
        try:
            model = build_tiny_model(model_type, tiny_config(model_type, variant))
        except ArchitectureTimeout:
            raise
        except Exception as error:
            row.one_prompt = row.batch_of_2 = row.batch_no_mask = f"no tiny config: {_short(error)}"
            return row
        pristine = copy.deepcopy(model)  # each bucketed call runs on a copy of it: a first call
        for name, (input_ids, attention_mask) in _prompts().items():
            cell = None
            for cache_implementation in ("static", None):
                if row.cache == "dynamic" and cache_implementation == "static":
                    continue
                try:
                    _, cell = compare(model, input_ids, attention_mask, cache_implementation, copy.deepcopy(pristine))
                except ArchitectureTimeout:
                    raise
                except Exception as error:  # upstream raised
                    cell = f"upstream fails: {_short(error)}"
                    continue
                row.cache = row.cache or ("static" if cache_implementation else "dynamic")
                break
            setattr(row, name, cell)
    return row


def markdown_table(rows: list[Row]) -> str:
    import transformers

    lines = [
        f'transformers {transformers.__version__}, `prefill_buckets="pow2"`, a {PROMPT_LENGTH}-token prompt and a '
        f"batch of 2 (one row left-padded by {RAGGED_PAD}), with its mask and without, {NEW_TOKENS} greedy new tokens, "
        "tokens and logits:",
        "",
        "| model_type | class | cache | one prompt | batch of 2 | batch, no mask |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| `{row.model_type}` | `{row.model_class}` | {row.cache or '-'} | {row.one_prompt} | "
                     f"{row.batch_of_2} | {row.batch_no_mask} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def summary(rows: list[Row]) -> str:
    upstream_runs = [r for r in rows if r.cache]
    counts = {}
    for row in upstream_runs:
        for cell in row.cells:
            kind = cell.split(":")[0].split(" ")[0]
            counts[kind] = counts.get(kind, 0) + 1
    types = {row.model_type.split(" (")[0] for row in rows}
    return (
        f"{len(types)} model types in {len(rows)} rows, upstream runs on {len(upstream_runs)} rows; cells: "
        + ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
        + f"; rows where the bucketed call crashed or differed: {sum(r.failed for r in rows)}"
    )


# `--large`: the sizes of a shrunken default config one step up (issue 36's sweep): hidden 64, heads of 16, a 21-token
# prompt (pow2: bucket 32) and a batch row left-padded by 5.
LARGE_SIZES = {
    ("hidden_size", "n_embd", "d_model", "embed_dim", "dim", "word_embed_proj_dim"): 64,
    ("head_dim", "kv_channels", "attention_head_dim"): 16,
    ("intermediate_size", "ffn_dim", "decoder_ffn_dim", "n_inner", "d_ff", "d_inner"): 128,
    ("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"): 32,
}


def use_large_sizes() -> None:
    """Sweeps the `LARGE_SIZES` models and prompts from now on (this process)."""
    global PROMPT_LENGTH, RAGGED_PAD
    for names, size in LARGE_SIZES.items():
        TINY_SIZES.update(dict.fromkeys(names, size))
    PROMPT_LENGTH, RAGGED_PAD = 21, 5


def sweep_arguments(description: str, argv=None, large: bool = False, every_type: bool = False) -> argparse.Namespace:
    """
    A sweep's command line: `--only` some model types, `--timeout` per architecture, `--write` the table, with `large`,
    `--large` (`LARGE_SIZES`), and with `every_type`, `--every-type` (`sliding_sweep.py`: every type, not only those
    with sliding layers).
    """
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--only", nargs="+", help="model types to run (default: all of the causal-LM mapping)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per architecture")
    parser.add_argument("--write", help="also write the markdown table to this file")
    if large:
        parser.add_argument("--large", action="store_true", help="hidden 64, a 21-token prompt (`LARGE_SIZES`)")
    if every_type:
        parser.add_argument("--every-type", action="store_true", help="also the types without sliding layers")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = sweep_arguments(__doc__.split("\n")[0], argv, large=True)

    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from transformers.utils import logging

    logging.set_verbosity_error()  # upstream's own advice, once per architecture, would bury the table
    logging.get_logger("prefill_buckets").propagate = False  # the table says what it logged
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.large:
        use_large_sizes()
    model_types = args.only or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    rows = []
    for model_type in model_types:
        for variant in (None, *variants_of(model_type)):
            row = sweep_one(model_type, timeout=args.timeout, variant=variant)
            print(f"{row.model_type}: {row.cache or '-'} | {' | '.join(row.cells)} ({row.seconds:.1f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
            rows.append(row)
    table = markdown_table(rows)
    print(table)
    print(summary(rows))
    if args.write:
        with open(args.write, "w", encoding="utf-8") as file:
            file.write(table + "\n" + summary(rows) + "\n")
    return 1 if any(r.failed for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

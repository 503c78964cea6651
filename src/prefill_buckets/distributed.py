"""Tensor parallelism: the ranks of a sharded model must run `generate` on the same inputs and settings, agree before
any of them raises, and keep their own compile caches (see the usage reference's "Several devices").

Ranks that pass different calls break or hang the collectives, or all return the same wrong tokens; a bad input on
one rank raises there while its peers wait. `ranks_agree` turns all of these into one clear error, the same on every
rank, for one all-gather at the start of each bucketed call.
"""

import contextlib
import json
import os

import torch
import torch.distributed as dist

from .upstream.transformers_api import cache_seq_length, tensor_parallel_group


_RANK_FIELD = "{rank}"
# Raised on every rank as the type a check raised on one, when it is one of these; otherwise as a `RuntimeError`.
_SHARED_ERRORS = {
    error.__name__: error for error in (ValueError, TypeError, IndexError, KeyError, NotImplementedError)
}
# Arguments of `generate` that `generate_call` doesn't compare: the config (compared field by field), and a streamer,
# which only sees the tokens (rank 0 alone often prints them).
_NOT_COMPARED = ("generation_config", "streamer")
# Advice at the end of every "different calls" error.
_SAME_CALL_ADVICE = (
    "Every rank holds a shard of the weights and all-reduces its partial results, so every rank must get the same "
    "call: send each request to all ranks of the group (for example, read it on rank 0 and "
    "`torch.distributed.broadcast_object_list` it). Different buckets or settings break or hang the collectives; "
    "different prompts in one bucket give every rank the same wrong tokens."
)


@contextlib.contextmanager
def ranks_agree(model, inputs: dict, settings: dict):
    r"""
    Runs the checks of a call (the body of the `with`) so that the tensor-parallel ranks of `model` agree before any
    raises: at the end of the block the ranks all-gather their `inputs`, `settings` and errors. If a rank raised, every
    rank raises the first rank's error; else if the calls differ, every rank raises the same `ValueError`, naming what
    differs. Does nothing more when `model` is not tensor-parallel. Every rank must enter it at the same point.

    Args:
        model ([`PreTrainedModel`]):
            The model `generate` runs, or its `torch.compile(model)` wrapper.
        inputs (`dict`):
            The tensor inputs of the call by name (`None` for an absent one): their shapes and the bits of their values
            are compared.
        settings (`dict`):
            The other values that shape the call by name (the generation config's fields, `max_new_tokens`, ...):
            compared by their JSON form, objects by their type.
    """
    group = tensor_parallel_group(model)
    if group is None:
        yield
        return
    error = None
    try:
        summary = _summarize_call(inputs, settings)
    except Exception as raised:  # the ranks must still meet in the all-gather
        summary, error = {"inputs": {}, "settings": {}}, raised
    try:
        yield
    except Exception as raised:
        error = error or raised
    _agree(group, summary, error)  # raises on every rank when any rank raised


def generate_call(model, arguments: dict, model_kwargs: dict, field_kwargs: dict) -> tuple[dict, dict]:
    """
    The `inputs` and `settings` of a `generate` call for `ranks_agree`: every tensor argument (the prompt as
    `input_ids`), and everything else that shapes the call (the generation config, the model's when none is passed).
    """
    inputs = {"input_ids": None, "inputs_embeds": None, "attention_mask": None}
    config = arguments.get("generation_config")
    settings = {"generation_config": config if config is not None else getattr(model, "generation_config", None)}
    for name, value in {**arguments, **model_kwargs, **field_kwargs}.items():
        if name in _NOT_COMPARED:
            continue
        name = "input_ids" if name == "inputs" else name
        if isinstance(value, torch.Tensor):
            inputs[name] = value
        elif value is not None:
            settings[name] = value
    return inputs, settings


def check_same_inputs_across_ranks(model, **inputs: torch.Tensor | None) -> None:
    r"""
    Raises the same `ValueError` on every tensor-parallel rank of `model` when the ranks were not given the same
    `inputs`; does nothing when `model` is not tensor-parallel (see `transformers_api.tensor_parallel_group`).

    Every rank must call it at the same point, with the same input names: one all-gather of each input's shape and a
    fingerprint of its values' bits. A bucketed `generate` runs this check itself, with its settings (`ranks_agree`).

    Args:
        model ([`PreTrainedModel`]):
            The model `generate` runs, or its `torch.compile(model)` wrapper.
        inputs (`torch.Tensor` or `None`):
            The inputs of the call, by name (for example `input_ids=..., attention_mask=...`): as passed to
            `generate`, or as padded (equal inputs pad equally). `None` counts as an absent input, which must be absent
            on every rank.

    Example:

    ```python
    >>> check_same_inputs_across_ranks(model, input_ids=padded_ids, attention_mask=padded_mask)  # under torchrun
    ```
    """
    with ranks_agree(model, inputs, {}):
        pass


def _summarize_call(inputs: dict, settings: dict) -> dict:
    """What a rank sends of its call: per input `[shape, fingerprint]` (`None` when absent), per setting its JSON."""
    return {
        "inputs": {name: _summarize_tensor(value) for name, value in sorted(inputs.items())},
        "settings": {name: _setting_text(value) for name, value in sorted(settings.items())},
    }


def _summarize_tensor(tensor) -> list | None:
    """`[shape, dtype, fingerprint]` of a tensor: the fingerprint is a position-weighted sum of its values' bits."""
    if tensor is None:
        return None
    if not isinstance(tensor, torch.Tensor):
        return [None, type(tensor).__name__, None]
    flat = tensor.detach().reshape(-1)  # [numel]
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    if flat.is_floating_point():  # its bits, as integers of its width: -0.0 is not 0.0, a NaN equals its copy
        flat = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    values = flat.to(torch.long)
    weights = torch.arange(1, values.numel() + 1, device=values.device, dtype=torch.long)
    fingerprint = int((values * weights).sum())  # wraps around on overflow, the same way on every rank
    return [list(tensor.shape), str(tensor.dtype), fingerprint]


def _setting_text(value) -> str:
    """A setting's JSON form, the same on every rank for the same value (an object is named by its type)."""
    if hasattr(value, "get_seq_length"):  # a cache: its type and how many tokens it holds
        try:
            held = cache_seq_length(value)
        except Exception:  # a cache that can't tell: its type alone
            held = "?"
        return f"{type(value).__name__} holding {held} tokens"
    if hasattr(value, "to_dict") and not isinstance(value, torch.Tensor):  # a `GenerationConfig`, a `CompileConfig`
        value = value.to_dict()
        value.pop("transformers_version", None)
    return json.dumps(value, sort_keys=True, default=lambda obj: f"<{type(obj).__qualname__}>")


def _agree(group, summary: dict, error: Exception | None) -> None:
    """The all-gather of every rank's summary and error, and the error every rank raises when they don't agree."""
    mine = {**summary, "error": None if error is None else [type(error).__name__, str(error)]}
    gathered = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    failed = [(rank, record["error"]) for rank, record in enumerate(gathered) if record["error"] is not None]
    if failed:
        name, message = failed[0][1]
        same = [rank for rank, error_ in failed if error_ == [name, message]]
        by = f"rank {same[0]}" if len(same) == 1 else f"ranks {', '.join(map(str, same))}"
        others = "".join(f"\n  rank {rank}: {': '.join(error_)}" for rank, error_ in failed if rank not in same)
        shared = _SHARED_ERRORS.get(name, RuntimeError)
        text = message if shared.__name__ == name else f"{name}: {message}"
        raise shared(
            f"{text}\n(Raised by tensor-parallel {by}; every rank of the group raises it, so that none waits for the "
            f"others in a collective.){others}"
        ) from error
    if any(record != gathered[0] for record in gathered[1:]):
        raise ValueError(_different_calls(gathered))


def _different_calls(gathered: list[dict]) -> str:
    """The error of ranks that called `generate` differently: each rank's inputs, and the settings that differ."""
    names = list(gathered[0]["inputs"])
    lines = [f"rank {rank}: {_describe(names, record['inputs'])}" for rank, record in enumerate(gathered)]
    inputs_differ = any(record["inputs"] != gathered[0]["inputs"] for record in gathered[1:])
    shapes = [[None if row is None else row[:2] for row in record["inputs"].values()] for record in gathered]
    same_shapes = all(shape == shapes[0] for shape in shapes[1:])
    text = "The tensor-parallel ranks of this model called `generate` with different "
    text += "inputs" if inputs_differ else "settings"
    if inputs_differ and same_shapes:
        text += " (same shapes, different values)"
    text += ":\n  " + "\n  ".join(lines)
    settings = sorted({name for record in gathered for name in record["settings"]})
    for name in settings:
        values = [record["settings"].get(name, "(unset)") for record in gathered]
        if any(value != values[0] for value in values[1:]):
            text += f"\n  {name}: " + ", ".join(f"{value} on rank {rank}" for rank, value in enumerate(values))
    return text + "\n" + _SAME_CALL_ADVICE


def _describe(names: list[str], inputs: dict) -> str:
    parts = []
    for name in names:
        row = inputs.get(name)
        if row is None:
            parts.append(f"{name}=None")
        elif row[0] is None:
            parts.append(f"{name} ({row[1]})")
        else:
            parts.append(f"{name} {row[0]} (fingerprint {row[2]})")
    return ", ".join(parts)


def rank_path(path: str | os.PathLike) -> str:
    r"""
    The compile cache file of this process: `path` with `{rank}` replaced by its rank in the default process group (0
    without one of more than one process). Each rank compiles, saves and loads its own graphs.

    Args:
        path (`str` or `os.PathLike`):
            A file path containing `{rank}`.

    Returns:
        `str`: the path for this rank.
    """
    path = os.fspath(path)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if distributed and _RANK_FIELD not in path:
        raise ValueError(
            f"The compile cache path {path!r} must contain `{_RANK_FIELD}` under torch.distributed (world size "
            f"{dist.get_world_size()}): each rank saves its own graphs, and ranks writing one file overwrite each "
            "other."
        )
    return path.replace(_RANK_FIELD, str(dist.get_rank() if distributed else 0))

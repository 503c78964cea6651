"""Tensor parallelism: the ranks of a sharded model must run `generate` on the same padded inputs, and keep their own
compile caches.

Under transformers' tensor parallelism (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))`,
launched with `torchrun`) every rank holds a shard of each weight and runs the whole of `generate`; the sharded layers
all-reduce their partial outputs at every forward. Every rank must therefore pass the same prompt:

- prompts padded to different buckets send all-reduces of different sizes: gloo aborts the process that receives
  the larger message (`SIGABRT`, "Received data size doesn't match expected size") and its peers fail on the
  broken connection; NCCL (not tried here) has no such size check: expect a hang until the process group's timeout;
- different prompts padded to the same bucket (or the same shape with other tokens) all-reduce partial activations
  of different prompts: no error, and every rank returns the same wrong tokens.

`check_same_inputs_across_ranks` turns both into one clear `ValueError` on every rank, for one small all-gather.
"""

import os

import torch
import torch.distributed as dist

from . import _compat


# Per input: present, then up to `_MAX_DIMS` sizes (0 past the tensor's rank), then a fingerprint of integer values.
_MAX_DIMS = 3
_RANK_FIELD = "{rank}"


def tensor_parallel_group(model) -> "dist.ProcessGroup | None":
    """
    The process group of `model`'s tensor-parallel ranks, or `None` when `model` is not sharded with tensor parallelism
    (`tp_size` of 1 or unset) or no process group is initialized.
    """
    module = _compat.unwrap(model)  # the `torch.compile(model)` wrapper
    if _compat.tensor_parallel_size(module) <= 1:
        return None
    if not dist.is_available() or not dist.is_initialized():
        return None
    mesh = _compat.device_mesh(module)
    if mesh is None:
        return dist.group.WORLD
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        return mesh["tp"].get_group()
    return mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD


def check_same_inputs_across_ranks(model, **inputs: torch.Tensor | None) -> None:
    r"""
    Raises the same `ValueError` on every tensor-parallel rank of `model` when the ranks were not given the same
    `inputs`; does nothing when `model` is not tensor-parallel (see `tensor_parallel_group`).

    Every rank must call it at the same point, with the same input names (the shapes and values are what is checked):
    it runs one all-gather of a few integers per input over the tensor-parallel group. Shapes are compared for every
    tensor, values too for integer tensors (`input_ids`, `attention_mask`), through a position-weighted sum.

    Args:
        model ([`PreTrainedModel`]):
            The model `generate` runs, or its `torch.compile(model)` wrapper.
        inputs (`torch.Tensor` or `None`):
            The inputs of the call, by name (for example `input_ids=..., attention_mask=...`): as passed to
            `generate`, or as padded (equal inputs pad equally). `None`
            counts as an absent input, which must be absent on every rank.

    Example:

    ```python
    >>> check_same_inputs_across_ranks(model, input_ids=padded_ids, attention_mask=padded_mask)  # under torchrun
    ```
    """
    group = tensor_parallel_group(model)
    if group is None:
        return
    module = _compat.unwrap(model)
    names = sorted(inputs)
    device = _collective_device(group, module)
    summary = torch.stack([_summarize(inputs[name], device) for name in names])  # [inputs, 2 + _MAX_DIMS]
    gathered = [torch.empty_like(summary) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, summary, group=group)
    if all(torch.equal(other, gathered[0]) for other in gathered[1:]):
        return
    lines = [f"rank {rank}: {_describe(names, summary)}" for rank, summary in enumerate(gathered)]
    same_shapes = all(torch.equal(other[:, :-1], gathered[0][:, :-1]) for other in gathered[1:])
    raise ValueError(
        "The tensor-parallel ranks of this model called `generate` with different inputs"
        + (" (same shapes, different tokens)" if same_shapes else "")
        + ":\n  "
        + "\n  ".join(lines)
        + "\nEvery rank holds a shard of the weights and all-reduces its partial results, so every rank must get "
        "the same prompt, hence the same bucket: send each request to all ranks of the group (for example, read it "
        "on rank 0 and `torch.distributed.broadcast_object_list` it). Different buckets break or hang the collectives; "
        "different prompts in one bucket give every rank the same wrong tokens."
    )


def _collective_device(group, module) -> torch.device:
    """Where the all-gathered tensor lives: the CPU for gloo, the model's device for NCCL and other backends."""
    backend = str(dist.get_backend(group)).lower()
    if backend == "gloo":
        return torch.device("cpu")
    return module.device


def _summarize(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """`[present, size_0, ..., size_{_MAX_DIMS - 1}, fingerprint]` of one input, as int64 on `device`."""
    row = torch.zeros(2 + _MAX_DIMS, dtype=torch.long)
    if tensor is None:
        return row.to(device)
    if tensor.ndim > _MAX_DIMS:
        raise ValueError(f"Inputs of up to {_MAX_DIMS} dimensions can be compared, got shape {tuple(tensor.shape)}.")
    row[0] = 1
    row[1 : 1 + tensor.ndim] = torch.tensor(tensor.shape, dtype=torch.long)
    row = row.to(device)
    if not tensor.is_floating_point() and not tensor.is_complex():
        values = tensor.detach().reshape(-1).to(device=device, dtype=torch.long)  # [numel]
        weights = torch.arange(1, values.numel() + 1, device=device, dtype=torch.long)  # position-weighted
        row[-1] = (values * weights).sum()  # wraps around on overflow, the same way on every rank
    return row


def _describe(names: list[str], summary: torch.Tensor) -> str:
    parts = []
    for name, row in zip(names, summary.tolist()):
        if not row[0]:
            parts.append(f"{name}=None")
            continue
        sizes = list(row[1:-1])
        while len(sizes) > 1 and sizes[-1] == 0:
            sizes.pop()
        parts.append(f"{name} {sizes} (fingerprint {row[-1]})" if row[-1] else f"{name} {sizes}")
    return ", ".join(parts)


def rank_path(path: str | os.PathLike) -> str:
    r"""
    The compile cache file of this process: `path` with `{rank}` replaced by its rank in the default process group.

    Each rank compiles (and so saves and loads) its own graphs, so give each its own file:
    `save_compile_cache(rank_path("cache-{rank}.zip"))`, and in a later launch with the same number of ranks
    `load_compile_cache(rank_path("cache-{rank}.zip"))`. Without an initialized process group of more than one
    process, `{rank}` becomes 0.

    Args:
        path (`str` or `os.PathLike`):
            A file path containing `{rank}`.

    Returns:
        `str`: the path for this rank.
    """
    path = os.fspath(path)
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if _RANK_FIELD not in path:
        if distributed:
            raise ValueError(
                f"The compile cache path {path!r} must contain `{_RANK_FIELD}` under torch.distributed (world size "
                f"{dist.get_world_size()}): each rank saves its own graphs, and ranks writing one file overwrite "
                "each other."
            )
        return path
    return path.replace(_RANK_FIELD, str(dist.get_rank() if distributed else 0))

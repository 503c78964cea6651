"""The key/value heads and head size each attention module of a model holds, read from its own projections.

A config may misstate the shape upstream allocates a static cache with (multi-query Falcon and GPT-BigCode, a GPT-NeoX
config with an unused `num_key_value_heads`): `sizing.py` allocates early only where it is what the modules hold.
"""

import torch

from ..buckets import is_positive_int
from ..state import state_of
from ..upstream.torch_api import submodule


# Where an attention module keeps its head size, its key projection (or its fused query/key/value projection), and,
# where its projections don't tell, its key/value head count: the names the transformers models use.
_HEAD_DIMS = ("head_dim", "head_size", "attention_head_size", "d_head")
_KEY_PROJECTIONS = ("k_proj", "key", "k", "key_proj", "wk", "k_lin")
_FUSED_PROJECTIONS = ("query_key_value", "c_attn", "qkv_proj", "Wqkv", "qkv", "W_pack")
_OUTPUT_PROJECTIONS = ("dense", "o_proj", "out_proj", "c_proj")
_QUERY_HEAD_COUNTS = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_KV_HEAD_COUNTS = ("num_key_value_heads", "num_kv_heads", "kv_heads", "n_kv_heads")


def _int_attribute(module, names) -> int | None:
    for name in names:
        value = module.__dict__.get(name)
        if is_positive_int(value):
            return value
    return None


def projection_features(projection, output: bool = True) -> int | None:
    """The output (or input) features of a linear projection on this rank (a tensor-parallel shard's), or `None`."""
    weight = getattr(projection, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
        return None
    local = weight.to_local() if hasattr(weight, "to_local") else weight  # a DTensor shard: this rank's rows
    if hasattr(projection, "nf"):  # GPT-2's `Conv1D` stores its weight transposed: [in, out]; outputs only
        return local.shape[1] if output else None
    return local.shape[0 if output else 1]  # nn.Linear: [out, in]


def _module_kv_shape(module) -> tuple[int, int] | None:
    """`(key/value heads, head_dim)` of an attention module, read from its own projections, or `None`."""
    head_dim = _int_attribute(module, _HEAD_DIMS)
    if head_dim is None:
        return None
    for name in _KEY_PROJECTIONS:
        rows = projection_features(submodule(module, name))
        if rows is not None:
            return (rows // head_dim, head_dim) if rows % head_dim == 0 else None
    query_heads = _int_attribute(module, _QUERY_HEAD_COUNTS)
    query_rows = query_heads * head_dim if query_heads is not None else None
    for name in _OUTPUT_PROJECTIONS if query_rows is None else ():  # its inputs: the query heads times `head_dim`
        query_rows = projection_features(submodule(module, name), output=False)
        if query_rows is not None:
            break
    for name in _FUSED_PROJECTIONS:
        rows = projection_features(submodule(module, name))
        if rows is not None and query_rows is not None:
            kv_rows = rows - query_rows  # queries first, then keys and values of one size
            if kv_rows <= 0 or kv_rows % (2 * head_dim):
                return None
            return kv_rows // (2 * head_dim), head_dim
    kv_heads = _int_attribute(module, _KV_HEAD_COUNTS)
    return (kv_heads, head_dim) if kv_heads is not None else None


def held_kv_shapes(model) -> dict[int | None, set[tuple[int, int]]]:
    """
    The `(key/value heads, head_dim)` the attention modules hold, by their `layer_idx` (`None`: modules that don't say
    their layer). Read from the modules' own projections once per model, never from the config.
    """
    state = state_of(model)
    if state.held_kv_shapes is None:
        held = {}
        for module in model.modules():
            shape = _module_kv_shape(module) if module is not model else None
            if shape is not None:
                layer = module.__dict__.get("layer_idx")
                held.setdefault(layer if isinstance(layer, int) else None, set()).add(shape)
        state.held_kv_shapes = held
    return state.held_kv_shapes

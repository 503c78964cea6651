"""Taking the padding off what `generate` returns: the added columns and the dummy rows."""

import torch
from transformers.utils import ModelOutput

from ..kvcache.attention_keys import layouts_for, place_keys, upstream_keys
from ..upstream.transformers_api import CACHE_KWARGS
from .plan import Plan
from .views import strip_left


def strip_output(output, plan: Plan):
    """Removes the added columns and dummy rows from what `generate` returns (a tensor, or a `ModelOutput`)."""
    if plan.padded_rows > plan.rows:
        output = _take_rows(output, plan.rows)
    if isinstance(output, torch.Tensor):
        return strip_left(output, plan.added_id_columns)
    if not isinstance(output, ModelOutput):
        return output
    sequences = output.get("sequences")
    if sequences is not None:
        output["sequences"] = strip_left(sequences, plan.added_id_columns)
    # The sequence the model has seen at step `s` spans `padded_length + s` positions. Prefill hidden states and
    # the prefill query axis span it; without a cache (`use_cache=False`) every step re-runs the whole sequence, so
    # every step's do; a dynamic cache's key axis does too. A static cache's key axis is its layer's slots, which
    # `attention_keys.upstream_keys` lays out as upstream's layer would in the unpadded call.
    added = plan.added_positions
    if output.get("hidden_states") is not None:
        output["hidden_states"] = tuple(
            tuple(_strip_if(h, 1, plan.padded_length + step, added) for h in layers)  # [B, S, H]
            for step, layers in enumerate(output["hidden_states"])
        )
    if output.get("attentions") is not None:
        output["attentions"] = tuple(
            _strip_attentions(layers, plan, plan.padded_length + step)
            for step, layers in enumerate(output["attentions"])
        )
    return output


def _strip_attentions(layers: tuple, plan: Plan, seen: int) -> tuple:
    """One step's attentions `[B, heads, query, key]` per layer, after which the model has seen `seen` positions."""
    added = plan.added_positions
    layouts = None
    if plan.run.key_layouts is not None and plan.right is None and layers:
        layouts = layouts_for(plan.run.key_layouts, len(layers))
    if layouts is None:  # a dynamic cache, or none: a key axis that spans the padded sequence loses the padding
        return tuple(
            _strip_keys(
                _strip_if(attention, -2, seen, added), seen if seen != plan.run.static_cache_length else None, added
            )
            for attention in layers
        )
    stripped = []
    for attention, layout in zip(layers, layouts):
        if attention is not None:  # the forward's cache held `seen - query` tokens before it
            attention = upstream_keys(attention, layout, seen, added, cached=seen - attention.shape[-2])
        stripped.append(_strip_if(attention, -2, seen, added))
    return tuple(stripped)


def _strip_keys(attention, padded_size: int | None, added: int):
    """Strips `added` keys when the key axis spans the padded sequence, as upstream's softmax would weigh the rest."""
    if attention is None or padded_size is None or added == 0 or attention.shape[-1] != padded_size:
        return attention
    return place_keys(attention, added, padded_size - added)


def _take_rows(value, rows: int):
    """The first `rows` rows of every tensor in `value` (a tensor, nested tuples, or a `ModelOutput`; not the cache)."""
    if isinstance(value, torch.Tensor):
        return value[:rows]
    if isinstance(value, ModelOutput):
        for key in list(value.keys()):
            if key not in CACHE_KWARGS:
                value[key] = _take_rows(value[key], rows)
        return value
    if isinstance(value, tuple):
        return tuple(_take_rows(item, rows) for item in value)
    return value


def _strip_if(tensor, dim: int, padded_size: int | None, added: int):
    """Strips `added` from `dim` when that axis spans the padded sequence (`padded_size` positions)."""
    if tensor is None or padded_size is None or tensor.shape[dim] != padded_size:
        return tensor
    return strip_left(tensor, added, dim=dim)

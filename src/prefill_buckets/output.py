"""Taking the padding off what `generate` returns: the added columns and the dummy rows."""

import torch
from transformers.utils import ModelOutput

from .cache import CACHE_KWARGS
from .inputs import Plan
from .padding import strip_left


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
    added = plan.added_positions
    padded_total = plan.padded_length  # sequence length the model has seen, at the current step
    if output.get("hidden_states") is not None:
        steps = list(output["hidden_states"])
        if steps:  # prefill: [B, S, H] per layer, S spans the padded prompt
            steps[0] = tuple(_strip_if(h, 1, plan.padded_length, added) for h in steps[0])
        output["hidden_states"] = tuple(steps)
    if output.get("attentions") is not None:
        steps = []
        for step, layers in enumerate(output["attentions"]):
            seen = padded_total + step
            new_layers = []
            for attention in layers:  # [B, heads, query, key]
                if step == 0:
                    attention = _strip_if(attention, -2, plan.padded_length, added)
                new_layers.append(_strip_if(attention, -1, seen, added))
            steps.append(tuple(new_layers))
        output["attentions"] = tuple(steps)
    return output


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


def _strip_if(tensor, dim: int, padded_size: int, added: int):
    """Strips `added` from `dim` when that axis spans the padded sequence, as a dynamic cache's key axis does."""
    if tensor is None or tensor.shape[dim] != padded_size:
        return tensor
    return strip_left(tensor, added, dim=dim)

"""Tensor operations on the sequence axis: add padding on the left, take it off again. No transformers here."""

import torch


def left_pad(tensor: torch.Tensor, pad: int, value: float | torch.Tensor, dim: int = -1) -> torch.Tensor:
    """
    Prepends `pad` entries along `dim`.

    Args:
        tensor (`torch.Tensor`): for example input ids `[B, S]`, or embeddings `[B, S, H]` with `dim=1`.
        pad (`int`): how many entries to add in front.
        value (`float` or `torch.Tensor`): the fill. A tensor broadcasts over the new slice, so an embedding
            vector `[H]` fills `[B, pad, H]`.
        dim (`int`): the sequence axis.
    """
    if pad == 0:
        return tensor
    dim = dim % tensor.ndim
    shape = list(tensor.shape)
    shape[dim] = pad
    if isinstance(value, torch.Tensor):
        filler = value.to(device=tensor.device, dtype=tensor.dtype).expand(shape)
    else:
        filler = torch.full(shape, value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor], dim=dim)


def fill_embedding(embedding: torch.nn.Module, token_id: int, like: torch.Tensor) -> torch.Tensor:
    """
    What a pad position of `inputs_embeds` holds: the input embedding of `token_id` (the pad token), `[H]`, detached,
    in the dtype and on the device of the embeddings `like` (`[B, S, H]`) it pads, as the user's own are.

    Args:
        embedding (`torch.nn.Module`): the model's input embedding (`model.get_input_embeddings()`).
        token_id (`int`): the id whose embedding fills the pads.
        like (`torch.Tensor`): the embeddings the fill goes beside.
    """
    return embedding.weight[token_id].detach().to(device=like.device, dtype=like.dtype)


def strip_left(tensor: torch.Tensor, pad: int, dim: int = -1) -> torch.Tensor:
    """Drops the first `pad` entries along `dim`: the inverse of `left_pad`."""
    if pad == 0:
        return tensor
    return tensor.narrow(dim, pad, tensor.shape[dim] - pad)

"""
The prefill of a right-padded call, in place of upstream's `_prefill` (installed as a hook by `hooks.py`): one forward
of the prompt padded after its end to the bucket, with no attention mask (causal attention never lets a prompt token
see the padding after it), logits for the prompt's last position only, then the cache's length set back to the
prompt's, so decode writes its first token over the first pad slot. Upstream, which sees the unpadded prompt, does
everything else.
"""

import contextlib

import torch

from . import _compat
from .cache import CACHE_KWARGS, cache_seq_length, early_initialize
from .inputs import Plan
from .windows import set_window


def prefill_right(plan: Plan, original, input_ids, generation_config, model_kwargs, *args, **kwargs):
    if plan.side != "right" or plan.bucket == 1:  # a 1-token bucket has no padding: upstream's prefill, decode's graph
        return original(input_ids, generation_config, model_kwargs, *args, **kwargs)
    model = plan.model
    cache_key, cache = next((key, model_kwargs[key]) for key in CACHE_KWARGS if model_kwargs.get(key) is not None)
    rows = input_ids.shape[0] if input_ids.shape[1] else model_kwargs["inputs_embeds"].shape[0]
    if not all(getattr(layer, "is_initialized", True) for layer in cache.layers):
        early_initialize(model, cache, rows)  # outside the compiled forward: static addresses, as on the left
    past = cache_seq_length(cache) or 0  # what a continued conversation holds; 0 for a fresh cache
    inputs_embeds = model_kwargs.get("inputs_embeds")
    if inputs_embeds is not None and past == 0:
        new_tokens = inputs_embeds.shape[1]
        fill = model.get_input_embeddings().weight[plan.settings.fill_token_id].detach().to(inputs_embeds.dtype)
        padding = fill.expand(rows, plan.bucket - new_tokens, -1)
        prompt = {"inputs_embeds": torch.cat([inputs_embeds, padding], dim=1)}  # [rows, bucket, hidden]
    else:
        new_ids = input_ids[:, past:]  # [rows, S]
        new_tokens = new_ids.shape[1]
        padding = new_ids.new_full((rows, plan.bucket - new_tokens), plan.settings.fill_token_id)
        prompt = {"input_ids": torch.cat([new_ids, padding], dim=1)}  # [rows, bucket]
    positions = past + torch.arange(plan.bucket, device=input_ids.device).expand(rows, -1)  # [rows, bucket]
    last = torch.tensor([new_tokens - 1], device=input_ids.device)  # [1]: the prompt's last position, an input
    if _compat.valid_auto_compile(model, model_kwargs, generation_config):
        forward = model.get_compiled_call(generation_config.compile_config)  # as upstream decodes
    else:
        forward = model.__call__  # compiled in place, through the compiled wrapper, or eager
    if plan.windowed_cache is not None:
        set_window(plan.windowed_cache, past + plan.bucket)
    empty = _compat.reports_empty(cache) if past == 0 else contextlib.nullcontext()
    with empty:
        outputs = forward(
            **prompt,
            position_ids=positions,
            attention_mask=None,
            logits_to_keep=last,
            use_cache=True,
            return_dict=True,
            **{cache_key: cache},
        )
    _compat.set_static_cache_length(cache, past + new_tokens)
    return outputs

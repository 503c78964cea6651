"""
The prefill of a right-padded call, in place of upstream's `_prefill`: one forward of the prompt padded after its end
to the bucket, with no attention mask (causal attention never lets a prompt token see the pads after it), logits for
the prompt's last position only, then the cache's length set back to the prompt's, so decode writes over the first pad
slot. Upstream, which sees the unpadded prompt, does everything else.

Rows of different lengths are padded each after its own end: row i's `L_i` tokens go to slots `0..L_i-1`, and its
first new token comes from the logits at `L_i - 1`, gathered from a fixed number of positions (one graph per bucket and
batch size). Decode then runs as upstream's on the prompt as passed: step t writes slot `S + t` (S the prompt's width),
with a mask of the cache's layout that hides row i's slots `[L_i, S)`.
"""

import contextlib

import torch
from transformers.utils import logging

from ..compile.compiled_calls import is_aot_forward, mark_prefill_dynamic
from ..kvcache.sizing import early_initialize
from ..kvcache.windows import set_window
from ..upstream import transformers_api
from ..upstream.transformers_api import cache_argument, cache_seq_length
from .hook_registry import hook
from .plan import Plan, fill_embedding


logger = logging.get_logger(__name__)


@hook("_prefill", reads=("input_ids", "generation_config", "model_kwargs"), positional=True, side="right")
def prefill_right(plan: Plan, step):
    right = plan.right
    if right.bucket == 1:  # a 1-token bucket has no padding: upstream's prefill, decode's graph
        return step.call()
    model = plan.model
    input_ids, generation_config, model_kwargs = step["input_ids"], step["generation_config"], step["model_kwargs"]
    cache_key, cache = cache_argument(model_kwargs)
    if cache_key is None or not transformers_api.is_static_cache(cache):
        # Upstream made no static cache for this model (it keeps its own, or none): nothing to rewind after the pads.
        logger.warning_once(
            f"The prompt is not padded: `generate` made no static cache for `{type(model).__name__}` to pad on the "
            "right, so this call runs unpadded (exact), and its prompt length may compile a new graph."
        )
        return step.call()
    rows = input_ids.shape[0] if input_ids.shape[1] else model_kwargs["inputs_embeds"].shape[0]
    # Compiled: allocated outside the compiled forward (static addresses), as on the left. Eager: on the first write,
    # as upstream's lazily initialized cache is (`None`: the cache hook did not run, so as if compiled).
    compiled = plan.run.compiled is not False or is_aot_forward(model)
    if compiled and not all(getattr(layer, "is_initialized", True) for layer in cache.layers):
        plan.run.allocated_early = early_initialize(model, cache, rows)
    past = plan.call.past_length  # what a continued conversation holds; 0 for a fresh cache
    inputs_embeds = model_kwargs.get("inputs_embeds")
    if past == 0:
        new_tokens = (inputs_embeds if inputs_embeds is not None else input_ids).shape[1]
        if plan.call.ragged:
            attention_mask = model_kwargs.get("attention_mask")
            prompt, row_lengths = _rows_from_the_start(plan, input_ids, inputs_embeds, attention_mask)
            keep, column = _last_positions(row_lengths, right.bucket)
        else:  # every row is the whole prompt: padded after it, each row's last token in the prompt's last column
            prompt, row_lengths = _padded_after(plan, input_ids, inputs_embeds), None
            # The prompt's last position, `min(rows, bucket)` times: the shape `_last_positions` gives ragged rows.
            device = next(iter(prompt.values())).device
            keep = torch.full((min(rows, right.bucket),), new_tokens - 1, dtype=torch.long, device=device)
            column = None
    else:  # a continued conversation: the rows are one length (the rule), the new tokens follow the cached ones
        new_ids = input_ids[:, past:]  # [rows, S]
        new_tokens = new_ids.shape[1]
        prompt = _padded_after(plan, new_ids, None)  # [rows, bucket]
        keep, column = torch.tensor([new_tokens - 1], device=input_ids.device), None  # [1]: an input, not a shape
    device = keep.device
    positions = past + torch.arange(right.bucket, device=device).expand(rows, -1)  # [rows, bucket]
    auto_compile = plan.run.auto_compile
    if auto_compile is None:
        auto_compile = transformers_api.valid_auto_compile(model, model_kwargs, generation_config)
    if auto_compile:
        forward = model.get_compiled_call(generation_config.compile_config)  # as upstream decodes
    else:
        forward = model.__call__  # compiled in place, through the compiled wrapper, or eager
    if plan.run.windowed_cache is not None:
        set_window(plan.run.windowed_cache, past + right.bucket, query=plan.run.query_window_tokens is not None)
    if plan.run.generic_prefill:  # one graph for every bucket: its length symbolic
        prompt["position_ids"] = positions
        mark_prefill_dynamic(prompt, right.bucket, past + right.bucket)
        positions = prompt.pop("position_ids")
    empty = transformers_api.reports_empty(cache) if past == 0 else contextlib.nullcontext()
    with empty:
        outputs = forward(
            **prompt,
            position_ids=positions,
            attention_mask=None,
            logits_to_keep=keep,
            use_cache=True,
            return_dict=True,
            **{cache_key: cache},
        )
    if column is not None:
        # [rows, kept, vocab] -> [rows, 1, vocab]: each row's logits at its own last position
        outputs["logits"] = outputs.logits[torch.arange(rows, device=device), column].unsqueeze(1)
    elif keep.shape[0] > 1:  # every kept position is the last token's: [rows, kept, vocab] -> [rows, 1, vocab]
        outputs["logits"] = outputs.logits[:, -1:]
    if (cache_seq_length(cache) or 0) == past:
        # The forward wrote nothing to the cache (OpenAI GPT takes it and keeps none): every decode step runs the whole
        # sequence again, as the user passed it, with the user's mask. Decode stays upstream's, mask and cache too.
        logger.warning_once(
            f"`{type(model).__name__}` keeps no cache: its prefill is bucketed, and each decode step runs the whole "
            "sequence again, as upstream's does (a new shape every step)."
        )
        return outputs
    transformers_api.set_static_cache_length(cache, past + new_tokens)
    if past == 0 and model_kwargs.get("attention_mask") is not None:
        # The cache's layout: row i's tokens in slots 0..L_i-1, the decode steps from slot S on. [rows, S]
        mask = model_kwargs["attention_mask"]
        if row_lengths is None:  # every row fills all S slots
            model_kwargs["attention_mask"] = torch.ones(rows, new_tokens, dtype=mask.dtype, device=device)
        else:
            slots = torch.arange(new_tokens, device=device)
            model_kwargs["attention_mask"] = (slots < row_lengths[:, None].to(device)).to(mask.dtype)
    return outputs


def _padded_after(plan: Plan, input_ids, inputs_embeds) -> dict:
    """The prompt as prefill runs it when every row is the whole prompt: padded after its end to the bucket."""
    given = inputs_embeds if inputs_embeds is not None else input_ids
    if given.shape[1] == plan.right.bucket:  # it fits its bucket: nothing to add; contiguous, as a padded prompt is
        return {"inputs_embeds" if inputs_embeds is not None else "input_ids": given.contiguous()}
    fill_id = plan.settings.unmasked_fill_token_id
    if inputs_embeds is not None:  # [rows, S, hidden] -> [rows, bucket, hidden]
        fill = fill_embedding(plan.model.get_input_embeddings(), fill_id, inputs_embeds)  # [hidden]
        rows, width, hidden = inputs_embeds.shape
        padding = fill.expand(rows, plan.right.bucket - width, hidden)
        return {"inputs_embeds": torch.cat([inputs_embeds, padding], dim=1)}
    padding = input_ids.new_full((input_ids.shape[0], plan.right.bucket - input_ids.shape[1]), fill_id)
    return {"input_ids": torch.cat([input_ids, padding], dim=1)}  # [rows, bucket]


def _rows_from_the_start(plan: Plan, input_ids, inputs_embeds, attention_mask) -> tuple[dict, torch.Tensor]:
    """
    The prompt as prefill runs it: each row's tokens moved to the start (a left-padded row's zeros are in front),
    padded after its end to the bucket. Returns the forward's prompt input and the rows' lengths `[rows]`.
    """
    prompt = inputs_embeds if inputs_embeds is not None else input_ids  # [rows, S] or [rows, S, hidden]
    rows, width = prompt.shape[:2]
    device = prompt.device
    if attention_mask is None:
        row_lengths = torch.full((rows,), width, dtype=torch.long, device=device)
    else:
        row_lengths = attention_mask.to(device=device, dtype=torch.long).sum(-1)  # [rows]
    steps = torch.arange(plan.right.bucket, device=device)  # [bucket]
    real = steps < row_lengths[:, None]  # [rows, bucket]
    source = (steps + (width - row_lengths)[:, None]).clamp(max=width - 1)  # [rows, bucket]: the column it comes from
    fill_id = plan.settings.unmasked_fill_token_id
    if inputs_embeds is not None:
        fill = fill_embedding(plan.model.get_input_embeddings(), fill_id, inputs_embeds)  # [hidden]
        moved = inputs_embeds.gather(1, source[..., None].expand(-1, -1, inputs_embeds.shape[-1]))
        return {"inputs_embeds": torch.where(real[..., None], moved, fill)}, row_lengths  # [rows, bucket, hidden]
    moved = input_ids.gather(1, source)
    return {"input_ids": torch.where(real, moved, moved.new_tensor(fill_id))}, row_lengths  # [rows, bucket]


def _last_positions(row_lengths: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """
    The positions to compute logits at, and the one of them that is each row's last token. `min(rows, bucket)`
    positions whatever the lengths (the distinct last positions, the last one repeated): one shape per bucket and
    batch size, so one graph.
    """
    rows = row_lengths.shape[0]
    distinct = torch.unique(row_lengths - 1)  # sorted
    keep = torch.cat([distinct, distinct[-1:].expand(min(rows, bucket) - distinct.shape[0])])  # [min(rows, bucket)]
    return keep, torch.searchsorted(distinct, row_lengths - 1)  # [rows]: the kept position of each row's last token

"""The batch padded to its batch bucket (`prefill_batch_buckets`): dummy rows after the user's.

Dummy rows are finished from the first step (`DummyRowsFinished`), so they never keep generation going, and
`output.strip_output` drops them.
"""

from dataclasses import replace

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .padding import fill_embedding
from .plan import PER_TOKEN_KWARGS, Plan
from .views import DummyRowsFinished, PromptStrippingStreamer


def pad_rows(plan: Plan, arguments: dict, model_kwargs: dict, padded_batch: int):
    """
    Appends dummy rows up to `padded_batch` (the batch bucket `decision.choose_side` chose): one unmasked pad token
    each (a fully masked row would give NaNs), no other inputs; on the right, a row of unmasked pad tokens as long as
    the prompt (all rows one length). A stopping criterion marks them finished from the first step, so they never keep
    generation going, and `output.strip_output` drops them.
    """
    model, settings = plan.model, plan.settings
    if plan.right is not None and arguments.get("inputs") is not None:
        arguments = dict(arguments)
        model_kwargs = dict(model_kwargs, input_ids=arguments.pop("inputs"))
    input_ids = model_kwargs.get("input_ids")
    prompt = model_kwargs["inputs_embeds"] if model_kwargs.get("inputs_embeds") is not None else input_ids
    batch_size = prompt.shape[0]
    expand = settings.rows_per_prompt

    extra = padded_batch - batch_size
    fill_token_id = settings.fill_token_id
    length = plan.padded_length
    model_kwargs = dict(model_kwargs)
    dummy_mask = torch.zeros(extra, length, dtype=torch.long, device=prompt.device)
    dummy_mask[:, -1] = 1
    if plan.right is not None:
        dummy_mask.fill_(1)
        if model_kwargs.get("attention_mask") is None:  # else upstream could infer a mask from the pad tokens
            model_kwargs["attention_mask"] = torch.ones(batch_size, length, dtype=torch.long, device=prompt.device)
    if input_ids is not None and input_ids.shape[1] > 0:
        dummy = torch.full((extra, input_ids.shape[1]), fill_token_id, dtype=input_ids.dtype, device=input_ids.device)
        model_kwargs["input_ids"] = torch.cat([input_ids, dummy])
    elif input_ids is not None:
        model_kwargs["input_ids"] = input_ids.new_empty(padded_batch, 0)
    if model_kwargs.get("inputs_embeds") is not None:
        embeds = model_kwargs["inputs_embeds"]
        fill = fill_embedding(model.get_input_embeddings(), fill_token_id, embeds)
        model_kwargs["inputs_embeds"] = torch.cat([embeds, fill.expand(extra, *embeds.shape[1:])])
    for key in PER_TOKEN_KWARGS:
        value = model_kwargs.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if key == "attention_mask":
            model_kwargs[key] = torch.cat([value, dummy_mask.to(value.dtype)])
        else:
            row_dim = 0 if value.ndim == 2 else 1  # multimodal rope position ids are [3, batch, length]
            shape = list(value.shape)
            shape[row_dim] = extra
            model_kwargs[key] = torch.cat([value, value.new_zeros(shape)], dim=row_dim)

    criteria = StoppingCriteriaList(arguments.get("stopping_criteria") or [])
    criteria.append(DummyRowsFinished(first_dummy_row=batch_size * expand))
    arguments = dict(arguments, stopping_criteria=criteria)
    plan = replace(plan, padded_rows=padded_batch * expand, padded_batch=padded_batch)
    if isinstance(arguments.get("streamer"), PromptStrippingStreamer):
        arguments["streamer"].rows = batch_size * expand
    elif arguments.get("streamer") is not None:
        arguments["streamer"] = PromptStrippingStreamer(arguments["streamer"], 0, rows=batch_size * expand)
    return plan, arguments, model_kwargs

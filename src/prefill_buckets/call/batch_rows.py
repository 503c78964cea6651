"""The batch padded to its batch bucket (`prefill_batch_buckets`): dummy rows after the user's, and the pad id the
rows that finish early are fed.

Dummy rows are finished from the first step (`DummyRowsFinished`), so they never keep generation going, and
`output.strip_output` drops them.
"""

import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList
from transformers.utils import logging

from ..config import PREFILL_BATCH_BUCKETS
from .padding import fill_embedding
from .plan import PER_TOKEN_KWARGS, Plan
from .views import DummyRowsFinished, PromptStrippingStreamer


logger = logging.get_logger(__name__)


def check_pad_token_id(plan: Plan, arguments: dict) -> dict:
    """
    Checks the pad id against the rows that finish early, and returns the generation kwargs the call needs for it.

    Upstream fills a row that finishes before the others with `pad_token_id` and feeds it back to the model, so a pad
    id outside the vocabulary fails at the embedding (an index error on CPU, a device assert on CUDA). Raises
    `ValueError` when one of the user's rows can finish early: there is more than one (and no beam search, which does
    not feed finished beams), and an eos id in the vocabulary, `stop_strings` or the user's own stopping criteria
    could finish it. The dummy rows of `prefill_batch_buckets` are finished from the first step, so they would be fed
    the pad id too: when no user row can finish early, the call fills finished rows with an id in the vocabulary
    instead (`{"pad_token_id": ...}`). No user row is ever filled, so the output is the same.
    """
    settings = plan.settings
    pad_token_id = settings.pad_token_id
    if pad_token_id is None or settings.vocab_size is None or settings.in_vocabulary(pad_token_id):
        return {}
    if settings.num_beams > 1:
        return {}
    user_criteria = [c for c in arguments.get("stopping_criteria") or () if not isinstance(c, DummyRowsFinished)]
    can_finish_early = [
        reason
        for reason, present in (
            (
                f"the eos ids {list(settings.eos_token_ids)} are in it",
                any(map(settings.in_vocabulary, settings.eos_token_ids)),
            ),
            ("`stop_strings` is set", bool(settings.stop_strings)),
            ("`stopping_criteria` are passed", bool(user_criteria)),
        )
        if present
    ]
    if plan.rows > 1 and can_finish_early:
        raise ValueError(
            f"`pad_token_id` is {pad_token_id}, outside the model's vocabulary (valid ids: 0 to "
            f"{settings.vocab_size - 1}). This call generates {plan.rows} rows and a row can finish before the others "
            f"({', '.join(can_finish_early)}): it is then filled with `pad_token_id` and fed back to the model, which "
            "can't look it up. Set `pad_token_id` to an id in the vocabulary (the eos token id is the usual choice)."
        )
    if plan.padded_rows > plan.rows:
        return {"pad_token_id": settings.fill_token_id}
    return {}


def pad_rows(plan: Plan, arguments: dict, model_kwargs: dict):
    """
    Appends dummy rows up to the batch bucket: one unmasked pad token each (a fully masked row would give NaNs), no
    other inputs; on the right, a row of unmasked pad tokens as long as the prompt (all rows one length). A stopping
    criterion marks them finished from the first step, so they never keep generation going,
    and `output.strip_output` drops them.
    """
    model, settings = plan.model, plan.settings
    if plan.right is not None and arguments.get("inputs") is not None:
        arguments = dict(arguments)
        model_kwargs = dict(model_kwargs, input_ids=arguments.pop("inputs"))
    input_ids = model_kwargs.get("input_ids")
    prompt = model_kwargs["inputs_embeds"] if model_kwargs.get("inputs_embeds") is not None else input_ids
    batch_size = prompt.shape[0]
    padded_batch = settings.batch_policy.bucket(batch_size)
    expand = settings.rows_per_prompt
    if padded_batch == batch_size:
        return plan, arguments, model_kwargs
    known = {"input_ids", "inputs_embeds", *PER_TOKEN_KWARGS}
    per_row = sorted(
        k
        for k, v in model_kwargs.items()
        if isinstance(v, torch.Tensor) and k not in known and v.shape[:1] == (batch_size,)
    )
    if settings.num_beams > 1 or per_row:
        reason = "beam search ranks rows together" if not per_row else f"it can't pad the per-row input {per_row[0]!r}"
        logger.warning_once(f"`{PREFILL_BATCH_BUCKETS}` is not applied to this call: {reason}.")
        return plan, arguments, model_kwargs
    if arguments.get("negative_prompt_ids") is not None:
        logger.warning_once(
            f"`{PREFILL_BATCH_BUCKETS}` is not applied to this call: it can't pad `negative_prompt_ids`."
        )
        return plan, arguments, model_kwargs

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
    plan.padded_rows = padded_batch * expand
    plan.padded_batch = padded_batch
    if isinstance(arguments.get("streamer"), PromptStrippingStreamer):
        arguments["streamer"].rows = batch_size * expand
    elif arguments.get("streamer") is not None:
        arguments["streamer"] = PromptStrippingStreamer(arguments["streamer"], 0, rows=batch_size * expand)
    return plan, arguments, model_kwargs

"""What is seen without the padding: by the objects upstream `generate` hands the padded ids to, and by the user.

Logits processors, stopping criteria and prompt lookup that read token content see `ids[:, pad:]`, as an unpadded run
does, through views that forward every other attribute; the hooks of the steps that build them are declared here. A
streamer gets no added columns and no dummy rows, and neither does what `generate` returns (`strip_output`, step 8).
"""

import copy

import torch
from transformers.generation import logits_process
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer
from transformers.utils import ModelOutput

from ..kvcache.attention_keys import layouts_for, place_keys, upstream_keys
from ..upstream import candidates, torch_api
from ..upstream.transformers_api import CACHE_KWARGS, parameters_of
from .budget import account_candidates
from .hook_registry import hook


class _View:
    """Forwards every attribute it does not have itself to `wrapped`."""

    def __init__(self, wrapped, pad: int):
        self.wrapped = wrapped
        self.pad = pad  # columns added in front of the ids

    def __getattr__(self, name):
        if name == "wrapped":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)


class UnpaddedProcessor(_View, LogitsProcessor):
    """Runs a logits processor on the ids without the added columns."""

    def __call__(self, input_ids, scores):
        return self.wrapped(input_ids[:, self.pad :], scores)


class UnpaddedCriterion(_View, StoppingCriteria):
    """Runs a stopping criterion on the ids without the added columns."""

    def __call__(self, input_ids, scores, **kwargs):
        return self.wrapped(input_ids[:, self.pad :], scores, **kwargs)


class UnpaddedPromptLookup(_View):
    """
    Runs prompt-lookup decoding's n-gram search on the ids without the added columns; the logits processors it checks
    candidates with take padded ids (`get_logits_processor`), so they get the columns back.
    """

    def __init__(self, generator, pad: int):
        super().__init__(generator, pad)
        generator.max_length -= pad  # compared with the length of the ids it sees
        self.added_ids = None  # [1, pad]: the columns in front of the ids of the running call
        if getattr(generator, "logits_processor", None) is not None:
            generator.logits_processor = _PaddedAgain(generator.logits_processor, self)

    def get_candidates(self, input_ids, *args, **kwargs):
        self.added_ids = input_ids[:, : self.pad]
        candidates, logits = self.wrapped.get_candidates(input_ids[:, self.pad :], *args, **kwargs)
        return torch.cat([self.added_ids, candidates], dim=1), logits

    def update_candidate_strategy(self, input_ids, *args, **kwargs):
        return self.wrapped.update_candidate_strategy(input_ids[:, self.pad :], *args, **kwargs)


class AssistantMergingByWrappedType(_View):
    """
    An assistant model's candidate generator whose assistant merges the call's processors by the type they wrap:
    upstream keeps one processor of each type, and a view is another type, so both would run (a bias added twice).
    """

    def get_candidates(self, input_ids, *args, **kwargs):
        with candidates.processors_merged_by(self.wrapped.assistant_model, _merge_by_wrapped_type):
            return self.wrapped.get_candidates(input_ids, *args, **kwargs)


def _merge_by_wrapped_type(merge):
    """Upstream's `merge(default_list, custom_list)`, with a processor that strips the padding as the type it wraps."""

    def merged(default_list, custom_list):
        views = {id(c.wrapped): c for c in custom_list if isinstance(c, UnpaddedProcessor)}
        unwrapped = type(custom_list)(c.wrapped if isinstance(c, UnpaddedProcessor) else c for c in custom_list)
        result = merge(default_list, unwrapped)
        return type(result)(views.get(id(p), p) for p in result)

    return merged


class _PaddedAgain(LogitsProcessorList):
    """The call's logits processors, given the ids prompt lookup searched with the added columns back in front."""

    def __init__(self, processors: LogitsProcessorList, lookup: UnpaddedPromptLookup):
        super().__init__(processors)
        self.lookup = lookup

    def __call__(self, input_ids, scores, **kwargs):
        added = self.lookup.added_ids.expand(input_ids.shape[0], -1)
        return super().__call__(torch.cat([added, input_ids], dim=1), scores, **kwargs)


class PromptStrippingStreamer(_View, BaseStreamer):
    """Hands the wrapped streamer the prompt without the added columns, and every value without dummy rows."""

    def __init__(self, streamer: BaseStreamer, pad: int, rows: int | None = None):
        super().__init__(streamer, pad)
        self.rows = rows  # the user's rows, when `prefill_batch_buckets` added dummy ones after them
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            value = strip_left(value, self.pad)
        if self.rows is not None:
            value = value[: self.rows]
        self.wrapped.put(value)

    def end(self):
        self.wrapped.end()


class DummyRowsFinished(StoppingCriteria):
    """Reports the dummy rows added by `prefill_batch_buckets` as finished, from the first step on."""

    def __init__(self, first_dummy_row: int):
        self.first_dummy_row = first_dummy_row

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        finished[self.first_dummy_row :] = True
        return finished


# Processors that count the sequence length against values moved by the padding (`_prepare_generated_length`, or set
# up with the padded prompt length) see the padded ids; every other one reads token content, and sees them unpadded.
_PADDED_VIEW = tuple(
    getattr(logits_process, name)
    for name in (
        "MinLengthLogitsProcessor",
        "MinNewTokensLengthLogitsProcessor",
        "ExponentialDecayLengthPenalty",
        "ForcedEOSTokenLogitsProcessor",
        "SuppressTokensAtBeginLogitsProcessor",
    )
    if hasattr(logits_process, name)
) + (MaxLengthCriteria,)


@hook("_get_logits_processor", reads=("generation_config", "logits_processor"), side="left")
def get_logits_processor(plan, step):
    processors = step.call()
    # Positions added in front of the mask that the ids lack: all of them when the prompt is only `inputs_embeds`.
    missing_from_ids = plan.added_positions - plan.added_id_columns
    if plan.added_id_columns == 0 and missing_from_ids == 0:
        return processors
    user_processors = {id(p) for p in step["logits_processor"] or ()}
    wrapped = LogitsProcessorList()
    for processor in processors:
        # Upstream built it to skip the left padding itself (5.23's repetition penalty: `prompt_ignore_length`, from
        # the padded mask): it must see the ids that mask spans.
        ignore_length = getattr(processor, "prompt_ignore_length", None)
        skips_left_padding = isinstance(ignore_length, torch.Tensor) and id(processor) not in user_processors
        if skips_left_padding and missing_from_ids:
            processor = copy.copy(processor)  # it skips as many ids as the padded mask has leading zeros
            processor.prompt_ignore_length = (processor.prompt_ignore_length - missing_from_ids).clamp(min=0)
        padded_view = isinstance(processor, _PADDED_VIEW) or skips_left_padding
        plain = not padded_view and len(parameters_of(processor.__call__)) == 2  # extra arguments: leave it be
        if plain and plan.added_id_columns:
            processor = UnpaddedProcessor(processor, plan.added_id_columns)
        wrapped.append(processor)
    return wrapped


def _padded_criterion(criterion, added: int):
    if not isinstance(criterion, _PADDED_VIEW):
        return UnpaddedCriterion(criterion, added)
    if isinstance(criterion, MaxLengthCriteria) and criterion.max_position_embeddings is not None:
        # It warns once the sequence passes the model's positions; the added columns take none of them.
        criterion = copy.copy(criterion)
        criterion.max_position_embeddings += added
    return criterion


@hook("_get_stopping_criteria", reads=("generation_config", "stopping_criteria"), side="left")
def get_stopping_criteria(plan, step):
    criteria = step.call()
    if plan.added_id_columns == 0:
        return criteria
    return StoppingCriteriaList(_padded_criterion(c, plan.added_id_columns) for c in criteria)


@hook("_get_candidate_generator", reads=("generation_config",), side="left")
def get_candidate_generator(plan, step):
    generator = step.call()
    account_candidates(plan, generator, step["generation_config"].max_length)  # the graphs its counts compile
    plan.run.recompile_limit = torch_api.recompile_limit()
    if plan.added_positions and candidates.drafts_from_padding(generator):
        raise RuntimeError(
            f"prefill_buckets padded this call, but upstream drafts its candidates with {type(generator).__name__}, "
            "whose drafts padding changes (it reads the target's states, or the padded mask): a row of "
            "`call/decision.py`'s `DECISION` should have run it unpadded. Please report it; unset the prefill bucket fields for now."
        )
    # Its candidates come from the ids' content: with the padding in front, a match could start in it. An assistant
    # model's candidates come from a forward with the attention mask, which hides the padding.
    if plan.added_id_columns and candidates.is_prompt_lookup(generator):
        return UnpaddedPromptLookup(generator, plan.added_id_columns)
    if plan.added_id_columns and candidates.is_assistant_model(generator):
        return AssistantMergingByWrappedType(generator, plan.added_id_columns)
    return generator


def strip_left(tensor: torch.Tensor, pad: int, dim: int = -1) -> torch.Tensor:
    """Drops the first `pad` entries along `dim`: the inverse of `plan.left_pad`."""
    if pad == 0:
        return tensor
    return tensor.narrow(dim, pad, tensor.shape[dim] - pad)


def strip_output(output, plan):
    """Removes the added columns and dummy rows from what `generate` returns (a tensor, or a `ModelOutput`)."""
    if plan.padded_rows > plan.call.output_rows:
        output = _take_rows(output, plan.call.output_rows)
    if isinstance(output, torch.Tensor):
        return strip_left(output, plan.added_id_columns)
    if not isinstance(output, ModelOutput):
        return output
    sequences = output.get("sequences")
    if sequences is not None:
        output["sequences"] = strip_left(sequences, plan.added_id_columns)
    # An axis that spans the `padded_length + s` positions seen at step `s` loses the padding (prefill states and
    # queries, every step's without a cache, a dynamic cache's keys); a static cache's keys are laid out as upstream's.
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


def _strip_attentions(layers: tuple, plan, seen: int) -> tuple:
    """One step's attentions `[B, heads, query, key]` per layer, after which the model has seen `seen` positions."""
    added = plan.added_positions
    layouts = None
    if plan.run.key_layouts is not None and plan.right is None and layers:
        layouts = layouts_for(plan.run.key_layouts, len(layers))
    if layouts is None:  # a dynamic cache, or none: a key axis that spans the padded sequence loses the padding
        stripped = tuple(_strip_if(attention, -2, seen, added) for attention in layers)
        if added == 0 or seen == plan.run.static_cache_length:
            return stripped
        # Keys that span the padded sequence lose the added ones, weighed as upstream's softmax would (`place_keys`).
        return tuple(a if a is None or a.shape[-1] != seen else place_keys(a, added, seen - added) for a in stripped)
    stripped = []
    for attention, layout in zip(layers, layouts):
        if attention is not None:  # the forward's cache held `seen - query` tokens before it
            attention = upstream_keys(attention, layout, seen, added, cached=seen - attention.shape[-2])
        stripped.append(_strip_if(attention, -2, seen, added))
    return tuple(stripped)


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
    """Strips `added` from `dim` when that axis spans the padded sequence (`padded_size` positions)."""
    if tensor is None or tensor.shape[dim] != padded_size:
        return tensor
    return strip_left(tensor, added, dim=dim)

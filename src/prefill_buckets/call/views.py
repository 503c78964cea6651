"""Views that hide the padding from the objects upstream `generate` hands the padded ids to.

Logits processors, stopping criteria and prompt-lookup decoding that read token *content* (n-grams, prefixes, bad
words, the user's own) must see the ids an unpadded run has: `ids[:, pad:]`. A streamer must get the prompt without
the added columns and no dummy rows. Each view wraps one object and forwards every other attribute to it.

The hooks of the steps that build those objects (`_get_logits_processor`, `_get_stopping_criteria`,
`_get_candidate_generator`) are declared here: they wrap what upstream built.
"""

import copy

import torch
from transformers.generation import logits_process
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import MaxLengthCriteria, StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..upstream import transformers_api
from .hook_registry import hook
from .settings import parameters_of


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
    """Runs prompt-lookup decoding's n-gram search on the ids without the added columns, as an unpadded run does."""

    def __init__(self, generator, pad: int):
        super().__init__(generator, pad)
        generator.max_length -= pad  # compared with the length of the ids it sees

    def get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = self.wrapped.get_candidates(input_ids[:, self.pad :], *args, **kwargs)
        return torch.cat([input_ids[:, : self.pad], candidates], dim=1), logits

    def update_candidate_strategy(self, input_ids, *args, **kwargs):
        return self.wrapped.update_candidate_strategy(input_ids[:, self.pad :], *args, **kwargs)


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


# Processors that count the sequence length against values `_prepare_generated_length` moved by the padding (or that
# upstream set up with the padded prompt length): they must see the padded ids. Every other processor and stopping
# criterion reads token content (n-grams, prefixes, bad words, the user's own), and sees the ids without padding.
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


def _skips_left_padding(processor, user_processors) -> bool:
    """
    Whether upstream built `processor` to skip the left padding itself: from transformers 5.23 on, its repetition
    penalty gets `prompt_ignore_length` from the (padded) attention mask, so it must see the ids that mask spans.
    """
    ignore_length = getattr(processor, "prompt_ignore_length", None)
    return isinstance(ignore_length, torch.Tensor) and id(processor) not in user_processors


@hook("_get_logits_processor", reads=("generation_config", "logits_processor"), side="left")
def get_logits_processor(plan, step):
    processors = step.call()
    if plan.added_id_columns == 0:
        return processors
    user_processors = {id(p) for p in step["logits_processor"] or ()}
    wrapped = LogitsProcessorList()
    for processor in processors:
        padded_view = isinstance(processor, _PADDED_VIEW) or _skips_left_padding(processor, user_processors)
        plain = not padded_view and len(parameters_of(processor.__call__)) == 2  # extra arguments: leave it be
        if plain:
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
    # Its candidates come from the ids' content: with the padding in front, a match could start in it. An assistant
    # model's candidates come from a forward with the attention mask, which hides the padding.
    if plan.added_id_columns and transformers_api.is_prompt_lookup(generator):
        return UnpaddedPromptLookup(generator, plan.added_id_columns)
    return generator


def strip_left(tensor: torch.Tensor, pad: int, dim: int = -1) -> torch.Tensor:
    """Drops the first `pad` entries along `dim`: the inverse of `plan.left_pad`."""
    if pad == 0:
        return tensor
    return tensor.narrow(dim, pad, tensor.shape[dim] - pad)

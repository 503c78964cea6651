"""Views that hide the padding from the objects upstream `generate` hands the padded ids to.

Logits processors, stopping criteria and prompt-lookup decoding that read token *content* (n-grams, prefixes, bad
words, the user's own) must see the ids an unpadded run has: `ids[:, pad:]`. A streamer must get the prompt without
the added columns and no dummy rows. Each view wraps one object and forwards every other attribute to it.
"""

import torch
from transformers.generation.logits_process import LogitsProcessor
from transformers.generation.stopping_criteria import StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from .padding import strip_left


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

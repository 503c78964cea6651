"""Step 1 of a bucketed call: its inputs resolved once (`resolve_call`), into one frozen record every later step reads.

`generate` binds its arguments as upstream's `generate` binds them, takes the bucket fields out, resolves the settings
(`settings.py`), reads the cache it passes (`kvcache.record.PassedCache`), and finds the prompt. The support decision and the
side (`decision.choose_side`), the plan (`plan.plan_call`) and the advice for an unbucketed call read the
`ResolvedCall`; none digs into the keyword arguments again.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from ..buckets import BucketPolicy
from ..config import FIELDS
from ..kvcache.record import PassedCache
from ..upstream import transformers_api
from .settings import CallSettings, call_sets_fields, prompt_rows, resolve_settings


@dataclass(frozen=True)
class ResolvedCall:
    """One `generate` call's inputs, as step 1 resolved them. Its dicts are the call's own: no step modifies them."""

    model: Any  # the model (unwrapped from a `torch.compile(model)` wrapper)
    wrapper: Any  # the `torch.compile(model)` wrapper the call was made on, or `None`
    arguments: dict  # upstream `generate`'s named parameters the call passed, by name, in their order
    model_kwargs: (
        dict  # the rest of its keyword arguments: model inputs and generation fields, bucket fields taken out
    )
    settings: CallSettings  # what the call asks for (a later turn's: the bucket fields its cache recorded)
    passed: PassedCache  # the cache the call passes (`passed.cache`: `None` when none), read before the call writes it
    input_ids: torch.Tensor | None  # `inputs` or `input_ids`, as passed
    inputs_embeds: torch.Tensor | None

    @property
    def prompt(self) -> torch.Tensor | None:
        """What the prompt's length and rows are read from: `inputs_embeds` when passed, else the ids (or `None`)."""
        return self.inputs_embeds if self.inputs_embeds is not None else self.input_ids

    @property
    def prompt_length(self) -> int:
        """Tokens in the prompt as passed (1 without one: upstream starts from one BOS token per row)."""
        prompt = self.prompt
        return prompt.shape[1] if prompt is not None and prompt.ndim >= 2 else 1

    @property
    def rows(self) -> int:
        """The prompts the call passes (as upstream counts them when it passes none)."""
        prompt = self.prompt
        return prompt.shape[0] if prompt is not None and prompt.ndim >= 1 else prompt_rows(self.model_kwargs)

    @property
    def cache(self):
        """The cache object the call passes, or `None`."""
        return self.passed.cache

    @property
    def past_length(self) -> int:
        """The tokens the cache passed in already holds (0 without one, or when it can't tell)."""
        return self.passed.tokens or 0

    @property
    def continued(self) -> tuple[int, int] | None:
        """`(columns added in front, padded batch)` of the bucketed call that filled the cache, when it left padding."""
        return self.passed.continued


def bind_call(model, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """
    The call's arguments as upstream's `generate` binds them: `(its named parameters that were passed, in their order;
    the rest of the keyword arguments; the bucket fields among them, taken out)`.
    """
    arguments, model_kwargs = _bind(model, args, kwargs)
    field_kwargs = {field: model_kwargs.pop(field) for field in FIELDS if field in model_kwargs}
    return arguments, model_kwargs, field_kwargs


def resolve_call(model, wrapper, arguments: dict, model_kwargs: dict, field_kwargs: dict) -> ResolvedCall:
    """
    Step 1: a bound call (`bind_call`) with its settings resolved and the cache it passes read. Raises `ValueError`
    for an invalid bucket field.
    """
    passed = PassedCache(model_kwargs)  # read before the call writes the cache's record
    generation_config = arguments.get("generation_config")
    settings = resolve_settings(model, generation_config, field_kwargs, model_kwargs)
    recorded = passed.bucketing
    if recorded is not None and not call_sets_fields(generation_config, field_kwargs):
        # A later turn of a conversation: bucketed as the call that filled the cache was.
        policy, batch_policy, padding_side = recorded
        settings = dataclasses.replace(settings, policy=policy, batch_policy=batch_policy, padding_side=padding_side)
    if settings.policy is None and passed.continued is not None:
        # The cache holds a bucketed call's padding: the prompt must get it too, bucket fields or not.
        settings = dataclasses.replace(settings, policy=BucketPolicy(pad_to_multiple_of=1))
    input_ids = arguments.get("inputs")
    input_ids = input_ids if input_ids is not None else model_kwargs.get("input_ids")
    inputs_embeds = model_kwargs.get("inputs_embeds")
    return ResolvedCall(model, wrapper, arguments, model_kwargs, settings, passed, input_ids, inputs_embeds)


# `generate`'s parameters after `self`, in order, and those that may come by position.
_PARAMETERS = tuple(
    p for p in transformers_api.UPSTREAM_GENERATE_SIGNATURE.parameters.values() if p.kind != p.VAR_KEYWORD
)[1:]
_NAMED = tuple(p.name for p in _PARAMETERS)
_POSITIONAL = tuple(p.name for p in _PARAMETERS if p.kind == p.POSITIONAL_OR_KEYWORD)


def _bind(model, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """
    The call's arguments as upstream's `generate` signature binds them: `(its named parameters that were passed, in
    their order; the rest of the keyword arguments)`. What only `inspect` can bind, or must reject, goes through it.
    """
    if len(args) > len(_POSITIONAL) or "self" in kwargs or any(name in kwargs for name in _POSITIONAL[: len(args)]):
        arguments = dict(transformers_api.UPSTREAM_GENERATE_SIGNATURE.bind(model, *args, **kwargs).arguments)
        arguments.pop("self")
        return arguments, arguments.pop("kwargs", {})
    passed = dict(zip(_POSITIONAL, args))
    model_kwargs = {}
    for name, value in kwargs.items():
        if name in _NAMED:
            passed[name] = value
        else:
            model_kwargs[name] = value
    return {name: passed[name] for name in _NAMED if name in passed}, model_kwargs

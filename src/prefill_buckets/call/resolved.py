"""Step 1 of a bucketed call: its inputs, bucket fields and settings, resolved once (`resolve_call`) into the frozen
`ResolvedCall` every later step reads.

The bucket fields resolve by upstream `generate`'s priority: a keyword argument (even `None`, which turns a field off)
> the `generation_config` argument > `model.generation_config`; a call that continues a bucketed call's cache and sets
none takes the fields recorded with it. Every other value is read off the config that upstream's
`_prepare_generation_config` makes, run once here (`hooks._prepare_generation_config` hands it on to `generate`).
"""

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

from ..buckets import BucketPolicy
from ..compile.compiled_calls import compiled_forward
from ..config import FIELDS, bucketing_from_fields
from ..kvcache.record import CachePadding, PassedCache
from ..state import state_of
from ..upstream import transformers_api
from ..upstream.transformers_api import max_positions, reserved_token_ids, vocabulary_size


@dataclass(frozen=True)
class CallSettings:
    """What one `generate` call asks for, as far as padding is concerned."""

    policy: BucketPolicy | None  # prompt-length buckets; `None`: the call is not bucketed
    batch_policy: BucketPolicy | None  # batch-size buckets (`prefill_batch_buckets`)
    pad_token_id: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    num_beams: int
    num_return_sequences: int
    cache_implementation: str | None
    stop_strings: str | list[str] | None
    vocab_size: int | None
    max_positions: int | None
    # What decides the padding side (`decision.DECISION`).
    padding_side: str = "auto"  # the `prefill_padding_side` asked for: "auto", "left" or "right"
    prefill_chunk_size: int | None = None
    max_cache_len: int | None = None
    use_cache: bool = True
    output_hidden_states: bool = False
    output_attentions: bool = False
    prompt_lookup_num_tokens: int | None = None
    assistant_early_exit: int | None = None  # self-speculative decoding: the model's first layers draft candidates
    use_mtp: bool = False  # multi-token prediction heads draft candidates
    speculation_type: str | None = None  # "dflash": a draft model reads the target's hidden states
    max_new_tokens: int | None = None
    max_length: int | None = None
    config_pad_token_id: int | None = None  # the model config's own, which its forward checks unmasked inputs for
    guidance_scale: float | None = None  # classifier-free guidance: on unless `None` or 1
    token_healing: bool = False  # the prompt decoded and tokenized again inside `generate`
    model_config: Any = dataclasses.field(default=None, compare=False, repr=False)  # read for `reserved_token_ids`
    # The call's generation config, as upstream's preparation step made it (`settings_of`), and the generation fields
    # the call passed as keyword arguments, which that step took out of the model's inputs.
    generation_config: Any = dataclasses.field(default=None, compare=False, repr=False)
    generation_kwargs: frozenset = dataclasses.field(default=frozenset(), compare=False, repr=False)
    # Who calls the model (`state.ModelState.entry`): the advice of a warning names that caller's options.
    entry: str = dataclasses.field(default="generate", compare=False)

    @functools.cached_property
    def reserved_token_ids(self) -> frozenset[int]:
        """Ids the config gives another job (an image or audio placeholder): never a fill, which would count as one."""
        return reserved_token_ids(self.model_config) if self.model_config is not None else frozenset()

    def new_tokens(self, prompt_length: int) -> int:
        """The most tokens the call generates after a prompt of `prompt_length`, as upstream resolves it."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return self.max_length - prompt_length

    @property
    def returned_outputs(self) -> tuple[str, ...]:
        """What the forwards return besides the logits (`"attentions"`, `"hidden states"`): a compiled graph of its own."""
        attentions = ("attentions",) if self.output_attentions else ()
        return attentions + (("hidden states",) if self.output_hidden_states else ())

    @property
    def rows_per_prompt(self) -> int:
        """Output rows per prompt: `max(num_beams, num_return_sequences)`."""
        return max(self.num_beams, self.num_return_sequences)

    @property
    def pad_token_is_inferable(self) -> bool:
        """Whether pad tokens in `input_ids` tell the padding, as upstream infers it: a pad token that is not eos."""
        return self.pad_token_id is not None and self.pad_token_id not in self.eos_token_ids

    def in_vocabulary(self, token_id) -> bool:
        return isinstance(token_id, int) and token_id >= 0 and (self.vocab_size is None or token_id < self.vocab_size)

    def _first_free(self, candidates) -> int | None:
        """The first of `candidates` in the vocabulary that the model's config does not reserve, or `None`."""
        return next((c for c in candidates if self.in_vocabulary(c) and c not in self.reserved_token_ids), None)

    @property
    def fill_token_id(self) -> int:
        """The id that fills added positions: masked, so any in the vocabulary but one the config reserves."""
        free = self._first_free((self.pad_token_id, *self.eos_token_ids))
        if free is None:  # of any `len(reserved) + 1` ids, one is free
            free = self._first_free(range(len(self.reserved_token_ids) + 1))
        return free if free is not None else 0

    @property
    def unmasked_fill_token_id(self) -> int:
        """
        The id that fills the unmasked positions a right-padded prefill adds after the prompt: any id gives the same
        output, and one that is no pad token keeps `warn_if_padding_and_no_attention_mask` quiet.
        """
        pads = (self.pad_token_id, self.config_pad_token_id)
        candidates = (*self.eos_token_ids, self.bos_token_id, 0, 1, 2, 3)
        free = self._first_free(c for c in candidates if c not in pads)
        return free if free is not None else self.fill_token_id


@dataclass(frozen=True)
class ResolvedCall:
    """One `generate` call's inputs, as step 1 resolved them, each read once (`resolve_call`); no step modifies them."""

    model: Any  # the model (unwrapped from a `torch.compile(model)` wrapper)
    wrapper: Any  # the `torch.compile(model)` wrapper the call was made on, or `None`
    arguments: dict  # upstream `generate`'s named parameters the call passed, by name, in their order
    model_kwargs: dict  # the rest of its keyword arguments: model inputs and generation fields, bucket fields out
    # The bucket fields, validated (`policy, batch policy, padding side`; a later turn's: those its cache recorded). A
    # policy of `None`: the call is not bucketed.
    bucketing: tuple
    passed: PassedCache  # the cache the call passes (`passed.cache`: `None` when none), read before the call writes it
    input_ids: torch.Tensor | None  # `inputs` or `input_ids`, as passed
    inputs_embeds: torch.Tensor | None
    prompt: torch.Tensor | None  # what its length and rows are read from: `inputs_embeds` when passed, else the ids
    prompt_length: int  # tokens in the prompt as passed (1 without one: upstream starts from one BOS token per row)
    rows: int  # the prompts the call passes (as upstream counts them when it passes none)
    cache: Any  # the cache object the call passes, or `None`
    continued: CachePadding | None  # the padding the bucketed call that filled the cache left, or `None`

    @property
    def bucketed(self) -> bool:
        return self.bucketing[0] is not None

    @functools.cached_property
    def settings(self) -> CallSettings:
        """The call's `CallSettings`, from the generation config upstream's own step prepares, made when first read."""
        return settings_of(self.model, self.arguments.get("generation_config"), self.model_kwargs, self.bucketing)

    @functools.cached_property
    def compiled_forward(self) -> str | None:
        """How the user compiled the model's forward in place (`compiled_calls.compiled_forward`), before the call."""
        return compiled_forward(self.model)

    @functools.cached_property
    def static_cache(self) -> bool:
        """Whether the call runs on a static cache: the one it passes, or the one `generate` makes for it."""
        if self.cache is not None:
            return transformers_api.is_static_cache(self.cache)
        return self.settings.cache_implementation in transformers_api.ALL_STATIC_CACHE_IMPLEMENTATIONS

    @functools.cached_property
    def rows_mask(self) -> torch.Tensor | None:
        """The prompt's attention mask: the one the call passes, else the one upstream infers (`inferred_mask`)."""
        mask = self.model_kwargs.get("attention_mask")
        return mask if mask is not None else inferred_mask(self.settings, self.prompt)

    @functools.cached_property
    def ragged(self) -> bool:
        """Whether the prompt's rows are of different lengths: zeros in `rows_mask`."""
        return isinstance(self.rows_mask, torch.Tensor) and not bool(self.rows_mask.all())

    @property
    def output_rows(self) -> int:
        """The rows upstream generates for the user's prompts: `rows * max(num_beams, num_return_sequences)`."""
        return self.rows * self.settings.rows_per_prompt

    @property
    def past_length(self) -> int:
        """The tokens the cache passed in holds (0: none, or it can't tell); read when asked: it syncs the device."""
        return self.passed.tokens or 0


# `generate`'s parameters after `self`, in order, and those that may come by position.
_SIGNATURE = transformers_api.UPSTREAM_GENERATE_SIGNATURE
_PARAMETERS = tuple(p for p in _SIGNATURE.parameters.values() if p.kind != p.VAR_KEYWORD)[1:]
_NAMED = tuple(p.name for p in _PARAMETERS)
_POSITIONAL = tuple(p.name for p in _PARAMETERS if p.kind == p.POSITIONAL_OR_KEYWORD)


def bind_call(model, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """
    The call's arguments as upstream's `generate` binds them: `(its named parameters that were passed, in their order;
    the rest of the keyword arguments; the bucket fields among them, taken out)`.
    """
    if len(args) > len(_POSITIONAL) or "self" in kwargs or any(name in kwargs for name in _POSITIONAL[: len(args)]):
        # What only `inspect` can bind, or must reject, goes through it.
        arguments = dict(_SIGNATURE.bind(model, *args, **kwargs).arguments)
        arguments.pop("self")
        model_kwargs = arguments.pop("kwargs", {})
    else:
        passed = dict(zip(_POSITIONAL, args))
        model_kwargs = {}
        for name, value in kwargs.items():
            if name in _NAMED:
                passed[name] = value
            else:
                model_kwargs[name] = value
        arguments = {name: passed[name] for name in _NAMED if name in passed}
    field_kwargs = {field: model_kwargs.pop(field) for field in FIELDS if field in model_kwargs}
    return arguments, model_kwargs, field_kwargs


def resolve_call(model, wrapper, arguments: dict, model_kwargs: dict, field_kwargs: dict) -> ResolvedCall:
    """Step 1: a bound call (`bind_call`), its bucket fields resolved. Raises `ValueError` for an invalid field."""
    passed = PassedCache(model_kwargs)  # read before the call writes the cache's record
    generation_config = arguments.get("generation_config")
    bucketing = bucketing_of(resolve_fields(model, generation_config, field_kwargs))
    # A later turn of a conversation that sets no bucket field itself (as an argument, even `None`, or on its config)
    # is bucketed as the call that filled its cache was.
    sets_fields = bool(field_kwargs) or any(getattr(generation_config, field, None) is not None for field in FIELDS)
    if passed.bucketing is not None and not sets_fields:
        bucketing = passed.bucketing
    if bucketing[0] is None and passed.continued is not None:
        # The cache holds a bucketed call's padding: the prompt must get it too, bucket fields or not.
        bucketing = (BucketPolicy(pad_to_multiple_of=1), *bucketing[1:])
    input_ids = arguments.get("inputs")
    input_ids = input_ids if input_ids is not None else model_kwargs.get("input_ids")
    inputs_embeds = model_kwargs.get("inputs_embeds")
    prompt = inputs_embeds if inputs_embeds is not None else input_ids
    has_length, has_rows = prompt is not None and prompt.ndim >= 2, prompt is not None and prompt.ndim >= 1
    return ResolvedCall(
        model,
        wrapper,
        arguments,
        model_kwargs,
        bucketing,
        passed,
        input_ids,
        inputs_embeds,
        prompt=prompt,
        prompt_length=prompt.shape[1] if has_length else 1,
        rows=prompt.shape[0] if has_rows else prompt_rows(model_kwargs),
        cache=passed.cache,
        continued=passed.continued,
    )


def resolve_fields(model, generation_config: GenerationConfig | None, field_kwargs: dict) -> dict[str, Any]:
    """The bucket fields' values for one call, by name, by the priority of the module docstring."""
    model_config = getattr(model, "generation_config", None)
    values = {}
    for name in FIELDS:
        if name in field_kwargs:
            values[name] = field_kwargs[name]
            continue
        value = getattr(generation_config, name, None)
        values[name] = value if value is not None else getattr(model_config, name, None)
    return values


def bucketing_of(fields: dict[str, Any]) -> tuple[BucketPolicy | None, BucketPolicy | None, str]:
    """
    `(policy, batch policy, padding side)` of the bucket fields' values, validated (a `ValueError` names an invalid
    one). Values of plain types are validated once per process: every call of a workload passes the same fields.
    """
    key = tuple(_typed(fields[field]) for field in FIELDS)
    if _UNKEYED in key:  # a value of another type (a tensor, a subclass): validated on every call
        return bucketing_from_fields(**fields)
    return _bucketing_of_key(key)


_UNKEYED = object()
_PLAIN = (int, str, bool, type(None))


def _typed(value):
    """A hashable key that tells `value` from every value of another type (`True` from `1`), or `_UNKEYED`."""
    if type(value) in _PLAIN:
        return type(value), value
    if type(value) in (list, tuple) and all(type(item) in _PLAIN for item in value):
        return type(value), tuple((type(item), item) for item in value)
    return _UNKEYED


def _untyped(key):
    """The value `_typed` made `key` of (a list or tuple anew, so the policies hold no list of the user's)."""
    kind, value = key
    return kind(_untyped(item) for item in value) if kind in (list, tuple) else value


@functools.lru_cache(maxsize=64)
def _bucketing_of_key(key: tuple):
    """`bucketing_from_fields` of the fields with the typed values `key` (in `FIELDS` order): validated once per key."""
    return bucketing_from_fields(**{field: _untyped(typed) for field, typed in zip(FIELDS, key)})


def _token_ids(value) -> tuple[int, ...]:
    """A special token id, list of ids or tensor of ids, as a tuple of plain ints (empty when unset)."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        value = value.flatten().tolist()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def settings_of(
    model, generation_config: GenerationConfig | None, model_kwargs: dict, bucketing: tuple
) -> CallSettings:
    """
    What padding reads of the call's generation config, with the bucket fields (`bucketing_of`): the private copy
    upstream's `model._prepare_generation_config` makes, which takes the generation fields out of `model_kwargs`.
    """
    config, model_inputs = model._prepare_generation_config(generation_config, **model_kwargs)
    policy, batch_policy, padding_side = bucketing
    return CallSettings(
        policy=policy,
        batch_policy=batch_policy,
        pad_token_id=next(iter(_token_ids(config.pad_token_id)), None),
        eos_token_ids=_token_ids(config.eos_token_id),
        bos_token_id=next(iter(_token_ids(config.bos_token_id)), None),
        num_beams=config.num_beams or 1,
        num_return_sequences=config.num_return_sequences or 1,
        cache_implementation=config.cache_implementation,
        stop_strings=config.stop_strings,
        vocab_size=vocabulary_size(model),
        max_positions=max_positions(model),
        padding_side=padding_side,
        prefill_chunk_size=getattr(config, "prefill_chunk_size", None),
        max_cache_len=getattr(config, "max_cache_len", None),
        use_cache=config.use_cache is not False,
        output_hidden_states=bool(config.output_hidden_states),
        output_attentions=bool(config.output_attentions),
        prompt_lookup_num_tokens=config.prompt_lookup_num_tokens,
        assistant_early_exit=getattr(config, "assistant_early_exit", None),
        use_mtp=bool(getattr(config, "use_mtp", False)),
        speculation_type=getattr(config, "speculation_type", None),
        max_new_tokens=config.max_new_tokens,
        max_length=config.max_length,
        config_pad_token_id=next(iter(_token_ids(getattr(model.config, "pad_token_id", None))), None),
        guidance_scale=config.guidance_scale,
        token_healing=bool(getattr(config, "token_healing", False)),
        model_config=model.config,
        generation_config=config,
        generation_kwargs=frozenset(model_kwargs.keys() - model_inputs.keys()),
        entry=state_of(model).entry,
    )


def resolve_settings(
    model, generation_config: GenerationConfig | None, field_kwargs: dict, model_kwargs: dict
) -> CallSettings:
    """The settings of a call made with these arguments (`settings_of`). Raises `ValueError` for an invalid field."""
    bucketing = bucketing_of(resolve_fields(model, generation_config, field_kwargs))
    return settings_of(model, generation_config, model_kwargs, bucketing)


def inferred_mask(settings: CallSettings, prompt) -> torch.Tensor | None:
    """The mask upstream infers for integer ids `prompt` passed without one: pad tokens (not eos) masked; or `None`."""
    if not (isinstance(prompt, torch.Tensor) and prompt.dtype in (torch.long, torch.int)):
        return None
    if not settings.pad_token_is_inferable or not bool((prompt == settings.pad_token_id).any()):
        return None
    return prompt.ne(settings.pad_token_id).long()


def prompt_rows(model_kwargs: dict) -> int:
    """The rows of a call that passes no prompt, as upstream counts them: those of its first tensor input (or 1)."""
    return next((v.shape[0] for v in model_kwargs.values() if isinstance(v, torch.Tensor)), 1)


def bos_prompt(model, settings: CallSettings, model_kwargs: dict) -> torch.Tensor:
    """The prompt upstream starts from when a call passes none, `[rows, 1]`: one BOS token per row."""
    if settings.bos_token_id is None:
        raise ValueError("`bos_token_id` has to be defined when no `input_ids` are provided.")
    return torch.full((prompt_rows(model_kwargs), 1), settings.bos_token_id, dtype=torch.long, device=model.device)

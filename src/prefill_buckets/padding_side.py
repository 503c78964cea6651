"""Which side a call's bucket padding goes: the one rule (`choose_side`), from the call's settings and arguments.

Right padding puts the pad tokens after the prompt: prefill runs the prompt with no attention mask (causal SDPA, as
upstream runs an unpadded prompt), the first new token comes from the logits at the prompt's last position, and
decode starts at the prompt's length, overwriting the pad slots of the static cache one by one (the causal mask hides
those not yet written). Rows of different lengths (a batch the tokenizer padded on the left) are padded each after its
own end, and decode masks each row's pad slots (`prefill_right.py`). That is exact only where every layer can forget
the pads and each row's positions follow its tokens. Where it is not, the call is left-padded (masked), as before. The
cases, and why:

| case | side | why |
|---|---|---|
| `prefill_padding_side="left"` | left | asked for |
| assisted or prompt-lookup decoding | left | upstream runs the prompt together with the first candidates |
| chunked prefill (`prefill_chunk_size`) | left | the user bounds the prefill's memory; one bucket-long forward ignores it |
| no cache (`use_cache=False`) or a dynamic cache | left | a dynamic cache is not compiled: no graph to share |
| `output_hidden_states`, `output_attentions` | left | per-position prefill outputs (the left path strips them) |
| attention other than sdpa and eager | left | flash and flex attention with a static cache need the 2D mask |
| a forward without `logits_to_keep` | left | it would compute logits for every pad position |
| recurrent, convolutional or chunked-attention layers | left | the pads would run through their state |
| a sliding window shorter than the cached tokens plus the bucket | left | the ring buffer would drop real tokens |
| rows of different lengths padded on the right, with zeros between tokens, or an empty row | left | upstream reads a short right-padded row's first token at a pad: only its mask gives that |
| rows of different lengths with a sliding window, continuing a cache, or a forward without `position_ids` | left | the window counts slots; the cache's rows need the mask; positions must follow each row |
| a cache filled by a left-padded call, or by rows of different lengths | left | the prompt must line up with the padding in the cache |
| `inputs_embeds` continuing from a cache, other per-token or multimodal inputs | left | not padded on the right |
| pad positions past `max_position_embeddings` | left | the model has no such positions |
| attention that is not causal (`is_decoder=False`, as BERT-style models) | left | the prompt would attend to the pads |
| everything else: beam search, `num_return_sequences`, streamers, scores, lengths, a continued conversation, `inputs_embeds`, `prefill_batch_buckets` | right | exact (tested) |
| rows of different lengths, left-padded (each row's mask zeros then ones; passed, or inferred from pad tokens) | right | each row after its own end, first tokens gathered per row (tested) |

With `"auto"` (the default) the rule picks; an explicit `"right"` where the rule says left logs the reason, once, and
pads on the left: never silently wrong.

Each side also assumes something of the model (`SIDE_ASSUMPTIONS`, checked in order): right padding needs causal
attention, left padding a model that takes its positions from `position_ids` or the mask (a forward without
`position_ids` but with a positional or rotary embedding module, as TrOCR, ProphetNet and the BART-family decoders,
counts positions from the cache length, so pads in front would shift them; recurrent and ALiBi models have none). Where the rule says left and the model can't take left padding either, the call runs unpadded,
exact, and the package logs why, once.
"""

import inspect
from dataclasses import dataclass

import torch
from transformers.utils import logging

from . import _compat
from .cache import cache_seq_length, continued_padding, passed_cache, ragged_rows_mask
from .config import PREFILL_PADDING_SIDE
from .settings import CallSettings, max_positions
from .state import state_of


logger = logging.get_logger(__name__)

# Model inputs the right-padded prefill knows: the prompt, its all-ones mask, and the cache.
_RIGHT_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "cache", "past_key_values")


@dataclass(frozen=True)
class PaddingSide:
    """The side of one call's padding, and why."""

    side: str  # "left", "right", or "unpadded" (neither side is exact: the call runs upstream's unpadded path)
    reason: str
    bucket: int | None = None  # right: the bucket of the new tokens (the prompt, less what the cache holds)
    past_length: int = 0  # right: the tokens the cache already holds


def _attention_is_bidirectional(model) -> bool:
    """
    BERT-style models attend both ways unless `is_decoder` is set. Other configs carry `is_decoder=False` too (GPT-NeoX),
    with attention modules that say they are causal: those count as causal.
    """
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "is_decoder", None) is not False:
        return False
    return not any(module.__dict__.get("is_causal") is True for module in model.modules())


def _positions_from_the_mask(model) -> bool:
    """
    No `position_ids` and no `max_position_embeddings`: positions are ALiBi biases built from the attention mask
    (BLOOM), which the right-padded prefill leaves out (on transformers 5.17 BLOOM then fails), or there are none.
    """
    return "position_ids" not in inspect.signature(model.forward).parameters and max_positions(model) is None


def _positions_count_from_the_cache(model) -> bool:
    """No `position_ids`, but position embeddings (learned, sinusoidal or rotary): counted from the cache length."""
    if "position_ids" in inspect.signature(model.forward).parameters:
        return False
    return any(
        "Positional" in type(module).__name__ or "Rotary" in type(module).__name__ for module in model.modules()
    )


# Models whose forward takes an attention mask and ignores it: pads in front would run through them.
MASK_IGNORED_BY = ("RwkvForCausalLM",)
# Models whose attention builds its own mask from the key states over every slot it reads (Doge's dynamic mask): pads
# on either side reach it (other tokens on transformers 5.17, right and left).
MASK_FROM_KEYS = ("DogeForCausalLM",)
# Models that add the cache length to the positions they are given at decode (GIT on transformers 5.17): positions
# taken from a left-padded mask would be shifted by the pads.
POSITIONS_PLUS_CACHE = ("GitForCausalLM",)


def _ignores_the_mask(model) -> bool:
    return type(model).__name__ in MASK_IGNORED_BY


def _masks_from_keys(model) -> bool:
    return type(model).__name__ in MASK_FROM_KEYS


def _adds_the_cache_length_to_positions(model) -> bool:
    return type(model).__name__ in POSITIONS_PLUS_CACHE


def _compresses_the_cache(model) -> bool:
    """Whether layers pool the tokens they cache into blocks (DeepSeek-V4's compressed attention): pads would join."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None) or ()
    return getattr(config, "compress_rates", None) is not None or any("compress" in str(t) for t in layer_types)


def _drops_the_mask(model) -> bool:
    """Whether the model's own `prepare_inputs_for_generation` leaves the mask out of the model inputs (XLNet)."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    try:
        model_inputs = model.prepare_inputs_for_generation(ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception:  # can't tell from here: the hook raises at the call if the mask is dropped
        return False
    return isinstance(model_inputs, dict) and "attention_mask" not in model_inputs


# What each side assumes of the model, in order: (side, the model breaks it, why). Data, so a case is one line.
SIDE_ASSUMPTIONS = (
    (
        "right",
        _attention_is_bidirectional,
        "its attention is not causal (`is_decoder=False`): the prompt would attend to the pads after it",
    ),
    (
        "right",
        _positions_from_the_mask,
        "its forward takes no `position_ids` and states no `max_position_embeddings`: positions come from the mask",
    ),
    (
        "right",
        _masks_from_keys,
        "its attention builds a dynamic mask from the keys, which would see the pads after it",
    ),
    (
        "left",
        _attention_is_bidirectional,
        "its attention is not causal (`is_decoder=False`), and masked pads in front changed XLM-RoBERTa-XL's tokens",
    ),
    (
        "left",
        _positions_count_from_the_cache,
        "its forward takes no `position_ids` and counts positions from the cache, so pads in front would shift them",
    ),
    ("left", _drops_the_mask, "its `prepare_inputs_for_generation` does not pass the attention mask on"),
    ("left", _ignores_the_mask, "its forward ignores the attention mask"),
    ("left", _masks_from_keys, "its attention builds a dynamic mask from the keys, which would see the pads in front"),
    (
        "left",
        _adds_the_cache_length_to_positions,
        "its forward adds the cache length to the positions at decode, so pads in front would shift them",
    ),
    ("left", _compresses_the_cache, "its attention compresses the cached tokens in blocks, pads in front included"),
)


def side_assumption_broken(model, side: str) -> str | None:
    """Why `model` can't be padded on `side` whatever the call (`SIDE_ASSUMPTIONS`), or `None`. Once per model."""
    known = state_of(model).side_assumptions
    if side not in known:
        known[side] = next(
            (
                f"`{type(model).__name__}`: {reason}"
                for assumed_side, breaks, reason in SIDE_ASSUMPTIONS
                if assumed_side == side and breaks(model)
            ),
            None,
        )
    return known[side]


def choose_side(model, settings: CallSettings, arguments: dict, model_kwargs: dict) -> PaddingSide:
    """The padding side of a bucketed call (see the module docstring for the rule)."""
    side = _rule(model, settings, arguments, model_kwargs)
    if side.side == "left":
        left_broken = side_assumption_broken(model, "left")
        if left_broken is not None:
            return PaddingSide("unpadded", f"{left_broken}; and it is not padded on the right: {side.reason}")
    if side.side == "left" and settings.padding_side == "right":
        logger.warning_once(
            f"`{PREFILL_PADDING_SIDE}='right'` is not exact for this call, so it is padded on the left: {side.reason}."
        )
    return side


def _prompt(arguments: dict, model_kwargs: dict):
    if model_kwargs.get("inputs_embeds") is not None:
        return model_kwargs["inputs_embeds"]
    prompt = arguments.get("inputs")
    return prompt if prompt is not None else model_kwargs.get("input_ids")


def _rule(model, settings: CallSettings, arguments: dict, model_kwargs: dict) -> PaddingSide:
    def left(reason: str) -> PaddingSide:
        return PaddingSide("left", reason)

    if settings.padding_side == "left":
        return left(f"`{PREFILL_PADDING_SIDE}='left'`")
    right_broken = side_assumption_broken(model, "right")
    if right_broken is not None:
        return left(right_broken)
    if arguments.get("assistant_model") is not None or settings.prompt_lookup_num_tokens is not None:
        return left("assisted and prompt-lookup decoding run the prompt together with the first candidates")
    if settings.prefill_chunk_size is not None:
        return left("chunked prefill (`prefill_chunk_size`) bounds each forward's length, and a bucket is one forward")
    if not settings.use_cache:
        return left("there is no cache (`use_cache=False`) to write the prompt into")
    if settings.output_hidden_states or settings.output_attentions:
        return left("`output_hidden_states` and `output_attentions` return the prefill's per-position outputs")
    attention = _compat.attention_implementation(model.config)
    if attention not in ("sdpa", "eager"):
        return left(f"`{attention}` attention needs the attention mask with a static cache (right: sdpa and eager)")
    if "logits_to_keep" not in inspect.signature(model.forward).parameters:
        return left(f"`{type(model).__name__}.forward` takes no `logits_to_keep`: it would compute every pad's logits")
    others = sorted(k for k, v in model_kwargs.items() if isinstance(v, torch.Tensor) and k not in _RIGHT_INPUTS)
    if others:
        return left(f"the input `{others[0]}` is not padded on the right")

    prompt = _prompt(arguments, model_kwargs)
    if prompt is None:  # upstream starts from one BOS token per row
        prompt_length, rows = 1, next((v.shape[0] for v in model_kwargs.values() if isinstance(v, torch.Tensor)), 1)
    elif prompt.ndim < 2 or prompt.shape[1] == 0:
        return left("the prompt is not a [batch, length] tensor")  # the left path raises the error
    else:
        prompt_length, rows = prompt.shape[0:2][::-1]
    cache = passed_cache(model_kwargs)
    if cache is None:
        if settings.cache_implementation not in _compat.ALL_STATIC_CACHE_IMPLEMENTATIONS or "offloaded" in str(
            settings.cache_implementation
        ):
            return left("the cache is not a static cache (a dynamic cache is not compiled: no graph to share)")
        past_length = 0
    else:
        if not _compat.is_static_cache(cache):
            return left(f"the cache passed in is a `{type(cache).__name__}`, not a `StaticCache`")
        past_length = cache_seq_length(cache) or 0
        continued = continued_padding(model_kwargs)
        if continued is not None and (continued[0] > 0 or continued[1] != rows):
            return left("the cache holds a left-padded call's tokens, and the prompt must line up with them")
        if past_length and ragged_rows_mask(cache) is not None:
            return left(
                "the cache holds rows of different lengths, each at the start of its slots: a mask lines them up"
            )
        if past_length and model_kwargs.get("inputs_embeds") is not None:
            return left("`inputs_embeds` continuing from a cache are not padded on the right")
    new_tokens = prompt_length - past_length
    if new_tokens < 1:
        return left("the cache already holds the whole prompt")
    bucket = settings.policy.bucket(new_tokens)
    slots = past_length + bucket
    if settings.max_positions is not None and slots > settings.max_positions:
        return left(f"the pad positions would pass `max_position_embeddings={settings.max_positions}`")
    layers_reason = _layers_reason(model, cache, slots)
    if layers_reason is not None:
        return left(layers_reason)
    if cache is None and settings.max_cache_len is not None and settings.max_cache_len < slots:
        return left(
            f"`max_cache_len={settings.max_cache_len}` is shorter than the {slots} slots the padded prompt fills"
        )
    if cache is not None and _compat.static_cache_slots(cache) < slots:
        return left(
            f"the cache passed in has {_compat.static_cache_slots(cache)} slots, fewer than the {slots} needed"
        )
    ragged_reason = _ragged_reason(model, settings, model_kwargs, prompt, past_length, cache, slots)
    if ragged_reason is not None:
        return left(ragged_reason)
    return PaddingSide("right", "exact", bucket=bucket, past_length=past_length)


def _ragged_reason(
    model, settings: CallSettings, model_kwargs: dict, prompt, past_length: int, cache, slots: int
) -> str | None:
    """
    Why rows of different lengths (zeros in the attention mask, passed or inferred from pad tokens as upstream infers
    it) can't be right-padded each after its own end, or `None` when they can (or the rows are all one length).
    """
    mask = model_kwargs.get("attention_mask")
    if mask is None and isinstance(prompt, torch.Tensor) and prompt.dtype in (torch.long, torch.int):
        if settings.pad_token_is_inferable and bool((prompt == settings.pad_token_id).any()):
            mask = prompt.ne(settings.pad_token_id)  # upstream's inferred mask
    if not isinstance(mask, torch.Tensor) or bool(mask.all()):
        return None
    if mask.ndim != 2 or prompt is None or mask.shape != prompt.shape[:2]:
        return "the attention mask is not a [batch, length] mask of the prompt"
    if past_length:
        return "rows of different lengths continuing from a cache need the mask to line them up with the cached rows"
    if not bool(((mask == 0) | (mask == 1)).all()):
        return "the attention mask holds values other than 0 and 1"
    mask = mask.long()
    if not bool(mask.any(dim=-1).all()):
        return "a row of the batch has no token (its attention mask is all zeros)"
    if not bool((mask[:, 1:] >= mask[:, :-1]).all()):  # left padding: each row's zeros, then its ones
        if bool((mask[:, 1:] <= mask[:, :-1]).all()):
            return (
                "the batch is padded on the right: upstream reads a short row's first new token at a pad position, "
                "which only its mask reproduces (decoder-only batches are padded on the left)"
            )
        return "the attention mask has zeros between a row's tokens"
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return f"`{type(model).__name__}.forward` takes no `position_ids`: each row's positions must follow its tokens"
    if _has_sliding_layers(model, cache, slots):
        return "a sliding window counts cache slots, and a short row's pads would sit after its tokens, not before"
    return None


def _has_sliding_layers(model, cache, slots: int) -> bool:
    """Whether the cache (passed in, or the one `generate` will make) has sliding-window layers."""
    if cache is not None:
        return any(_compat.sliding_window_slots(layer) is not None for layer in cache.layers)
    known = state_of(model).ragged_sliding_layers
    if slots not in known:  # `_layers_reason` built the lazy cache already when it could: this one can't fail
        known[slots] = any(
            _compat.sliding_window_slots(layer) is not None for layer in _compat.lazy_static_cache(model, slots).layers
        )
    return known[slots]


def _layers_reason(model, cache, slots: int) -> str | None:
    """Why the cache's layers can't take right padding into `slots` slots, or `None` when they can."""
    if cache is not None:
        return _reason_for(cache.layers, slots)
    # The cache `generate` will make: its layer types depend on the model and the slots only, so the (lazy, empty)
    # cache built to read them is built once per slot count, not on every call.
    known = state_of(model).right_padding_layers
    if slots not in known:
        try:
            known[slots] = _reason_for(_compat.lazy_static_cache(model, slots).layers, slots)
        except Exception as error:  # a model whose config a static cache can't be built from
            known[slots] = f"a static cache for this model can't be checked ({type(error).__name__})"
    return known[slots]


def _reason_for(layers, slots: int) -> str | None:
    for layer in layers:
        kind = type(layer).__name__
        if kind not in _compat.RIGHT_PADDED_LAYERS or getattr(layer, "is_linear", False):
            return f"the cache has `{kind}` layers (recurrent, convolutional or chunked), which can't forget the pads"
        window = _compat.sliding_window_slots(layer)
        if window is not None and window < slots:
            return f"a sliding window of {window} slots is shorter than the {slots} the padded prompt fills"
    return None

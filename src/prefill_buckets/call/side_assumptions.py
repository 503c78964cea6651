"""What each padding side assumes of the model: the predicates rows of `decision.DECISION` test, asked once per model
(`model_breaks`). Right padding needs causal attention and positions that don't come from the mask; left padding a
model that takes its positions from `position_ids` or the mask, and passes the mask on. A few depend on the call too:
its cache (`window_reason`, `cache_layers_reason`, `cache_has_sliding_layers`) and what PEFT passes the layers.
"""

import sys

import torch

from ..kvcache.kv_shapes import projection_features
from ..state import state_of
from ..upstream import torch_api, transformers_api
from ..upstream.transformers_api import forward_takes, max_positions


def attention_is_bidirectional(model) -> bool:
    """`is_decoder=False` (BERT-style), unless an attention module says `is_causal` (GPT-NeoX carries it too)."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "is_decoder", None) is not False:
        return False
    return not any(module.__dict__.get("is_causal") is True for module in model.modules())


def positions_from_the_mask(model) -> bool:
    """No `position_ids` nor `max_position_embeddings`: ALiBi from the mask (BLOOM), which right padding leaves out."""
    return not forward_takes(model, "position_ids") and max_positions(model) is None


def positions_count_from_the_cache(model) -> bool:
    """No `position_ids`, but position embeddings (learned, sinusoidal or rotary): counted from the cache length."""
    if forward_takes(model, "position_ids"):
        return False
    return any(
        "Positional" in type(module).__name__ or "Rotary" in type(module).__name__ for module in model.modules()
    )


# Models whose forward takes an attention mask and ignores it: pads in front would run through them (CPM-Ant reads
# padding from its ids' zeros instead, which a generated 0 after pads of 0 confuses, upstream's own call alike).
MASK_IGNORED_BY = ("RwkvForCausalLM", "CpmAntForCausalLM")
# Models whose attention builds its own mask from the key states over every slot it reads (Doge's dynamic mask): pads
# on either side reach it (other tokens on transformers 5.17, right and left).
MASK_FROM_KEYS = ("DogeForCausalLM",)
# Models that add the cache length to the positions they are given at decode (GIT on transformers 5.17): positions
# taken from a left-padded mask would be shifted by the pads.
POSITIONS_PLUS_CACHE = ("GitForCausalLM",)


# Models whose local-attention layers place their window from the cache's last slot, not the query's position (GPT-Neo
# slices its causal buffer by the key length), by class name: the config field that holds the window.
WINDOW_FROM_THE_CACHE_END = {"GPTNeoForCausalLM": "window_size"}


def window_from_the_cache_end(model) -> int | None:
    """The window of `model`'s local layers when they count it from the cache's end (`WINDOW_FROM_THE_CACHE_END`)."""
    field = WINDOW_FROM_THE_CACHE_END.get(type(model).__name__)
    if field is None:
        return None
    window = getattr(model.config, field, None)
    layers = getattr(model.config, "attention_layers", None) or ()
    return window if isinstance(window, int) and "local" in layers else None


def window_reason(call) -> str | None:
    """
    Why a call (`padding_side.RuleFacts`) on a model whose local window counts from the cache's end must run unpadded,
    or `None`: upstream's tokens depend on a cache longer than the window, which bucketing sizes another way.
    """
    window = window_from_the_cache_end(call.model)
    if window is None or not call.settings.use_cache or not call.bucketable_cache:
        return None
    if call.cache is not None:
        slots, whose = call.cache_slots, "the cache passed in has"
    elif call.settings.max_cache_len is not None:
        slots, whose = call.settings.max_cache_len, "`max_cache_len` is"
    else:
        # Sized by the package: the model's cache when the call fits it, else at most the model's positions (or
        # what the call needs, when that is more).
        needed = call.bucket + call.settings.new_tokens(call.prompt_length)
        previous = transformers_api.previous_max_cache_length(call.model)
        slots = previous if previous >= needed else max(needed, call.settings.max_positions or needed + window)
        whose = "a bucketed call's static cache can have"
    if slots <= window:
        return None
    return (
        f"`{call.model_name}`'s local attention layers place their window of {window} tokens from the end of the "
        f"static cache, not from each token, so upstream's tokens depend on the cache's length once it is longer "
        f"than the window, and {whose} {slots} slots: a padded prompt in a bucketed cache would get other tokens. "
        "Pin `max_cache_len` to at most the window to bucket, or use a dynamic cache"
    )


def ignores_the_mask(model) -> bool:
    return type(model).__name__ in MASK_IGNORED_BY


def masks_from_keys(model) -> bool:
    return type(model).__name__ in MASK_FROM_KEYS


def adds_the_cache_length_to_positions(model) -> bool:
    return type(model).__name__ in POSITIONS_PLUS_CACHE


def keeps_a_state_on_its_modules(model) -> bool:
    """Whether recurrent blocks keep their state on their modules, outside the cache (RecurrentGemma)."""
    return any("recurrent_states" in module.__dict__ for module in model.modules())


def counts_no_tokens(model) -> bool:
    """
    Whether the static cache counts its tokens by a recurrent layer the model never writes (RecurrentGemma on
    transformers 5.25): the cache then reads as empty, and a later turn can't line up with its padding.
    """
    return keeps_a_state_on_its_modules(model) and transformers_api.counts_by_a_recurrent_layer(model)


def compresses_the_cache(model) -> bool:
    """Whether layers pool the tokens they cache into blocks (DeepSeek-V4's compressed attention): pads would join."""
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None) or ()
    return getattr(config, "compress_rates", None) is not None or any("compress" in str(t) for t in layer_types)


def _latent_key_heads(module) -> int | None:
    """The key heads a multi-head latent attention module builds (`kv_b_proj`: nope and value parts per head)."""
    rows = projection_features(getattr(module, "kv_b_proj", None))
    part = [module.__dict__.get(name) for name in ("qk_nope_head_dim", "v_head_dim")]
    if rows is None or not all(isinstance(p, int) and p > 0 for p in part):
        return None
    return rows // sum(part) if rows % sum(part) == 0 else None


def repeated_key_heads(model) -> tuple[int, int] | None:
    """
    `(keys repeated, query heads)` of the first attention module whose keys, repeated `num_key_value_groups` times,
    are not its query heads (latent attention with `num_key_value_heads` below `num_attention_heads`), or `None`:
    upstream's masked attention then fails, and only SDPA without a mask runs.
    """
    for module in model.modules():
        groups, heads = module.__dict__.get("num_key_value_groups"), module.__dict__.get("num_heads")
        if not (isinstance(groups, int) and groups > 1 and isinstance(heads, int)):
            continue
        keys = _latent_key_heads(module)
        if keys is not None and keys * groups != heads:
            return keys * groups, heads
    return None


def drops_the_mask(model) -> bool:
    """Whether the model's own `prepare_inputs_for_generation` leaves the mask out of the model inputs (XLNet)."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=model.device)
    try:
        model_inputs = model.prepare_inputs_for_generation(ids, attention_mask=torch.ones_like(ids), use_cache=False)
    except Exception:  # can't tell from here: the hook raises at the call if the mask is dropped
        return False
    return isinstance(model_inputs, dict) and "attention_mask" not in model_inputs


def model_breaks(model, assumption) -> bool:
    """Whether `model` breaks `assumption` (one of the predicates above), asked once per model."""
    known = state_of(model).side_assumptions
    if assumption.__name__ not in known:
        known[assumption.__name__] = bool(assumption(model))
    return known[assumption.__name__]


# What PEFT passes a call's LoRA layers per row through forward pre-hooks (`adapter_names`, activated LoRA's
# `alora_offsets`), each with whether it counts positions from the end of each forward: dummy rows have no entry (PEFT
# raises), and pads after the prompt, or in front of a chunk's end, would move the offsets.
PEFT_ROW_ARGUMENTS = {"adapter_names": False, "alora_offsets": True}


def peft_row_arguments(model) -> dict[str, bool]:
    """`{name: counts from a forward's end}` of the `PEFT_ROW_ARGUMENTS` passed to `model`'s layers now, or `{}`."""
    if "peft" not in sys.modules:  # only PEFT registers them: without it, no walk over the modules
        return {}
    passed = torch_api.forward_pre_hook_keywords(model, PEFT_ROW_ARGUMENTS)
    return {name: PEFT_ROW_ARGUMENTS[name] for name in sorted(passed)}


def cache_has_sliding_layers(model, cache, slots: int) -> bool:
    """Whether the cache (passed in, or the one `generate` will make) has sliding-window layers."""
    if cache is not None:
        return any(transformers_api.sliding_window_slots(layer) is not None for layer in cache.layers)
    known = state_of(model).ragged_sliding_layers
    if slots not in known:  # `cache_layers_reason` built the lazy cache already when it could: this one can't fail
        known[slots] = any(
            transformers_api.sliding_window_slots(layer) is not None
            for layer in transformers_api.lazy_static_cache(model, slots).layers
        )
    return known[slots]


def cache_layers_reason(model, cache, slots: int) -> str | None:
    """Why the cache's layers can't take right padding into `slots` slots, or `None` when they can."""
    if cache is not None:
        return _reason_for(cache.layers, slots)
    # The cache `generate` will make: its layers depend on the model and the slots only, read once per slot count.
    known = state_of(model).right_padding_layers
    if slots not in known:
        try:
            known[slots] = _reason_for(transformers_api.lazy_static_cache(model, slots).layers, slots)
        except Exception as error:  # a model whose config a static cache can't be built from
            known[slots] = f"a static cache for this model can't be checked ({type(error).__name__})"
    return known[slots]


def _reason_for(layers, slots: int) -> str | None:
    for layer in layers:
        kind = type(layer).__name__
        if kind not in transformers_api.RIGHT_PADDED_LAYERS or getattr(layer, "is_linear", False):
            return f"the cache has `{kind}` layers (recurrent, convolutional or chunked), which can't forget the pads"
        window = transformers_api.sliding_window_slots(layer)
        if window is not None and window < slots:
            return f"a sliding window of {window} slots is shorter than the {slots} the padded prompt fills"
    return None

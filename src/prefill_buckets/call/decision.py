"""Step 3 of a bucketed call: the one decision of how it is padded (`choose_side`), from one table, `DECISION`.

Each row is a condition over the call's facts (`padding_side.RuleFacts`), an outcome (`raise`, `unpadded`, `left` or
`right`), why (for the docs' What runs exactly page, which shows `decision_table`: `python -m
prefill_buckets.call.decision`) and the reason logged or raised. The rows are checked in order and the first that
applies decides: calls padding can't serve on either side; calls that can't be padded on the right
(`RuleFacts.not_right`, the first `left` row that applies) nor on the left; the batch's rows; then `left` where right
padding is not exact, else `right`. The decision also gives the batch bucket and the pad id of rows that finish early.

Two checks stay in the run, for cases no fact before the call tells: a right-padded call for which `generate` makes
no static cache runs its prefill unpadded (`prefill_right.py`), and a left-padded call whose model step drops a mask
that hides tokens raises (`hooks._check_mask_passed_on`).
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

from transformers.utils import logging

from ..config import BUCKET_FIELDS, PREFILL_BATCH_BUCKETS, PREFILL_BUCKETS, PREFILL_PADDING_SIDE
from ..upstream.transformers_api import forward_takes
from . import side_assumptions
from .padding_side import RuleFacts, capped_bucket, count, warn_long_prompt
from .plan import PaddingSide
from .resolved import ResolvedCall
from .side_assumptions import window_reason


logger = logging.get_logger(__name__)

__all__ = ["DECISION", "capped_bucket", "choose_side", "decision_table"]

OUTCOMES = ("raise", "unpadded", "left", "right")


@dataclass(frozen=True)
class Row:
    """One case of the decision: a call for which `condition` holds has `outcome`, and says `reason`."""

    case: str  # when it applies, in words (the table's first column)
    outcome: str  # one of `OUTCOMES`: "raise" is a `ValueError`
    why: str  # why that outcome, in words (the table's third column)
    condition: Callable[[RuleFacts], object]  # truthy when the row applies: what it returns is `{found}` in `reason`
    reason: str  # what the log or the error says: `reason.format(call=facts, found=what condition returned)`

    def check(self, facts: RuleFacts) -> str | None:
        """The row's reason for the call, when it applies; else `None`."""
        found = self.condition(facts)
        return self.reason.format(call=facts, found=found) if found else None


def _model_row(outcome: str, case: str, why: str, assumption: Callable, reason: str) -> Row:
    """
    The row of a model that breaks one of a side's assumptions (`side_assumptions`), whatever the call: on the right,
    the call is padded on the left; on the left (`unpadded`), where it can't be padded on the right either, unpadded;
    on both (`neither`), unpadded."""
    reason = f"`{{call.model_name}}`: {reason}"
    if outcome in ("left", "neither"):  # neither: the model breaks the assumption on both sides
        return Row(case, outcome.replace("neither", "unpadded"), why, lambda call: call.breaks(assumption), reason)
    return Row(
        f"left only: {case}",
        outcome,
        why,
        lambda call: call.not_right and call.breaks(assumption),
        f"{reason}; and it is not padded on the right: {{call.not_right}}",
    )


def _dummy_rows_lost(call: RuleFacts) -> str | None:
    """Why a continued cache's dummy rows (`prefill_batch_buckets`) can't come back in this call, or `None`."""
    if call.continued is None or call.batch_kept_reason is None:
        return None
    return (
        f"The cache passed in holds {count(call.wanted_batch - call.rows, 'dummy row')} of `{PREFILL_BATCH_BUCKETS}` "
        f"after the {count(call.rows, 'prompt')} of the call that filled it, which this call can't bring back: "
        f"{call.batch_kept_reason}. Leave `{PREFILL_BATCH_BUCKETS}` unset on the call that starts a conversation you "
        "continue this way."
    )


_FIELDS = ", ".join(f"`{field}`" for field in BUCKET_FIELDS)

# The decision, in the order its rows are checked: the first that applies decides (the module docstring).
DECISION = (
    Row(
        "an encoder-decoder model",
        "raise",
        "its prompt goes to the encoder: pad it there",
        lambda call: call.model.config.is_encoder_decoder,
        f"The prefill bucket fields ({_FIELDS}) support decoder-only models, but {{call.model_name}} is an "
        "encoder-decoder model. Its prompt goes to the encoder: pad it there with the tokenizer's `pad_to_multiple_of` "
        "(any side, with the attention mask), and unset the fields.",
    ),
    Row(
        "`custom_generate`",
        "unpadded",
        "it replaces the generation loop",
        lambda call: call.arguments.get("custom_generate") is not None,
        "`custom_generate` replaces the generation loop",
    ),
    Row(
        "continuous batching (`cache_implementation='paged'`)",
        "unpadded",
        "continuous batching pads by its own intervals",
        lambda call: call.model_kwargs.get("cache_implementation") == "paged",
        "`cache_implementation='paged'` switches to continuous batching, which pads by its own intervals when it "
        "compiles or captures CUDA graphs: each step's query tokens to a multiple of "
        "`ContinuousBatchingConfig.q_padding_interval_size` (64 by default) and its cache reads to "
        "`kv_padding_interval_size`. Set those on the `ContinuousBatchingConfig` instead, or drop "
        "`cache_implementation='paged'` to use the buckets",
    ),
    Row(
        "a cache of recurrent layers only",
        "unpadded",
        "a state and no keys: the prompt can't be lined up with them",
        lambda call: call.passed.tokens is None or call.passed.recurrent_only,
        "the cache passed in has only recurrent (linear-attention) layers, which hold a state and no keys (before "
        "transformers 5.25 not even how many tokens they hold), so the prompt can't be lined up with them. Let "
        "`generate` create the cache",
    ),
    Row(
        "a forward without `attention_mask`",
        "unpadded",
        "padding could not be masked",
        lambda call: not forward_takes(call.model, "attention_mask"),
        "`{call.model_name}.forward` takes no `attention_mask`, so padding could not be masked",
    ),
    Row(
        "assisted or prompt-lookup decoding from `inputs_embeds` alone",
        "unpadded",
        "upstream cuts the mask to the ids, which hold no prompt",
        lambda call: call.decodes_candidates and call.embeds_only,
        "assisted and prompt-lookup decoding from `inputs_embeds` alone cut the attention mask to the ids, which hold "
        "no prompt: the padding's mask would be lost. Pass `input_ids` to bucket it",
    ),
    Row(
        "candidates drafted from what padding changes: the target's outputs (`use_mtp`, a Gemma 4 assistant, DFlash), "
        "or an assistant with another tokenizer",
        "unpadded",
        "padding would change the candidates, and sampled tokens",
        lambda call: call.decodes_candidates and call.drafter_padding_changes,
        "{found} (upstream runs it on one unpadded row): padding would change the candidates, and sampled tokens",
    ),
    Row(
        "assisted or prompt-lookup decoding with `output_hidden_states` or `output_attentions`",
        "unpadded",
        "upstream returns the first positions' states, which padding fills",
        lambda call: call.decodes_candidates and call.settings.returned_outputs,
        "upstream returns, for the tokens its first candidate check accepts after the first, the states of the "
        "sequence's first positions (`_split_model_outputs` slices from 0), which padding fills",
    ),
    Row(
        "assisted or prompt-lookup decoding on a static cache with sliding-window layers",
        "unpadded",
        "upstream crops the cache, which a sliding-window layer allows only within its window",
        lambda call: call.decodes_candidates and call.sliding_static_cache,
        "upstream crops the cache after each candidate check, which its static sliding-window layer allows only "
        "while the cache fits the window: padding could take the cache past it",
    ),
    Row(
        "token healing (`token_healing=True`)",
        "unpadded",
        "the padding would be decoded with the prompt",
        lambda call: call.settings.token_healing,
        "token healing decodes the prompt and tokenizes it again inside `generate`, then regenerates each prompt's "
        "last token in `generate` calls of its own: the padding would be decoded with the prompt",
    ),
    Row(
        "classifier-free guidance (`guidance_scale`) on a forward the user compiled",
        "unpadded",
        "a new graph every step, which no bucket bounds",
        lambda call: call.settings.guidance_scale not in (None, 1) and call.user_compiled,
        "classifier-free guidance (`guidance_scale={call.settings.guidance_scale}`) runs the model's forward from its "
        "logits processor at every step, on a view of the last token whose stride is the sequence's length, with a "
        "cache that grows: the forward, compiled with {found}, compiles new graphs for those on every call, which no "
        "bucket bounds. Generate with a forward upstream compiles (`compile_config`) to bucket guided calls",
    ),
    Row(
        "no cache (`use_cache=False`) on a forward the user compiled",
        "unpadded",
        "a graph per step of every call, which no bucket bounds",
        lambda call: not call.settings.use_cache and call.user_compiled,
        "without a cache (`use_cache=False`) every step's forward runs the whole sequence, a token longer than the "
        "last: the forward, compiled with {found}, compiles a graph per step of every call, which no bucket bounds. "
        "Generate with a cache to bucket the call",
    ),
    Row(
        "chunked prefill (`prefill_chunk_size`) with PEFT's activated LoRA (`alora_offsets`)",
        "unpadded",
        "padding would move the ends of the chunks",
        lambda call: call.settings.prefill_chunk_size is not None and call.peft_from_the_end,
        "PEFT passes the layers `{found}`, which count from each forward's last token, and padding in front would move "
        "the ends of the prefill's chunks (`prefill_chunk_size={call.settings.prefill_chunk_size}`)",
    ),
    Row(
        "local attention windows counted from the cache's end (GPT-Neo), in a cache longer than the window",
        "unpadded",
        "upstream's tokens depend on its cache's length, which bucketing changes",
        window_reason,
        "{found}",
    ),
    _model_row(
        "neither",
        "a model whose attention is not causal (`is_decoder=False`, and no attention module says `is_causal`)",
        "the prompt would attend to the pads after it; masked pads in front change its tokens",
        side_assumptions.attention_is_bidirectional,
        "its attention is not causal (`is_decoder=False`): the prompt would attend to the pads after it, and masked "
        "pads in front change such a model's tokens (measured on XLM-RoBERTa-XL)",
    ),
    _model_row(
        "neither",
        "attention that builds a dynamic mask from the keys over every slot it reads (Doge)",
        "pads on either side would reach that mask",
        side_assumptions.masks_from_keys,
        "its attention builds a dynamic mask from the keys, which would see the pads after the prompt or in front",
    ),
    _model_row(
        "neither",
        "recurrent blocks that keep their state on their modules, in a cache that counts its tokens by their layer "
        "(RecurrentGemma on transformers 5.25)",
        "the cache reads as empty: a later turn can't line up with the padding in it",
        side_assumptions.counts_no_tokens,
        "its recurrent blocks keep their state on their modules, and its cache counts its tokens by their layer, "
        "which counts none: the cache would read as empty, and a later turn that continues it, which upstream runs "
        "whole again, could not line up with the padding in it",
    ),
    _model_row(
        "unpadded",
        "a forward without `position_ids` that counts positions from the cache (TrOCR, BART's decoder)",
        "pads in front would shift every position",
        side_assumptions.positions_count_from_the_cache,
        "its forward takes no `position_ids` and counts positions from the cache, so pads in front would shift them",
    ),
    _model_row(
        "unpadded",
        "a model whose own `prepare_inputs_for_generation` drops the mask (XLNet)",
        "pads in front would be attended",
        side_assumptions.drops_the_mask,
        "its `prepare_inputs_for_generation` does not pass the attention mask on",
    ),
    _model_row(
        "unpadded",
        "a forward that ignores the attention mask it takes (RWKV, CPM-Ant)",
        "pads in front would be read",
        side_assumptions.ignores_the_mask,
        "its forward ignores the attention mask",
    ),
    _model_row(
        "unpadded",
        "a forward that adds the cache length to the positions it is given at decode (GIT)",
        "pads in front would shift every position",
        side_assumptions.adds_the_cache_length_to_positions,
        "its forward adds the cache length to the positions at decode, so pads in front would shift them",
    ),
    Row(
        "rows of different lengths on a forward that adds the cache length to the positions it is given at decode (GIT)",
        "unpadded",
        "padded on the right, each after its own end, they leave a cache a later turn lines up with only on the left",
        lambda call: call.ragged and call.breaks(side_assumptions.adds_the_cache_length_to_positions),
        "`{call.model_name}`: rows of different lengths padded on the right, each after its own end, leave their "
        "tokens in other cache slots than upstream's, which a later turn that continues the cache lines up with only "
        "by padding on the left, and its forward adds the cache length to the positions at decode, so pads in front "
        "would shift them",
    ),
    _model_row(
        "unpadded",
        "attention that compresses the cached tokens in blocks (DeepSeek-V4)",
        "pads in front would be pooled with real tokens",
        side_assumptions.compresses_the_cache,
        "its attention compresses the cached tokens in blocks, pads in front included",
    ),
    _model_row(
        "unpadded",
        "attention that repeats its keys into more heads than its queries have (a latent-attention config whose "
        "`num_key_value_heads` is below `num_attention_heads`)",
        "upstream's masked attention fails on it, and pads in front need the mask",
        side_assumptions.repeated_key_heads,
        "its attention repeats its keys `num_key_value_groups` times into more heads than its queries have (a "
        "latent-attention config whose `num_key_value_heads` is below `num_attention_heads`), which fails with the "
        "attention mask that pads in front need: upstream runs only where it needs no mask",
    ),
    Row(
        "left only: a cache passed in that holds an unpadded or right-padded call's tokens",
        "unpadded",
        "no padding can go in front of the cached tokens",
        lambda call: call.not_right and call.filled_unpadded,
        "the cache passed in already holds tokens from {found}, so the prompt can't be padded in front of them, and it "
        "is not padded on the right: {call.not_right}. The call runs unpadded (exact output), and this prompt length "
        "may compile a new graph",
    ),
    Row(
        "left only: `input_ids` that are not an integer `[batch, length]` tensor",
        "raise",
        "the left path pads `[batch, length]` ids",
        lambda call: call.not_right and call.ids_not_paddable,
        "{found}",
    ),
    Row(
        "left only: an empty prompt",
        "raise",
        "a prompt is padded up to a bucket: it needs a token",
        lambda call: call.not_right and call.prompt is not None and call.prompt_length == 0,
        f"The prompt is empty (0 tokens). `{PREFILL_BUCKETS}` pads a prompt up to a bucket, so it needs at least one "
        "token: start the prompt with the BOS token.",
    ),
    Row(
        "`input_ids` outside the model's vocabulary (on the right, from `input_ids` alone)",
        "raise",
        "the embedding can't look them up (an index error on CPU, a device assert on CUDA)",
        lambda call: call.ids_outside_vocabulary,
        "{found}",
    ),
    Row(
        "left only: a cache passed in too short for the padded call, holding a bucketed call's padding",
        "raise",
        "the padding in the cache can't be left out, and a static cache does not grow",
        lambda call: call.not_right and call.room[0],
        "{found}",
    ),
    Row(
        "left only: a cache passed in too short for the padded call",
        "unpadded",
        "upstream runs the unpadded call in it",
        lambda call: call.not_right and call.room[1],
        "{found}",
    ),
    Row(
        "a cache passed in whose rows are not the rows of the call that filled it (or of a selection of them)",
        "raise",
        "the rows would not line up: a dummy row's tokens are nobody's",
        lambda call: isinstance(call.continued_rows, str) and call.continued_rows,
        "{found}",
    ),
    Row(
        "a cache passed in that holds dummy rows (`prefill_batch_buckets`) this call can't bring back",
        "raise",
        "beam search, a per-row input, `negative_prompt_ids` or PEFT's per-row arguments",
        _dummy_rows_lost,
        "{found}",
    ),
    Row(
        "`pad_token_id` outside the vocabulary, with rows that can finish early",
        "raise",
        "a finished row is fed `pad_token_id`, which the embedding can't look up",
        lambda call: call.finished_rows_error,
        "{found}",
    ),
    Row(
        f'`{PREFILL_PADDING_SIDE}="left"`',
        "left",
        "asked for",
        lambda call: call.settings.padding_side == "left",
        f"`{PREFILL_PADDING_SIDE}='left'`",
    ),
    _model_row(
        "left",
        "a forward without `position_ids` whose config states no `max_position_embeddings` (ALiBi from the mask)",
        "the right-padded prefill passes no mask",
        side_assumptions.positions_from_the_mask,
        "its forward takes no `position_ids` and states no `max_position_embeddings`: positions come from the mask",
    ),
    _model_row(
        "left",
        "recurrent blocks that keep their state on their modules, outside the cache (RecurrentGemma)",
        "the pads after the prompt would run into the state",
        side_assumptions.keeps_a_state_on_its_modules,
        "its recurrent blocks keep their state on their modules, outside the cache, and the pads after the prompt "
        "would run into it",
    ),
    Row(
        "assisted decoding (`assistant_model`, `assistant_early_exit`, `use_mtp`) or prompt lookup",
        "left",
        "upstream runs the prompt with the first candidates, not through its prefill step",
        lambda call: call.decodes_candidates,
        "assisted and prompt-lookup decoding run the prompt together with the first candidates",
    ),
    Row(
        "chunked prefill (`prefill_chunk_size`)",
        "left",
        "a bucket is one forward; the chunk size bounds each forward",
        lambda call: call.settings.prefill_chunk_size is not None,
        "chunked prefill (`prefill_chunk_size`) bounds each forward's length, and a bucket is one forward",
    ),
    Row(
        "no cache (`use_cache=False`)",
        "left",
        "not compiled: there is no graph to share",
        lambda call: not call.settings.use_cache,
        "there is no cache (`use_cache=False`) to write the prompt into",
    ),
    Row(
        "`output_hidden_states`, `output_attentions`",
        "left",
        "per-position prefill outputs, which the left path strips",
        lambda call: call.settings.returned_outputs,
        "`output_hidden_states` and `output_attentions` return the prefill's per-position outputs",
    ),
    Row(
        "attention other than sdpa and eager (flash, flex)",
        "left",
        "with a static cache they need the 2D mask",
        lambda call: call.attention not in ("sdpa", "eager"),
        "`{call.attention}` attention needs the attention mask with a static cache (right: sdpa and eager)",
    ),
    Row(
        "a forward without `logits_to_keep`",
        "left",
        "it would compute logits for every pad position",
        lambda call: not forward_takes(call.model, "logits_to_keep"),
        "`{call.model_name}.forward` takes no `logits_to_keep`: it would compute every pad's logits",
    ),
    Row(
        "other per-token or multimodal inputs",
        "left",
        "not padded on the right",
        lambda call: call.other_inputs,
        "the input `{call.other_inputs[0]}` is not padded on the right",
    ),
    Row(
        "PEFT's activated LoRA (`alora_offsets`, which its hooks pass the layers)",
        "left",
        "the offsets count from each forward's last token",
        lambda call: call.peft_from_the_end is not None,
        "PEFT passes the layers `{call.peft_from_the_end}`, which count from each forward's last token: after the "
        "prompt, those would be pads",
    ),
    Row(
        "a prompt that is not a `[batch, length]` tensor",
        "left",
        "the left path raises the error",
        lambda call: call.prompt is not None and (call.prompt.ndim < 2 or call.prompt.shape[1] == 0),
        "the prompt is not a [batch, length] tensor",
    ),
    Row(
        "a dynamic cache (or an offloaded one, or `'hybrid'`, which it makes dynamic) for `generate` to make",
        "left",
        "not compiled: there is no graph to share",
        lambda call: call.cache is None and not call.bucketable_cache,
        "the cache is not a static cache (a dynamic cache is not compiled: no graph to share)",
    ),
    Row(
        "a cache passed in that is not a `StaticCache`",
        "left",
        "not compiled: there is no graph to share",
        lambda call: call.cache is not None and not call.bucketable_cache,
        "the cache passed in is a `{call.cache.__class__.__name__}`, not a `StaticCache`",
    ),
    Row(
        "a cache filled by a left-padded call, or with dummy rows (`prefill_batch_buckets`)",
        "left",
        "the prompt must line up with the padding in the cache, and the batch with its rows",
        lambda call: (
            call.continued is not None and (call.continued.columns > 0 or call.continued.padded_rows != call.rows)
        ),
        "the cache holds a left-padded call's tokens or dummy rows, and the prompt must line up with them",
    ),
    Row(
        "a cache filled by rows of different lengths",
        "left",
        "the prompt must line up with the padding in the cache (pass the first call's mask, then ones)",
        lambda call: call.past_length and call.passed.ragged_rows is not None,
        "the cache holds rows of different lengths, each at the start of its slots: a mask lines them up",
    ),
    Row(
        "`inputs_embeds` continuing from a cache",
        "left",
        "not padded on the right",
        lambda call: call.past_length and call.model_kwargs.get("inputs_embeds") is not None,
        "`inputs_embeds` continuing from a cache are not padded on the right",
    ),
    Row(
        "a cache that already holds the whole prompt",
        "left",
        "no new token to pad",
        lambda call: call.prompt_length - call.past_length < 1,
        "the cache already holds the whole prompt",
    ),
    Row(
        "pad positions past `max_position_embeddings`",
        "left",
        "the model has no such positions",
        lambda call: call.settings.max_positions is not None and call.slots > call.settings.max_positions,
        "the pad positions would pass `max_position_embeddings={call.settings.max_positions}`",
    ),
    Row(
        "recurrent or convolutional layers (Mamba, Jamba, LFM2), chunked attention, or a sliding window shorter than "
        "the cached tokens plus the bucket",
        "left",
        "the pads would run through their state; the ring buffer would keep pads and drop real tokens",
        lambda call: call.layers_reason is not None,
        "{call.layers_reason}",
    ),
    Row(
        "a `max_cache_len` shorter than the cached tokens plus the bucket",
        "left",
        "no room for the pads",
        lambda call: (
            call.cache is None and call.settings.max_cache_len is not None and call.settings.max_cache_len < call.slots
        ),
        "`max_cache_len={call.settings.max_cache_len}` is shorter than the {call.slots} slots the padded prompt fills",
    ),
    Row(
        "a cache passed in shorter than the cached tokens plus the bucket",
        "left",
        "no room for the pads",
        lambda call: call.cache is not None and call.cache_slots < call.slots,
        "the cache passed in has {call.cache_slots} slots, fewer than the {call.slots} needed",
    ),
    Row(
        "rows of different lengths padded on the right, with zeros between a row's tokens, an empty row, or a mask "
        "other than 0/1 `[batch, length]`; or with a sliding window, continuing from a cache, or a forward without "
        "`position_ids`",
        "left",
        "upstream reads a short right-padded row's first token at a pad position: only its mask reproduces that; the "
        "window counts slots, not positions; cached rows line up through the mask; positions must follow each row",
        lambda call: call.ragged_reason is not None,
        "{call.ragged_reason}",
    ),
    Row(
        "everything else: a static cache, attention layers, sdpa or eager attention, none of the cases above",
        "right",
        "exact",
        lambda call: True,
        "exact",
    ),
)


def decision_table() -> str:
    """`DECISION` as a markdown table, `| case | outcome | why |`, as the docs' What runs exactly page shows it."""
    rows = [f"| {row.case} | {row.outcome} | {row.why} |" for row in DECISION]
    return "\n".join(["| case | outcome | why |", "| --- | --- | --- |", *rows])


def choose_side(call: ResolvedCall) -> PaddingSide:
    """How `call` is padded: the first row of `DECISION` that applies (a `ValueError` for a `raise` row)."""
    facts = RuleFacts(call, DECISION)
    row, reason = next((row, reason) for row in DECISION if (reason := row.check(facts)))
    if row.outcome == "raise":
        raise ValueError(reason)
    if row.outcome == "unpadded":
        return PaddingSide("unpadded", reason)
    settings = call.settings
    if row.outcome == "left":
        if settings.padding_side == "right":
            logger.warning_once(
                f"`{PREFILL_PADDING_SIDE}='right'` is not exact for this call, so it is padded on the left: {reason}."
            )
        side = PaddingSide("left", reason, padded_length=facts.padded_length)
    else:
        warn_long_prompt(settings, call.prompt_length - call.past_length, facts.bucket)
        side = PaddingSide("right", reason, bucket=facts.bucket)
    if facts.batch_kept_reason is not None:
        logger.warning_once(f"`{PREFILL_BATCH_BUCKETS}` is not applied to this call: {facts.batch_kept_reason}.")
    return replace(side, padded_batch=facts.padded_batch, finished_rows_pad_id=facts.finished_rows_pad_id)


if __name__ == "__main__":  # the table for the docs' What runs exactly page: `python -m prefill_buckets.call.decision`
    print(decision_table())

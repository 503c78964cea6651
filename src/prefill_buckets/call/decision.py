"""Steps 2 and 3 of a bucketed call: the one decision of how it is padded (`choose_side`).

A call is padded on the left, on the right, or not at all: then it runs upstream's exact path, and the package logs
the reason once. Inputs padding can't serve raise a `ValueError`. Every such reason is decided here, before anything is
padded, in this order:

1. `UNSUPPORTED`: calls padding can't serve on either side (a table; the first case that applies decides). This table
   is made from it (`unsupported_table`), and the docs' What runs exactly page shows the same one (a test checks it):

{unsupported_table}

2. The side, by the rule (`padding_side.RULE`).
3. What left padding needs besides the rule: a model that takes it (`side_assumptions.py`), a cache whose tokens sit
   behind padding (a left-padded call's; an unpadded or right-padded call's don't), a prompt that can be padded (or a
   `ValueError`), and room in the cache for the padded call.
4. The batch: the bucket dummy rows pad it to (`prefill_batch_buckets`), or why it keeps its rows; and the pad id the
   rows that finish early are fed (a `ValueError` where it can't be looked up).

One check stays in the run: a right-padded call whose `generate` makes no static cache (a model keeping its own) runs
its prefill unpadded (`prefill_right.py`): upstream's cache step picks the cache, by the model's class and config.
"""

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers.utils import logging

from ..compile.compiled_calls import compiled_forward, is_aot_forward
from ..config import (
    BUCKET_FIELDS,
    PREFILL_BATCH_BUCKETS,
    PREFILL_BUCKETS,
    PREFILL_PAD_TO_MULTIPLE_OF,
    PREFILL_PADDING_SIDE,
)
from ..kvcache.sizing import room_reason
from ..upstream.transformers_api import forward_takes
from .padding_side import PaddingSide, RuleFacts, rule_side
from .plan import PER_TOKEN_KWARGS
from .resolved import CallSettings, ResolvedCall
from .side_assumptions import side_assumption_broken, window_reason


logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class Unsupported:
    """A call padding can't serve on either side: when `applies`, it runs unpadded (or, with `error`, raises)."""

    case: str  # in words
    applies: Callable[[RuleFacts], object]  # truthy when the case applies: what it returns is `why` below
    reason: str  # what the call says: `reason.format(call=facts, why=what applies returned)`
    error: bool = False  # a `ValueError`: nothing upstream runs would be what the user asked for


def _user_compiled(call: RuleFacts) -> str | None:
    """How the user compiled the model's forward, or `None` (eager, or compiled by upstream: `compile_config`)."""
    if call.call.wrapper is not None:
        return "the `torch.compile(model)` wrapper"
    if is_aot_forward(call.model):
        return "`aot_forward`"
    compiled = compiled_forward(call.model)
    return f"`{compiled}`" if compiled is not None else None


_FIELDS = ", ".join(f"`{field}`" for field in BUCKET_FIELDS)

# Checked in order; the first that applies decides.
UNSUPPORTED = (
    Unsupported(
        "an encoder-decoder model",
        lambda call: call.model.config.is_encoder_decoder,
        f"The prefill bucket fields ({_FIELDS}) support decoder-only models, but {{call.model_name}} is an "
        "encoder-decoder model. Its prompt goes to the encoder: pad it there with the tokenizer's `pad_to_multiple_of` "
        "(any side, with the attention mask), and unset the fields.",
        error=True,
    ),
    Unsupported(
        "`custom_generate`",
        lambda call: call.arguments.get("custom_generate") is not None,
        "`custom_generate` replaces the generation loop",
    ),
    Unsupported(
        "continuous batching (`cache_implementation='paged'`)",
        lambda call: call.model_kwargs.get("cache_implementation") == "paged",
        "`cache_implementation='paged'` switches to continuous batching, which pads by its own intervals when it "
        "compiles or captures CUDA graphs: each step's query tokens to a multiple of "
        "`ContinuousBatchingConfig.q_padding_interval_size` (64 by default) and its cache reads to "
        "`kv_padding_interval_size`. Set those on the `ContinuousBatchingConfig` instead, or drop "
        "`cache_implementation='paged'` to use the buckets",
    ),
    Unsupported(
        "a cache of recurrent layers only",
        lambda call: call.passed.tokens is None or call.passed.recurrent_only,
        "the cache passed in has only recurrent (linear-attention) layers, which hold a state and no keys (before "
        "transformers 5.25 not even how many tokens they hold), so the prompt can't be lined up with them. Let "
        "`generate` create the cache",
    ),
    Unsupported(
        "a forward without `attention_mask`",
        lambda call: not forward_takes(call.model, "attention_mask"),
        "`{call.model_name}.forward` takes no `attention_mask`, so padding could not be masked",
    ),
    Unsupported(
        "assisted or prompt-lookup decoding from `inputs_embeds` alone",
        lambda call: call.decodes_candidates and call.embeds_only,
        "assisted and prompt-lookup decoding from `inputs_embeds` alone cut the attention mask to the ids, which hold "
        "no prompt: the padding's mask would be lost. Pass `input_ids` to bucket it",
    ),
    Unsupported(
        "candidates drafted from what padding changes: the target's outputs (`use_mtp`, a Gemma 4 assistant, DFlash), "
        "or an assistant with another tokenizer",
        lambda call: call.decodes_candidates and call.drafter_padding_changes,
        "{why} (upstream runs it on one unpadded row): padding would change the candidates, and sampled tokens",
    ),
    Unsupported(
        "assisted or prompt-lookup decoding with `output_hidden_states` or `output_attentions`",
        lambda call: (
            call.decodes_candidates and (call.settings.output_hidden_states or call.settings.output_attentions)
        ),
        "upstream returns, for the tokens its first candidate check accepts after the first, the states of the "
        "sequence's first positions (`_split_model_outputs` slices from 0), which padding fills",
    ),
    Unsupported(
        "assisted or prompt-lookup decoding on a static cache with sliding-window layers",
        lambda call: call.decodes_candidates and call.sliding_static_cache,
        "upstream crops the cache after each candidate check, which its static sliding-window layer allows only "
        "while the cache fits the window: padding could take the cache past it",
    ),
    Unsupported(
        "token healing (`token_healing=True`)",
        lambda call: call.settings.token_healing,
        "token healing decodes the prompt and tokenizes it again inside `generate`, then regenerates each prompt's "
        "last token in `generate` calls of its own: the padding would be decoded with the prompt",
    ),
    Unsupported(
        "classifier-free guidance (`guidance_scale`) on a forward the user compiled",
        lambda call: call.settings.guidance_scale not in (None, 1) and _user_compiled(call),
        "classifier-free guidance (`guidance_scale={call.settings.guidance_scale}`) runs the model's forward from its "
        "logits processor at every step, on a view of the last token whose stride is the sequence's length, with a "
        "cache that grows: the forward, compiled with {why}, compiles new graphs for those on every call, which no "
        "bucket bounds. Generate with a forward upstream compiles (`compile_config`) to bucket guided calls",
    ),
    Unsupported(
        "no cache (`use_cache=False`) on a forward the user compiled",
        lambda call: not call.settings.use_cache and _user_compiled(call),
        "without a cache (`use_cache=False`) every step's forward runs the whole sequence, a token longer than the "
        "last: the forward, compiled with {why}, compiles a graph per step of every call, which no bucket bounds. "
        "Generate with a cache to bucket the call",
    ),
    Unsupported(
        "chunked prefill (`prefill_chunk_size`) with PEFT's activated LoRA (`alora_offsets`)",
        lambda call: call.settings.prefill_chunk_size is not None and call.peft_from_the_end,
        "PEFT passes the layers `{why}`, which count from each forward's last token, and padding in front would move "
        "the ends of the prefill's chunks (`prefill_chunk_size={call.settings.prefill_chunk_size}`)",
    ),
    Unsupported(
        "local attention windows counted from the cache's end (GPT-Neo), in a cache longer than the window",
        window_reason,
        "{why}",
    ),
)


def unsupported_table() -> str:
    """`UNSUPPORTED` as a markdown table, `| case | outcome |`, as the module docstring and the docs show it."""
    rows = [f"| {case.case} | {'`ValueError`' if case.error else 'unpadded'} |" for case in UNSUPPORTED]
    return "\n".join(["| case | outcome |", "| --- | --- |", *rows])


def choose_side(call: ResolvedCall) -> PaddingSide:
    """How `call` is padded (the module docstring), or a `ValueError` for inputs padding can't serve."""
    facts = RuleFacts(call)
    for case in UNSUPPORTED:
        why = case.applies(facts)
        if why:
            reason = case.reason.format(call=facts, why=why)
            if case.error:
                raise ValueError(reason)
            return PaddingSide("unpadded", reason)
    side = rule_side(facts)
    if side.side == "left":
        side = _left(facts, side)
        if side.side == "unpadded":
            return side
    else:
        input_ids = call.input_ids
        if call.inputs_embeds is None and input_ids is not None and input_ids.dtype in (torch.long, torch.int):
            call.settings.check_ids_in_vocabulary(input_ids)
        warn_long_prompt(call.settings, call.prompt_length - side.past_length, side.bucket)
    padded_batch = _padded_batch(facts)
    return replace(side, padded_batch=padded_batch, finished_rows_pad_id=_finished_rows_pad_id(call, padded_batch))


def _left(facts: RuleFacts, side: PaddingSide) -> PaddingSide:
    """A left-padded call's own conditions (step 3): the side with the padded length, or why it runs unpadded."""
    call = facts.call
    left_broken = side_assumption_broken(call.model, "left")
    if left_broken is not None:
        return PaddingSide("unpadded", f"{left_broken}; and it is not padded on the right: {side.reason}")
    if call.cache is not None and call.past_length > 0 and call.continued is None:
        filled_by = "a right-padded call" if call.passed.bucketing is not None else "an unpadded call"
        return PaddingSide(
            "unpadded",
            f"the cache passed in already holds tokens from {filled_by}, so the prompt can't be padded in front of "
            f"them, and it is not padded on the right: {side.reason}. The call runs unpadded (exact output), and this "
            "prompt length may compile a new graph",
        )
    if call.settings.padding_side == "right":
        logger.warning_once(
            f"`{PREFILL_PADDING_SIDE}='right'` is not exact for this call, so it is padded on the left: {side.reason}."
        )
    padded_length = _left_padded_length(call)
    reason = room_reason(call.settings, call.cache, call.continued is not None, call.prompt_length, padded_length)
    if reason is not None:
        return PaddingSide("unpadded", reason)
    return replace(side, padded_length=padded_length)


def _left_padded_length(call: ResolvedCall) -> int:
    """A left-padded prompt's length: a continued conversation's, with the padding its cache holds in front; else its
    bucket (`capped_bucket`). Raises `ValueError` for a prompt that can't be padded."""
    input_ids, inputs_embeds = call.input_ids, call.inputs_embeds
    if inputs_embeds is None and input_ids is not None:
        if input_ids.ndim != 2 or input_ids.dtype not in (torch.long, torch.int):
            raise ValueError(
                f"`{PREFILL_BUCKETS}` pads `input_ids` of shape [batch, length] with an integer dtype, but got shape "
                f"{tuple(input_ids.shape)} and dtype {input_ids.dtype}."
            )
    prompt_length = call.prompt_length
    if call.prompt is not None and prompt_length == 0:
        raise ValueError(
            f"The prompt is empty (0 tokens). `{PREFILL_BUCKETS}` pads a prompt up to a bucket, so it needs at least "
            "one token: start the prompt with the BOS token."
        )
    continued = call.continued
    if input_ids is not None:
        call.settings.check_ids_in_vocabulary(input_ids)
    if continued is not None:
        return prompt_length + continued.columns
    return capped_bucket(call.settings, prompt_length)


def _continued_rows(call: ResolvedCall) -> int:
    """
    The rows a call that continues a bucketed call's cache runs with: the cache's. Where the cache holds the rows the
    call that filled it left (its rows, then the dummy rows of `prefill_batch_buckets`), the call passes the rows it
    generated, and the dummy rows come back; where the user has selected rows since (`batch_select_indices`), it passes
    those. Raises `ValueError` for any other count: the rows would not line up (a dummy row's tokens are nobody's).
    """
    continued, expand = call.continued, call.settings.rows_per_prompt  # upstream runs each prompt as `expand` rows
    held = call.passed.rows if call.passed.rows is not None else continued.padded_rows
    if held % expand == 0:
        if held == continued.padded_rows:
            if call.rows * expand == continued.rows:
                return held // expand
        elif call.rows * expand == held:
            return held // expand
    dummy_rows = continued.padded_rows - continued.rows if held == continued.padded_rows else 0
    dummies = f", then {_count(dummy_rows, 'dummy row')} of `{PREFILL_BATCH_BUCKETS}`" if dummy_rows else ""
    each = f" of {expand} rows each" if expand > 1 else ""
    raise ValueError(
        f"The cache passed in holds {held} rows (the {_count(held - dummy_rows, 'row')} of the call that filled it"
        f"{dummies}), but this call has {_count(call.rows, 'prompt')}{each}. Continue a cache with the rows that "
        "filled it, one prompt each (a returned `sequences`, with your new tokens)."
    )


def _count(number: int, thing: str) -> str:
    return f"{number} {thing}" + ("" if number == 1 else "s")


def _padded_batch(facts: RuleFacts) -> int:
    """The rows the call's batch is padded to (step 4): its batch bucket, or its own rows, with the reason logged. A call
    that continues a cache brings back the dummy rows the call that filled it added, and raises where it can't."""
    call = facts.call
    rows, policy, continued = call.rows, call.settings.batch_policy, call.continued
    if continued is not None:
        padded_batch = _continued_rows(call)
    elif policy is not None:
        padded_batch = policy.bucket(rows)
    else:
        return rows
    if padded_batch == rows:
        return rows
    known = {"input_ids", "inputs_embeds", *PER_TOKEN_KWARGS}
    per_row = sorted(
        k
        for k, v in call.model_kwargs.items()
        if isinstance(v, torch.Tensor) and k not in known and v.shape[:1] == (rows,)
    )
    reason = None
    if call.settings.num_beams > 1:
        reason = "beam search ranks rows together"
    elif per_row:
        reason = f"it can't pad the per-row input {per_row[0]!r}"
    elif call.arguments.get("negative_prompt_ids") is not None:
        reason = "it can't pad `negative_prompt_ids`"
    elif facts.peft_row_arguments:
        reason = f"it can't pad the per-row `{next(iter(facts.peft_row_arguments))}` PEFT passes the layers"
    if reason is not None and continued is not None:
        raise ValueError(
            f"The cache passed in holds {_count(padded_batch - rows, 'dummy row')} of `{PREFILL_BATCH_BUCKETS}` after "
            f"the {_count(rows, 'prompt')} of the call that filled it, which this call can't bring back: {reason}. "
            f"Leave `{PREFILL_BATCH_BUCKETS}` unset on the call that starts a conversation you continue this way."
        )
    if reason is not None:
        logger.warning_once(f"`{PREFILL_BATCH_BUCKETS}` is not applied to this call: {reason}.")
        return rows
    return padded_batch


def _finished_rows_pad_id(call: ResolvedCall, padded_batch: int) -> int | None:
    """
    Checks the pad id against the rows that finish early; returns the id finished rows are fed instead, or `None`.
    Upstream feeds a row that finished early `pad_token_id`, which outside the vocabulary fails at the embedding (an
    index error on CPU, a device assert on CUDA). Raises `ValueError` when a user's row can finish early: there is more
    than one (and no beam search, which feeds no finished beam), and an eos id in the vocabulary, `stop_strings` or
    stopping criteria could finish it. The dummy rows of `prefill_batch_buckets` finish at once: when no user row can
    finish early, finished rows are fed an id in the vocabulary instead, and no user row ever is.
    """
    settings = call.settings
    pad_token_id = settings.pad_token_id
    if pad_token_id is None or settings.vocab_size is None or settings.num_beams > 1:
        return None
    if settings.in_vocabulary(pad_token_id):
        return None
    rows = call.rows * settings.rows_per_prompt
    eos_in_vocabulary = any(map(settings.in_vocabulary, settings.eos_token_ids))
    can_finish_early = [
        reason
        for reason, present in (
            (f"the eos ids {list(settings.eos_token_ids)} are in it", eos_in_vocabulary),
            ("`stop_strings` is set", bool(settings.stop_strings)),
            ("`stopping_criteria` are passed", bool(call.arguments.get("stopping_criteria"))),
        )
        if present
    ]
    if rows > 1 and can_finish_early:
        raise ValueError(
            f"`pad_token_id` is {pad_token_id}, outside the model's vocabulary (valid ids: 0 to "
            f"{settings.vocab_size - 1}). This call generates {rows} rows and a row can finish before the others "
            f"({', '.join(can_finish_early)}): it is then filled with `pad_token_id` and fed back to the model, which "
            "can't look it up. Set `pad_token_id` to an id in the vocabulary (the eos token id is the usual choice)."
        )
    return settings.fill_token_id if padded_batch > call.rows else None


def capped_bucket(settings: CallSettings, prompt_length: int, warn: bool = True) -> int:
    """The bucket of a prompt, capped at the model's `max_position_embeddings` (a longer prompt is not padded). With
    `warn`, logs what happened to a prompt outside the buckets, one warning per call (`warn_long_prompt`)."""
    padded_length = settings.policy.bucket(prompt_length)
    max_positions = settings.max_positions
    if max_positions is not None and padded_length > max_positions:
        capped = max(prompt_length, max_positions)
        if warn:
            warn_long_prompt(settings, prompt_length, capped, uncapped=padded_length)
        return capped
    if warn:
        warn_long_prompt(settings, prompt_length, padded_length)
    return padded_length


def warn_long_prompt(settings: CallSettings, prompt_length: int, padded_length: int, uncapped: int | None = None):
    """
    The one warning for a prompt outside the buckets, saying what was done with it; nothing for a prompt inside them.

    - longer than `max_position_embeddings`: not padded, so each such length is a graph of its own;
    - its bucket (`uncapped`) longer than `max_position_embeddings`: padded to that instead. Every such prompt gets
      that one length, so the text names no prompt, and it is logged once;
    - longer than the largest listed bucket: padded to a multiple of it, a graph per such length.
    """
    policy, max_positions = settings.policy, settings.max_positions
    if uncapped is not None and padded_length == prompt_length and prompt_length > max_positions:
        logger.warning_once(
            f"A prompt of {prompt_length} tokens is longer than the model's `max_position_embeddings` "
            f"({max_positions}), so it is not padded: it runs at its own length, and each such length compiles a new "
            "graph. The model was not built for sequences this long."
        )
    elif uncapped is not None:
        logger.warning_once(
            f"Buckets longer than the model's `max_position_embeddings` ({max_positions}) have more positions than the "
            f"model has, so a prompt of at most {max_positions} tokens whose bucket is longer ({policy}) is padded to "
            f"{max_positions} instead: those prompts share one length, and its compiled graph. Make {max_positions} "
            "your largest bucket to say so."
        )
    elif policy.exceeds_buckets(prompt_length):
        multiple = policy.pad_to_multiple_of or policy.largest_bucket
        logger.warning_once(
            f"A prompt of {prompt_length} tokens is longer than the largest of `{PREFILL_BUCKETS}` "
            f"({policy.largest_bucket}), so it is padded to {padded_length}, the next multiple of {multiple}. Each such "
            f"length compiles a new graph: add a larger bucket, or set `{PREFILL_PAD_TO_MULTIPLE_OF}` to choose the "
            "length for long prompts."
        )


__doc__ = __doc__.replace("{unsupported_table}", unsupported_table())

"""The facts of one call that the rows of the decision (`decision.DECISION`) read: `RuleFacts`.

Right padding (`prefill_right.py`: the prompt run with no mask, pads after it, each row's after its own end) is exact
only where every layer can forget the pads and each row's positions follow its tokens: the decision's `left` rows say
where it is not.
"""

from functools import cached_property

import torch
from transformers.utils import logging

from ..compile.compiled_calls import is_aot_forward
from ..config import PREFILL_BATCH_BUCKETS, PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF
from ..kvcache.sizing import room_reason
from ..state import advice_for
from ..upstream import candidates, transformers_api
from ..upstream.transformers_api import forward_takes
from .plan import PER_TOKEN_KWARGS
from .resolved import CallSettings
from .side_assumptions import cache_has_sliding_layers, cache_layers_reason, model_breaks, peft_row_arguments


logger = logging.get_logger(__name__)

# Model inputs the right-padded prefill knows: the prompt, its all-ones mask, and the cache.
_RIGHT_INPUTS = ("input_ids", "inputs_embeds", "attention_mask", "cache", "past_key_values")


class RuleFacts:
    """What the decision's rows (`table`) read of one `ResolvedCall`: each fact computed once, when first asked."""

    def __init__(self, call, table):
        self.call, self.table = call, table

    def __getattr__(self, name):
        """
        The call's own attributes (`model`, `settings`, `cache`, `past_length`, ...), read from the frozen
        `ResolvedCall` once and kept: the rows read them again and again.
        """
        if name.startswith("__") or name == "call":  # not the call's (`copy` asks for `__setstate__`)
            raise AttributeError(name)
        value = self.__dict__[name] = getattr(self.call, name)
        return value

    @cached_property
    def other_inputs(self) -> list[str]:
        kwargs = self.model_kwargs
        return sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _RIGHT_INPUTS)

    @cached_property
    def bucket(self) -> int:
        """The bucket of the new tokens: the prompt, less what the cache holds."""
        return self.settings.policy.bucket(self.prompt_length - self.past_length)

    @cached_property
    def slots(self) -> int:
        """The cache slots the right-padded prompt fills: the cached tokens, then the bucket."""
        return self.past_length + self.bucket

    @cached_property
    def decodes_candidates(self) -> bool:
        """Assisted or prompt-lookup decoding: upstream checks candidates (`_assisted_decoding`), no prefill step."""
        return (
            self.arguments.get("assistant_model") is not None
            or self.settings.prompt_lookup_num_tokens is not None
            or self.settings.assistant_early_exit is not None
            or self.settings.use_mtp
        )

    @cached_property
    def drafter_padding_changes(self) -> str | None:
        """The drafter padding would change (`candidates.drafter_padding_changes`), in words, or `None`."""
        tokenizers = all(self.model_kwargs.get(name) is not None for name in ("tokenizer", "assistant_tokenizer"))
        return candidates.drafter_padding_changes(self.settings, self.arguments.get("assistant_model"), tokenizers)

    @cached_property
    def embeds_only(self) -> bool:
        """Whether the prompt is `inputs_embeds` alone: no ids, or ids of no tokens (then they hold only new tokens)."""
        input_ids = self.input_ids
        return self.inputs_embeds is not None and (input_ids is None or input_ids.shape[1] == 0)

    @cached_property
    def bucketable_cache(self) -> bool:
        """
        Whether the call's cache can be bucketed: its `static_cache`, unless `generate` makes it offloaded (an offloaded
        cache is not compiled).
        """
        return self.static_cache and (self.cache is not None or "offloaded" not in self.settings.cache_implementation)

    @cached_property
    def sliding_static_cache(self) -> bool:
        """Whether the call runs on a `bucketable_cache` with sliding-window layers."""
        return self.bucketable_cache and cache_has_sliding_layers(self.model, self.cache, self.slots)

    @cached_property
    def peft_row_arguments(self) -> dict[str, bool]:
        """What PEFT passes the layers per row during this call (`side_assumptions.PEFT_ROW_ARGUMENTS`)."""
        return peft_row_arguments(self.model)

    @cached_property
    def peft_from_the_end(self) -> str | None:
        """The first of those that counts positions from each forward's end (aLoRA's `alora_offsets`), or `None`."""
        return next((name for name, from_the_end in self.peft_row_arguments.items() if from_the_end), None)

    @cached_property
    def model_name(self) -> str:
        return type(self.model).__name__

    @cached_property
    def attention(self) -> str | None:
        return transformers_api.attention_implementation(self.model.config)

    @cached_property
    def cache_slots(self) -> int:
        return transformers_api.static_cache_slots(self.cache)

    @cached_property
    def layers_reason(self) -> str | None:
        return cache_layers_reason(self.model, self.cache, self.slots)

    @cached_property
    def ragged_reason(self) -> str | None:
        """Why rows of different lengths (zeros in the call's `rows_mask`) can't be right-padded, or `None`."""
        mask = self.rows_mask
        if not isinstance(mask, torch.Tensor) or bool(mask.all()):
            return None
        if mask.ndim != 2 or self.prompt is None or mask.shape != self.prompt.shape[:2]:
            return "the attention mask is not a [batch, length] mask of the prompt"
        if self.past_length:
            return (
                "rows of different lengths continuing from a cache need the mask to line them up with the cached rows"
            )
        if not bool(((mask == 0) | (mask == 1)).all()):
            return "the attention mask holds values other than 0 and 1"
        mask = mask.long()
        if not bool(mask.any(dim=-1).all()):
            return "a row of the batch has no token (its attention mask is all zeros)"
        if not bool((mask[:, 1:] >= mask[:, :-1]).all()):  # left padding: each row's zeros, then its ones
            if bool((mask[:, 1:] <= mask[:, :-1]).all()):
                return (
                    "the batch is padded on the right: upstream reads a short row's first new token at a pad "
                    "position, which only its mask reproduces (decoder-only batches are padded on the left)"
                )
            return "the attention mask has zeros between a row's tokens"
        if not forward_takes(self.model, "position_ids"):
            return (
                f"`{type(self.model).__name__}.forward` takes no `position_ids`: each row's positions must follow its "
                "tokens"
            )
        if cache_has_sliding_layers(self.model, self.cache, self.slots):
            return "a sliding window counts cache slots, and a short row's pads would sit after its tokens, not before"
        return None

    @cached_property
    def not_right(self) -> str | None:
        """Why the call is not padded on the right: the reason of the first `left` row that applies, or `None`."""
        return next((reason for row in self.table if row.outcome == "left" and (reason := row.check(self))), None)

    def breaks(self, assumption) -> bool:
        """Whether the model breaks a padding side's `assumption` (`side_assumptions`), asked once per model."""
        return model_breaks(self.model, assumption)

    @cached_property
    def user_compiled(self) -> str | None:
        """How the user compiled the model's forward, or `None` (eager, or compiled by upstream: `compile_config`)."""
        if self.wrapper is not None:
            return "the `torch.compile(model)` wrapper"
        if is_aot_forward(self.model):
            return "`aot_forward`"
        compiled = self.compiled_forward
        return f"`{compiled}`" if compiled is not None else None

    @cached_property
    def filled_unpadded(self) -> str | None:
        """Whose tokens a cache passed in holds, when no padding can go in front of them (not a bucketed call's)."""
        if self.cache is None or self.past_length <= 0 or self.continued is not None:
            return None
        return "a right-padded call" if self.passed.bucketing is not None else "an unpadded call"

    @cached_property
    def ids_not_paddable(self) -> str | None:
        """The error for `input_ids` (the prompt) that are not an integer `[batch, length]` tensor, or `None`."""
        ids = self.input_ids
        if self.inputs_embeds is not None or ids is None:
            return None
        if ids.ndim == 2 and ids.dtype in (torch.long, torch.int):
            return None
        return (
            f"`{PREFILL_BUCKETS}` pads `input_ids` of shape [batch, length] with an integer dtype, but got shape "
            f"{tuple(ids.shape)} and dtype {ids.dtype}."
        )

    @cached_property
    def ids_outside_vocabulary(self) -> str | None:
        """The error for `input_ids` the embedding can't look up, when the call is padded on either side, or `None`."""
        ids, vocab_size = self.input_ids, self.settings.vocab_size
        embedded = ids is not None and (  # the padded call looks them up
            self.not_right or (self.inputs_embeds is None and ids.dtype in (torch.long, torch.int))
        )
        if not embedded or vocab_size is None or ids.numel() == 0:
            return None
        low, high = torch.stack(torch.aminmax(ids)).tolist()  # one device sync for both
        if low >= 0 and high < vocab_size:
            return None
        return (
            f"`input_ids` holds the id {low if low < 0 else high}, outside the model's vocabulary (valid ids: 0 to "
            f"{vocab_size - 1}). If those positions are padding, fill them with a `pad_token_id` in the vocabulary "
            "and mask them with `attention_mask`."
        )

    @cached_property
    def padded_length(self) -> int:
        """A left-padded prompt's length: with the padding a continued cache holds, else its `capped_bucket`."""
        if self.continued is not None:
            return self.prompt_length + self.continued.columns
        return capped_bucket(self.settings, self.prompt_length)

    @cached_property
    def room(self) -> tuple[str | None, str | None]:
        """A left-padded call against its cache (`room_reason`): `(why it can't run, why it runs unpadded)`."""
        try:
            return None, room_reason(
                self.settings, self.cache, self.continued is not None, self.prompt_length, self.padded_length
            )
        except ValueError as error:
            return str(error), None

    @cached_property
    def continued_rows(self) -> int | str | None:
        """
        The rows a call that continues a bucketed call's cache runs with: the cache's, where it passes the rows that
        call generated (its dummy rows come back) or the ones selected since (`batch_select_indices`); else the error
        message. `None` when it continues no bucketed call's cache.
        """
        if self.continued is None:
            return None
        continued, expand = self.continued, self.settings.rows_per_prompt  # upstream runs a prompt as `expand` rows
        held = self.passed.rows if self.passed.rows is not None else continued.padded_rows
        as_filled = held == continued.padded_rows  # else a selection of them
        if held % expand == 0 and self.output_rows == (continued.rows if as_filled else held):
            return held // expand
        dummy_rows = continued.padded_rows - continued.rows if as_filled else 0
        dummies = f", then {count(dummy_rows, 'dummy row')} of `{PREFILL_BATCH_BUCKETS}`" if dummy_rows else ""
        each = f" of {expand} rows each" if expand > 1 else ""
        return (
            f"The cache passed in holds {held} rows (the {count(held - dummy_rows, 'row')} of the call that filled "
            f"it{dummies}), but this call has {count(self.rows, 'prompt')}{each}. Continue a cache with the rows "
            "that filled it, one prompt each (a returned `sequences`, with your new tokens)."
        )

    @cached_property
    def wanted_batch(self) -> int:
        """The rows the batch would be padded to: a continued cache's, or the batch bucket, or its own."""
        if self.continued is not None:
            return self.continued_rows
        policy = self.settings.batch_policy
        return policy.bucket(self.rows) if policy is not None else self.rows

    @cached_property
    def batch_kept_reason(self) -> str | None:
        """Why the batch keeps its rows though `wanted_batch` has more (dummy rows the call can't pad), or `None`."""
        if self.wanted_batch == self.rows:
            return None
        known = {"input_ids", "inputs_embeds", *PER_TOKEN_KWARGS}
        per_row = sorted(
            k
            for k, v in self.model_kwargs.items()
            if isinstance(v, torch.Tensor) and k not in known and v.shape[:1] == (self.rows,)
        )
        if self.settings.num_beams > 1:
            return "beam search ranks rows together"
        if per_row:
            return f"it can't pad the per-row input {per_row[0]!r}"
        if self.arguments.get("negative_prompt_ids") is not None:
            return "it can't pad `negative_prompt_ids`"
        if self.peft_row_arguments:
            return f"it can't pad the per-row `{next(iter(self.peft_row_arguments))}` PEFT passes the layers"
        return None

    @cached_property
    def padded_batch(self) -> int:
        """The rows the batch is padded to: `wanted_batch`, unless it keeps its own (`batch_kept_reason`)."""
        return self.rows if self.batch_kept_reason is not None else self.wanted_batch

    @cached_property
    def pad_id_outside_vocabulary(self) -> bool:
        """Whether rows that finish early would be fed a `pad_token_id` outside the vocabulary (not in beam search)."""
        settings = self.settings
        if settings.pad_token_id is None or settings.vocab_size is None or settings.num_beams > 1:
            return False
        return not settings.in_vocabulary(settings.pad_token_id)

    @cached_property
    def finished_rows_error(self) -> str | None:
        """
        Why the rows that finish early can't be fed `pad_token_id` (`pad_id_outside_vocabulary`), where one of several
        user rows can finish early (an eos id in the vocabulary, `stop_strings`, stopping criteria), or `None`.
        """
        settings, rows = self.settings, self.output_rows
        if not self.pad_id_outside_vocabulary or rows <= 1:
            return None
        can_finish_early = []
        if any(map(settings.in_vocabulary, settings.eos_token_ids)):
            can_finish_early.append(f"the eos ids {list(settings.eos_token_ids)} are in it")
        if settings.stop_strings:
            can_finish_early.append("`stop_strings` is set")
        if self.arguments.get("stopping_criteria"):
            can_finish_early.append("`stopping_criteria` are passed")
        if not can_finish_early:
            return None
        return (
            f"`pad_token_id` is {settings.pad_token_id}, outside the model's vocabulary (valid ids: 0 to "
            f"{settings.vocab_size - 1}). This call generates {rows} rows and a row can finish before the others "
            f"({', '.join(can_finish_early)}): it is then filled with `pad_token_id` and fed back to the model, which "
            "can't look it up. Set `pad_token_id` to an id in the vocabulary (the eos token id is the usual choice)."
        )

    @cached_property
    def finished_rows_pad_id(self) -> int | None:
        """The id dummy rows are fed in place of a `pad_token_id` outside the vocabulary, or `None`."""
        if self.pad_id_outside_vocabulary and self.padded_batch > self.rows:
            return self.settings.fill_token_id
        return None


def count(number: int, thing: str) -> str:
    return f"{number} {thing}" + ("" if number == 1 else "s")


def capped_bucket(settings: CallSettings, prompt_length: int, warn: bool = True) -> int:
    """
    The bucket of a prompt, capped at the model's `max_position_embeddings` (a longer prompt is not padded). With
    `warn`, logs what happened to a prompt outside the buckets (`warn_long_prompt`).
    """
    padded_length, uncapped = settings.policy.bucket(prompt_length), None
    max_positions = settings.max_positions
    if max_positions is not None and padded_length > max_positions:
        padded_length, uncapped = max(prompt_length, max_positions), padded_length
    if warn:
        warn_long_prompt(settings, prompt_length, padded_length, uncapped=uncapped)
    return padded_length


# What to do about prompts longer than the largest bucket, in the options of who calls (`CallSettings.entry`).
_LONGER_THAN_THE_BUCKETS = {
    "generate": f"add a larger bucket, or set `{PREFILL_PAD_TO_MULTIPLE_OF}` to choose the length for long prompts.",
    "serve": "start `prefill-buckets serve` with a `--max-prompt` that holds your longest prompt.",
}


def warn_long_prompt(settings: CallSettings, prompt_length: int, padded_length: int, uncapped: int | None = None):
    """
    The one warning for a prompt outside the buckets (longer than `max_position_embeddings`, a bucket longer than that
    (`uncapped`), or longer than the largest bucket), saying what was done with it.
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
            f"length compiles a new graph: {advice_for(settings.entry, _LONGER_THAN_THE_BUCKETS)}"
        )

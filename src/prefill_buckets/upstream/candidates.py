"""What the package reads of upstream's candidate generators (assisted, prompt-lookup and other speculative decoding):
which one a call gets, which drafters padding would change, and the assistant's processor merge.
"""

import contextlib

from transformers.generation.candidate_generator import AssistedCandidateGeneratorDifferentTokenizers


def is_prompt_lookup(candidate_generator) -> bool:
    return type(candidate_generator).__name__ == "PromptLookupCandidateGenerator"


def is_assistant_model(candidate_generator) -> bool:
    """Whether candidates come from an assistant's own `generate` (a model with the same tokenizer, or early exit)."""
    return type(candidate_generator).__name__ in ("AssistedCandidateGenerator", "EarlyExitCandidateGenerator")


def most_drafted(candidate_generator, remaining: int) -> int:
    """
    The most candidates one check of `candidate_generator` may hold, at most `remaining`: a prompt lookup's
    `num_output_tokens`, an assistant's `num_assistant_tokens` under the `"constant"` schedule (a heuristic one grows).
    """
    drafted = remaining  # any generator that says less of itself
    if is_prompt_lookup(candidate_generator):
        drafted = getattr(candidate_generator, "num_output_tokens", remaining)
    elif is_assistant_model(candidate_generator):
        config = getattr(candidate_generator, "assistant_generation_config", None)
        if getattr(config, "num_assistant_tokens_schedule", None) == "constant":
            drafted = int(getattr(candidate_generator, "num_assistant_tokens", remaining))
    return max(0, min(drafted, remaining))


@contextlib.contextmanager
def processors_merged_by(model, wrap):
    """
    While open, `model.generate` merges the logits processors passed in with those it builds by `wrap(merge)`, where
    `merge` is upstream's `_merge_criteria_processor_list` (which keeps the one passed in of each type).
    """
    own = model.__dict__.get("_merge_criteria_processor_list")
    object.__setattr__(model, "_merge_criteria_processor_list", wrap(model._merge_criteria_processor_list))
    try:
        yield
    finally:
        if own is None:
            object.__delattr__(model, "_merge_criteria_processor_list")
        else:
            object.__setattr__(model, "_merge_criteria_processor_list", own)


def drafter_padding_changes(settings, assistant_model, tokenizers: bool) -> str | None:
    """
    What upstream's `_get_candidate_generator` picks (in its order) that padding would change, in words, or `None`:
    drafters that read the target's outputs at every position, and an assistant with another tokenizer (`tokenizers`).
    """
    every_position = "at every position, unmasked"
    if settings.use_mtp:
        return f"multi-token prediction (`use_mtp`) drafts from the target's hidden states {every_position}"
    name = type(assistant_model).__name__
    if assistant_model is not None and name.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant")):
        return f"a {name} assistant drafts from the target's key-value states {every_position}"
    if settings.speculation_type == "dflash":
        return f"DFlash (`speculation_type='dflash'`) drafts from the target's hidden states {every_position}"
    if assistant_model is not None and tokenizers:
        return (
            "an assistant with another tokenizer (`assistant_tokenizer`) drafts from the prompt's text, but with the "
            "padded prompt's attention mask and positions"
        )
    return None


def drafts_from_padding(candidate_generator) -> bool:
    """Whether `candidate_generator` drafts from what padding changes (`drafter_padding_changes`'s kinds)."""
    return bool(getattr(candidate_generator, "requires_model_outputs", False)) or isinstance(
        candidate_generator, AssistedCandidateGeneratorDifferentTokenizers
    )

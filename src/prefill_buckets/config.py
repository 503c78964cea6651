"""The `GenerationConfig` fields this project adds: names, documentation and validation (`patch.py` installs them)."""

from typing import Any

from .buckets import BucketPolicy, check_positive_int, validate_buckets


PREFILL_PAD_TO_MULTIPLE_OF = "prefill_pad_to_multiple_of"
PREFILL_BUCKETS = "prefill_buckets"
PREFILL_BATCH_BUCKETS = "prefill_batch_buckets"
PREFILL_PADDING_SIDE = "prefill_padding_side"
FIELDS = (PREFILL_PAD_TO_MULTIPLE_OF, PREFILL_BUCKETS, PREFILL_BATCH_BUCKETS, PREFILL_PADDING_SIDE)
# The fields that pad: when none is set, a call is upstream `generate` (the padding side alone pads nothing).
BUCKET_FIELDS = (PREFILL_PAD_TO_MULTIPLE_OF, PREFILL_BUCKETS, PREFILL_BATCH_BUCKETS)
PADDING_SIDES = ("auto", "left", "right")

# The docstring entries, in `GenerationConfig`'s own style. `patch.enable()` appends them to its docstring.
FIELD_DOCS = """
        > Parameters that pad the prompt to a few lengths, so a compiled model compiles a few graphs

        prefill_pad_to_multiple_of (`int`, *optional*):
            Pad the prompt up to a multiple of this length before prefill (on the side `prefill_padding_side`
            picks), and strip the padding from the output. With a static cache and a compiled forward, prompts whose padded lengths are equal
            share one compiled prefill graph. When `prefill_buckets` is also set, it aligns the buckets: each is
            rounded up to a multiple of this value, and the prompt takes the smallest aligned bucket that holds it.
        prefill_buckets (`list[int]` or `str`, *optional*):
            Pad the prompt up to the smallest of these lengths that holds it, and strip the padding from the
            output. Either a list of strictly increasing positive lengths, such as `[64, 256, 1024]`, or a named set:
            `"pow2"` for every power of two (up to 2x padding), `"pow2-quarters"` for every power of two and, from 8
            on, the three lengths evenly between each and the next (at most 25% padding, more graphs). A prompt longer than the largest listed bucket is padded to a multiple of the largest
            bucket (or of `prefill_pad_to_multiple_of` when set) and logs a warning, since each such length compiles a
            new graph. With a static cache and no `max_cache_len`, the model's first cache holds the largest bucket
            (8192 slots for `"pow2"`), and a prompt that outgrows it grows it (see the reference's "Cache sizing"), so
            prompts of different lengths share one cache shape. Every forward reads only an attention window of the
            cache, the slots that hold tokens rounded up to a window length: with `dynamic=False` one decode graph per
            window it reaches; with `model.compile()`, one symbolic in the window for all of them.
        prefill_batch_buckets (`list[int]` or `str`, *optional*):
            Pad the batch up to the smallest of these sizes that holds it, with dummy rows (one masked-in pad token
            each) that are finished from the first step and stripped from the output. Same values as
            `prefill_buckets`. Every batch size is its own set of compiled graphs, so this bounds them too. Not
            applied with beam search, whose rows are not independent. With `do_sample=True` the dummy rows take
            their share of the random stream, so seeded samples differ from an unpadded run (as they would in a
            batch of another size); greedy outputs are unchanged. A cache the call fills holds the dummy rows after
            yours: a later call that continues from it brings them back.
        prefill_padding_side (`str`, *optional*, defaults to `"auto"`):
            Which side of the prompt the bucket's pad tokens go, like the tokenizer's `padding_side`. `"right"`: after
            the prompt, with no attention mask (prefill runs causal attention as for an unpadded prompt, the first
            token comes from the logits at the prompt's last position, and decode overwrites the pad slots).
            `"left"`: in front of the prompt, masked. `"auto"` (or `None`): right where that is exact (a static cache,
            attention layers only, sdpa or eager attention, rows of one length or left-padded rows of different
            lengths, each then padded after its own end; see the reference's "Padding side"), left elsewhere. An explicit
            `"right"` where it is not exact logs why and pads on the left.
"""


def validate_fields(
    prefill_pad_to_multiple_of: Any = None,
    prefill_buckets: Any = None,
    prefill_batch_buckets: Any = None,
    prefill_padding_side: Any = None,
) -> None:
    """Validates the fields; raises `ValueError` naming the field, the value and what is valid."""
    if prefill_padding_side is not None and prefill_padding_side not in PADDING_SIDES:
        raise ValueError(
            f"`{PREFILL_PADDING_SIDE}` must be one of {PADDING_SIDES} or None, but is {prefill_padding_side!r}."
        )
    check_positive_int(prefill_pad_to_multiple_of, PREFILL_PAD_TO_MULTIPLE_OF, optional=True)
    validate_buckets(prefill_buckets, PREFILL_BUCKETS)
    validate_buckets(prefill_batch_buckets, PREFILL_BATCH_BUCKETS, example="[1, 2, 4, 8]")


def bucketing_from_fields(
    prefill_pad_to_multiple_of: Any = None,
    prefill_buckets: Any = None,
    prefill_batch_buckets: Any = None,
    prefill_padding_side: Any = None,
) -> tuple[BucketPolicy | None, BucketPolicy | None, str]:
    """
    Validates every field, and returns `(the BucketPolicy for the prompt length, the one for the batch size, the
    padding side)`. A policy is `None` when no field sets it (no field at all: plain upstream generate); with only
    `prefill_batch_buckets` set, prompt lengths are kept (an alignment of 1). A padding side of `None` is `"auto"`.
    """
    validate_fields(prefill_pad_to_multiple_of, prefill_buckets, prefill_batch_buckets, prefill_padding_side)
    batch_policy = None if prefill_batch_buckets is None else BucketPolicy(buckets=prefill_batch_buckets)
    if prefill_pad_to_multiple_of is None and prefill_buckets is None:
        policy = None if batch_policy is None else BucketPolicy(pad_to_multiple_of=1)
    else:
        policy = BucketPolicy(buckets=prefill_buckets, pad_to_multiple_of=prefill_pad_to_multiple_of)
    return policy, batch_policy, prefill_padding_side or "auto"

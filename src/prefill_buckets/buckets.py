"""Bucket policies: the padded length a prompt of a given length gets.

Pure integer arithmetic, no torch and no transformers: every rule about *which* length a prompt is padded to lives
here, so it can be read (and tested) on its own.

The rule, in one place:

1. `buckets` picks the size: the smallest bucket that holds the prompt (`"pow2"`: the next power of two).
2. A prompt longer than the largest bucket of a list is padded to the next multiple of the largest bucket, unless
   `pad_to_multiple_of` is set, in which case step 3 alone decides.
3. `pad_to_multiple_of` applies last, as an alignment: the length from steps 1-2 is rounded up to a multiple of it.

So `buckets="pow2", pad_to_multiple_of=64` gives 64, 64, ..., 64, 128, 256, ...: powers of two with a floor of 64.

A static cache needs `padded prompt + max_new_tokens - 1` slots. Its length is bucketed geometrically, whatever the
prompt policy: the next power of two (then aligned to `pad_to_multiple_of`). Every cache size is a compiled decode
graph, and upstream keeps the largest cache seen so far on the model, so geometric sizes bound the decode graphs by
log2 of the longest sequence, where prompt-sized steps (say multiples of 64) would compile one per step.
"""

from collections.abc import Sequence
from dataclasses import dataclass


POW2 = "pow2"
BUCKET_POLICIES = (POW2,)


def round_up(length: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is `>= length`."""
    return -(-length // multiple) * multiple


def next_power_of_two(length: int) -> int:
    """The smallest power of two that is `>= length` (1 for lengths up to 1)."""
    return 1 << max(length - 1, 0).bit_length()


@dataclass(frozen=True)
class BucketPolicy:
    """
    Maps a length to its padded length. Built from the two `GenerationConfig` fields; at least one is set.

    Args:
        buckets (`tuple[int, ...]` or `"pow2"`, *optional*):
            Increasing bucket lengths, or `"pow2"` for every power of two.
        pad_to_multiple_of (`int`, *optional*):
            Alignment applied after the bucket: the padded length is a multiple of it.
    """

    buckets: tuple[int, ...] | str | None = None
    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if self.buckets is None and self.pad_to_multiple_of is None:
            raise ValueError("A `BucketPolicy` needs `buckets`, `pad_to_multiple_of`, or both.")
        if isinstance(self.buckets, Sequence) and not isinstance(self.buckets, str):
            object.__setattr__(self, "buckets", tuple(self.buckets))

    @property
    def largest_bucket(self) -> int | None:
        """The largest listed bucket, or `None` when the policy has no upper end (`"pow2"` or no list)."""
        return self.buckets[-1] if isinstance(self.buckets, tuple) else None

    def exceeds_buckets(self, length: int) -> bool:
        """Whether `length` is longer than every listed bucket (never true for `"pow2"` or a bare multiple)."""
        return self.largest_bucket is not None and length > self.largest_bucket

    def bucket(self, length: int) -> int:
        """The padded length for a sequence of `length` tokens (always `>= length`)."""
        if length < 0:
            raise ValueError(f"A length must be >= 0, got {length}.")
        padded = length
        if self.buckets == POW2:
            padded = next_power_of_two(length)
        elif isinstance(self.buckets, tuple):
            fitting = [b for b in self.buckets if b >= length]
            if fitting:
                padded = fitting[0]
            elif self.pad_to_multiple_of is None:
                padded = round_up(length, self.largest_bucket)
        if self.pad_to_multiple_of is not None:
            padded = round_up(max(padded, 1), self.pad_to_multiple_of)
        return padded

    def cache_length(self, length: int) -> int:
        """The static cache length for a sequence that needs `length` slots: the next power of two, aligned."""
        padded = next_power_of_two(length)
        if self.pad_to_multiple_of is not None:
            padded = round_up(padded, self.pad_to_multiple_of)
        return padded

    def __str__(self) -> str:
        parts = []
        if self.buckets is not None:
            parts.append(f"prefill_buckets={self.buckets!r}")
        if self.pad_to_multiple_of is not None:
            parts.append(f"prefill_pad_to_multiple_of={self.pad_to_multiple_of}")
        return ", ".join(parts)

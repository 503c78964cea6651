"""Bucket policies: the padded length a prompt of a given length gets. Pure integer arithmetic, no torch.

The rule, in one place: `pad_to_multiple_of` aligns the buckets (each rounded up to a multiple of it); a prompt is
padded to the smallest aligned bucket that holds it; a prompt longer than every aligned bucket of a list is padded to
the next multiple of `pad_to_multiple_of` when it is set, else of the largest bucket. So `buckets="pow2",
pad_to_multiple_of=64` gives 64, 64, ..., 64, 128, 256, ... A padded length is its own bucket.
"""

import numbers
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any


# The named bucket sets, as the lengths per doubling. `"pow2"`: every power of two (pads up to 2x). `"pow2-quarters"`:
# from `FINE_FROM` on, 4 per doubling: 1, 2, 4, 8, 10, 12, 14, 16, 20, 24, ... (pads at most 25% past 8 tokens).
STEPS_PER_DOUBLING = {"pow2": 1, "pow2-quarters": 4}
NAMED_BUCKETS = tuple(STEPS_PER_DOUBLING)
FINE_FROM = 8  # below it a finer step would be under 2 tokens: powers of two only


def round_up(length: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is `>= length`."""
    return -(-length // multiple) * multiple


def next_power_of_two(length: int) -> int:
    """The smallest power of two that is `>= length` (1 for lengths up to 1)."""
    return 1 << max(length - 1, 0).bit_length()


def is_positive_int(value: Any, *, integral: bool = False) -> bool:
    """Whether `value` is an `int` (with `integral`, any `numbers.Integral`) of at least 1, and not a `bool`."""
    return isinstance(value, numbers.Integral if integral else int) and not isinstance(value, bool) and value > 0


def check_positive_int(value: Any, name: str, optional: bool = False) -> None:
    """Raises `ValueError` naming the argument `name` unless `value` is a positive `int` (or, if `optional`, `None`)."""
    if optional and value is not None and not is_positive_int(value):
        raise ValueError(f"`{name}` must be a positive integer (such as 64) or None, but is {value!r}.")
    if not optional and not is_positive_int(value):
        raise ValueError(f"`{name}` must be a positive integer, but is {value!r}.")


def named_bucket_lengths(name: str) -> Iterator[int]:
    """The lengths of the named bucket set `name` (a key of `STEPS_PER_DOUBLING`), increasing, without end."""
    steps = STEPS_PER_DOUBLING[name]
    yield 1
    power = 1
    while True:  # the lengths in (power, 2 * power]
        count = steps if power >= FINE_FROM else 1
        for k in range(1, count + 1):
            yield power + k * power // count
        power *= 2


def validate_buckets(value: Any, field: str, example: str = "[64, 256, 1024]") -> None:
    """
    Raises `ValueError` naming `field` unless `value` is `None`, a name of `NAMED_BUCKETS`, or a strictly increasing
    list (or tuple) of positive ints; `example` is a valid list, said in the error.
    """
    if value is None:
        return
    valid = f"a list of strictly increasing positive integers (such as {example}), one of {NAMED_BUCKETS}, or None"
    if isinstance(value, str):
        if value not in NAMED_BUCKETS:
            raise ValueError(f"`{field}` must be {valid}, but is the unknown policy {value!r}.")
        return
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"`{field}` must be {valid}, but is {value!r} of type {type(value).__name__}.")
    if len(value) == 0:
        raise ValueError(f"`{field}` must be {valid}, but is an empty list.")
    bad = [bucket for bucket in value if not is_positive_int(bucket)]
    if bad:
        raise ValueError(f"`{field}` must be {valid}, but {value!r} holds {bad[0]!r}, which is not.")
    if any(later <= earlier for earlier, later in zip(value, value[1:])):
        raise ValueError(f"`{field}` must be {valid}, but {value!r} is not strictly increasing.")


@dataclass(frozen=True)
class BucketPolicy:
    """
    Maps a length to its padded length. Built from the two `GenerationConfig` fields; at least one is set.

    Args:
        buckets (`tuple[int, ...]` or `str`, *optional*):
            Increasing bucket lengths, or a named set: `"pow2"` for every power of two, `"pow2-quarters"` for every
            power of two and, from 8 on, the three lengths evenly between it and the next (`STEPS_PER_DOUBLING`).
        pad_to_multiple_of (`int`, *optional*):
            Alignment applied after the bucket: the padded length is a multiple of it.

    Raises:
        `ValueError`: a field holds a value the `GenerationConfig` fields refuse (`prefill_buckets`,
        `prefill_pad_to_multiple_of`), with the same message, naming this field.
    """

    buckets: tuple[int, ...] | str | None = None
    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if self.buckets is None and self.pad_to_multiple_of is None:
            raise ValueError("A `BucketPolicy` needs `buckets`, `pad_to_multiple_of`, or both.")
        validate_buckets(self.buckets, "buckets")
        check_positive_int(self.pad_to_multiple_of, "pad_to_multiple_of", optional=True)
        if isinstance(self.buckets, Sequence) and not isinstance(self.buckets, str):
            object.__setattr__(self, "buckets", tuple(self.buckets))

    @property
    def largest_bucket(self) -> int | None:
        """The largest listed bucket, or `None` when the policy has no upper end (a named set or no list)."""
        return self.buckets[-1] if isinstance(self.buckets, tuple) else None

    def _align(self, length: int) -> int:
        return length if self.pad_to_multiple_of is None else round_up(max(length, 1), self.pad_to_multiple_of)

    def exceeds_buckets(self, length: int) -> bool:
        """Whether `length` is longer than every (aligned) listed bucket; never for a named set or a bare multiple."""
        return self.largest_bucket is not None and length > self._align(self.largest_bucket)

    def bucket(self, length: int) -> int:
        """The padded length for a sequence of `length` tokens: the smallest aligned bucket `>= length`."""
        if length < 0:
            raise ValueError(f"A length must be >= 0, got {length}.")
        if isinstance(self.buckets, str):
            # A named set's aligned lengths never decrease: the first that holds `length` is the smallest.
            for candidate in named_bucket_lengths(self.buckets):
                if self._align(candidate) >= length:
                    return self._align(candidate)
        if isinstance(self.buckets, tuple):
            fitting = [aligned for aligned in map(self._align, self.buckets) if aligned >= length]
            if fitting:
                return fitting[0]
            if self.pad_to_multiple_of is None:
                return round_up(length, self.largest_bucket)
        return self._align(length)

    def cache_length(self, length: int) -> int:
        """The static cache length for a sequence that needs `length` slots: the next power of two, aligned."""
        return self._align(next_power_of_two(length))

    def __str__(self) -> str:
        parts = []
        if self.buckets is not None:
            parts.append(f"prefill_buckets={self.buckets!r}")
        if self.pad_to_multiple_of is not None:
            parts.append(f"prefill_pad_to_multiple_of={self.pad_to_multiple_of}")
        return ", ".join(parts)


# ---- choosing buckets from observed lengths -------------------------------------------------------------------------


def _check_lengths(lengths: Iterable[int], function: str) -> list[int]:
    """`lengths` as a list of Python ints, or a `ValueError` naming what is wrong."""
    lengths = list(lengths)
    if not lengths:
        raise ValueError(f"`{function}` needs at least one length, got an empty `lengths`.")
    for position, length in enumerate(lengths):
        if not is_positive_int(length, integral=True):
            raise ValueError(
                f"`lengths` must hold positive ints (prompt lengths in tokens), got {length!r} at position {position}."
            )
    return [int(length) for length in lengths]


def _check_positive_int(value, name: str, optional: bool = False) -> None:
    if not is_positive_int(value, integral=True) and not (optional and value is None):
        valid = "an int >= 1" + (" or None" if optional else "")
        raise ValueError(f"`{name}` must be {valid}, got {value!r}.")


def suggest_buckets(lengths: Iterable[int], max_buckets: int = 8, pad_to_multiple_of: int | None = None) -> list[int]:
    """
    The bucket lengths that minimise the total number of pad tokens for an observed sample of prompt lengths.

    The answer is exact: in an optimal set every bucket is an observed length (rounded up to `pad_to_multiple_of`),
    so the distinct values are split into at most `max_buckets` consecutive groups by dynamic programming (divide and
    conquer on each layer, the cost being Monge): 100,000 lengths with 2,000 distinct values take about 0.1 s.

    Args:
        lengths (`Iterable[int]`):
            Observed prompt lengths in tokens, each `>= 1` (for instance, the lengths of a sample of real traffic).
        max_buckets (`int`, *optional*, defaults to 8):
            The most buckets to return: with `model.compile(dynamic=False)` each bucket is one compiled prefill graph
            per batch size (`model.compile()` compiles one for every bucket).
        pad_to_multiple_of (`int`, *optional*):
            When set, every bucket is a multiple of it, matching `BucketPolicy(buckets, pad_to_multiple_of)`.

    Returns:
        `list[int]`: Strictly increasing bucket lengths, at most `max_buckets` of them (fewer when there are fewer
        distinct values, in which case no padding is needed), the last one `>= max(lengths)`. Pass it as
        `BucketPolicy(buckets=...)` or as `prefill_buckets` in a `GenerationConfig`.

    Raises:
        `ValueError`: `lengths` is empty or holds something other than a positive int, `max_buckets` is not an int
        `>= 1`, or `pad_to_multiple_of` is neither `None` nor an int `>= 1`.

    Example:

    ```python
    >>> from prefill_buckets.buckets import BucketPolicy, padding_waste, suggest_buckets

    >>> lengths = [3, 5, 8, 9, 30, 31, 32, 100]
    >>> suggest_buckets(lengths, max_buckets=3)
    [9, 32, 100]
    >>> print(padding_waste(lengths, BucketPolicy(buckets=suggest_buckets(lengths, max_buckets=3))))
    8 prompts: 218 real + 14 pad tokens (6.0% padding), 3 prefill graphs (padded lengths 9, 32, 100)
    >>> suggest_buckets(lengths, max_buckets=3, pad_to_multiple_of=8)
    [8, 32, 104]
    ```
    """
    lengths = _check_lengths(lengths, "suggest_buckets")
    _check_positive_int(max_buckets, "max_buckets")
    _check_positive_int(pad_to_multiple_of, "pad_to_multiple_of", optional=True)

    # Group by the smallest admissible bucket of each length: the length itself, or its round-up to the multiple.
    counts = Counter(lengths)
    groups: dict[int, list[int]] = {}  # candidate bucket -> [number of prompts, sum of their lengths]
    for length, count in counts.items():
        candidate = length if pad_to_multiple_of is None else round_up(length, pad_to_multiple_of)
        group = groups.setdefault(candidate, [0, 0])
        group[0] += count
        group[1] += count * length
    values = sorted(groups)
    d = len(values)
    if d <= max_buckets:
        return values

    # Prefix sums: groups i..j (inclusive) padded to values[j] cost values[j] * (C[j+1] - C[i]) - (S[j+1] - S[i]).
    prompts_before = [0] * (d + 1)
    tokens_before = [0] * (d + 1)
    for j, value in enumerate(values):
        prompts_before[j + 1] = prompts_before[j] + groups[value][0]
        tokens_before[j + 1] = tokens_before[j] + groups[value][1]

    def cost(i: int, j: int) -> int:
        return values[j] * (prompts_before[j + 1] - prompts_before[i]) - (tokens_before[j + 1] - tokens_before[i])

    # best[j]: least padding for groups 0..j with the buckets used so far, the last of them at values[j].
    # first[t][j]: the first group of the last bucket in that optimum with t + 1 buckets, for the backtrack.
    best = [cost(0, j) for j in range(d)]
    first: list[list[int]] = [[0] * d]
    for t in range(1, max_buckets):
        current = [0] * d
        split = [0] * d
        # With t + 1 buckets the last one starts at group t at the earliest (each earlier bucket holds a group); the
        # last layer only needs the full range. Each pending item: rows lo..hi, whose best first group lies in
        # option_lo..option_hi (it is monotone in the row, by the quadrangle inequality).
        pending = [(d - 1 if t == max_buckets - 1 else t, d - 1, t, d - 1)]
        while pending:
            lo, hi, option_lo, option_hi = pending.pop()
            if lo > hi:
                continue
            mid = (lo + hi) // 2
            best_cost, best_i = None, option_lo
            for i in range(option_lo, min(mid, option_hi) + 1):
                candidate = best[i - 1] + cost(i, mid)
                if best_cost is None or candidate < best_cost:
                    best_cost, best_i = candidate, i
            current[mid], split[mid] = best_cost, best_i
            pending.append((lo, mid - 1, option_lo, best_i))
            pending.append((mid + 1, hi, best_i, option_hi))
        best = current
        first.append(split)

    buckets = []
    j = d - 1
    for t in range(max_buckets - 1, -1, -1):
        buckets.append(values[j])
        j = first[t][j] - 1
    return buckets[::-1]


@dataclass(frozen=True)
class WasteReport:
    """
    How much padding a bucket policy adds to a sample of prompt lengths, and how many prefill graphs it compiles.

    Args:
        prompts (`int`):
            Number of prompts in the sample.
        real_tokens (`int`):
            Sum of the prompt lengths.
        padded_tokens (`int`):
            Pad tokens added: sum of `policy.bucket(length) - length`.
        padded_share (`float`):
            `padded_tokens / (real_tokens + padded_tokens)`: the share of prefill compute spent on padding.
        prefill_graphs (`int`):
            Distinct padded lengths: the prefill graphs a compiled model needs at one batch size.
        padded_lengths (`tuple[int, ...]`):
            The distinct padded lengths, sorted.
    """

    prompts: int
    real_tokens: int
    padded_tokens: int
    padded_share: float
    prefill_graphs: int
    padded_lengths: tuple[int, ...]

    def __str__(self) -> str:
        shown = self.padded_lengths
        listed = (
            ", ".join(map(str, shown)) if len(shown) <= 8 else f"{shown[0]}, {shown[1]}, {shown[2]}, ..., {shown[-1]}"
        )
        return (
            f"{self.prompts} prompts: {self.real_tokens} real + {self.padded_tokens} pad tokens "
            f"({self.padded_share:.1%} padding), {self.prefill_graphs} prefill graphs (padded lengths {listed})"
        )


def padding_waste(lengths: Iterable[int], policy: BucketPolicy) -> WasteReport:
    """
    The padding `policy` adds to a sample of prompt lengths, and the prefill graphs it needs.

    Args:
        lengths (`Iterable[int]`):
            Observed prompt lengths in tokens, each `>= 1`.
        policy ([`BucketPolicy`]):
            Any policy: a bucket list (for instance from [`suggest_buckets`]), `"pow2"`, a bare multiple, or both.

    Returns:
        [`WasteReport`]: Prompts, real and pad tokens, the pad share, and the distinct padded lengths.

    Example:

    ```python
    >>> from prefill_buckets.buckets import BucketPolicy, padding_waste

    >>> report = padding_waste([3, 5, 8, 9], BucketPolicy(buckets=(8, 16)))
    >>> report.padded_tokens, report.prefill_graphs
    (15, 2)
    >>> print(report)
    4 prompts: 25 real + 15 pad tokens (37.5% padding), 2 prefill graphs (padded lengths 8, 16)
    ```
    """
    lengths = _check_lengths(lengths, "padding_waste")
    if not isinstance(policy, BucketPolicy):
        raise ValueError(f"`policy` must be a `BucketPolicy`, got {type(policy).__name__}.")
    counts = Counter(lengths)
    padded = {length: policy.bucket(length) for length in counts}
    real_tokens = sum(lengths)
    padded_tokens = sum(count * (padded[length] - length) for length, count in counts.items())
    padded_lengths = tuple(sorted(set(padded.values())))
    return WasteReport(
        prompts=len(lengths),
        real_tokens=real_tokens,
        padded_tokens=padded_tokens,
        padded_share=padded_tokens / (real_tokens + padded_tokens),
        prefill_graphs=len(padded_lengths),
        padded_lengths=padded_lengths,
    )

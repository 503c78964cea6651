# Unit tests of the pure parts: `BucketPolicy` (which length a prompt is padded to) and the `left_pad` / `strip_left`
# round trip (`left_pad` alone: test_plan.py);
# then `suggest_buckets` (exact optimum against brute force) and `padding_waste` / `WasteReport`.

import dataclasses
import itertools
import random
import time
import unittest

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from parameterized import parameterized

from prefill_buckets import BucketPolicy
from prefill_buckets.buckets import (
    NAMED_BUCKETS,
    WasteReport,
    named_bucket_lengths,
    next_power_of_two,
    padding_waste,
    round_up,
    suggest_buckets,
)
from prefill_buckets.call.plan import left_pad
from prefill_buckets.call.views import strip_left


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class HelpersTest(unittest.TestCase):
    @parameterized.expand([(0, 8, 0), (1, 8, 8), (7, 8, 8), (8, 8, 8), (9, 8, 16), (5, 1, 5), (100, 64, 128)])
    def test_round_up(self, length, multiple, expected):
        self.assertEqual(round_up(length, multiple), expected)

    @parameterized.expand(
        [(0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 16), (63, 64), (64, 64), (65, 128), (1000, 1024)]
    )
    def test_next_power_of_two(self, length, expected):
        self.assertEqual(next_power_of_two(length), expected)


class BucketPolicyTest(unittest.TestCase):
    # ---- construction ----------------------------------------------------------------------------------------

    def test_needs_a_field(self):
        with self.assertRaisesRegex(ValueError, "buckets.*pad_to_multiple_of"):
            BucketPolicy()

    @parameterized.expand(
        [
            ("unknown_policy", {"buckets": "pow3"}, "`buckets`", "'pow2'"),
            ("negative_multiple", {"pad_to_multiple_of": -4}, "`pad_to_multiple_of`", "positive integer"),
            ("zero_bucket", {"buckets": [0]}, "`buckets`", "strictly increasing positive integers"),
            ("decreasing", {"buckets": [16, 8]}, "`buckets`", "strictly increasing"),
        ]
    )
    def test_bad_values_raise(self, _, fields, field, valid):
        # Unchecked, "pow3" padded nothing, -4 gave a bucket shorter than the prompt, and [0] divided by zero.
        with self.assertRaises(ValueError) as context:
            BucketPolicy(**fields)
        self.assertIn(field, str(context.exception))
        self.assertIn(valid, str(context.exception))

    def test_list_is_stored_as_tuple(self):
        policy = BucketPolicy(buckets=[8, 16, 32])
        self.assertEqual(policy.buckets, (8, 16, 32))
        self.assertEqual(policy, BucketPolicy(buckets=(8, 16, 32)))
        self.assertEqual(hash(policy), hash(BucketPolicy(buckets=(8, 16, 32))))

    def test_pow2_is_kept_as_string(self):
        self.assertEqual(BucketPolicy(buckets="pow2").buckets, "pow2")

    def test_frozen(self):
        policy = BucketPolicy(buckets=[8])
        with self.assertRaises(dataclasses.FrozenInstanceError):
            policy.buckets = (16,)

    def test_largest_bucket(self):
        self.assertEqual(BucketPolicy(buckets=[8, 16, 1024]).largest_bucket, 1024)
        self.assertEqual(BucketPolicy(buckets=[8, 16], pad_to_multiple_of=64).largest_bucket, 16)
        self.assertIsNone(BucketPolicy(buckets="pow2").largest_bucket)
        self.assertIsNone(BucketPolicy(pad_to_multiple_of=8).largest_bucket)

    def test_negative_length_raises(self):
        for policy in (BucketPolicy(buckets=[8]), BucketPolicy(buckets="pow2"), BucketPolicy(pad_to_multiple_of=8)):
            with self.assertRaisesRegex(ValueError, "-1"):
                policy.bucket(-1)

    def test_str(self):
        self.assertEqual(str(BucketPolicy(buckets=[8, 16])), "prefill_buckets=(8, 16)")
        self.assertEqual(str(BucketPolicy(buckets="pow2")), "prefill_buckets='pow2'")
        self.assertEqual(str(BucketPolicy(pad_to_multiple_of=64)), "prefill_pad_to_multiple_of=64")
        self.assertEqual(
            str(BucketPolicy(buckets=[8], pad_to_multiple_of=4)), "prefill_buckets=(8,), prefill_pad_to_multiple_of=4"
        )

    # ---- each rule alone -------------------------------------------------------------------------------------

    @parameterized.expand(
        [(1, 1), (2, 2), (3, 4), (5, 8), (8, 8), (9, 16), (17, 32), (33, 64), (64, 64), (65, 128), (1025, 2048)]
    )
    def test_pow2(self, length, expected):
        self.assertEqual(BucketPolicy(buckets="pow2").bucket(length), expected)

    @parameterized.expand(
        [(1, 1), (3, 4), (5, 8), (8, 8), (9, 10), (15, 16), (17, 20), (33, 40), (129, 160), (131, 160), (145, 160)]
        + [(161, 192), (219, 224), (257, 320), (523, 640), (953, 1024), (1025, 1280), (4097, 5120)]
    )
    def test_pow2_quarters(self, length, expected):
        self.assertEqual(BucketPolicy(buckets="pow2-quarters").bucket(length), expected)

    def test_pow2_quarters_pads_at_most_a_quarter_past_8(self):
        policy = BucketPolicy(buckets="pow2-quarters")
        for length in range(9, 20_000):
            self.assertLessEqual(policy.bucket(length), 1.25 * length)
        # Its lengths: the powers of two and, from 8 on, three evenly between each and the next.
        lengths = sorted({policy.bucket(n) for n in range(1, 257)})
        self.assertEqual(lengths[:8], [1, 2, 4, 8, 10, 12, 14, 16])
        self.assertEqual(lengths[-8:], [80, 96, 112, 128, 160, 192, 224, 256])
        self.assertTrue({1 << k for k in range(9)} <= set(lengths))

    def test_pow2_quarters_with_multiple(self):
        # Aligned to 64: 64 for every prompt up to 64, then 128, 192 (160 and 192 align to 192), 256, 320, ...
        policy = BucketPolicy(buckets="pow2-quarters", pad_to_multiple_of=64)
        self.assertEqual(
            [policy.bucket(n) for n in (1, 64, 65, 129, 161, 257, 330)], [64, 64, 128, 192, 192, 320, 384]
        )

    @parameterized.expand(
        [
            # (length, expected) for buckets [8, 16, 32, 64]
            (1, 8),
            (7, 8),
            (8, 8),  # exact fit
            (9, 16),
            (16, 16),
            (17, 32),
            (32, 32),
            (33, 64),
            (63, 64),
            (64, 64),
            # beyond the largest bucket: a multiple of the largest bucket
            (65, 128),
            (70, 128),
            (128, 128),
            (129, 192),
            (1000, 1024),
        ]
    )
    def test_list(self, length, expected):
        self.assertEqual(BucketPolicy(buckets=[8, 16, 32, 64]).bucket(length), expected)

    def test_list_not_powers_of_two(self):
        policy = BucketPolicy(buckets=[3, 10, 100])
        self.assertEqual(
            [policy.bucket(n) for n in (1, 3, 4, 10, 11, 100, 101, 250)], [3, 3, 10, 10, 100, 100, 200, 300]
        )

    def test_single_bucket(self):
        policy = BucketPolicy(buckets=[1])
        self.assertEqual([policy.bucket(n) for n in (1, 2, 7)], [1, 2, 7])

    @parameterized.expand([(1, 8), (7, 8), (8, 8), (9, 16), (16, 16), (17, 24), (63, 64), (65, 72)])
    def test_multiple(self, length, expected):
        self.assertEqual(BucketPolicy(pad_to_multiple_of=8).bucket(length), expected)

    def test_multiple_of_one_is_identity(self):
        policy = BucketPolicy(pad_to_multiple_of=1)
        self.assertEqual([policy.bucket(n) for n in range(1, 40)], list(range(1, 40)))

    # ---- the combination rule: align the buckets, then pick --------------------------------------------------

    def test_pow2_with_multiple_is_pow2_with_a_floor(self):
        # The example of the module docstring: 64, 64, ..., 64, 128, 256, ...
        policy = BucketPolicy(buckets="pow2", pad_to_multiple_of=64)
        self.assertEqual([policy.bucket(n) for n in (1, 2, 33, 63, 64)], [64] * 5)
        self.assertEqual([policy.bucket(n) for n in (65, 128, 129, 256, 257)], [128, 128, 256, 256, 512])

    def test_pow2_with_multiple_not_power_of_two(self):
        # The powers of two are aligned first (1..16 -> 24, 32 -> 48, 64 -> 72, 128 -> 144), then a prompt takes the
        # smallest that holds it: 17 tokens fit in 24.
        policy = BucketPolicy(buckets="pow2", pad_to_multiple_of=24)
        lengths = (1, 16, 17, 24, 25, 32, 33, 48, 49, 64, 65, 72, 73)
        self.assertEqual([policy.bucket(n) for n in lengths], [24, 24, 24, 24, 48, 48, 48, 48, 72, 72, 72, 72, 144])

    @parameterized.expand(
        [
            # buckets [10, 20, 50], alignment 8: the buckets become 16, 24, 56, and a prompt takes the first that
            # holds it (an 11-token prompt fits the aligned first bucket, 16)
            (1, 16),
            (10, 16),
            (11, 16),
            (16, 16),
            (17, 24),
            (20, 24),
            (24, 24),
            (25, 56),
            (50, 56),
            # beyond the list, with the alignment set: the alignment alone decides
            (51, 56),
            (57, 64),
            (100, 104),
        ]
    )
    def test_list_then_alignment(self, length, expected):
        self.assertEqual(BucketPolicy(buckets=[10, 20, 50], pad_to_multiple_of=8).bucket(length), expected)

    def test_overflow_uses_alignment_not_largest_bucket(self):
        # Without the alignment: a multiple of the largest bucket (64). With it: a multiple of 16 only.
        self.assertEqual(BucketPolicy(buckets=[8, 16, 32, 64]).bucket(70), 128)
        self.assertEqual(BucketPolicy(buckets=[8, 16, 32, 64], pad_to_multiple_of=16).bucket(70), 80)
        self.assertEqual(BucketPolicy(buckets=[8, 16, 32, 64], pad_to_multiple_of=1).bucket(70), 70)

    def test_alignment_that_divides_buckets_changes_nothing_inside_the_list(self):
        plain = BucketPolicy(buckets=[8, 16, 32, 64])
        aligned = BucketPolicy(buckets=[8, 16, 32, 64], pad_to_multiple_of=8)
        for n in range(1, 65):
            self.assertEqual(plain.bucket(n), aligned.bucket(n), n)

    # ---- the static cache length -----------------------------------------------------------------------------

    @parameterized.expand([(1, 1), (11, 16), (16, 16), (17, 32), (100, 128), (1025, 2048)])
    def test_cache_length_is_a_power_of_two(self, length, expected):
        # Whatever the prompt policy: prompt-sized steps would compile one decode graph per step.
        for policy in (BucketPolicy(buckets=[8, 16, 1000]), BucketPolicy(buckets="pow2")):
            self.assertEqual(policy.cache_length(length), expected)

    def test_cache_length_is_aligned(self):
        policy = BucketPolicy(buckets=[8, 16], pad_to_multiple_of=24)
        self.assertEqual([policy.cache_length(n) for n in (1, 11, 24, 27, 33)], [24, 24, 48, 48, 72])
        self.assertEqual(BucketPolicy(pad_to_multiple_of=64).cache_length(11), 64)

    # ---- exceeds_buckets ---------------------------------------------------------------------------------------

    def test_exceeds_buckets(self):
        policy = BucketPolicy(buckets=[8, 16, 32, 64])
        self.assertFalse(policy.exceeds_buckets(1))
        self.assertFalse(policy.exceeds_buckets(64))
        self.assertTrue(policy.exceeds_buckets(65))
        self.assertTrue(policy.exceeds_buckets(10_000))
        self.assertTrue(BucketPolicy(buckets=[8, 16], pad_to_multiple_of=8).exceeds_buckets(17))
        self.assertFalse(BucketPolicy(buckets=[8, 16], pad_to_multiple_of=8).exceeds_buckets(16))

    def test_never_exceeds_without_a_list(self):
        for policy in (BucketPolicy(buckets="pow2"), BucketPolicy(pad_to_multiple_of=8)):
            for n in (1, 64, 10**6):
                self.assertFalse(policy.exceeds_buckets(n))


# ---- properties over random policies and lengths --------------------------------------------------------------

bucket_lists = st.lists(st.integers(1, 4096), min_size=1, max_size=8, unique=True).map(sorted)


@st.composite
def policy_strategy(draw):
    buckets = draw(st.one_of(st.none(), st.sampled_from(NAMED_BUCKETS), bucket_lists))
    if buckets is None:
        multiple = draw(st.integers(1, 512))
    else:
        multiple = draw(st.one_of(st.none(), st.integers(1, 512)))
    return BucketPolicy(buckets=buckets, pad_to_multiple_of=multiple)


lengths = st.integers(1, 20_000)


class BucketPolicyPropertyTest(unittest.TestCase):
    @settings(max_examples=500, deadline=None)
    @given(policy_strategy(), lengths)
    def test_bucket_holds_the_length(self, policy, length):
        self.assertGreaterEqual(policy.bucket(length), length)

    @settings(max_examples=500, deadline=None)
    @given(policy_strategy(), lengths)
    def test_bucket_is_a_bucket_or_a_multiple(self, policy, length):
        padded = policy.bucket(length)
        if policy.pad_to_multiple_of is not None:
            # The alignment applies last, always.
            self.assertEqual(padded % policy.pad_to_multiple_of, 0)
            if policy.buckets is None or policy.exceeds_buckets(length):
                self.assertLess(padded - length, policy.pad_to_multiple_of)
            else:
                # The smallest of the aligned buckets that holds it.
                raw = policy.buckets
                if isinstance(raw, str):
                    raw = list(itertools.takewhile(lambda b: b < 2 * length + 2, named_bucket_lengths(raw)))
                aligned = [round_up(b, policy.pad_to_multiple_of) for b in raw]
                self.assertEqual(padded, min(a for a in aligned if a >= length))
        elif policy.buckets == "pow2":
            self.assertTrue(is_power_of_two(padded))
            self.assertLess(padded, 2 * length)
        elif policy.buckets == "pow2-quarters":
            self.assertLessEqual(padded, max(1.25 * length, next_power_of_two(length)))
            self.assertIn(
                padded, set(itertools.takewhile(lambda b: b <= padded, named_bucket_lengths("pow2-quarters")))
            )
        elif policy.exceeds_buckets(length):
            self.assertEqual(padded % policy.largest_bucket, 0)
            self.assertLess(padded - length, policy.largest_bucket)
        else:
            self.assertIn(padded, policy.buckets)
            # The smallest bucket that holds it.
            self.assertEqual(padded, min(b for b in policy.buckets if b >= length))

    @settings(max_examples=300, deadline=None)
    @given(policy_strategy(), lengths)
    def test_cache_length_holds_the_length(self, policy, length):
        cache_length = policy.cache_length(length)
        self.assertGreaterEqual(cache_length, length)
        if policy.pad_to_multiple_of is None:
            self.assertTrue(is_power_of_two(cache_length))
            self.assertLess(cache_length, 2 * length)
        else:
            self.assertEqual(cache_length % policy.pad_to_multiple_of, 0)

    @settings(max_examples=300, deadline=None)
    @given(policy_strategy(), lengths, lengths)
    def test_monotonic(self, policy, a, b):
        low, high = sorted((a, b))
        self.assertLessEqual(policy.bucket(low), policy.bucket(high))

    @settings(max_examples=500, deadline=None)
    @given(policy_strategy(), lengths)
    def test_idempotent(self, policy, length):
        # A padded length is its own bucket: `precompile` warms a bucket up with a prompt of exactly its length.
        padded = policy.bucket(length)
        self.assertEqual(policy.bucket(padded), padded)

    @settings(max_examples=200, deadline=None)
    @given(st.integers(1, 512), lengths)
    def test_multiple_is_idempotent(self, multiple, length):
        policy = BucketPolicy(pad_to_multiple_of=multiple)
        padded = policy.bucket(length)
        self.assertEqual(policy.bucket(padded), padded)

    @settings(max_examples=200, deadline=None)
    @given(bucket_lists, lengths)
    def test_exceeds_buckets_matches_the_list(self, buckets, length):
        policy = BucketPolicy(buckets=buckets)
        self.assertEqual(policy.exceeds_buckets(length), length > max(buckets))


# ---- left_pad / strip_left (`left_pad` alone: test_plan.py) -------------------------------------------------------


class PaddingTest(unittest.TestCase):
    def test_left_pad_zero_returns_input(self):
        ids = torch.tensor([[5, 6, 7]])
        self.assertIs(left_pad(ids, 0, 0), ids)
        self.assertIs(strip_left(ids, 0), ids)

    def test_negative_dim(self):
        tensor = torch.ones(2, 3, 4)
        self.assertEqual(tuple(left_pad(tensor, 2, 0, dim=-2).shape), (2, 5, 4))
        self.assertEqual(tuple(left_pad(tensor, 2, 0, dim=-1).shape), (2, 3, 6))
        self.assertEqual(tuple(strip_left(left_pad(tensor, 2, 0, dim=-2), 2, dim=-2).shape), (2, 3, 4))

    def test_does_not_modify_input(self):
        ids = torch.tensor([[5, 6, 7]])
        before = ids.clone()
        left_pad(ids, 3, 0)
        strip_left(ids, 1)
        self.assertTrue(torch.equal(ids, before))

    def test_strip_left(self):
        ids = torch.tensor([[0, 0, 5, 6, 7]])
        self.assertTrue(torch.equal(strip_left(ids, 2), torch.tensor([[5, 6, 7]])))
        self.assertEqual(tuple(strip_left(ids, 5).shape), (1, 0))

    @settings(max_examples=200, deadline=None)
    @given(
        st.integers(1, 3),  # batch
        st.integers(0, 12),  # length
        st.integers(0, 12),  # pad
        st.integers(-1000, 1000),  # fill
        st.sampled_from([torch.long, torch.int32, torch.float32]),
    )
    def test_round_trip_ids(self, batch, length, pad, fill, dtype):
        tensor = torch.randint(-50, 50, (batch, length)).to(dtype)
        padded = left_pad(tensor, pad, fill)
        self.assertEqual(tuple(padded.shape), (batch, length + pad))
        self.assertTrue((padded[:, :pad] == fill).all())
        self.assertTrue(torch.equal(strip_left(padded, pad), tensor))

    @settings(max_examples=100, deadline=None)
    @given(st.integers(1, 3), st.integers(1, 12), st.integers(0, 12), st.integers(1, 8))
    def test_round_trip_embeddings(self, batch, length, pad, hidden):
        embeds = torch.randn(batch, length, hidden)
        pad_vector = torch.randn(hidden)
        padded = left_pad(embeds, pad, pad_vector, dim=1)
        self.assertEqual(tuple(padded.shape), (batch, length + pad, hidden))
        if pad:
            self.assertTrue(torch.equal(padded[:, :pad], pad_vector.expand(batch, pad, hidden)))
        self.assertTrue(torch.equal(strip_left(padded, pad, dim=1), embeds))

    def test_round_trip_with_policy(self):
        policy = BucketPolicy(buckets=[8, 16, 32])
        for length in range(1, 40):
            ids = torch.arange(1, length + 1).unsqueeze(0)
            pad = policy.bucket(length) - length
            padded = left_pad(ids, pad, 0)
            self.assertEqual(padded.shape[1], policy.bucket(length))
            self.assertTrue(torch.equal(strip_left(padded, pad), ids))


# ---- suggest_buckets, padding_waste ----------------------------------------------------------------------------------


def total_padding(lengths, buckets, pad_to_multiple_of=None):
    """Pad tokens when every length goes to the smallest bucket that holds it (buckets must cover the longest)."""
    buckets = sorted(buckets)
    total = 0
    for length in lengths:
        target = length if pad_to_multiple_of is None else round_up(length, pad_to_multiple_of)
        total += next(b for b in buckets if b >= target) - length
    return total


def brute_force_padding(lengths, max_buckets, pad_to_multiple_of=None):
    """Least padding over every subset of the candidate buckets of size <= max_buckets that holds the longest."""
    candidates = sorted(
        {length if pad_to_multiple_of is None else round_up(length, pad_to_multiple_of) for length in lengths}
    )
    largest, rest = candidates[-1], candidates[:-1]
    return min(
        total_padding(lengths, (*subset, largest), pad_to_multiple_of)
        for size in range(min(max_buckets, len(candidates)))
        for subset in itertools.combinations(rest, size)
    )


def quadratic_dp_padding(lengths, max_buckets):
    """Least padding by the plain O(k d^2) dynamic program, as a second reference for larger cases."""
    values = sorted(set(lengths))
    d = len(values)
    prompts_before, tokens_before = [0], [0]
    for value in values:
        prompts_before.append(prompts_before[-1] + lengths.count(value))
        tokens_before.append(tokens_before[-1] + lengths.count(value) * value)

    def cost(i, j):
        return values[j] * (prompts_before[j + 1] - prompts_before[i]) - (tokens_before[j + 1] - tokens_before[i])

    best = [cost(0, j) for j in range(d)]
    for _ in range(1, min(max_buckets, d)):
        best = [min([best[j]] + [best[i - 1] + cost(i, j) for i in range(1, j + 1)]) for j in range(d)]
    return best[-1]


class SuggestBucketsOptimalityTest(unittest.TestCase):
    def check_optimal(self, lengths, max_buckets, pad_to_multiple_of=None):
        buckets = suggest_buckets(lengths, max_buckets=max_buckets, pad_to_multiple_of=pad_to_multiple_of)
        context = f"lengths={lengths}, max_buckets={max_buckets}, pad_to_multiple_of={pad_to_multiple_of}"
        self.assertLessEqual(len(buckets), max_buckets, context)
        self.assertTrue(all(a < b for a, b in zip(buckets, buckets[1:])), context)
        self.assertGreaterEqual(buckets[-1], max(lengths), context)
        if pad_to_multiple_of is not None:
            self.assertTrue(all(b % pad_to_multiple_of == 0 for b in buckets), context)
        padding = total_padding(lengths, buckets, pad_to_multiple_of)
        self.assertEqual(padding, brute_force_padding(lengths, max_buckets, pad_to_multiple_of), context)
        # The suggestion means the same thing to a `BucketPolicy` as to the brute force.
        policy = BucketPolicy(buckets=buckets, pad_to_multiple_of=pad_to_multiple_of)
        self.assertEqual(padding_waste(lengths, policy).padded_tokens, padding, context)
        return buckets

    def test_seeded_random_small_cases(self):
        rng = random.Random(1234)
        for _ in range(400):
            n = rng.randint(1, 16)
            top = rng.choice([4, 16, 64, 300])
            lengths = [rng.randint(1, top) for _ in range(n)]
            self.check_optimal(lengths, rng.randint(1, 6))

    def test_seeded_random_with_duplicates(self):
        # Few distinct values with heavy repetition: counts, not just values, decide the split.
        rng = random.Random(99)
        for _ in range(200):
            pool = rng.sample(range(1, 200), rng.randint(1, 10))
            lengths = [rng.choice(pool) for _ in range(rng.randint(1, 60))]
            self.check_optimal(lengths, rng.randint(1, 5))

    def test_seeded_random_with_pad_to_multiple_of(self):
        rng = random.Random(7)
        for _ in range(300):
            lengths = [rng.randint(1, 200) for _ in range(rng.randint(1, 14))]
            self.check_optimal(lengths, rng.randint(1, 5), pad_to_multiple_of=rng.choice([1, 2, 8, 16, 64]))

    def test_matches_quadratic_dp_on_larger_cases(self):
        # Beyond brute force: the divide-and-conquer layers agree with the plain quadratic dynamic program.
        rng = random.Random(2024)
        for _ in range(25):
            lengths = [rng.randint(1, 500) for _ in range(rng.randint(30, 120))]
            max_buckets = rng.randint(1, 12)
            buckets = suggest_buckets(lengths, max_buckets=max_buckets)
            self.assertEqual(total_padding(lengths, buckets), quadratic_dp_padding(lengths, max_buckets))

    @settings(max_examples=300, deadline=None)
    @given(
        lengths=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=12),
        max_buckets=st.integers(min_value=1, max_value=4),
    )
    def test_optimal_against_brute_force(self, lengths, max_buckets):
        self.check_optimal(lengths, max_buckets)

    @settings(max_examples=150, deadline=None)
    @given(
        lengths=st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=12),
        max_buckets=st.integers(min_value=1, max_value=4),
        pad_to_multiple_of=st.sampled_from([1, 3, 8, 16]),
    )
    def test_optimal_against_brute_force_with_multiple(self, lengths, max_buckets, pad_to_multiple_of):
        self.check_optimal(lengths, max_buckets, pad_to_multiple_of)


class SuggestBucketsBehaviourTest(unittest.TestCase):
    @parameterized.expand(
        [
            ("single", [7], 1, [7]),
            ("one_bucket_is_the_max", [3, 5, 8, 9], 1, [9]),
            ("two_buckets", [3, 5, 8, 9], 2, [5, 9]),
            ("docstring", [3, 5, 8, 9, 30, 31, 32, 100], 3, [9, 32, 100]),
            ("counts_matter", [1] * 10 + [2, 3, 4, 100], 2, [4, 100]),
        ]
    )
    def test_hand_checked(self, _, lengths, max_buckets, expected):
        self.assertEqual(suggest_buckets(lengths, max_buckets=max_buckets), expected)

    def test_covers_longest_length(self):
        rng = random.Random(5)
        for max_buckets in (1, 2, 3, 8):
            lengths = [rng.randint(1, 5000) for _ in range(500)]
            self.assertEqual(suggest_buckets(lengths, max_buckets=max_buckets)[-1], max(lengths))
            with_multiple = suggest_buckets(lengths, max_buckets=max_buckets, pad_to_multiple_of=64)
            self.assertEqual(with_multiple[-1], round_up(max(lengths), 64))

    def test_enough_buckets_means_no_padding(self):
        lengths = [5, 3, 9, 3, 12, 5, 5]
        for max_buckets in (4, 5, 100):
            buckets = suggest_buckets(lengths, max_buckets=max_buckets)
            self.assertEqual(buckets, [3, 5, 9, 12])
            self.assertEqual(padding_waste(lengths, BucketPolicy(buckets=buckets)).padded_tokens, 0)

    def test_enough_buckets_with_multiple_means_only_alignment(self):
        lengths = [5, 3, 9, 17, 12]
        buckets = suggest_buckets(lengths, max_buckets=8, pad_to_multiple_of=8)
        self.assertEqual(buckets, [8, 16, 24])
        self.assertEqual(total_padding(lengths, buckets, 8), sum(round_up(n, 8) - n for n in lengths))

    def test_strictly_increasing(self):
        rng = random.Random(11)
        for _ in range(50):
            lengths = [rng.randint(1, 1000) for _ in range(rng.randint(1, 300))]
            buckets = suggest_buckets(
                lengths, max_buckets=rng.randint(1, 16), pad_to_multiple_of=rng.choice([None, 16])
            )
            self.assertTrue(all(a < b for a, b in zip(buckets, buckets[1:])), buckets)
            self.assertTrue(all(isinstance(b, int) for b in buckets))

    def test_multiples(self):
        lengths = [3, 5, 8, 9, 30, 31, 32, 100]
        self.assertEqual(suggest_buckets(lengths, max_buckets=3, pad_to_multiple_of=8), [8, 32, 104])
        buckets = suggest_buckets(list(range(1, 1000)), max_buckets=6, pad_to_multiple_of=64)
        self.assertTrue(all(b % 64 == 0 for b in buckets), buckets)

    def test_accepts_any_iterable(self):
        self.assertEqual(suggest_buckets((n for n in [3, 5, 8, 9]), max_buckets=2), [5, 9])
        self.assertEqual(suggest_buckets(range(1, 5), max_buckets=2), [2, 4])

    def test_large_sample_finishes(self):
        rng = random.Random(0)
        lengths = [rng.randint(1, 2048) for _ in range(20000)]
        start = time.perf_counter()
        buckets = suggest_buckets(lengths, max_buckets=8)
        elapsed = time.perf_counter() - start
        self.assertEqual(len(buckets), 8)
        self.assertEqual(buckets[-1], max(lengths))
        self.assertLess(elapsed, 10.0)

    # ---- validation -----------------------------------------------------------------------------------------

    def test_empty_lengths(self):
        with self.assertRaisesRegex(ValueError, "at least one length.*empty `lengths`"):
            suggest_buckets([])

    @parameterized.expand(
        [("zero", 0), ("negative", -3), ("bool", True), ("float", 4.0), ("str", "8"), ("none", None)]
    )
    def test_bad_length(self, _, bad):
        with self.assertRaisesRegex(ValueError, rf"`lengths` must hold positive ints.*got {bad!r} at position 1"):
            suggest_buckets([4, bad, 9])

    @parameterized.expand([("zero", 0), ("negative", -1), ("bool", True), ("float", 2.0), ("none", None)])
    def test_bad_max_buckets(self, _, bad):
        with self.assertRaisesRegex(ValueError, rf"`max_buckets` must be an int >= 1, got {bad!r}\."):
            suggest_buckets([4, 9], max_buckets=bad)

    @parameterized.expand([("zero", 0), ("negative", -8), ("bool", False), ("float", 8.0)])
    def test_bad_pad_to_multiple_of(self, _, bad):
        with self.assertRaisesRegex(ValueError, rf"`pad_to_multiple_of` must be an int >= 1 or None, got {bad!r}\."):
            suggest_buckets([4, 9], pad_to_multiple_of=bad)


class PaddingWasteTest(unittest.TestCase):
    def test_hand_checked_bucket_list(self):
        report = padding_waste([3, 5, 8, 9], BucketPolicy(buckets=(8, 16)))
        # 3 -> 8, 5 -> 8, 8 -> 8, 9 -> 16: 5 + 3 + 0 + 7 pad tokens, two padded lengths.
        self.assertEqual(
            report,
            WasteReport(
                prompts=4,
                real_tokens=25,
                padded_tokens=15,
                padded_share=15 / 40,
                prefill_graphs=2,
                padded_lengths=(8, 16),
            ),
        )
        self.assertEqual(
            str(report), "4 prompts: 25 real + 15 pad tokens (37.5% padding), 2 prefill graphs (padded lengths 8, 16)"
        )

    def test_pow2_and_multiple(self):
        report = padding_waste([3, 5, 8, 9], BucketPolicy(buckets="pow2"))
        self.assertEqual((report.padded_tokens, report.padded_lengths), (1 + 3 + 0 + 7, (4, 8, 16)))
        report = padding_waste([3, 5, 8, 9], BucketPolicy(pad_to_multiple_of=4))
        self.assertEqual(
            (report.padded_tokens, report.padded_lengths, report.prefill_graphs), (1 + 3 + 0 + 3, (4, 8, 12), 3)
        )

    def test_beyond_largest_bucket(self):
        # 40 is past the largest bucket: the policy pads it to the next multiple of 16, a third graph.
        report = padding_waste([3, 16, 40], BucketPolicy(buckets=(8, 16)))
        self.assertEqual((report.padded_tokens, report.padded_lengths), (5 + 0 + 8, (8, 16, 48)))

    def test_no_padding(self):
        report = padding_waste([8, 8, 16], BucketPolicy(buckets=(8, 16)))
        self.assertEqual((report.padded_tokens, report.padded_share, report.prefill_graphs), (0, 0.0, 2))
        self.assertIn("0.0% padding", str(report))

    def test_long_list_is_abbreviated(self):
        report = padding_waste(range(1, 21), BucketPolicy(pad_to_multiple_of=1))
        self.assertEqual(report.prefill_graphs, 20)
        self.assertIn("padded lengths 1, 2, 3, ..., 20)", str(report))

    def test_frozen(self):
        report = padding_waste([3], BucketPolicy(buckets=(8,)))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            report.padded_tokens = 0

    def test_suggestion_beats_pow2(self):
        rng = random.Random(3)
        lengths = [rng.randint(1, 2048) for _ in range(2000)]
        suggested = padding_waste(lengths, BucketPolicy(buckets=suggest_buckets(lengths, max_buckets=11)))
        pow2 = padding_waste(lengths, BucketPolicy(buckets="pow2"))
        self.assertLessEqual(suggested.prefill_graphs, 11)
        self.assertLess(suggested.padded_tokens, pow2.padded_tokens)

    def test_validation(self):
        with self.assertRaisesRegex(ValueError, "empty `lengths`"):
            padding_waste([], BucketPolicy(buckets=(8,)))
        with self.assertRaisesRegex(ValueError, "positive ints.*got 0 at position 0"):
            padding_waste([0], BucketPolicy(buckets=(8,)))
        with self.assertRaisesRegex(ValueError, "`policy` must be a `BucketPolicy`, got tuple"):
            padding_waste([3], (8, 16))


if __name__ == "__main__":
    unittest.main()

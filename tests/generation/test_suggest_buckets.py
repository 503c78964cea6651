# Unit tests of `suggest_buckets` (exact optimum against brute force) and `padding_waste` / `WasteReport`.

import dataclasses
import itertools
import random
import time
import unittest

from hypothesis import given, settings
from hypothesis import strategies as st
from parameterized import parameterized

from prefill_buckets.buckets import BucketPolicy, WasteReport, padding_waste, round_up, suggest_buckets


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

# The helpers each rule is written once in: a positive int, and the cache among a call's arguments. (The embedding that
# fills pad positions is tested in test_plan.py, the BOS prompt upstream starts from without one in test_resolved.py.)

import unittest

import numpy as np

from prefill_buckets.buckets import check_positive_int, is_positive_int
from prefill_buckets.kvcache.record import passed_cache
from prefill_buckets.upstream.transformers_api import cache_argument


class PositiveIntTest(unittest.TestCase):
    def test_ints(self):
        self.assertTrue(all(is_positive_int(value) for value in (1, 64, 2**40)))
        for value in (0, -1, True, 1.0, "1", None, np.int64(3)):
            with self.subTest(value=value):
                self.assertFalse(is_positive_int(value))

    def test_integral(self):
        # A sample of lengths may hold numpy's ints; `True` is still not a length.
        self.assertTrue(is_positive_int(np.int64(3), integral=True))
        self.assertFalse(is_positive_int(np.int64(0), integral=True))
        self.assertFalse(is_positive_int(True, integral=True))

    def test_check_names_the_argument(self):
        check_positive_int(3, "max_bytes")
        with self.assertRaisesRegex(ValueError, r"^`max_bytes` must be a positive integer, but is 0\.$"):
            check_positive_int(0, "max_bytes")


class CacheArgumentTest(unittest.TestCase):
    def test_first_set_name(self):
        self.assertEqual(cache_argument({}), (None, None))
        self.assertEqual(cache_argument({"cache": None, "past_key_values": 3}), ("past_key_values", 3))
        self.assertEqual(cache_argument({"cache_params": 2, "cache": 1}), ("cache", 1))

    def test_passed_cache_is_a_cache_object(self):
        self.assertIsNone(passed_cache({"past_key_values": 3}))  # whatever it holds is not a cache


if __name__ == "__main__":
    unittest.main()

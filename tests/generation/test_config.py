# Tests `config.py`: the two `GenerationConfig` fields: validation (in every place a value can come in) and
# persistence through generation_config.json. enable()/disable() (`patch.py`): test_patch.py.

import copy
import json
import os
import tempfile
import unittest
from unittest import mock

import torch
from parameterized import parameterized
from transformers import GenerationConfig

import prefill_buckets
from prefill_buckets import PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF
from prefill_buckets.buckets import BucketPolicy
from prefill_buckets.call import resolved
from prefill_buckets.config import validate_fields

from .tiny_models import FirstForwardLength, random_ids, tiny_llama_256_positions


PAD, EOS, BOS = 0, 1, 2


# (value, how the message shows it). The message must name the field, show the value and say what is valid.
BAD_PAD_TO_MULTIPLE_OF = [
    (0, "0"),
    (-1, "-1"),
    (True, "True"),
    (False, "False"),
    (2.0, "2.0"),
    ("64", "'64'"),
    ("abc", "'abc'"),
    ([64], "[64]"),
]
BAD_BUCKETS = [
    (0, "0"),
    ([0, 8], "[0, 8]"),
    ([-4, 8], "[-4, 8]"),
    ([True, 8], "[True, 8]"),
    ([4.0, 8], "[4.0, 8]"),
    (["4", 8], "['4', 8]"),
    ([8, 4], "[8, 4]"),
    ([4, 4], "[4, 4]"),
    ([], "empty list"),  # said in words
    ("pow3", "'pow3'"),
    ("", "''"),
    ({"a": 1}, "{'a': 1}"),
]
BAD_VALUES = [
    (f"{PREFILL_PAD_TO_MULTIPLE_OF}_{i}", PREFILL_PAD_TO_MULTIPLE_OF, value, shown)
    for i, (value, shown) in enumerate(BAD_PAD_TO_MULTIPLE_OF)
] + [(f"{PREFILL_BUCKETS}_{i}", PREFILL_BUCKETS, value, shown) for i, (value, shown) in enumerate(BAD_BUCKETS)]

GOOD_VALUES = [
    ("multiple_1", PREFILL_PAD_TO_MULTIPLE_OF, 1),
    ("multiple_64", PREFILL_PAD_TO_MULTIPLE_OF, 64),
    ("multiple_none", PREFILL_PAD_TO_MULTIPLE_OF, None),
    ("buckets_single", PREFILL_BUCKETS, [1]),
    ("buckets_list", PREFILL_BUCKETS, [8, 16, 1024]),
    ("buckets_tuple", PREFILL_BUCKETS, (8, 16)),
    ("buckets_pow2", PREFILL_BUCKETS, "pow2"),
    ("buckets_none", PREFILL_BUCKETS, None),
]


class ConfigValidationTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        prefill_buckets.disable()
        cls.model = tiny_llama_256_positions()
        cls.input_ids = random_ids(5)

    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)

    def assertGoodMessage(self, error: ValueError, field: str, shown: str):
        message = str(error)
        self.assertIn(f"`{field}`", message)
        self.assertIn(shown, message)
        if field == PREFILL_PAD_TO_MULTIPLE_OF:
            self.assertIn("positive integer", message)
        else:
            self.assertIn("strictly increasing positive integers", message)
            self.assertIn("'pow2'", message)

    @parameterized.expand(BAD_VALUES)
    def test_bucket_policy_raises_the_config_message(self, _, field, value, shown):
        # One validator: `BucketPolicy(buckets=...)` says what `GenerationConfig(prefill_buckets=...)` says, of its
        # own field.
        policy_field = {PREFILL_BUCKETS: "buckets", PREFILL_PAD_TO_MULTIPLE_OF: "pad_to_multiple_of"}[field]
        with self.assertRaises(ValueError) as config_error:
            validate_fields(**{field: value})
        with self.assertRaises(ValueError) as policy_error:
            BucketPolicy(**{policy_field: value})
        expected = str(config_error.exception).replace(f"`{field}`", f"`{policy_field}`")
        self.assertEqual(str(policy_error.exception), expected)
        self.assertGoodMessage(config_error.exception, field, shown)

    @parameterized.expand(BAD_VALUES)
    def test_bad_value_in_generation_config(self, _, field, value, shown):
        prefill_buckets.enable()
        with self.assertRaises(ValueError) as context:
            GenerationConfig(**{field: value})
        self.assertGoodMessage(context.exception, field, shown)

    @parameterized.expand(BAD_VALUES)
    def test_bad_value_in_functional_generate(self, _, field, value, shown):
        self.assertFalse(prefill_buckets.is_enabled())
        with self.assertRaises(ValueError) as context:
            prefill_buckets.generate(self.model, self.input_ids, **{field: value}, max_new_tokens=2)
        self.assertGoodMessage(context.exception, field, shown)

    @parameterized.expand(BAD_VALUES)
    def test_bad_value_in_patched_generate(self, _, field, value, shown):
        prefill_buckets.enable()
        with self.assertRaises(ValueError) as context:
            self.model.generate(self.input_ids, **{field: value}, max_new_tokens=2)
        self.assertGoodMessage(context.exception, field, shown)

    @parameterized.expand(BAD_VALUES)
    def test_bad_value_set_on_a_config_then_passed(self, _, field, value, shown):
        # Set after construction (not enabled: stored silently), then passed as `generation_config`.
        config = GenerationConfig(max_new_tokens=2)
        setattr(config, field, value)
        with self.assertRaises(ValueError) as context:
            prefill_buckets.generate(self.model, self.input_ids, generation_config=config)
        self.assertGoodMessage(context.exception, field, shown)

    @parameterized.expand(BAD_VALUES)
    def test_bad_value_in_update(self, _, field, value, shown):
        prefill_buckets.enable()
        config = GenerationConfig()
        with self.assertRaises(ValueError) as context:
            config.update(**{field: value})
        self.assertGoodMessage(context.exception, field, shown)

    @parameterized.expand(GOOD_VALUES)
    def test_good_value_in_generation_config(self, _, field, value):
        prefill_buckets.enable()
        config = GenerationConfig(**{field: value})
        self.assertEqual(getattr(config, field), value)
        config.validate()

    @parameterized.expand(GOOD_VALUES)
    def test_good_value_in_functional_generate(self, _, field, value):
        out = prefill_buckets.generate(self.model, self.input_ids, **{field: value}, max_new_tokens=2)
        self.assertEqual(tuple(out.shape), (1, self.input_ids.shape[1] + 2))

    @parameterized.expand(GOOD_VALUES)
    def test_good_value_in_patched_generate(self, _, field, value):
        prefill_buckets.enable()
        out = self.model.generate(self.input_ids, **{field: value}, max_new_tokens=2)
        self.assertEqual(tuple(out.shape), (1, self.input_ids.shape[1] + 2))


class FieldsValidatedOnceTest(unittest.TestCase):
    # A workload's calls pass the same fields: they are validated once, and their policies reused. A value of another
    # type is never taken for an equal one (`True` for 1), and a bad value raises on every call.
    def fields(self, **values):
        return {**dict.fromkeys(prefill_buckets.config.FIELDS), **values}

    def test_the_same_fields_are_validated_once(self):
        resolved._bucketing_of_key.cache_clear()
        with mock.patch.object(resolved, "bucketing_from_fields", wraps=resolved.bucketing_from_fields) as validated:
            first = resolved.bucketing_of(self.fields(prefill_buckets=[16, 64]))
            again = resolved.bucketing_of(self.fields(prefill_buckets=[16, 64]))
            resolved.bucketing_of(self.fields(prefill_buckets=(16, 64)))  # a tuple: another key
            resolved.bucketing_of(self.fields(prefill_buckets=torch.tensor([16, 64]).tolist()))
        self.assertIs(first, again)
        self.assertEqual(validated.call_count, 2)

    def test_a_bool_is_not_taken_for_an_int(self):
        resolved.bucketing_of(self.fields(prefill_pad_to_multiple_of=1))
        with self.assertRaisesRegex(ValueError, "prefill_pad_to_multiple_of"):
            resolved.bucketing_of(self.fields(prefill_pad_to_multiple_of=True))

    def test_a_bad_value_raises_on_every_call(self):
        for _ in range(2):
            with self.assertRaisesRegex(ValueError, "strictly increasing"):
                resolved.bucketing_of(self.fields(prefill_buckets=[64, 16]))

    def test_the_policy_holds_no_list_of_the_users(self):
        buckets = [16, 64]
        policy, _, _ = resolved.bucketing_of(self.fields(prefill_buckets=buckets))
        buckets.append(256)
        self.assertEqual(resolved.bucketing_of(self.fields(prefill_buckets=[16, 64]))[0].buckets, (16, 64))
        self.assertEqual(policy.buckets, (16, 64))


class ConfigPersistenceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_llama_256_positions()

    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)
        original = copy.deepcopy(self.model.generation_config)

        def restore():
            self.model.generation_config = original

        self.addCleanup(restore)

    @parameterized.expand(
        [
            ("list_and_multiple", [8, 32], 8),
            ("pow2", "pow2", None),
            ("multiple_only", None, 64),
            ("tuple", (8, 16), None),
        ]
    )
    def test_round_trip(self, _, buckets, multiple):
        prefill_buckets.enable()
        config = GenerationConfig(prefill_buckets=buckets, prefill_pad_to_multiple_of=multiple, max_new_tokens=4)
        with tempfile.TemporaryDirectory() as tmpdir:
            config.save_pretrained(tmpdir)
            with open(os.path.join(tmpdir, "generation_config.json")) as f:
                saved = json.load(f)
            loaded = GenerationConfig.from_pretrained(tmpdir)
        expected_buckets = list(buckets) if isinstance(buckets, tuple) else buckets
        self.assertEqual(loaded.prefill_buckets, expected_buckets)
        self.assertEqual(type(loaded.prefill_buckets), type(expected_buckets))
        self.assertEqual(loaded.prefill_pad_to_multiple_of, multiple)
        self.assertEqual(loaded.max_new_tokens, 4)
        # Only the fields that are set are written.
        self.assertEqual(PREFILL_BUCKETS in saved, buckets is not None)
        self.assertEqual(PREFILL_PAD_TO_MULTIPLE_OF in saved, multiple is not None)
        if buckets is not None:
            self.assertEqual(saved[PREFILL_BUCKETS], expected_buckets)
        if multiple is not None:
            self.assertEqual(saved[PREFILL_PAD_TO_MULTIPLE_OF], multiple)

    def test_unset_fields_are_not_written(self):
        prefill_buckets.enable()
        config = GenerationConfig(max_new_tokens=4)
        diff = config.to_diff_dict()
        self.assertNotIn(PREFILL_BUCKETS, diff)
        self.assertNotIn(PREFILL_PAD_TO_MULTIPLE_OF, diff)
        self.assertIn("max_new_tokens", diff)
        with tempfile.TemporaryDirectory() as tmpdir:
            config.save_pretrained(tmpdir)
            with open(os.path.join(tmpdir, "generation_config.json")) as f:
                saved = json.load(f)
            self.assertNotIn(PREFILL_BUCKETS, saved)
            self.assertNotIn(PREFILL_PAD_TO_MULTIPLE_OF, saved)
            loaded = GenerationConfig.from_pretrained(tmpdir)
        self.assertIsNone(loaded.prefill_buckets)
        self.assertIsNone(loaded.prefill_pad_to_multiple_of)

    def test_bad_value_in_json_raises_on_load(self):
        prefill_buckets.enable()
        with tempfile.TemporaryDirectory() as tmpdir:
            with open(os.path.join(tmpdir, "generation_config.json"), "w") as f:
                json.dump({PREFILL_BUCKETS: [16, 8]}, f)
            with self.assertRaisesRegex(ValueError, PREFILL_BUCKETS):
                GenerationConfig.from_pretrained(tmpdir)

    @parameterized.expand(
        [("buckets", {PREFILL_BUCKETS: [16, 64]}, 16), ("multiple", {PREFILL_PAD_TO_MULTIPLE_OF: 8}, 8)]
    )
    def test_saved_config_is_honored_without_enable(self, _, fields, bucket):
        prefill_buckets.enable()
        config = GenerationConfig(pad_token_id=PAD, eos_token_id=EOS, bos_token_id=BOS, **fields)
        with tempfile.TemporaryDirectory() as tmpdir:
            config.save_pretrained(tmpdir)
            prefill_buckets.disable()
            self.model.generation_config = GenerationConfig.from_pretrained(tmpdir)
        for field, value in fields.items():
            self.assertEqual(getattr(self.model.generation_config, field), value)

        input_ids = random_ids(5, seed=3)
        recorder = FirstForwardLength(self.model)
        self.addCleanup(recorder.remove)
        padded = prefill_buckets.generate(self.model, input_ids, max_new_tokens=4, do_sample=False)
        self.assertEqual(recorder.first, bucket)
        recorder.lengths.clear()
        plain = self.model.generate(input_ids, max_new_tokens=4, do_sample=False)  # upstream: not enabled
        self.assertEqual(recorder.first, 5)
        self.assertEqual(tuple(padded.shape), (1, 9))
        self.assertTrue(torch.equal(padded, plain))

        # A kwarg set to None turns the saved field off for one call.
        recorder.lengths.clear()
        off = prefill_buckets.generate(
            self.model, input_ids, max_new_tokens=4, do_sample=False, **dict.fromkeys(fields)
        )
        self.assertEqual(recorder.first, 5)
        self.assertTrue(torch.equal(off, plain))


if __name__ == "__main__":
    unittest.main()

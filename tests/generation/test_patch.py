# Tests `patch.py`: `enable()` / `disable()` install the fields and the bucketed `generate` into transformers and put
# back exactly what they replaced, each idempotent. Moved whole from test_config.py, whose tiny Llama, prompt and
# forward-length recorder (now in tiny_models.py) it shares; test_config.py keeps the fields' validation and
# persistence.

import unittest

import torch
from torch._dynamo.eval_frame import OptimizedModule
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

import prefill_buckets
from prefill_buckets import PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF

from .tiny_models import FirstForwardLength, random_ids, tiny_llama_256_positions


class EnableDisableTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = tiny_llama_256_positions()
        cls.input_ids = random_ids(5)

    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)
        self.originals = {
            "init": GenerationConfig.__init__,
            "validate": GenerationConfig.validate,
            "doc": GenerationConfig.__doc__,
            "generate": GenerationMixin.__dict__["generate"],
            "compiled_generate": OptimizedModule.__dict__.get("generate"),
        }

    def assertRestored(self):
        self.assertIs(GenerationConfig.__init__, self.originals["init"])
        self.assertIs(GenerationConfig.validate, self.originals["validate"])
        self.assertIs(GenerationConfig.__doc__, self.originals["doc"])
        self.assertIs(GenerationMixin.__dict__["generate"], self.originals["generate"])
        self.assertIs(GenerationMixin.generate, self.originals["generate"])
        self.assertIs(type(self.model).generate, self.originals["generate"])
        # `torch.compile(model).generate` is the wrapped module's again (enable() routes it through ours).
        self.assertIs(OptimizedModule.__dict__.get("generate"), self.originals["compiled_generate"])

    def assertPatched(self):
        self.assertIsNot(GenerationConfig.__init__, self.originals["init"])
        self.assertIsNot(GenerationConfig.validate, self.originals["validate"])
        self.assertIsNot(GenerationConfig.__doc__, self.originals["doc"])
        self.assertIsNot(GenerationMixin.__dict__["generate"], self.originals["generate"])

    def test_enable_then_disable_restores_the_same_objects(self):
        self.assertFalse(prefill_buckets.is_enabled())
        prefill_buckets.enable()
        self.assertTrue(prefill_buckets.is_enabled())
        self.assertPatched()
        prefill_buckets.disable()
        self.assertFalse(prefill_buckets.is_enabled())
        self.assertRestored()

    def test_enable_is_idempotent(self):
        prefill_buckets.enable()
        patched = (GenerationConfig.__init__, GenerationConfig.validate, GenerationConfig.__doc__)
        patched_generate = GenerationMixin.__dict__["generate"]
        prefill_buckets.enable()
        self.assertTrue(prefill_buckets.is_enabled())
        self.assertEqual(patched, (GenerationConfig.__init__, GenerationConfig.validate, GenerationConfig.__doc__))
        self.assertIs(GenerationMixin.__dict__["generate"], patched_generate)
        self.assertEqual(GenerationConfig.__doc__.count(f"{PREFILL_BUCKETS} ("), 1)
        prefill_buckets.disable()
        self.assertRestored()

    def test_disable_is_idempotent(self):
        prefill_buckets.disable()
        prefill_buckets.disable()
        self.assertFalse(prefill_buckets.is_enabled())
        self.assertRestored()
        prefill_buckets.enable()
        prefill_buckets.disable()
        prefill_buckets.disable()
        self.assertFalse(prefill_buckets.is_enabled())
        self.assertRestored()

    def test_enable_disable_twice(self):
        for _ in range(2):
            prefill_buckets.enable()
            self.assertEqual(GenerationConfig(prefill_buckets="pow2").prefill_buckets, "pow2")
            prefill_buckets.disable()
            self.assertRestored()

    def test_enabled_defaults_and_docstring(self):
        self.assertFalse(hasattr(GenerationConfig(), PREFILL_BUCKETS))
        prefill_buckets.enable()
        config = GenerationConfig()
        self.assertIsNone(config.prefill_buckets)
        self.assertIsNone(config.prefill_pad_to_multiple_of)
        self.assertIn(f"{PREFILL_BUCKETS} (", GenerationConfig.__doc__)
        self.assertIn(f"{PREFILL_PAD_TO_MULTIPLE_OF} (", GenerationConfig.__doc__)
        # Upstream's docstring is kept, the fields are added to it.
        self.assertTrue(GenerationConfig.__doc__.startswith(self.originals["doc"]))

    def test_enabled_generate_pads(self):
        prefill_buckets.enable()
        recorder = FirstForwardLength(self.model)
        self.addCleanup(recorder.remove)
        padded = self.model.generate(self.input_ids, prefill_buckets=[16], max_new_tokens=3, do_sample=False)
        self.assertEqual(recorder.first, 16)
        prefill_buckets.disable()
        recorder.lengths.clear()
        plain = self.model.generate(self.input_ids, max_new_tokens=3, do_sample=False)
        self.assertEqual(recorder.first, self.input_ids.shape[1])
        self.assertTrue(torch.equal(padded, plain))

    def test_after_disable_the_field_is_unknown_again(self):
        prefill_buckets.enable()
        with self.assertRaises(ValueError):
            GenerationConfig(prefill_buckets=[0])
        prefill_buckets.disable()
        # Upstream stores an unknown field silently.
        config = GenerationConfig(prefill_buckets=[0])
        self.assertEqual(config.prefill_buckets, [0])
        with self.assertRaisesRegex(ValueError, "model_kwargs` are not used by the model") as context:
            self.model.generate(self.input_ids, prefill_buckets=[8], max_new_tokens=2)
        self.assertIn(PREFILL_BUCKETS, str(context.exception))


if __name__ == "__main__":
    unittest.main()

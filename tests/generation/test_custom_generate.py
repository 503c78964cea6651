# `save_custom_generate`: bucketing through transformers' own `custom_generate` extension point, with no `enable()`.
# A tiny model saved to a temp dir gets the file, is loaded back with `trust_remote_code=True`, and its `generate`
# pads to the buckets saved in its generation config: one prefill graph per bucket, upstream's tokens.

import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets import GraphCounter

from .tiny_models import tiny_llama


LENGTHS = (5, 9, 16, 3, 12, 30, 20)  # buckets 16 and 32
NEW_TOKENS = 4


# A new process that loads the folder with no code change: it never imports `prefill_buckets` itself (the folder's
# `custom_generate` does), compiles with the counting backend, and prints what it generated and compiled.
_NEW_PROCESS = """
import json, sys
import torch
from transformers import AutoModelForCausalLM

folder, lengths, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
shapes = []

def count(gm, example_inputs):
    shapes.append(tuple(example_inputs[0].shape))
    return gm.forward

model.compile(backend=count, dynamic=False, fullgraph=True)
tokens = {}
for n in lengths:
    ids = torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(n))
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    tokens[n] = out[0].tolist()
import prefill_buckets
print(json.dumps({"tokens": tokens, "shapes": shapes, "enabled": prefill_buckets.is_enabled()}))
"""


def prompt(length: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length))


class SaveCustomGenerateTest(unittest.TestCase):
    def setUp(self):
        prefill_buckets.disable()  # no patching anywhere: the folder alone must do it
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.folder = tmp.name
        self.reference = tiny_llama()
        self.expected = {
            n: self.reference.generate(
                prompt(n), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            for n in LENGTHS
        }

    def test_loaded_model_generates_bucketed(self):
        model = tiny_llama()
        model.generation_config = GenerationConfig(
            cache_implementation="static", prefill_buckets=[16, 32], pad_token_id=0, eos_token_id=1, bos_token_id=2
        )
        model.save_pretrained(self.folder)
        path = prefill_buckets.save_custom_generate(self.folder)
        self.assertEqual(str(path), os.path.join(self.folder, "custom_generate", "generate.py"))

        loaded = AutoModelForCausalLM.from_pretrained(self.folder, trust_remote_code=True).eval()
        self.assertEqual(loaded.generation_config.prefill_buckets, [16, 32])
        counter = GraphCounter()
        loaded.compile(backend=counter, dynamic=False, fullgraph=True)
        for n in LENGTHS:
            out = loaded.generate(prompt(n), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            self.assertTrue(torch.equal(out, self.expected[n]), f"prompt of {n} tokens")
        # 2 prefill graphs (the buckets) + 1 decode graph for 7 lengths; every forward compiled.
        self.assertEqual(sorted(shapes[0][1] for shapes in counter.shapes), [1, 16, 32], counter.shapes)
        self.assertEqual(counter.calls, NEW_TOKENS * len(LENGTHS))
        self.assertFalse(prefill_buckets.is_enabled())

    def test_a_new_process_generates_bucketed_with_no_code_change(self):
        # The docs' no-code-change load: `from_pretrained(folder, trust_remote_code=True)` in a process that never
        # calls `enable()` nor imports the package.
        model = tiny_llama()
        model.generation_config = GenerationConfig(
            cache_implementation="static", prefill_buckets=[16, 32], pad_token_id=0, eos_token_id=1, bos_token_id=2
        )
        model.save_pretrained(self.folder)
        prefill_buckets.save_custom_generate(self.folder)
        result = subprocess.run(
            [sys.executable, "-c", _NEW_PROCESS, self.folder, json.dumps(LENGTHS), str(NEW_TOKENS)],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        seen = json.loads(result.stdout.strip().splitlines()[-1])
        for n in LENGTHS:
            self.assertEqual(seen["tokens"][str(n)], self.expected[n][0].tolist(), f"prompt of {n} tokens")
        self.assertEqual(sorted(shape[1] for shape in seen["shapes"]), [1, 16, 32], seen["shapes"])
        self.assertFalse(seen["enabled"])

    def test_warns_when_the_fields_would_be_dropped(self):
        # A generation config derived from the model config loses unknown fields on load: said at save time.
        model = tiny_llama()
        model.generation_config.prefill_buckets = [16, 32]
        model.save_pretrained(self.folder)
        with CaptureLogger(logging.get_logger("prefill_buckets")) as logs:
            prefill_buckets.save_custom_generate(self.folder)
        self.assertIn("transformers drops the fields it does not know", logs.out)
        loaded = AutoModelForCausalLM.from_pretrained(self.folder, trust_remote_code=True)
        self.assertIsNone(getattr(loaded.generation_config, "prefill_buckets", None))  # what the warning says
        # With `enable()` in effect when it loads, `GenerationConfig` knows the fields: they are kept (the docs).
        prefill_buckets.enable()
        self.addCleanup(prefill_buckets.disable)
        loaded = AutoModelForCausalLM.from_pretrained(self.folder)
        self.assertEqual(loaded.generation_config.prefill_buckets, [16, 32])

    def test_custom_generate_argument(self):
        # Any model, the folder passed per call: the fields come from the call's config.
        prefill_buckets.save_custom_generate(self.folder)
        model = tiny_llama()
        seen = []
        model.register_forward_pre_hook(lambda m, a, k: seen.append(k["input_ids"].shape[1]), with_kwargs=True)
        config = GenerationConfig(
            max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, prefill_buckets=[16, 32]
        )
        for n in (5, 20):
            out = model.generate(
                prompt(n), generation_config=config, custom_generate=self.folder, trust_remote_code=True
            )
            self.assertTrue(torch.equal(out, self.expected[n]))
        self.assertEqual([s for s in seen if s > 1], [16, 32])

# `compile/aot_key.py`: the dispatch key that tells apart the graphs `aot_forward` compiles for one model (the guards
# a saved graph drops are audited through `aot_forward`, in test_aot_forward.py).

import json
import unittest

import torch
from transformers import StaticCache

from prefill_buckets.compile.aot_key import UNNAMED, dispatch_key
from prefill_buckets.upstream import checks, transformers_api

from .tiny_models import tiny_llama_config


# As the rest of `aot_forward`'s tests (test_aot_forward.py): `aot_forward` raises on a torch older than 2.13.
@unittest.skipIf(checks.aot_compile_problem() is not None, "`aot_forward` raises on this torch (test_checks.py)")
class DispatchKeyTest(unittest.TestCase):
    def test_a_fresh_cache_and_functions_set_on_it_are_in_the_key(self):
        cache = StaticCache(config=tiny_llama_config(), max_cache_len=64)
        ids = torch.ones(1, 8, dtype=torch.long)
        continued = dispatch_key((), {"input_ids": ids, "cache": cache})
        with transformers_api.reports_empty(cache):
            fresh = dispatch_key((), {"input_ids": ids, "cache": cache})
        self.assertNotEqual(fresh.text(), continued.text())
        self.assertEqual(continued.instance_functions, ())
        self.assertEqual(
            json.loads(fresh.text())["inputs"], [["cache", "StaticCache"], ["input_ids", [1, 8], "torch.int64"]]
        )
        cache.get_mask_sizes = lambda *args: None
        self.assertIn(("cache", "get_mask_sizes", UNNAMED), dispatch_key((), {"cache": cache}).instance_functions)


if __name__ == "__main__":
    unittest.main()

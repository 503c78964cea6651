"""
A pytest plugin that runs transformers' own tests with the package: `enable()`, and optionally bucket fields on every
`GenerationConfig`. From a transformers source checkout whose version matches the installed one (its `tests/`):

    PB_MODE=fields PYTHONPATH=/path/to/transformers-prefill-buckets/utils:. python -m pytest \\
        tests/models/llama/test_modeling_llama.py -p upstream_suite -k "generate or beam or assisted or cache"

- `PB_MODE`: `off` (the baseline: the plugin does nothing), `enable` (`prefill_buckets.enable()` only: the results
  must be the baseline's), or `fields` (also a default `prefill_buckets` on every `GenerationConfig`).
- `PB_BUCKETS`: the default `prefill_buckets` in `fields` mode, a policy name or a JSON list (`pow2` by default);
  `PB_BATCH`: a JSON list for `prefill_batch_buckets` too.
- `PB_RELAX=1`: two checks of what bucketing changes by design, and documents, are relaxed, so the tests go on to
  compare outputs: the returned cache's sequence axis (a static cache sized from the bucket; a dynamic cache that
  holds the padded prompt) and dynamo's recompile log (the bucketed prefill is a graph of its own beside decode's).
  The returned cache's batch axis (`PB_BATCH`: its dummy rows) is not relaxed.

In `fields` mode without `PB_RELAX`, expect those checks to fail (`GenerationTesterMixin`'s
`_check_past_key_values_for_generate`, and `test_generate_compile_model_forward_fullgraph`); with it, the results
should be the baseline's.
"""

import json
import os


def pytest_configure(config):
    mode = os.environ.get("PB_MODE", "off")
    if mode not in ("off", "enable", "fields"):
        raise ValueError(f"PB_MODE must be one of 'off', 'enable', 'fields', but is {mode!r}.")
    if mode == "off":
        return
    import prefill_buckets

    prefill_buckets.enable()
    if mode == "fields":
        from transformers import GenerationConfig

        buckets = os.environ.get("PB_BUCKETS", "pow2")
        buckets = json.loads(buckets) if buckets.startswith("[") else buckets
        batch = os.environ.get("PB_BATCH")
        batch = json.loads(batch) if batch else None
        original = GenerationConfig.__init__

        def init(self, **kwargs):
            kwargs.setdefault("prefill_buckets", buckets)
            if batch is not None:
                kwargs.setdefault("prefill_batch_buckets", batch)
            original(self, **kwargs)

        GenerationConfig.__init__ = init


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("PB_RELAX") != "1":
        return
    import torch

    from tests.generation import test_utils

    mixin = test_utils.GenerationTesterMixin
    original = mixin._check_past_key_values_for_generate
    if getattr(original, "relaxed", False):
        return

    def relaxed(self, batch_size, past_key_values, seq_length, config):
        return original(self, batch_size, past_key_values, None, config)  # `None`: no sequence axis compared

    relaxed.relaxed = True
    mixin._check_past_key_values_for_generate = relaxed
    torch._logging.set_logs = lambda *args, **kwargs: None  # no recompile log to find

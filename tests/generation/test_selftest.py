# The self-test (`upstream/selftest.py`), which the version gate (`upstream/gate.py`) runs at the first bucketed call
# on a transformers outside the tested range: it passes here, logs nothing, and a step that changed meaning fails
# loudly, for good. (Outside torch's tested range: test_checks.py's `TorchVersionTest`.)

import threading
import time
import unittest
from unittest import mock

import torch
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

import prefill_buckets
from prefill_buckets.testing_utils import as_new_process
from prefill_buckets.upstream import gate
from prefill_buckets.upstream.selftest import self_test

from .tiny_models import random_ids, tiny_llama


class UntestedVersionTest(unittest.TestCase):
    def setUp(self):
        # As on a transformers release outside the tested range, in a fresh process: nothing checked yet.
        self.enterContext(as_new_process())
        patcher = mock.patch.object(gate, "is_tested_range", return_value=False)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_self_test_passes_here(self):
        self_test(prefill_buckets.generate)

    def test_self_test_runs_on_the_cpu_in_float32_whatever_the_call_runs_under(self):
        # The first bucketed call runs it, inside whatever the user's call runs under: a `with torch.device("cuda"):`
        # block (the meta device plays it on a CPU-only machine) made its model there, and it failed ("Cannot copy
        # out of meta tensor"), and with it, for the whole process, every bucketed call; a float16 default dtype made
        # its model float16.
        with torch.device("meta"):
            self_test(prefill_buckets.generate)
        previous = torch.get_default_dtype()
        self.addCleanup(torch.set_default_dtype, previous)
        torch.set_default_dtype(torch.float16)
        models = []

        def generate(model, *args, **kwargs):
            models.append((model.dtype, model.device.type))
            return prefill_buckets.generate(model, *args, **kwargs)

        self_test(generate)
        self.assertEqual(set(models), {(torch.float32, "cpu")})

    def test_self_test_logs_nothing(self):
        # It generates on a model of its own, which the user never sees: it logged that its bucketed call grew the
        # static cache of its unpadded one ("A call needs 10 static cache slots, more than the model's cache of 7").
        logger = logging.get_logger("prefill_buckets")
        logger.warning_once.cache_clear()
        self.addCleanup(logger.warning_once.cache_clear)
        with CaptureLogger(logger) as logs:
            self_test(prefill_buckets.generate)
        # The version gate's own warning aside (this test plays an untested version, and its calls pass the gate).
        others = [line for line in logs.out.splitlines() if line and "prefill_buckets is tested on" not in line]
        self.assertEqual(others, [])

    def test_first_bucketed_call_warns_and_self_tests(self):
        model = tiny_llama()
        with mock.patch("prefill_buckets.upstream.selftest.self_test", wraps=self_test) as spy:
            with CaptureLogger(logging.get_logger("prefill_buckets")) as logs:
                out = prefill_buckets.generate(model, random_ids(5), max_new_tokens=2, prefill_buckets=[8])
                prefill_buckets.generate(model, random_ids(6), max_new_tokens=2, prefill_buckets=[8])
        self.assertEqual(out.shape, (1, 7))
        self.assertEqual(spy.call_count, 1)  # once per process
        self.assertIn("prefill_buckets is tested on transformers", logs.out)

    def test_a_changed_step_fails_loudly(self):
        # As if a release changed what a hooked step means: here, the padding is no longer stripped.
        with mock.patch("prefill_buckets.call.generation.strip_output", lambda output, plan: output):
            with self.assertRaisesRegex(RuntimeError, "self-test failed on transformers"):
                prefill_buckets.generate(tiny_llama(), random_ids(5), max_new_tokens=2, prefill_buckets=[8])

    def test_a_failed_self_test_keeps_failing(self):
        # The verdict sticks: the second call (the step still broken, or not) raises too, instead of running bucketed
        # on a version the self-test has shown to be broken. The self-test runs once.
        model = tiny_llama()
        with mock.patch("prefill_buckets.upstream.selftest.self_test", wraps=self_test) as spy:
            with mock.patch("prefill_buckets.call.generation.strip_output", lambda output, plan: output):
                with self.assertRaisesRegex(RuntimeError, "self-test failed on transformers"):
                    prefill_buckets.generate(model, random_ids(5), max_new_tokens=2, prefill_buckets=[8])
            for _ in range(2):
                with self.assertRaisesRegex(RuntimeError, "self-test failed on transformers"):
                    prefill_buckets.generate(model, random_ids(5), max_new_tokens=2, prefill_buckets=[8])
        self.assertEqual(spy.call_count, 1)
        # Unbucketed calls are upstream's, and still run.
        self.assertEqual(prefill_buckets.generate(model, random_ids(5), max_new_tokens=2).shape, (1, 7))

    def test_concurrent_first_calls_wait_for_the_verdict(self):
        # A second thread's first call, made while the self-test runs, waits for its verdict and raises it too.
        started, results = threading.Event(), {}

        def failing_self_test(generate):
            started.set()
            time.sleep(0.5)  # long enough for the other thread to be waiting on the verdict
            raise RuntimeError("prefill_buckets' self-test failed on transformers (simulated)")

        def call(name):
            try:
                prefill_buckets.generate(tiny_llama(), random_ids(5), max_new_tokens=2, prefill_buckets=[8])
                results[name] = "ran"
            except RuntimeError as error:
                results[name] = str(error)

        with mock.patch("prefill_buckets.upstream.selftest.self_test", failing_self_test):
            first = threading.Thread(target=call, args=("first",))
            first.start()
            self.assertTrue(started.wait(timeout=60))
            second = threading.Thread(target=call, args=("second",))
            second.start()
            first.join(timeout=60)
            second.join(timeout=60)
        self.assertEqual(set(results), {"first", "second"})
        for name in ("first", "second"):
            self.assertIn("self-test failed", results[name], name)

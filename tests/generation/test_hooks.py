# Tests `call/hooks.py`'s installation of a call's hooks (`bucketed_call`): under threads, each call's hooks act for
# its model and its context only, calls on two models interleave with upstream's exact output, and a call in flight
# when `disable` runs finishes exactly and takes its hooks with it (`enable` from many threads wraps once too). Moved
# whole from test_robustness.py, whose `RobustnessTestBase` (every hook and fallback removed after each test, now in
# tiny_models.py) it shares.

import threading
import unittest

import torch
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

import prefill_buckets
from prefill_buckets.call.generation import UPSTREAM_GENERATE

from .tiny_models import RobustnessTestBase, random_batch_ids, tiny_llama


class ThreadsTest(RobustnessTestBase):
    def run_threads(self, targets):
        errors = []

        def guard(target):
            try:
                target()
            except BaseException as error:  # noqa: BLE001 (reported below)
                errors.append(error)

        threads = [threading.Thread(target=guard, args=(t,)) for t in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=300)
        self.assertEqual(errors, [])

    def test_enable_from_many_threads(self):
        original_init = GenerationConfig.__init__
        barrier = threading.Barrier(8)
        made = []

        def target():
            barrier.wait()
            prefill_buckets.enable()
            made.append(GenerationConfig(prefill_buckets=[8, 16]).prefill_buckets)

        self.run_threads([target] * 8)
        self.assertEqual(made, [[8, 16]] * 8)
        self.assertIs(GenerationConfig.__init__.__wrapped__, original_init)  # wrapped once
        prefill_buckets.disable()
        self.assertIs(GenerationConfig.__init__, original_init)

    def test_two_models_and_two_threads_per_model(self):
        other = tiny_llama(seed=1, num_hidden_layers=1)
        jobs = []
        for model, fields in ((self.model, {"prefill_buckets": [8, 16, 32]}), (other, {"prefill_buckets": "pow2"})):
            for seed, cache in ((1, "static"), (2, None)):
                for length in (3, 7, 13, 21):
                    jobs.append((model, fields, random_batch_ids(2, length, seed=seed * 100 + length), cache))
        expected = [
            model.generate(ids, max_new_tokens=5, do_sample=False, cache_implementation=cache)
            for model, _, ids, cache in jobs
        ]
        actual = [None] * len(jobs)

        def worker(indices):
            def target():
                for i in indices:
                    model, fields, ids, cache = jobs[i]
                    actual[i] = prefill_buckets.generate(
                        model, ids, max_new_tokens=5, do_sample=False, cache_implementation=cache, **fields
                    )

            return target

        # Four threads, each mixing both models, interleaved.
        self.run_threads([worker(range(start, len(jobs), 4)) for start in range(4)])
        for i, (got, want) in enumerate(zip(actual, expected)):
            with self.subTest(job=i):
                self.assertSameIds(got, want)
        self.assertNoHooksLeft(other)

    def test_disable_during_a_call(self):
        prefill_buckets.enable()
        started, release = threading.Event(), threading.Event()

        class PausingStreamer:
            def put(self, value):
                if not started.is_set():
                    started.set()
                    release.wait(timeout=60)

            def end(self):
                pass

        input_ids = random_batch_ids(1, 7)
        expected = UPSTREAM_GENERATE(self.model, input_ids, max_new_tokens=4, do_sample=False)
        result = {}

        def target():
            result["ids"] = self.model.generate(
                input_ids, max_new_tokens=4, do_sample=False, prefill_buckets=[16], streamer=PausingStreamer()
            )

        thread = threading.Thread(target=target)
        thread.start()
        self.assertTrue(started.wait(timeout=60))
        prefill_buckets.disable()  # mid-call: transformers' classes are restored at once
        self.assertIs(GenerationMixin.generate, UPSTREAM_GENERATE)
        self.assertFalse(prefill_buckets.is_enabled())
        self.assertNotIn("generate", torch._dynamo.eval_frame.OptimizedModule.__dict__)
        self.assertEqual(GenerationConfig(prefill_buckets=[0]).prefill_buckets, [0])  # unknown, not validated
        release.set()
        thread.join(timeout=60)
        self.assertSameIds(result["ids"], expected)  # the call in flight finishes exactly
        self.assertNoHooksLeft(self.model)  # and takes its per-call hooks with it


if __name__ == "__main__":
    unittest.main()

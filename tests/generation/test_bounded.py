# The simplest config is bounded (issues 13 and 22): bucket fields set, no `max_cache_len`, no `precompile`, prompts of
# 10 to 500 tokens in random orders. The graphs per batch size are at most the prefill buckets used plus the attention
# windows used plus 2 (`kvcache/windows.py`: every forward reads a window of the cache, one graph per window), no forward falls
# back to eager, and the tokens are upstream's.
#
# Counted with `GraphCounter` (eager backend: tracing only) on `model.compile(dynamic=False, fullgraph=True)`: each
# forward is one compiled call or an error, so `calls == forwards` means nothing ran eagerly.

import random
import unittest

import torch
from parameterized import parameterized
from transformers import GenerationConfig

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.kvcache.windows import window_length

from .tiny_models import tiny_llama


NEW_TOKENS = 8
WORKLOAD_SIZE = 20
# Room past the longest padded prompt (512 + 7 slots): a cache is never sized past the model's positions unless a call
# needs more (GPT-Neo sizes buffers by them), so a 512-position model would grow at the edge (512, then 519 slots).
POSITIONS = 1024


def workload(seed: int) -> list[int]:
    """`WORKLOAD_SIZE` distinct prompt lengths from 10 to 500, in a random order."""
    return random.Random(seed).sample(range(10, 501), WORKLOAD_SIZE)


def prompt(length: int) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(length))


def windows_used(lengths, bucket, slots: int, chunk: int | None = None) -> set[int]:
    """The windows the forwards of these calls read: one per count of tokens the cache holds after a forward."""
    windows = set()
    for length in lengths:
        padded = bucket(length)
        filled = list(range(chunk, padded, chunk)) if chunk else []  # after each chunk but the last
        filled += range(padded, padded + NEW_TOKENS)  # after prefill, then after each decode step
        windows.update(window_length(tokens, slots) for tokens in filled)
    return windows


class BoundedByDefaultTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # Upstream's tokens, once per length: eager, unpadded, a dynamic cache.
        cls.reference = tiny_llama(max_position_embeddings=POSITIONS)
        cls.expected = {}

    def expected_tokens(self, length: int) -> torch.Tensor:
        if length not in self.expected:
            self.expected[length] = self.reference.generate(
                prompt(length), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
        return self.expected[length]

    def run_workload(self, lengths, **fields) -> tuple[GraphCounter, set[int], set[int]]:
        torch._dynamo.reset()
        model = tiny_llama(max_position_embeddings=POSITIONS)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        config = GenerationConfig(
            cache_implementation="static", max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
        cache_lengths = set()
        for length in lengths:
            calls_before = counter.calls
            out = prefill_buckets.generate(model, prompt(length), generation_config=config, **fields)
            self.assertTrue(torch.equal(out, self.expected_tokens(length)), f"prompt of {length} tokens")
            forwards = counter.calls - calls_before
            chunk = fields.get("prefill_chunk_size")
            prefill_forwards = 1 if chunk is None else -(-length // chunk)
            self.assertEqual(forwards, prefill_forwards + NEW_TOKENS - 1, "a forward ran eagerly")
            cache_lengths.add(model._previous_max_cache_length)
        prefill_shapes = {shape[0] for shape in counter.shapes}
        return counter, cache_lengths, prefill_shapes

    @parameterized.expand([(f"pow2_{seed}", "pow2", seed) for seed in (0, 1)] + [("multiple64_2", 64, 2)])
    def test_buckets_plus_windows(self, _, policy, seed):
        lengths = workload(seed)
        fields = {"prefill_buckets": "pow2"} if policy == "pow2" else {"prefill_pad_to_multiple_of": policy}
        bucket = prefill_buckets.BucketPolicy(
            buckets=fields.get("prefill_buckets"), pad_to_multiple_of=fields.get("prefill_pad_to_multiple_of")
        ).bucket
        buckets_used = {bucket(length) for length in lengths}
        counter, cache_lengths, _ = self.run_workload(lengths, **fields)
        self.assertEqual(len(cache_lengths), 1, f"the cache grew: {sorted(cache_lengths)}")
        windows = windows_used(lengths, bucket, cache_lengths.pop())
        self.assertGreater(len(windows), 1)  # the workload crosses windows
        self.assertLessEqual(counter.graphs, len(buckets_used) + len(windows) + 2, counter.shapes)

    def test_chunked_graphs_per_window(self):
        lengths = workload(3)
        counter, cache_lengths, _ = self.run_workload(lengths, prefill_chunk_size=64, prefill_pad_to_multiple_of=64)
        self.assertEqual(len(cache_lengths), 1, f"the cache grew: {sorted(cache_lengths)}")
        windows = windows_used(lengths, lambda n: -(-n // 64) * 64, cache_lengths.pop(), chunk=64)
        # One chunk graph and one decode graph per window (a last chunk of another length: `prefill_pad_to_multiple_of`
        # makes every chunk 64 long).
        self.assertLessEqual(counter.graphs, 2 * len(windows), counter.shapes)
        self.assertLessEqual(counter.graphs, 1 + len(windows) + 2, counter.shapes)

    def test_one_growth_past_the_largest_bucket(self):
        # A list bounds the first cache to its largest bucket (64 + 7 -> 128 slots); prompts past it grow the cache
        # once, to the longest sequence the model takes (its 1024 positions), and never again.
        lengths = [40, 20, 300, 60, 450, 10, 500]
        buckets = [32, 64]
        counter, cache_lengths, _ = self.run_workload(lengths, prefill_buckets=buckets)
        self.assertEqual(sorted(cache_lengths), [128, POSITIONS])
        policy = prefill_buckets.BucketPolicy(buckets=buckets)
        before = {policy.bucket(n) for n in lengths[:2]}
        after = {policy.bucket(n) for n in lengths[2:]}
        # Buckets before the growth, then every bucket after it at the new length, and the windows at each length.
        windows = windows_used(lengths[:2], policy.bucket, 128) | windows_used(lengths[2:], policy.bucket, POSITIONS)
        self.assertLessEqual(counter.graphs, len(before) + len(after) + len(windows) + 2, counter.shapes)


class CandidateDecodingTest(unittest.TestCase):
    @parameterized.expand([("prompt_lookup",), ("assistant",)])
    def test_room_for_every_candidate_count(self, drafter):
        # Prompt-lookup and assisted decoding have no prefill step: the first forward runs the prompt with the first
        # candidates, and each later one checks up to 10 of them (`prompt_lookup_num_tokens`; an assistant's
        # `num_assistant_tokens`, which its heuristic schedule moves): a graph per count, in every window, more than torch's default limit of 8. With
        # `fullgraph=True` a forward past the limit raises (`FailOnRecompileLimitHit`), so the budget makes room for
        # them (`budget.account_candidates`).
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        model, counter = tiny_llama(max_position_embeddings=POSITIONS), GraphCounter()
        reference = tiny_llama(max_position_embeddings=POSITIONS)
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        fields = {"cache_implementation": "static", "do_sample": False, "max_new_tokens": 24}
        if drafter == "prompt_lookup":
            fields["prompt_lookup_num_tokens"] = 10
        else:
            # Other weights: candidates rejected, so the heuristic schedule drafts 10 at first, then more or fewer.
            assistant = tiny_llama(seed=1, max_position_embeddings=POSITIONS)
            assistant.generation_config.num_assistant_tokens = 10
            assistant.generation_config.num_assistant_tokens_schedule = "heuristic_transient"
            assistant.generation_config.assistant_confidence_threshold = 0  # drafts every token it may
            fields["assistant_model"] = assistant
        try:
            reference.generate(torch.arange(3, 8).unsqueeze(0), max_cache_len=256, **fields)
        except ValueError as error:  # transformers 5.17: no candidate decoding on a static cache at all
            self.skipTest(f"upstream: {error}")
        generator = torch.Generator().manual_seed(0)
        with torch._dynamo.config.patch(recompile_limit=8):
            for length in (5, 9, 13, 7, 21, 30, 11, 6):
                ids = torch.randint(3, 20, (1, 4), generator=generator).repeat(1, 8)[:, :length]  # repeats: matches
                out = prefill_buckets.generate(model, ids, prefill_buckets="pow2", **fields)
                # Upstream's own call on a cache of its own length overflows it with candidates: a longer one.
                expected = reference.generate(ids, max_cache_len=256, **fields)
                self.assertEqual(out.tolist(), expected.tolist())
        self.assertGreater(counter.graphs, 8, "the premise: more graphs than torch's default limit")

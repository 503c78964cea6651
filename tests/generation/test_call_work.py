# What a bucketed call derives, it derives once (issue 33, item 3): the cache it continues from is read once per call,
# the forward's signature once per forward, the auto-compile verdict once per call, and a decode step looks up nothing
# the call already knows. Counted, not timed.

import inspect
import unittest
from unittest import mock

import torch
from transformers import StaticCache

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.call import hooks, prefill_right, resolved
from prefill_buckets.compile import compiled_calls
from prefill_buckets.kvcache import record as cache_record_module
from prefill_buckets.upstream import torch_api, transformers_api

from .tiny_models import CACHE, single_thread_module, static_config, tiny_llama


setUpModule, tearDownModule = single_thread_module()


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, length), generator=torch.Generator().manual_seed(seed))


class Counter:
    """Counts the calls of `owner.name` (still calling it) while the context is open."""

    def __init__(self, owner, name: str, only=None):
        self.owner, self.name, self.only, self.calls = owner, name, only, 0

    def __enter__(self):
        original = getattr(self.owner, self.name)

        def counted(*args, **kwargs):
            if self.only is None or self.only(*args, **kwargs):
                self.calls += 1
            return original(*args, **kwargs)

        self.patcher = mock.patch.object(self.owner, self.name, counted)
        self.patcher.start()
        return self

    def __exit__(self, *exc):
        self.patcher.stop()


class CallWorkTest(unittest.TestCase):
    def setUp(self):
        prefill_buckets.disable()  # `model.generate` is upstream's
        self.model = tiny_llama()

    def test_the_cache_a_call_continues_from_is_read_once(self):
        # Its record (the padding, the bucket fields, the ragged rows) was looked up by every step that asked: five
        # times or more per call.
        model = self.model
        config = static_config(4, return_dict_in_generate=True)
        for side in ("left", "right"):
            with self.subTest(side):
                cache = StaticCache(config=model.config, max_cache_len=128)
                first = prefill_buckets.generate(
                    model, prompt(5), generation_config=config, prefill_buckets=[16], prefill_padding_side=side,
                    cache_implementation=None, **{CACHE: cache},
                )  # fmt: skip
                turn = torch.cat([first.sequences, prompt(3, seed=1)], dim=1)
                with Counter(cache_record_module, "cache_record") as records:
                    prefill_buckets.generate(
                        model, turn, generation_config=config, cache_implementation=None, **{CACHE: first[CACHE]}
                    )
                self.assertEqual(records.calls, 1)

    def test_the_forward_signature_is_read_once_per_forward(self):
        # Upstream's `generate` reads it itself; a bucketed call asked three times more (the mask, `logits_to_keep`,
        # `position_ids`), on every call.
        model = self.model
        forward = type(model).forward

        def of_forward(obj, *args, **kwargs):
            return getattr(obj, "__func__", obj) is forward

        with Counter(inspect, "signature", only=of_forward) as upstream:
            model.generate(prompt(5), generation_config=static_config(3))
        for side in ("left", "right"):
            with self.subTest(side):
                call = lambda: prefill_buckets.generate(  # noqa: E731
                    model, prompt(5), generation_config=static_config(3), prefill_buckets=[16],
                    prefill_padding_side=side,
                )  # fmt: skip
                call()
                with Counter(inspect, "signature", only=of_forward) as signatures:
                    call()
                self.assertEqual(signatures.calls, upstream.calls)

    def test_auto_compile_is_decided_once_per_call(self):
        # The cache hook decides it; the right-padded prefill reads the plan instead of asking upstream again.
        with Counter(transformers_api, "valid_auto_compile") as verdicts:
            prefill_buckets.generate(
                self.model, prompt(5), generation_config=static_config(3), prefill_buckets=[16],
                prefill_padding_side="right",
            )  # fmt: skip
        self.assertEqual(verdicts.calls, 1)

    def test_upstream_decides_auto_compile_once_per_call_too(self):
        # Upstream asks before it decodes, of the config and cache the cache step asked of: the verdict is that one.
        owner = type(self.model)
        with Counter(owner, "_valid_auto_compile_criteria") as upstream:
            self.model.generate(prompt(5), generation_config=static_config(3))
        self.assertEqual(upstream.calls, 1)  # the positive control: upstream's own call asks once
        for side in ("left", "right"):
            with self.subTest(side), Counter(owner, "_valid_auto_compile_criteria") as verdicts:
                prefill_buckets.generate(
                    self.model, prompt(5), generation_config=static_config(3), prefill_buckets=[16],
                    prefill_padding_side=side,
                )  # fmt: skip
            self.assertEqual(verdicts.calls, 1)

    def test_an_eager_right_padded_prefill_allocates_its_cache_as_upstream_does(self):
        # Lazily, on its first write: an early allocation (static addresses) is for a compiled forward.
        with Counter(prefill_right, "early_initialize") as allocations:
            out = prefill_buckets.generate(
                self.model, prompt(5), generation_config=static_config(3), prefill_buckets=[16],
                prefill_padding_side="right",
            )  # fmt: skip
        self.assertEqual(allocations.calls, 0)
        self.assertEqual(out.shape, (1, 8))

    def test_a_prompt_that_fits_its_bucket_reads_no_fill_id(self):
        # The fill id skips the ids the model's config reserves (`reserved_token_ids` walks the config and the configs
        # nested in it): a call that adds no position needs none, on either side. The positive control: one that does.
        for side in ("left", "right"):
            reads = []
            for length in (16, 5):
                with Counter(resolved, "reserved_token_ids") as walks:
                    out = prefill_buckets.generate(
                        self.model, prompt(length), generation_config=static_config(3), prefill_buckets=[16],
                        prefill_padding_side=side,
                    )  # fmt: skip
                self.assertEqual(out.shape, (1, length + 3))
                reads.append(walks.calls)
            with self.subTest(side):
                self.assertEqual(reads, [0, 1])

    def test_a_decode_step_looks_up_nothing_the_call_knows(self):
        # Whether the cache reads windows, and torch's recompile limit, are the call's: as many lookups with 2 new
        # tokens as with 12. A 512-slot cache has windowed layers (its window is 256).
        model = self.model
        for side in ("left", "right"):
            counts = []
            for new_tokens in (2, 12):
                config = static_config(new_tokens, max_cache_len=512)
                with Counter(hooks, "has_windows") as windows, Counter(hooks, "restore_recompile_limit") as limits:
                    prefill_buckets.generate(
                        model, prompt(5), generation_config=config, prefill_buckets=[16], prefill_padding_side=side
                    )
                counts.append((windows.calls, limits.calls))
            with self.subTest(side):
                self.assertEqual(counts[0], counts[1])
                self.assertLessEqual(counts[1][1], 2)  # the prompt's forward, and the first decode step

    def test_an_eager_call_keeps_no_graph_accounts(self):
        # Torch's recompile limit and the windows decode steps read are kept for compiled forwards' graphs: an eager
        # call (a dynamic cache, padded on the left, no compiled forward) keeps neither, on any step.
        with Counter(hooks, "restore_recompile_limit") as limits:
            out = prefill_buckets.generate(self.model, prompt(5), max_new_tokens=6, prefill_buckets=[16])
        self.assertEqual(limits.calls, 0)
        self.assertEqual(out.shape, (1, 11))

    def test_a_decode_step_reads_the_cache_length_only_for_windows(self):
        # Read from a static cache, the length is a 0-d tensor: `int()` of it is a device sync on every decode step.
        # Only windows need it (the window a step reads); a 64-slot cache has none: as many reads with 12 new tokens
        # as with 2. The positive control: a 512-slot cache's windows are set on every step. (A model per side: after
        # a 512-slot cache, upstream makes every later static cache of the model that long.)
        for side in ("left", "right"):
            model, counts = tiny_llama(), {}
            for slots, new_tokens in ((64, 2), (64, 12), (512, 2), (512, 12)):
                config = static_config(new_tokens, max_cache_len=slots)
                with Counter(cache_record_module, "cache_seq_length") as reads:
                    prefill_buckets.generate(
                        model, prompt(5), generation_config=config, prefill_buckets=[16], prefill_padding_side=side
                    )
                counts[slots, new_tokens] = reads.calls
            with self.subTest(side):
                self.assertEqual(counts[64, 2], counts[64, 12], counts)
                if side == "right":  # the left-padded call passes a mask, whose length says it
                    self.assertGreater(counts[512, 12], counts[512, 2], counts)


class CompiledCallWorkTest(unittest.TestCase):
    """A warm compiled call (nothing compiles): what it asks torch, counted against a forward with graph breaks."""

    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)

    def warm_call(self, fullgraph: bool, counted: tuple):
        """Compiles a tiny Llama, calls it once, and counts `counted` (`(owner, name)`) during a second call."""
        model, counter = tiny_llama(), GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=fullgraph)
        call = lambda: prefill_buckets.generate(  # noqa: E731
            model, prompt(5), generation_config=static_config(3), prefill_buckets=[16]
        )
        expected = call()
        graphs, runs = counter.graphs, counter.calls
        with Counter(*counted) as counts:
            self.assertTrue(torch.equal(call(), expected))
        self.assertEqual((counter.graphs, counter.calls - runs), (graphs, 3), "compiled, and nothing compiled again")
        return counts.calls

    def test_the_forward_graphs_are_counted_once(self):
        # Before the call, for the recompile limit. After it, where dynamo compiled nothing since and the forward has
        # no graph breaks, they are as many (each graph one entry): not counted again. With graph breaks, frames may
        # have added entries that compiled nothing, so they are.
        self.assertEqual(self.warm_call(True, (torch_api, "forward_graphs")), 1)
        self.assertEqual(self.warm_call(False, (torch_api, "forward_graphs")), 2)

    def test_a_forward_without_graph_breaks_reads_no_input_signature(self):
        # The eager fallback tells shapes apart once one has failed to compile: with `fullgraph=True` a failed compile
        # has run nothing, so until then there is nothing to look up. With graph breaks it records each new shape.
        self.assertEqual(self.warm_call(True, (compiled_calls, "_signature")), 0)
        self.assertEqual(self.warm_call(False, (compiled_calls, "_signature")), 3)  # each forward

    def test_torch_global_state_is_read_when_it_changes(self):
        # Every graph is guarded on it, and every call's graphs are accounted with it: read anew only when dynamo's
        # guard says it changed (as another thread count does).
        self.assertEqual(self.warm_call(True, (torch_api, "_remember_global_state")), 0)
        threads = torch.get_num_threads()
        self.addCleanup(torch.set_num_threads, threads)
        first = torch_api.global_state()
        torch.set_num_threads(2 if threads == 1 else 1)
        with Counter(torch_api, "_remember_global_state") as reads:
            self.assertNotEqual(torch_api.global_state(), first)
            torch_api.global_state()
        self.assertEqual(reads.calls, 1)


if __name__ == "__main__":
    unittest.main()

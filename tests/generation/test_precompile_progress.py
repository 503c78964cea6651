"""`precompile` and `prefill-buckets serve --precompile` show their progress (issue 66): up front the warm-up calls they
will run and the graphs they expect, then a line per warm-up call as it ends (its shape, the graphs it compiled, its
seconds, the calls left); and nothing they log advises calling `precompile` while it runs.

A tiny Llama built from a config, compiled with the counting backend (`GraphCounter`, eager: tracing only), so the
graphs the lines report are checked against the graphs dynamo really compiled.
"""

import contextlib
import io
import logging
import re
import unittest

import torch
from transformers import GenerationConfig
from transformers.utils import logging as hf_logging

import prefill_buckets
from prefill_buckets import GraphCounter, serving
from prefill_buckets.state import PROCESS

from .tiny_models import tiny_llama


PLAN = re.compile(r"^precompile: (\d+) warm-up calls? .*: (\d+) graphs? at most ")
LINE = re.compile(
    r"^precompile: warm-up call (\d+)/(\d+) done: rows (\d+), prompt (\d+)(?: \(bucket \d+\))?, cache (\d+|dynamic), "
    r"(\d+) new tokens(, rows of different lengths)?: (\d+) graphs? compiled in ([\d.]+) s; (\d+) left$"
)
DONE = re.compile(r"^precompile: done, (\d+) warm-up calls? compiled (\d+) graphs? in [\d.]+ s$")


def config(**fields) -> GenerationConfig:
    return GenerationConfig(cache_implementation="static", max_new_tokens=4, do_sample=False, **fields)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


class PrecompileProgressTest(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()
        self.addCleanup(torch._dynamo.reset)
        limit = torch._dynamo.config.recompile_limit
        self.addCleanup(setattr, torch._dynamo.config, "recompile_limit", limit)
        torch._dynamo.config.recompile_limit = 6
        # The budget remembers the highest limit it raised to (and says so once): a fresh process's state.
        self.addCleanup(setattr, PROCESS, "raised_recompile_limit", PROCESS.raised_recompile_limit)
        PROCESS.raised_recompile_limit = (None, 0)
        hf_logging.get_logger("prefill_buckets").warning_once.cache_clear()
        self.records = _Records()
        package = logging.getLogger("prefill_buckets")
        package.addHandler(self.records)
        self.addCleanup(package.removeHandler, self.records)
        level = package.level
        package.setLevel(logging.INFO)
        self.addCleanup(package.setLevel, level)

    def precompile(self, dynamic, batch_sizes=(1, 2), progress=True):
        model = tiny_llama()
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=dynamic, fullgraph=True)
        self.model, self.config = model, config(prefill_buckets=[8, 16, 32, 64])
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            shapes = prefill_buckets.precompile(model, self.config, batch_sizes=batch_sizes, progress=progress)
        return counter, shapes, stderr.getvalue().splitlines()

    def check_lines(self, lines, counter, shapes):
        """The plan, a line per warm-up call, the end; the graphs the lines report are the graphs dynamo compiled."""
        progress = [line for line in lines if line.startswith("precompile: ")]
        plan = PLAN.match(progress[0])
        self.assertIsNotNone(plan, progress[0])
        planned, expected = int(plan.group(1)), int(plan.group(2))
        calls = [LINE.match(line) for line in progress[1:-1]]
        self.assertTrue(all(calls), progress)
        self.assertEqual(len(calls), planned)
        self.assertEqual([int(c.group(1)) for c in calls], list(range(1, planned + 1)))
        self.assertEqual([int(c.group(10)) for c in calls], list(range(planned - 1, -1, -1)))  # calls left
        reported = [int(c.group(8)) for c in calls]
        self.assertEqual(sum(reported), counter.graphs)
        self.assertEqual(sum(reported), sum(shape.graphs for shape in shapes))
        self.assertLessEqual(counter.graphs, expected)
        # Each line's shape: the rows and bucket of a returned shape, at its cache length.
        shapes_seen = {(int(c.group(3)), int(c.group(4)), int(c.group(5))) for c in calls}
        self.assertEqual(shapes_seen, {(s.batch_size, s.prompt_length, s.cache_length) for s in shapes})
        done = DONE.match(progress[-1])
        self.assertIsNotNone(done, progress[-1])
        self.assertEqual((int(done.group(1)), int(done.group(2))), (planned, counter.graphs))
        return planned, reported

    def test_static_compile_prints_the_plan_and_a_line_per_call(self):
        counter, shapes, lines = self.precompile(dynamic=False)
        planned, reported = self.check_lines(lines, counter, shapes)
        # Batch size 2 is also warmed up with rows of different lengths: 4 buckets x (1 + 2) calls.
        self.assertEqual(planned, 12)
        self.assertEqual(counter.graphs, 10, counter.shapes)  # per batch size: 4 prefill graphs and a decode graph

    def test_dynamic_compile_compiles_fewer_graphs_than_calls(self):
        # `model.compile()`'s default (`dynamic=None`): one prefill graph serves several buckets.
        counter, shapes, lines = self.precompile(dynamic=None)
        planned, reported = self.check_lines(lines, counter, shapes)
        self.assertLess(counter.graphs, planned)
        self.assertIn(0, reported[1:])

    def test_without_progress_the_lines_go_to_the_logger(self):
        counter, shapes, lines = self.precompile(dynamic=False, batch_sizes=(1,), progress=False)
        self.assertEqual([line for line in lines if line.startswith("precompile: ")], [])
        self.check_lines(self.records.messages(logging.INFO), counter, shapes)

    def test_nothing_advises_calling_precompile_while_it_runs(self):
        # 14 graphs at most, more than the limit (6): precompile raises it before its first call and says so; the
        # budget's own warning, which advises calling `prefill_buckets.precompile`, is not logged.
        counter, shapes, lines = self.precompile(dynamic=False)
        warnings = self.records.messages(logging.WARNING)
        self.assertEqual([m for m in warnings if "prefill_buckets.precompile" in m], [], warnings)
        raised = [m for m in warnings if m.startswith("precompile's calls need 14 compiled graphs")]
        self.assertEqual(len(raised), 1, warnings)
        self.assertIn("Raised the limit to 14. They are compiled now, before any other call.", raised[0])
        # Every graph compiled: past the limit (6) torch would have run the rest eagerly. The limit is the user's again
        # once no call is in flight.
        self.assertEqual(counter.graphs, 10, counter.shapes)
        self.assertEqual(torch._dynamo.config.recompile_limit, 6)
        # Later calls on those graphs compile nothing and warn nothing.
        hf_logging.get_logger("prefill_buckets").warning_once.cache_clear()
        before = len(self.records.messages(logging.WARNING))
        for length in (3, 20, 64):
            prefill_buckets.generate(self.model, torch.full((1, length), 5), generation_config=self.config)
        self.assertEqual(counter.graphs, 10, counter.shapes)
        self.assertEqual(self.records.messages(logging.WARNING)[before:], [])


class ServePrecompileProgressTest(unittest.TestCase):
    def setUp(self):
        prefill_buckets.disable()
        torch._dynamo.reset()
        self.addCleanup(prefill_buckets.disable)
        self.addCleanup(torch._dynamo.reset)

    def test_serve_precompile_shows_its_progress(self):
        counter = GraphCounter()
        options = serving.ServeOptions(
            buckets=[8, 16], max_new_tokens=8, precompile=True, compile_with="model", backend=counter
        )
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            warm = serving.prepare_model(tiny_llama(), options)
        progress = [line for line in stderr.getvalue().splitlines() if line.startswith("precompile: ")]
        self.assertIsNotNone(PLAN.match(progress[0]), progress)
        calls = [LINE.match(line) for line in progress[1:-1]]
        self.assertTrue(calls and all(calls), progress)
        self.assertEqual(sorted(int(c.group(4)) for c in calls), [8, 16])
        self.assertEqual(sum(int(c.group(8)) for c in calls), counter.graphs)
        self.assertEqual(warm.graphs, counter.graphs)


if __name__ == "__main__":
    unittest.main()

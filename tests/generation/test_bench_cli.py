# The benchmark CLI: `prefill-buckets bench --quick` end to end (a tiny model, subprocesses, table, JSON, plot), so
# the command can't rot, plus the pieces that need no subprocess: the packaged prompts and the table.

import contextlib
import importlib.util
import io
import json
import tempfile
import unittest
from pathlib import Path

from prefill_buckets import bench
from prefill_buckets.cli import main


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class BenchPromptsTest(unittest.TestCase):
    def test_packaged_prompts(self):
        prompts = bench.load_prompts(None)
        self.assertEqual(len(prompts), 32)
        names = [p["name"] for p in prompts]
        self.assertEqual(len(set(names)), len(names))
        for prompt in prompts:
            if "messages" in prompt:
                self.assertEqual(prompt["messages"][-1]["role"], "user")
                self.assertTrue(all(m["content"].strip() for m in prompt["messages"]))
            else:
                self.assertTrue(prompt["text"].strip())

    def test_default_uses_every_other_prompt_and_eager_first(self):
        parser = _bench_parser()
        self.assertEqual(bench._strategy_list(parser.parse_args([]))[0], "eager")
        self.assertEqual(bench._strategy_list(parser.parse_args(["--full"])), list(bench.STRATEGIES))
        self.assertEqual(bench._strategy_list(parser.parse_args(["--strategies", "pow2,eager"])), ["eager", "pow2"])
        with self.assertRaises(SystemExit):
            bench._strategy_list(parser.parse_args(["--strategies", "pow3"]))


class BenchTableTest(unittest.TestCase):
    def test_percentile(self):
        self.assertEqual(bench._percentile([3.0, 1.0, 2.0], 0.5), 2.0)
        self.assertAlmostEqual(bench._percentile([0.0, 10.0], 0.9), 9.0)
        self.assertIsNone(bench._percentile([], 0.9))

    def test_mismatch_and_failure_are_visible(self):
        strategy = bench.STRATEGIES["pow2"]
        calls = [
            {
                "name": "a",
                "length": 5,
                "graphs": 2,
                "ttft_seconds": 1.0,
                "decode_seconds_per_token": 0.5,
                "tokens": [1],
            },
            {
                "name": "b",
                "length": 7,
                "graphs": 0,
                "ttft_seconds": 0.1,
                "decode_seconds_per_token": 0.01,
                "tokens": [2],
            },
        ]
        record = {
            "calls": calls,
            "graphs": 2,
            "fxgraph_cache_hits": 0,
            "total_seconds": 3.0,
            "forwards": 4,
            "compiled_calls": 4,
            "graph_breaks": 0,
        }
        summary = bench.summarize(record, strategy, {"a": [1], "b": [3]}, [5, 7])
        self.assertFalse(summary["tokens_equal_eager"])
        self.assertEqual(summary["mismatched_prompts"], ["b"])
        self.assertEqual(summary["compile_free_calls"], 1)
        self.assertEqual(summary["pad_tokens"], 3 + 1)  # 5 -> 8, 7 -> 8
        self.assertEqual(summary["eager_fallbacks"], 0)
        table = bench.format_table(
            [
                {"strategy": "pow2", "summary": summary},
                {"strategy": "chunked", "summary": {"error": "exit code 1"}},
            ]
        )
        self.assertIn("NO (1)", table)
        self.assertIn("chunked          FAILED: exit code 1", table)


@unittest.skipUnless(importlib.util.find_spec("matplotlib"), "the benchmark plot needs matplotlib (the `bench` extra)")
class BenchQuickTest(unittest.TestCase):
    def test_quick_bench(self):
        with tempfile.TemporaryDirectory() as tmp:
            stdout = io.StringIO()
            with contextlib.redirect_stdout(stdout):
                code = main(["bench", "--quick", "--output", tmp, "--no-progress"])
            printed = stdout.getvalue()
            self.assertEqual(code, 0, printed)

            report = json.loads((Path(tmp) / "bench.json").read_text())
            self.assertEqual((Path(tmp) / "bench.png").read_bytes()[:8], PNG_MAGIC)

        self.assertIn("tokens==eager", printed)
        for name in bench.QUICK_STRATEGIES:
            self.assertRegex(printed, rf"(?m)^{name}\s+\d+")
        self.assertEqual([s["strategy"] for s in report["strategies"]], list(bench.QUICK_STRATEGIES))
        self.assertEqual(len(report["prompts"]), len(bench.QUICK_LENGTHS))
        for key in ("cpu_count", "torch", "transformers", "torch_threads"):
            self.assertIn(key, report["machine"])
        results = {s["strategy"]: s for s in report["strategies"]}
        eager, pow2 = results["eager"]["summary"], results["pow2"]["summary"]
        self.assertEqual(eager["graphs"], 0)
        # The quick lengths share the bucket 64: one prefill and one decode graph, every forward compiled.
        self.assertEqual(pow2["graphs"], 2)
        self.assertEqual(pow2["graph_breaks"], 0)
        self.assertEqual(pow2["eager_fallbacks"], 0)
        self.assertTrue(pow2["tokens_equal_eager"], pow2["mismatched_prompts"])
        self.assertEqual(pow2["compile_free_calls"], len(bench.QUICK_LENGTHS) - 1)
        for call in results["pow2"]["record"]["calls"]:
            self.assertEqual(len(call["tokens"]), report["max_new_tokens"])
            self.assertEqual(call["forwards"], report["max_new_tokens"])


def _bench_parser():
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser


if __name__ == "__main__":
    unittest.main()

# Upstream's own recipe as the benchmark's peer (issue 66): the `decode-only` strategy (`compile_config`: prefill eager,
# decode compiled by `generate`), the default set's strategies, and the report's table against it (first token by
# bucket, total time with compiles, payback). The worker runs in this process, with the eager backend in place of
# inductor (tracing only): the graphs it counts are the graphs dynamo compiled.

import dataclasses
import unittest
from unittest import mock

import torch

from prefill_buckets import benchmark as bench
from prefill_buckets.benchmark import report, worker
from prefill_buckets.benchmark.strategies import BASELINE, DEFAULT_STRATEGIES, STRATEGIES

from .tiny_models import bench_parser, tiny_workload


class StrategiesTest(unittest.TestCase):
    def test_the_default_run_has_upstreams_recipe_as_a_peer(self):
        self.assertEqual(BASELINE, "decode-only")
        self.assertIn("decode-only", DEFAULT_STRATEGIES)
        self.assertIn("decode-only", bench.strategy_list(bench_parser().parse_args([])))
        recipe = STRATEGIES["decode-only"]
        self.assertEqual(recipe.fields, {})  # no bucket fields
        self.assertIsNotNone(recipe.compile_config)
        self.assertTrue(recipe.pin_cache)

    def test_the_recommended_config_compiles_with_dynamic_none_and_the_static_one_runs_with_full(self):
        recommended, static = STRATEGIES["quarters-default"], STRATEGIES["quarters-static"]
        self.assertIsNone(recommended.dynamic)
        self.assertIs(static.dynamic, False)
        self.assertEqual(static.fields, recommended.fields)
        self.assertEqual(static.shuffled, recommended.shuffled)
        self.assertNotIn("quarters-static", DEFAULT_STRATEGIES)
        self.assertIn("quarters-static", bench.strategy_list(bench_parser().parse_args(["--full"])))


class DecodeOnlyWorkerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp, cls.model_dir, cls.workload_path, _ = tiny_workload((5, 40, 17))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_strategy(self, name: str, new_tokens: int = 4) -> dict:
        spec = {
            "strategy": name,
            "phase": "run",
            "model": self.model_dir,
            "device": "cpu",
            "dtype": "float32",
            "workload": self.workload_path,
            "max_new_tokens": new_tokens,
            "progress": False,
        }
        self.addCleanup(torch._dynamo.reset)
        return worker.run_worker(spec)

    def test_generate_compiles_the_decode_step_and_prefill_runs_eagerly(self):
        # The eager backend in place of inductor (what the recipe compiles with is the config's business).
        tracing = dataclasses.replace(STRATEGIES["decode-only"], compile_config={"backend": "eager", "mode": None})
        eager = self.run_strategy("eager")
        with mock.patch.dict(STRATEGIES, {"decode-only": tracing}):
            recipe = self.run_strategy("decode-only")
        self.assertEqual([c["tokens"] for c in recipe["calls"]], [c["tokens"] for c in eager["calls"]])
        self.assertEqual([c["tokens"] for c in recipe["second_calls"]], [c["tokens"] for c in eager["calls"]])
        # One graph: the decode step at the pinned cache (40 + 4 - 1 slots, rounded up to 64), compiled by the first
        # call; prefill is never compiled (it would be a graph per prompt length). Without the CPU opt-in
        # (`compile_on_all_devices`) generate compiles nothing on CPU.
        self.assertEqual(recipe["graphs"], 1)
        self.assertEqual([c["graphs"] for c in recipe["calls"]], [1, 0, 0])
        self.assertEqual(sum(c["graphs"] for c in recipe["second_calls"]), 0)
        summary = bench.summarize(recipe, tracing, None, [5, 40, 17])
        self.assertIsNone(summary["eager_fallbacks"])  # prefill eager by design: not counted as fallbacks


def strategy_result(name: str, total: float, second: float, ttft: dict, graphs: int = 3) -> dict:
    """A result as `bench` builds it: a record with a second pass of the prompts `ttft` names (seconds each)."""
    lengths = {"p10": 10, "p11": 11, "p40": 40, "p90": 90}
    calls = [{"name": n, "length": lengths[n], "ttft_seconds": t} for n, t in ttft.items()]
    record = {"calls": calls, "total_seconds": total, "second_pass_seconds": second, "second_calls": calls}
    ttfts = sorted(ttft.values())
    summary = {
        "graphs": graphs,
        "total_seconds": total,
        "second_ttft_median_ms": 1000 * (ttfts[1] + ttfts[2]) / 2,
        "second_decode_median_ms_per_token": 50.0,
    }
    return {"strategy": name, "summary": summary, "record": record}


class AgainstBaselineTest(unittest.TestCase):
    def results(self):
        base = strategy_result("decode-only", 100.0, 8.0, {"p10": 0.10, "p11": 0.10, "p40": 0.20, "p90": 0.40}, 1)
        auto = strategy_result("dynamic-auto", 400.0, 6.0, {"p10": 0.05, "p11": 0.10, "p40": 0.10, "p90": 0.40})
        quarters = strategy_result(
            "quarters-default", 300.0, 4.0, {"p10": 0.05, "p11": 0.05, "p40": 0.10, "p90": 0.20}
        )
        eager = strategy_result("eager", 50.0, 10.0, {"p10": 0.1, "p11": 0.1, "p40": 0.2, "p90": 0.4}, 0)
        for result in (auto, quarters):
            result["summary"]["payback_calls_vs_baseline"] = report.payback_calls(result["record"], base["record"])
        return [eager, base, auto, quarters]

    def test_totals_first_tokens_and_payback_against_decode_only(self):
        comparison = report.against_baseline(self.results())
        rows = {row["strategy"]: row for row in comparison["strategies"]}
        self.assertEqual(list(rows), ["decode-only", "dynamic-auto", "quarters-default"])  # eager: not compiled
        self.assertEqual(rows["quarters-default"]["total_ratio"], 3.0)
        self.assertEqual(rows["dynamic-auto"]["total_ratio"], 4.0)
        self.assertEqual(rows["quarters-default"]["second_ttft_ratio"], 75.0 / 150.0)
        # 4 calls a pass; 1 s a call faster in steady state, 200 s more cold: 4 + 200 = 204 calls.
        self.assertEqual(rows["quarters-default"]["payback_calls"], 204)
        self.assertEqual(rows["dynamic-auto"]["payback_calls"], 4 + 300 * 2)
        # By the prompts' pow2-quarters buckets (the first bucketed strategy's: 8, 10, 12, 14, 16, 20, ... 40, ...
        # 80, 96); the ratio is the median of each prompt's ratio to decode-only's.
        self.assertEqual(comparison["policy"], "quarters-default")
        by_bucket = {row["bucket"]: row for row in comparison["by_bucket"]}
        self.assertEqual(sorted(by_bucket), [10, 12, 40, 96])
        self.assertEqual(by_bucket[12]["prompts"], 1)
        self.assertEqual(by_bucket[40]["strategies"]["quarters-default"]["ratio"], 0.5)
        self.assertEqual(by_bucket[96]["strategies"]["dynamic-auto"]["ratio"], 1.0)
        self.assertAlmostEqual(by_bucket[10]["baseline_ttft_ms"], 100.0)
        table = report.format_baseline_table(comparison)
        self.assertIn("quarters-default", table)
        self.assertRegex(
            table, r"quarters-default\s+3\s+300\.0\s+3\.00x\s+75\.0\s+0\.50x\s+50\.0\s+1\.00x\s+204 calls"
        )
        self.assertRegex(table, r"\n\s+40\s+1\s+200\s+100 \(0\.50x\)\s+100 \(0\.50x\)")
        # Where it beats decode-only, in words.
        self.assertIn(
            "quarters-default: first token faster than decode-only's in buckets 10 (0.50x), 12 (0.50x), 40 (0.50x), "
            "96 (0.50x); total time with compiles 3.00x decode-only's; pays back its compiles against decode-only "
            "after 204 calls.",
            table,
        )
        self.assertIn(
            "dynamic-auto: first token faster than decode-only's in buckets 10 (0.50x), 40 (0.50x), not in "
            "12 (1.00x), 96 (1.00x)",
            table,
        )

    def test_never_when_not_faster_than_decode_only(self):
        results = self.results()
        slow = strategy_result("pow2-default", 200.0, 9.0, {"p10": 0.2, "p11": 0.2, "p40": 0.3, "p90": 0.5})
        slow["summary"]["payback_calls_vs_baseline"] = report.payback_calls(slow["record"], results[1]["record"])
        table = report.format_baseline_table(report.against_baseline([*results, slow]))
        self.assertRegex(table, r"pow2-default .* never")
        self.assertIn("pow2-default: first token faster than decode-only's in buckets none, not in", table)
        self.assertIn("never pays back against decode-only (not faster once warm).", table)

    def test_no_table_without_decode_only(self):
        results = [r for r in self.results() if r["strategy"] != "decode-only"]
        self.assertIsNone(report.against_baseline(results))
        self.assertEqual(report.format_baseline_table(None), "")
        failed = [*results, {"strategy": "decode-only", "summary": {"error": "exit code 1"}, "record": {}}]
        self.assertIsNone(report.against_baseline(failed))


if __name__ == "__main__":
    unittest.main()

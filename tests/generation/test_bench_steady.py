# The benchmark's steady state (a second pass on the same prompts), its payback against eager, the warm start from
# torch's own compile artifacts (`dynamic-auto-warm`), and the sliding-window pair's model and references. Runs no
# compiler: the worker runs eagerly in this process, and the driver's processes are mocked.

import json
import os
import tempfile
import unittest
from pathlib import Path
from unittest import mock

from prefill_buckets import benchmark as bench
from prefill_buckets.benchmark import command, second_pass, sliding, worker
from prefill_buckets.benchmark.report import fastest_per_prompt, payback_calls

from .tiny_models import bench_parser, tiny_workload


def record(total: float, second: float, calls: int = 4) -> dict:
    return {"calls": [{}] * calls, "total_seconds": total, "second_pass_seconds": second}


class PaybackTest(unittest.TestCase):
    def test_the_calls_at_which_the_compiled_process_catches_up(self):
        eager = record(total=8.0, second=8.0)  # 2 s a call
        # Cold pass 68 s (60 s of compiling), then 1 s a call: 4 + (68 - 8) / 1 = 64 calls from its start.
        self.assertEqual(payback_calls(record(total=68.0, second=4.0), eager), 64)
        # Checked by hand: after 64 calls, 68 + 60 * 1 == 8 + 60 * 2; after 63, the compiled process is still behind.
        self.assertEqual(68 + 60 * 1, 8 + 60 * 2)
        # A cold pass faster than eager's has paid back within it.
        self.assertEqual(payback_calls(record(total=5.0, second=4.0), eager), 1)

    def test_several_rounds_count_as_one_pass(self):
        # With `--second-pass-rounds 2`, a second pass's seconds are two passes' (each prompt ran twice).
        eager = record(total=8.0, second=8.0)
        twice = dict(record(total=68.0, second=8.0), second_pass_rounds=2)
        self.assertEqual(payback_calls(twice, eager), 64)  # as `record(total=68.0, second=4.0)` above

    def test_never_when_not_faster_once_warm(self):
        eager = record(total=8.0, second=4.0)
        self.assertIsNone(payback_calls(record(total=60.0, second=4.0), eager))
        self.assertIsNone(payback_calls(record(total=60.0, second=5.0), eager))
        self.assertIsNone(payback_calls(record(total=60.0, second=1.0), None))
        self.assertIsNone(payback_calls({"calls": [{}], "total_seconds": 60.0}, eager))  # no second pass


class WorkerSecondPassTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp, cls.model_dir, cls.workload_path, _ = tiny_workload((5, 40, 17))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_the_second_pass_runs_the_same_prompts(self):
        spec = {
            "strategy": "eager",
            "phase": "run",
            "model": self.model_dir,
            "device": "cpu",
            "dtype": "float32",
            "workload": self.workload_path,
            "max_new_tokens": 4,
            "progress": False,
        }
        eager = worker.run_worker(spec)
        self.assertEqual([c["name"] for c in eager["second_calls"]], [c["name"] for c in eager["calls"]])
        self.assertEqual([c["tokens"] for c in eager["second_calls"]], [c["tokens"] for c in eager["calls"]])
        self.assertGreater(eager["second_pass_seconds"], 0)
        # The cold pass's forwards: 4 new tokens per prompt; the second pass's are not counted in them.
        self.assertEqual(eager["cold_forwards"], 3 * 4)
        self.assertEqual(eager["forwards"], 2 * 3 * 4)
        reference = {c["name"]: c["tokens"] for c in eager["calls"]}
        summary = bench.summarize(eager, bench.STRATEGIES["eager"], reference, [5, 40, 17], eager=eager)
        self.assertIsNotNone(summary["second_ttft_median_ms"])
        self.assertIsNotNone(summary["second_decode_median_ms_per_token"])
        self.assertEqual(summary["second_pass_graphs"], 0)
        self.assertIsNone(summary["payback_calls"])  # eager has nothing to pay back
        # A token that differs in the second pass only is a mismatch.
        eager["second_calls"][1]["tokens"] = [0] * 4
        summary = bench.summarize(eager, bench.STRATEGIES["pow2"], reference, [5, 40, 17])
        self.assertEqual(summary["mismatched_prompts"], ["p40 (second pass)"])


class WarmFromTorchArtifactsTest(unittest.TestCase):
    def test_dynamic_auto_saves_and_the_warm_peer_loads(self):
        calls = []

        def fake_spawn(spec, workdir, tag, second_pass=None):
            calls.append((tag, spec.get("save_artifacts"), spec.get("artifacts_file")))
            if spec.get("save_artifacts"):
                Path(spec["save_artifacts"]).write_bytes(b"artifacts")
            return {"strategy": spec["strategy"], "total_seconds": 5.0, "artifacts_loaded": True}

        names = ["eager", "dynamic-auto", "dynamic-auto-warm"]
        record = {"artifacts_load_seconds": 0.1, "fxgraph_cache_hits": 3, "fxgraph_cache_misses": 0}
        with tempfile.TemporaryDirectory() as tmp:
            workdir = Path(tmp)
            with mock.patch.object(command, "spawn", side_effect=lambda *a: {**fake_spawn(*a), **record}):
                command.run_strategy("dynamic-auto", {}, workdir, names)
                warm = command.run_strategy("dynamic-auto-warm", {}, workdir, names)
            source = str(command.artifacts_file(workdir, "dynamic-auto"))
            # dynamic-auto's own run saved them; the warm process loaded that file, and no extra process ran.
            self.assertEqual(calls, [("dynamic-auto", source, None), ("dynamic-auto-warm", None, source)])
            self.assertIsNone(warm["prep_seconds"])  # the bench loop fills it from dynamic-auto's run

            # Alone, the warm peer first runs its source once (its preparation).
            calls.clear()
            os.remove(source)
            with mock.patch.object(command, "spawn", side_effect=lambda *a: {**fake_spawn(*a), **record}):
                warm = command.run_strategy("dynamic-auto-warm", {}, workdir, ["eager", "dynamic-auto-warm"])
            self.assertEqual(calls, [("source", source, None), ("dynamic-auto-warm", None, source)])
            self.assertEqual(warm["prep_seconds"], 5.0)


class SlidingPairTest(unittest.TestCase):
    def test_reference_per_model_runs_first(self):
        parser = bench_parser()
        names = bench.strategy_list(parser.parse_args(["--strategies", "sliding-pow2,pow2"]))
        self.assertEqual(names, ["eager", "sliding-eager", "sliding-pow2", "pow2"])

    def test_tiny_sliding_model(self):
        workload = [{"ids": [3, 5, 700]}, {"ids": [9]}]
        with tempfile.TemporaryDirectory() as tmp:
            folder = sliding.save_tiny_sliding_model(Path(tmp) / "m", workload)
            config = json.loads((folder / "config.json").read_text())
        self.assertEqual(config["model_type"], "gemma3_text")
        self.assertEqual(config["layer_types"], ["sliding_attention", "full_attention"])
        self.assertEqual(config["sliding_window"], sliding.SLIDING_WINDOW)
        self.assertEqual(config["vocab_size"], 704)  # holds id 700, rounded up to 64


if __name__ == "__main__":
    unittest.main()


class SecondPassRoundsTest(unittest.TestCase):
    def test_each_prompt_its_fastest_call(self):
        calls = [
            {"name": "a", "ttft_seconds": 0.30},
            {"name": "b", "ttft_seconds": 0.50},
            {"name": "a", "ttft_seconds": 0.20},  # the second round: another job took less of this one
            {"name": "b", "ttft_seconds": None},  # no first token timed
        ]
        self.assertEqual(fastest_per_prompt(calls, "ttft_seconds"), [0.20, 0.50])
        self.assertEqual(fastest_per_prompt(calls[:2], "ttft_seconds"), [0.30, 0.50])  # one round: every call

    def test_rounds_ask_each_prompt_in_turn(self):
        pass_ = second_pass.SecondPass(rounds=2)
        asked = []
        for name in ("x", "y"):
            worker = mock.Mock(strategy=name)
            worker.ask.side_effect = lambda index, name=name: asked.append((name, index))
            worker.finish.return_value = {"second_calls": []}
            pass_.workers.append(worker)
        records = {"x": {"calls": []}, "y": {"calls": []}}
        pass_.run(records, prompts=3)
        # Each prompt through both processes, the first asked rotating; then the whole pass again.
        self.assertEqual(
            asked,
            [("x", 0), ("y", 0), ("y", 1), ("x", 1), ("x", 2), ("y", 2)]
            + [("y", 0), ("x", 0), ("x", 1), ("y", 1), ("y", 2), ("x", 2)],
        )
        self.assertEqual(records["x"], {"calls": [], "second_calls": [], "second_pass_rounds": 2})
        self.assertEqual(pass_.workers, [])

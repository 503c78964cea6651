# The Benchmarks page's "Measured results" (docs/source/en/benchmarks.md) come from one benchmark run (`bench
# --write-docs`, `make bench-docs`): the block is rendered from the run's saved summary, and the page must show exactly
# that (regenerated, never edited by hand).

import contextlib
import io
import json
import re
import tempfile
import unittest
from pathlib import Path

from prefill_buckets.benchmark import docs
from prefill_buckets.benchmark.report import machine_info
from prefill_buckets.cli import main


REPO = Path(__file__).resolve().parents[2]


def synthetic_report() -> dict:
    def summary(graphs, total, fallbacks, equal=True, pad=0.0):
        return {
            "graphs": graphs,
            "total_seconds": total,
            "prep_seconds": None,
            "ttft_median_ms": 400.0,
            "ttft_p90_ms": 900.0,
            "decode_median_ms_per_token": 60.5,
            "decode_p90_ms_per_token": 70.25,
            "pad_overhead": pad,
            "eager_fallbacks": fallbacks,
            "eager_fallbacks_exact": True,
            "tokens_equal_eager": equal,
        }

    return {
        "command": "python -m prefill_buckets bench --strategies upstream-static,dynamic-auto,pow2-default",
        "model": "SmolLM2-135M-Instruct",
        "device": "cpu",
        "dtype": "float32",
        "max_new_tokens": 24,
        "prompts": [{"name": "a", "length": 10}, {"name": "b", "length": 953}],
        "machine": {
            "date": "2026-12-01 18:33 UTC",
            "processor": "x86_64",
            "cpu_count": 2,
            "torch_threads": 2,
            "torch": "2.13.0",
            "transformers": "5.24.0",
            "prefill_buckets": "0.1.0",
            "python": "3.11.7",
            "load_average_start": [1.5, 1.0, 0.5],
            "load_average_end": [9.0, 8.0, 7.0],
        },
        "wall_seconds": 1234.5,
        "strategies": [
            {"strategy": "eager", "summary_text": "no compile", "summary": summary(0, 40.0, None, None)},
            {"strategy": "upstream-static", "summary_text": "dynamic=False", "summary": summary(8, 350.0, 78)},
            {"strategy": "dynamic-auto", "summary_text": "dynamic=None", "summary": summary(5, 300.0, 0)},
            {"strategy": "pow2-default", "summary_text": '"pow2"', "summary": summary(8, 150.0, 0, pad=0.44)},
        ],
    }


def page_with_block(root: Path, block: str = "old") -> Path:
    guide = root / docs.PAGE
    guide.parent.mkdir(parents=True)
    (root / docs.RESULTS).parent.mkdir(parents=True)
    guide.write_text(
        f"# Guide\n\n## Measured results\n\n{docs.START}\n{block}\n{docs.END}\n\nAfter.\n", encoding="utf-8"
    )
    return guide


class RenderTest(unittest.TestCase):
    def test_caption_table_and_findings_come_from_the_run(self):
        block = docs.render(docs.docs_summary(synthetic_report()))
        self.assertTrue(block.startswith(docs.START) and block.endswith(docs.END))
        flat = " ".join(block.split())  # the prose is wrapped
        for expected in ("2026-12-01 18:33 UTC", "torch 2.13.0", "transformers 5.24.0", "2 cores", "1234 s"):
            self.assertIn(expected, flat)
        self.assertIn(
            "`python -m prefill_buckets bench --strategies upstream-static,dynamic-auto,pow2-default`", block
        )
        rows = [line for line in block.splitlines() if line.startswith("| `")]
        self.assertEqual(
            [row.split("`")[1] for row in rows], ["eager", "upstream-static", "dynamic-auto", "pow2-default"]
        )
        self.assertIn("| 8 | 350.0 | 400 / 900 | 60.5 / 70.2 | 0% | 78 | yes |", rows[1])
        self.assertIn("ran 78 forwards eagerly", flat)
        self.assertIn("`pow2-default` took 0.50x `dynamic-auto`'s total time", flat)
        self.assertIn("Every strategy's tokens equal eager's.", flat)

    def test_the_caption_names_the_cpu_where_the_run_read_it(self):
        report = synthetic_report()
        flat = " ".join(docs.render(docs.docs_summary(report)).split())
        self.assertIn("UTC: x86_64, 2 cores", flat)  # an older run, without the field
        report["machine"]["cpu_model"] = "AMD EPYC 9654"
        flat = " ".join(docs.render(docs.docs_summary(report)).split())
        self.assertIn("UTC: x86_64 (AMD EPYC 9654), 2 cores", flat)

    def test_machine_info_reads_the_cpu_model(self):
        cpuinfo = Path("/proc/cpuinfo")
        if not cpuinfo.is_file() or "model name" not in cpuinfo.read_text(encoding="utf-8"):
            self.skipTest("no /proc/cpuinfo with a model name on this machine")
        expected = next(
            line.split(":", 1)[1].strip()
            for line in cpuinfo.read_text(encoding="utf-8").splitlines()
            if line.startswith("model name")
        )
        self.assertEqual(machine_info("cpu")["cpu_model"], expected)

    def test_second_pass_payback_and_targets(self):
        report = synthetic_report()
        by_name = {result["strategy"]: result["summary"] for result in report["strategies"]}
        by_name["dynamic-auto"].update(second_ttft_median_ms=200.0, second_decode_median_ms_per_token=50.0)
        by_name["pow2-default"].update(
            second_ttft_median_ms=230.0, second_decode_median_ms_per_token=51.0, payback_calls=37
        )
        by_name["pow2-default"]["decode_median_ms_per_token"] = 63.525  # 1.05x dynamic-auto's 60.5
        by_name["upstream-static"].update(second_ttft_median_ms=150.0, second_decode_median_ms_per_token=40.0)
        block = docs.render(docs.docs_summary(report))
        flat = " ".join(block.split())
        rows = {row.split("`")[1]: row for row in block.splitlines() if row.startswith("| `")}
        self.assertTrue(rows["pow2-default"].endswith("| 230 / 51.0 | 37 |"), rows["pow2-default"])
        # Second-pass figures but no payback: it never pays back; the reference has none to pay.
        self.assertTrue(rows["upstream-static"].endswith("| 150 / 40.0 | never |"), rows["upstream-static"])
        self.assertTrue(rows["eager"].endswith("| - / - | - |"), rows["eager"])
        self.assertIn("`pow2-default` decode median: 1.05x `dynamic-auto`'s (target: at most 1.05x).", flat)
        self.assertIn("`pow2-default` time to first token 1.15x and decode 1.02x `dynamic-auto`'s", flat)

    def test_the_caption_says_how_the_second_passes_ran(self):
        report = synthetic_report()
        flat = " ".join(docs.render(docs.docs_summary(report)).split())  # a run from before: no interleaving said
        self.assertIn("Second pass: the workload again in the same process, the same prompts in the same order,", flat)
        report.update(second_pass=docs.SECOND_PASS_INTERLEAVED, second_pass_rounds=3)
        flat = " ".join(docs.render(docs.docs_summary(report)).split())
        self.assertIn("one after the other, their second passes interleaved prompt by prompt, in one run", flat)
        self.assertIn("the processes taking each prompt in turn", flat)
        self.assertIn("3 times over, each prompt's fastest call", flat)

    def test_each_target_said_met_or_missed(self):
        report = synthetic_report()
        report["strategies"] += [
            {"strategy": name, "summary_text": name, "summary": dict(report["strategies"][3]["summary"])}
            for name in ("quarters-default", "pow2-warm")
        ]
        by_name = {result["strategy"]: result["summary"] for result in report["strategies"]}
        by_name["dynamic-auto"].update(second_ttft_median_ms=200.0, second_decode_median_ms_per_token=50.0)
        # The first token may cost its padding: (1 + 8%) x 1.05 = 1.13x; 226 ms is 1.13x dynamic-auto's.
        by_name["quarters-default"].update(pad_overhead=0.08, second_ttft_median_ms=226.0)
        by_name["quarters-default"]["second_decode_median_ms_per_token"] = 53.0  # 1.06x
        by_name["pow2-default"].update(second_ttft_median_ms=230.0, second_decode_median_ms_per_token=51.0)
        by_name["pow2-warm"].update(second_ttft_median_ms=240.0, second_decode_median_ms_per_token=51.0)
        flat = " ".join(docs.render(docs.docs_summary(report)).split())
        self.assertIn(
            "`quarters-default` second-pass time to first token: 1.13x `dynamic-auto`'s (target: at most 1.13x, "
            "(1 + its 8% padding) x 1.05). Met.",
            flat,
        )
        self.assertIn(
            "`quarters-default` second-pass decode: 1.06x `dynamic-auto`'s (target: at most 1.05x). **Missed**.", flat
        )
        self.assertIn(
            "`pow2-warm` second-pass time to first token: 1.04x `pow2-default`'s (target: at most 1.05x). Met.", flat
        )
        self.assertIn("`pow2-warm` second-pass decode: 1.00x `pow2-default`'s (target: at most 1.05x). Met.", flat)
        # 150 s against upstream-static's 350 s: 0.43x, at most 0.8x.
        self.assertIn(
            "`pow2-default` total time, compiles included: 0.43x `upstream-static`'s (target: at most 0.80x). Met.",
            flat,
        )
        # A target whose strategies did not run is not said.
        self.assertNotIn("`chunked-pinned`", flat)

    def test_sliding_pair_finding(self):
        report = synthetic_report()
        sliding = {"strategy": "sliding-upstream-static", "summary_text": "tiny", "summary": {}}
        sliding["summary"] = dict(report["strategies"][1]["summary"], graphs=8, eager_fallbacks=40)
        bucketed = {"strategy": "sliding-pow2", "summary_text": "tiny", "summary": {}}
        bucketed["summary"] = dict(report["strategies"][1]["summary"], graphs=5, eager_fallbacks=0)
        bucketed["summary"].update(second_decode_median_ms_per_token=2.5)
        report["strategies"] += [sliding, bucketed]
        flat = " ".join(docs.render(docs.docs_summary(report)).split())
        self.assertIn(
            "static cache + compile 8 graphs, 40 eager fallbacks; bucketed 5 graphs, 0 eager fallbacks", flat
        )
        self.assertIn("second-pass decode - and 2.5 ms/token", flat)

    def test_a_mismatch_is_said(self):
        report = synthetic_report()
        report["strategies"][3]["summary"]["tokens_equal_eager"] = False
        block = docs.render(docs.docs_summary(report))
        self.assertIn("**no**", block)
        self.assertIn("tokens differ from eager's", " ".join(block.split()))

    def test_write_docs_replaces_only_the_block(self):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            guide = page_with_block(root)
            docs.write_docs(synthetic_report(), plot=None, root=root)
            text = guide.read_text(encoding="utf-8")
            self.assertTrue(text.startswith("# Guide\n\n## Measured results\n\n"))
            self.assertTrue(text.endswith(f"{docs.END}\n\nAfter.\n"))
            self.assertNotIn("\nold\n", text)
            saved = json.loads((root / docs.RESULTS).read_text(encoding="utf-8"))
            self.assertIn(docs.render(saved), text)

            # `bench --docs-from` renders the same block again from the saved summary, running nothing.
            page_with_block(Path(tmp) / "again")
            again = Path(tmp) / "again"
            (again / docs.RESULTS).write_text(json.dumps(saved), encoding="utf-8")
            docs.write_docs_from(again / docs.RESULTS, root=again)
            self.assertEqual((again / docs.PAGE).read_text(encoding="utf-8"), text)

    def test_a_page_without_the_markers_is_refused(self):
        with self.assertRaisesRegex(ValueError, "no generated block"):
            docs.replace_block("# Guide\n", "block")

    def test_docs_from_on_the_command_line(self):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            page_with_block(root)
            results = root / "bench.json"
            results.write_text(json.dumps(synthetic_report()), encoding="utf-8")
            cwd = Path.cwd()
            try:
                import os

                os.chdir(root)
                with contextlib.redirect_stdout(io.StringIO()):
                    self.assertEqual(main(["bench", "--docs-from", str(results)]), 0)
            finally:
                os.chdir(cwd)
            self.assertIn("ran 78 forwards eagerly", " ".join((root / docs.PAGE).read_text(encoding="utf-8").split()))


class BenchmarksPageShowsTheSavedRunTest(unittest.TestCase):
    def test_the_page_block_is_the_rendered_run(self):
        summary = json.loads((REPO / docs.RESULTS).read_text(encoding="utf-8"))
        text = (REPO / docs.PAGE).read_text(encoding="utf-8")
        self.assertIn(docs.render(summary), text, "regenerate it: `python -m prefill_buckets bench --docs-from ...`")
        self.assertTrue((REPO / docs.PLOT).is_file())
        # Positive control: a hand edit of one figure in the block is caught.
        edited = text.replace(f"{summary['wall_seconds']:.0f} s", f"{summary['wall_seconds'] + 1:.0f} s", 1)
        self.assertNotIn(docs.render(summary), edited)


class GuideSummaryTest(unittest.TestCase):
    """The guide's "Measured summary" states the figures of the saved run the Benchmarks page shows."""

    GUIDE = REPO / "docs" / "source" / "en" / "llm_optims.md"

    @staticmethod
    def normalized(text: str) -> str:
        return " ".join(text.replace("`", "").replace('"', "").split())

    def summary_and_block(self) -> tuple[str, str]:
        text = self.GUIDE.read_text(encoding="utf-8")
        summary = text[text.index("## Measured summary") : text.index("## Messages you may meet")]
        saved = json.loads((REPO / docs.RESULTS).read_text(encoding="utf-8"))
        return self.normalized(summary), self.normalized(docs.render(saved))

    def claims(self, summary: str) -> list[str]:
        """The block's sentences that the summary's figures must match, filled in with the summary's own figures."""
        figure = r"(\d+(?:\.\d+)?)"

        def find(pattern: str) -> str:
            match = re.search(pattern, summary)
            self.assertIsNotNone(match, f"the guide's summary no longer says {pattern!r}")
            return match.group(1)

        warm_ttft, warm_decode = re.search(
            rf"{figure}x its time to first token, {figure}x its decode", summary
        ).groups()
        return [
            f"ran {find(rf'ran {figure} forwards eagerly')} forwards eagerly",
            f"pow2-default {find(rf'pow2 {figure} graphs')} graphs, 0 fallbacks",
            f"quarters-default {find(rf'pow2-quarters {figure}, with')} graphs, 0 fallbacks",
            f"quarters-default second-pass time to first token: {find(rf'time to first token was {figure}x')}x",
            f"quarters-default second-pass decode: {find(rf'its decode {figure}x')}x",
            f"pow2-warm second-pass time to first token: {warm_ttft}x",
            f"pow2-warm second-pass decode: {warm_decode}x",
            "Every strategy's tokens equal eager's.",
        ]

    def test_the_summary_states_the_saved_run(self):
        summary, block = self.summary_and_block()
        self.assertLessEqual(len(summary.split(" - ")), 15)
        self.assertIn("0 forwards eagerly", summary)
        self.assertIn("Every strategy's tokens equal eager's.", summary)
        for claim in self.claims(summary):
            self.assertIn(claim, block, "update the guide's Measured summary to the run the Benchmarks page shows")

    def test_positive_control(self):
        summary, block = self.summary_and_block()
        edited = summary.replace("ran 78 forwards eagerly", "ran 77 forwards eagerly")
        self.assertNotEqual(edited, summary)
        self.assertNotIn(self.claims(edited)[0], block)

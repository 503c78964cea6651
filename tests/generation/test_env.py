# `python -m prefill_buckets env`: what a bug report needs, from the installed package.

import contextlib
import io
import subprocess
import sys
import unittest
from unittest import mock

import torch
import transformers
from packaging.version import Version

import prefill_buckets
from prefill_buckets.cli import main
from prefill_buckets.upstream import gate, versions


def run_env() -> str:
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["env"])
    assert status == 0
    return printed.getvalue()


class EnvCommandTest(unittest.TestCase):
    def test_prints_what_a_bug_report_needs(self):
        lines = dict(line.split(": ", 1) for line in run_env().splitlines())
        self.assertEqual(lines["torch"], torch.__version__)
        self.assertEqual(lines["transformers"], transformers.__version__)
        self.assertTrue(lines["prefill_buckets"].startswith(prefill_buckets.__version__ + " "))
        self.assertIn("cpu" if not torch.cuda.is_available() else "cuda", lines["device"])
        tested = f"transformers in the tested range ({versions.TESTED_TRANSFORMERS[0]} to {versions.TESTED_TRANSFORMERS[-1]})"
        self.assertEqual(lines[tested], "yes" if gate.is_tested_transformers() else lines[tested])
        tested_torch = f"torch in the tested range ({versions.TESTED_TORCH[0]} to {versions.TESTED_TORCH[-1]})"
        self.assertEqual(lines[tested_torch], "yes" if gate.is_tested_torch() else lines[tested_torch])
        self.assertIn("python", lines)

    def test_says_when_transformers_is_outside_the_tested_range(self):
        # The positive control of the range line: a version outside it is reported as such.
        with mock.patch.object(gate, "is_tested_transformers", return_value=False):
            output = run_env()
        self.assertRegex(output, r"transformers in the tested range \([^)]*\): NO: outside the tested range")
        self.assertNotRegex(output, r"torch in the tested range \([^)]*\): NO")
        with mock.patch.object(gate, "is_tested_transformers", return_value=True):
            self.assertRegex(run_env(), r"transformers in the tested range \([^)]*\): yes\n")

    def test_says_when_torch_is_outside_the_tested_range(self):
        # A real version, not a mocked verdict: the line reads the installed torch's version against TESTED_TORCH.
        newer = f"2.{Version(versions.TESTED_TORCH[-1]).minor + 1}.0"  # just past the newest tested
        for installed, expected in (("2.10.0", "NO: outside"), (newer, "NO: outside"), ("2.11.0+cu130", "yes")):
            with self.subTest(installed=installed):
                with mock.patch.object(versions, "TORCH_VERSION", Version(installed)):
                    output = run_env()
                self.assertRegex(output, rf"torch in the tested range \([^)]*\): {expected}")
                self.assertNotRegex(output, r"transformers in the tested range \([^)]*\): NO")

    def test_runs_as_a_module_of_the_installed_package(self):
        completed = subprocess.run(
            [sys.executable, "-m", "prefill_buckets", "env"], capture_output=True, text=True, timeout=300
        )
        self.assertEqual(completed.returncode, 0, completed.stderr)
        self.assertIn(f"torch: {torch.__version__}\n", completed.stdout)
        self.assertIn(f"transformers: {transformers.__version__}\n", completed.stdout)

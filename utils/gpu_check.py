# Copyright 2025 The prefill-buckets authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""
Helpers of `utils/gpu_check.sh`, which is the command to run: the parts that are easier to write in Python.

- `env`: prints the versions the check ran with (python, torch, CUDA, triton, transformers, GPU).
- `junit --expect pass|skip FILE`: reads pytest's JUnit XML, prints the counts, and exits non-zero unless the run
  went as expected: `pass` (a GPU run: tests ran, none failed) or `skip` (a dry run: every test skipped, with a reason).
- `summary --out DIR`: writes `DIR/summary.md`, a table of the phases, the tests and the numbers the GPU tests
  recorded (`gpu_test_metrics.json`), and prints it.

Only the standard library is imported at module level, so the summary works even when torch does not import.
"""

import argparse
import importlib.metadata
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_env() -> int:
    print(f"python: {sys.version.split()[0]} ({platform.platform()})")
    for name in ("torch", "triton", "transformers", "transformers-prefill-buckets"):
        print(f"{name}: {_version(name)}")
    try:
        import torch
    except Exception as error:  # a broken torch install is exactly what this should report
        print(f"torch import failed: {type(error).__name__}: {error}")
        return 0
    print(f"torch CUDA build: {torch.version.cuda}")
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            print(
                f"GPU {index}: {props.name}, {props.total_memory / 2**30:.0f} GiB, "
                f"compute capability {props.major}.{props.minor}"
            )
    else:
        print("GPU: none visible to torch (torch.cuda.is_available() is False)")
    try:
        import prefill_buckets

        print(f"prefill_buckets: {prefill_buckets.__version__} from {Path(prefill_buckets.__file__).parent}")
    except Exception as error:
        print(f"prefill_buckets: not importable ({type(error).__name__}: {error})")
    return 0


def junit_counts(path: Path) -> dict[str, int]:
    """Totals of a pytest JUnit XML file: tests, failures, errors, skipped, passed."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in suites:
        for key in counts:
            counts[key] += int(suite.get(key, 0))
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def junit_cases(path: Path) -> list[tuple[str, str, float, str]]:
    """(test name, outcome, seconds, message) for every test case of a pytest JUnit XML file."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (element.get("message") or "").strip().splitlines()[0:1]
                message = message[0] if message else ""
                break
        cases.append((case.get("name", "?"), outcome, float(case.get("time", 0) or 0), message))
    return cases


def check_junit(path: Path, expect: str) -> int:
    if not path.is_file():
        print(f"{path}: not found (pytest did not get as far as writing it)")
        return 1
    counts = junit_counts(path)
    print(", ".join(f"{value} {key}" for key, value in counts.items()))
    for name, outcome, _, message in junit_cases(path):
        if outcome != "passed":
            print(f"  {outcome}: {name}: {message}")
    if counts["tests"] == 0:
        print("no tests were collected")
        return 1
    if counts["failures"] or counts["errors"]:
        return 1
    if expect == "skip":
        if counts["skipped"] != counts["tests"]:
            print(f"expected every test to skip on a machine without a GPU, but {counts['passed']} ran")
            return 1
        reasons = [message for _, outcome, _, message in junit_cases(path) if outcome == "skipped"]
        if not all(reasons):
            print("a test skipped without a reason")
            return 1
    elif counts["passed"] == 0:
        print("every test skipped: the GPU tests did not run (no CUDA visible, or RUN_SLOW unset)")
        return 1
    return 0


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(cell).replace("|", "\\|") for cell in row) + " |" for row in rows]
    return lines


def write_summary(out: Path) -> int:
    lines = ["# GPU check summary", ""]
    env = out / "env.txt"
    if env.is_file():
        lines += ["```text", *env.read_text().strip().splitlines(), "```", ""]

    phases = out / "phases.tsv"
    if phases.is_file():
        rows = [line.split("\t") for line in phases.read_text().splitlines() if line.strip()]
        lines += ["## Phases", "", *_table(["phase", "status", "seconds", "log"], rows), ""]

    junit = out / "pytest_gpu.xml"
    if junit.is_file():
        counts = junit_counts(junit)
        lines += ["## Tests (tests/generation/test_gpu.py)", ""]
        lines += [", ".join(f"{value} {key}" for key, value in counts.items()), ""]
        rows = [
            [name, outcome, f"{seconds:.1f}", message[:160]] for name, outcome, seconds, message in junit_cases(junit)
        ]
        lines += [*_table(["test", "outcome", "seconds", "message"], rows), ""]

    metrics = out / "gpu_test_metrics.json"
    if metrics.is_file():
        data = json.loads(metrics.read_text())
        rows = [[key, json.dumps(value) if not isinstance(value, str) else value] for key, value in data.items()]
        lines += ["## Measured by the GPU tests", "", *_table(["metric", "value"], rows), ""]

    text = "\n".join(lines)
    (out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("env", help="print the versions and the GPU")
    junit = commands.add_parser("junit", help="check a pytest JUnit XML file")
    junit.add_argument("path", type=Path)
    junit.add_argument("--expect", choices=("pass", "skip"), required=True)
    summary = commands.add_parser("summary", help="write DIR/summary.md")
    summary.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.command == "env":
        return print_env()
    if args.command == "junit":
        return check_junit(args.path, args.expect)
    return write_summary(args.out)


if __name__ == "__main__":
    sys.exit(main())

# The transformers and torch versions CI tests are the ends of the ranges setup.py claims: for transformers, the
# oldest in constraints/oldest.txt (`make test-oldest`) and the newest in constraints/dev.txt (`make test`); for torch,
# the oldest in constraints/oldest.txt and the newest in constraints/newest.txt (`make test-newest`). Both ends run the
# same tests (the oldest a few more), and `.ci/run` runs both.

import re
import unittest
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version


ROOT = Path(__file__).resolve().parents[2]


def claimed(package: str) -> SpecifierSet:
    """The `package` requirement in setup.py's `install_requires`."""
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    match = re.search(rf"""["']{package}\s*([<>=!~][^"']*)["']""", setup)
    if match is None:
        raise AssertionError(f"setup.py has no `{package}` requirement")
    return SpecifierSet(match.group(1))


def claimed_transformers() -> SpecifierSet:
    return claimed("transformers")


def makefile_variable(name: str) -> list[str]:
    """The words of a `NAME := ...` assignment in the Makefile, its continuation lines joined."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    match = re.search(rf"^{name}\s*:=(.*)$", text, re.MULTILINE)
    if match is None:
        raise AssertionError(f"the Makefile sets no {name}")
    return match.group(1).split()


def makefile_recipe(target: str) -> str:
    """The recipe lines of a Makefile target."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    match = re.search(rf"^{re.escape(target)}:[^\n]*\n((?:\t[^\n]*\n)*)", text, re.MULTILINE)
    if match is None:
        raise AssertionError(f"the Makefile has no target {target}")
    return match.group(1)


def pinned(constraints: str, package: str) -> Version:
    """The version `constraints/<constraints>` pins `package` to (`package==X`)."""
    for line in (ROOT / "constraints" / constraints).read_text(encoding="utf-8").splitlines():
        name, _, version = line.split("#")[0].strip().partition("==")
        if name.strip() == package:
            return Version(version.strip())
    raise AssertionError(f"constraints/{constraints} does not pin {package}")


class TestedVersionsTest(unittest.TestCase):
    def test_oldest_pin_is_the_claimed_lower_bound(self):
        lower_bounds = [Version(spec.version) for spec in claimed_transformers() if spec.operator == ">="]
        self.assertEqual(lower_bounds, [pinned("oldest.txt", "transformers")])

    def test_both_pins_are_claimed(self):
        claimed = claimed_transformers()
        for constraints in ("dev.txt", "oldest.txt"):
            with self.subTest(constraints=constraints):
                self.assertIn(pinned(constraints, "transformers"), claimed)

    def test_oldest_pin_is_older_than_the_dev_pin(self):
        self.assertLess(pinned("oldest.txt", "transformers"), pinned("dev.txt", "transformers"))

    def test_torch_lower_bound_is_the_oldest_pin(self):
        lower_bounds = [Version(spec.version) for spec in claimed("torch") if spec.operator == ">="]
        self.assertEqual(lower_bounds, [pinned("oldest.txt", "torch")])

    def test_every_torch_pin_is_claimed_and_in_order(self):
        for constraints in ("oldest.txt", "dev.txt", "newest.txt"):
            with self.subTest(constraints=constraints):
                self.assertIn(pinned(constraints, "torch"), claimed("torch"))
        self.assertLess(pinned("oldest.txt", "torch"), pinned("dev.txt", "torch"))
        self.assertLessEqual(pinned("dev.txt", "torch"), pinned("newest.txt", "torch"))

    def test_transformers_pins_are_in_order(self):
        # The whole suite runs on dev.txt's; the newest, a release that came after it, runs the range tests.
        self.assertLess(pinned("oldest.txt", "transformers"), pinned("dev.txt", "transformers"))
        self.assertLessEqual(pinned("dev.txt", "transformers"), pinned("newest.txt", "transformers"))

    def test_tested_torch_is_the_pins(self):
        # The torch range `gate.check_upstream` and `env` call tested is the range CI tests.
        from prefill_buckets.upstream import versions

        self.assertEqual(
            tuple(Version(v) for v in versions.TESTED_TORCH),
            (pinned("oldest.txt", "torch"), pinned("newest.txt", "torch")),
        )

    def test_no_torch_upper_bound(self):
        # pip must never downgrade (or re-download, multi-GB) a user's newer torch to install this package.
        self.assertEqual([spec for spec in claimed("torch") if spec.operator in ("<", "<=", "==", "~=")], [])

    def test_both_ends_run_the_same_tests_in_ci(self):
        range_tests = makefile_variable("RANGE_TESTS")
        for needed in ("equivalence", "compile_counts", "windows", "sliding", "aot_forward", "bounded"):
            self.assertIn(f"tests/generation/test_{needed}.py", range_tests)
        for test in range_tests:
            self.assertTrue((ROOT / test).is_file(), test)
        self.assertEqual(makefile_variable("OLDEST_TESTS")[0], "$(RANGE_TESTS)")  # the oldest runs them and more
        # The newest runs them and the serving tests (transformers 5.25 rebuilt the server's loading).
        newest_tests = makefile_variable("NEWEST_TESTS")
        self.assertEqual(newest_tests[0], "$(RANGE_TESTS)")
        for test in (
            "tests/generation/test_serving.py",
            "tests/generation/test_serving_loads.py",
            "tests/generation/test_serve_process.py",
        ):
            self.assertIn(test, newest_tests)
            self.assertTrue((ROOT / test).is_file(), test)
        for target, python, tests in (
            ("test-oldest", "$(OLDEST_PYTHON)", "$(OLDEST_TESTS)"),
            ("test-newest", "$(NEWEST_PYTHON)", "$(NEWEST_TESTS)"),
        ):
            with self.subTest(target=target):
                self.assertIn(f"{python} $(PYTEST) {tests}", makefile_recipe(target))
                self.assertIn(f"{python} -m prefill_buckets env", makefile_recipe(target))
        self.assertEqual(makefile_variable("OLDEST_CONSTRAINTS"), ["constraints/oldest.txt"])
        self.assertEqual(makefile_variable("NEWEST_CONSTRAINTS"), ["constraints/newest.txt"])
        ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
        for target in ("make test-oldest", "make test-newest"):
            self.assertIn(f"run {target}\n", ci)
        # The GPU machine's pair is the oldest pair: its check's dry run runs in .venv-oldest.
        self.assertRegex(ci, r"PYTHON=\.venv-oldest/bin/python bash utils/gpu_check\.sh --dry-run")

    def test_every_test_target_runs_in_test_workers_processes(self):
        # What the README says of `make test`: 2 processes by default (pytest-xdist, from the `testing` extra).
        text = (ROOT / "Makefile").read_text(encoding="utf-8")
        self.assertRegex(text, r"(?m)^TEST_WORKERS \?= 2$")
        self.assertEqual(makefile_variable("PYTEST")[:4], ["-m", "pytest", "-n", "$(TEST_WORKERS)"])
        for target in ("test", "test-oldest", "test-newest", "test-slow"):
            self.assertIn(" $(PYTEST) ", makefile_recipe(target), target)
        self.assertNotRegex(text, r"-m pytest (?!-n)", "a test run outside $(PYTEST)")
        self.assertRegex((ROOT / "setup.py").read_text(encoding="utf-8"), r'"testing": \[[^]]*"pytest-xdist"')
        readme = (ROOT / "README.md").read_text(encoding="utf-8")
        self.assertIn("in 2 processes (`TEST_WORKERS=2`, pytest-xdist", readme)

    def test_each_environment_installs_its_own_torch_pin(self):
        # torch is installed first, pinned, from the environment's own constraints file (never a resolved torch).
        text = (ROOT / "Makefile").read_text(encoding="utf-8")
        self.assertIn('-m pip install "torch==$(call pin,torch,$(2))"', text)
        for stamp, constraints in (
            ("$(VENV)/.stamp", "$(CONSTRAINTS)"),
            ("$(OLDEST_VENV)/.stamp", "$(OLDEST_CONSTRAINTS)"),
            ("$(NEWEST_VENV)/.stamp", "$(NEWEST_CONSTRAINTS)"),
        ):
            self.assertIn("$(call build_venv,", makefile_recipe(stamp))
            self.assertIn(f",{constraints},", makefile_recipe(stamp))

    def test_tested_versions_are_the_pins(self):
        # The range `gate.check_upstream` calls tested (and warns outside of) is the range CI tests.
        from prefill_buckets.upstream import versions

        self.assertEqual(
            tuple(Version(v) for v in versions.TESTED_TRANSFORMERS),
            (pinned("oldest.txt", "transformers"), pinned("newest.txt", "transformers")),
        )

    def test_no_upper_bound(self):
        # pip must never downgrade a user's newer transformers to install this package.
        self.assertEqual([spec for spec in claimed_transformers() if spec.operator in ("<", "<=", "==", "~=")], [])

# The transformers versions CI tests are the ends of the range setup.py claims: the newest in constraints/dev.txt
# (`make test`), the oldest in constraints/oldest.txt (`make test-oldest`).

import re
import unittest
from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import Version


ROOT = Path(__file__).resolve().parents[2]


def claimed_transformers() -> SpecifierSet:
    """The `transformers` requirement in setup.py's `install_requires`."""
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    match = re.search(r"""["']transformers\s*([<>=!~][^"']*)["']""", setup)
    if match is None:
        raise AssertionError("setup.py has no `transformers` requirement")
    return SpecifierSet(match.group(1))


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

    def test_same_torch_in_both(self):
        self.assertEqual(pinned("oldest.txt", "torch"), pinned("dev.txt", "torch"))

    def test_tested_versions_are_the_pins(self):
        # The range `support.check_upstream` calls tested (and warns outside of) is the range CI tests.
        from prefill_buckets import _compat

        self.assertEqual(
            tuple(Version(v) for v in _compat.TESTED_TRANSFORMERS),
            (pinned("oldest.txt", "transformers"), pinned("dev.txt", "transformers")),
        )

    def test_no_upper_bound(self):
        # pip must never downgrade a user's newer transformers to install this package.
        self.assertEqual([spec for spec in claimed_transformers() if spec.operator in ("<", "<=", "==", "~=")], [])

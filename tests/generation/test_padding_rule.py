# The padding-side rule is data (`padding_side.RULE`): the function works from it, the module docstring's table is made
# from it, and the table of the docs' What runs exactly page must show it, case by case, in the order the rule checks them.

import re
import unittest
from pathlib import Path

from prefill_buckets.call import padding_side
from prefill_buckets.call.padding_side import RULE, rule_table


REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "source" / "en" / "reference.md"  # What runs exactly


def table_rows(text: str) -> list[tuple[str, str, str]]:
    """The `(case, side, why)` rows of every `| case | side | why |` table in `text`, headers and rules left out."""
    rows = re.findall(r"^\| (.+?) \| ([^|]+?) \| (.+?) \|$", text, re.MULTILINE)
    return [row for row in rows if row != ("case", "side", "why") and set(row[0]) != {"-"}]


def rule_block(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The rows from the rule's first case to its last one, where `rows` holds the rule's table."""
    first, last = (case.case for case in (RULE[0], RULE[-1]))
    cases = [case for case, _, _ in rows]
    if first not in cases or last not in cases:
        return []
    return rows[cases.index(first) : cases.index(last) + 1]


class PaddingRuleTablesTest(unittest.TestCase):
    expected = [(case.case, case.side, case.why) for case in RULE]

    def test_reference_page_shows_the_rule(self):
        shown = rule_block(table_rows(REFERENCE.read_text(encoding="utf-8")))
        self.assertEqual(shown, self.expected, "the reference page's padding-side table is `padding_side.RULE`'s")

    def test_docstring_shows_the_rule(self):
        self.assertIn(rule_table(), padding_side.__doc__)
        self.assertEqual(rule_block(table_rows(padding_side.__doc__)), self.expected)

    def test_the_rule_is_well_formed(self):
        self.assertEqual(len({case.case for case in RULE}), len(RULE), "each case once")
        self.assertTrue(all(case.side in ("left", "right") for case in RULE))
        self.assertEqual(RULE[-1].side, "right")  # the last case takes every call the others left
        # Only the last case has no condition: every call reaches a case, and no case is unreachable behind it.
        self.assertEqual([case.condition is None for case in RULE], [False] * (len(RULE) - 1) + [True])

    def test_positive_control(self):
        # A page whose table lost a case, or swapped two, or changed a side, does not show the rule.
        text = REFERENCE.read_text(encoding="utf-8")
        rows = [f"| {case} | {side} | {why} |" for case, side, why in self.expected]
        for broken in (
            text.replace(rows[3] + "\n", ""),
            text.replace(rows[3] + "\n" + rows[4], rows[4] + "\n" + rows[3]),
            text.replace(rows[1], rows[1].replace("| left |", "| right |")),
        ):
            self.assertNotEqual(broken, text)
            self.assertNotEqual(rule_block(table_rows(broken)), self.expected)


if __name__ == "__main__":
    unittest.main()

# How a call is padded is data: `decision.DECISION`, one table of rows (condition, outcome, why, reason), checked in
# order, the first that applies deciding. The docs' What runs exactly page shows that table as `decision_table`
# renders it: a hand edit of the page, or a row changed in the code and not on the page, fails here.

import unittest
from pathlib import Path

from prefill_buckets.call.decision import DECISION, OUTCOMES, decision_table


REFERENCE = Path(__file__).resolve().parents[2] / "docs" / "source" / "en" / "reference.md"  # What runs exactly
HEADER = "| case | outcome | why |"


def shown_table(text: str) -> str:
    """The `| case | outcome | why |` table of `text`: its header and the rows after it, up to the first other line."""
    lines = text.splitlines()
    if lines.count(HEADER) != 1:
        raise AssertionError(f"the page has {lines.count(HEADER)} `{HEADER}` tables, not one")
    start = lines.index(HEADER)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


class DecisionTableTest(unittest.TestCase):
    def test_reference_page_shows_the_table(self):
        shown = shown_table(REFERENCE.read_text(encoding="utf-8"))
        self.assertEqual(shown, decision_table(), "the reference page's table is `decision_table()`: regenerate it")

    def test_the_table_is_well_formed(self):
        self.assertEqual(len({row.case for row in DECISION}), len(DECISION), "each case once")
        self.assertTrue(all(row.outcome in OUTCOMES for row in DECISION))
        self.assertTrue(all("|" not in row.case + row.why for row in DECISION), "a cell holds no column separator")
        self.assertEqual(DECISION[0].outcome, "raise")  # an encoder-decoder model raises before any other row is read
        # The last row takes every call the others leave, and it is the only one that does: no row hides behind it.
        self.assertEqual(DECISION[-1].outcome, "right")
        self.assertIs(DECISION[-1].condition(None), True)

    def test_positive_control(self):
        # A page whose table lost a row, swapped two, changed an outcome, or reworded a cell does not show the table.
        text = REFERENCE.read_text(encoding="utf-8")
        rows = decision_table().splitlines()[2:]
        for broken in (
            text.replace(rows[3] + "\n", ""),
            text.replace(rows[3] + "\n" + rows[4], rows[4] + "\n" + rows[3]),
            text.replace(rows[1], rows[1].replace("| unpadded |", "| left |")),
            text.replace(rows[-1], rows[-1].replace("exact", "exact, always")),
        ):
            self.assertNotEqual(broken, text)
            self.assertNotEqual(shown_table(broken), decision_table())


if __name__ == "__main__":
    unittest.main()

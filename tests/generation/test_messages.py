# Every message the package logs or raises has a row in the Messages page (docs/source/en/messages.md): its first
# literal words are found in the first cell of a row, where the message's placeholders may stand as any text (`N`,
# `PATH`, `Model`). A new `logger.warning(...)`, `logger.info(...)` or `raise ...Error(f"...")` under
# `src/prefill_buckets/` fails here until the page has a row for it. The benchmark (`benchmark/`) is a tool of the
# repository, not the library: its messages are its command line's, and are not listed.

import ast
import re
import unittest
from dataclasses import dataclass
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
SOURCE = REPO / "src" / "prefill_buckets"
MESSAGES_PAGE = REPO / "docs" / "source" / "en" / "messages.md"
EXCLUDED = ("benchmark",)

LOG_LEVELS = {"debug", "info", "warning", "warning_once", "error", "exception", "critical"}
WORDS = 5  # the message's first literal words a row must show (fewer when the message has fewer)
MAX_CELL_WORDS = 60

# Raises that show no message of their own: Python protocol errors (`__getattr__`'s AttributeError of an attribute
# name), and the archive's internal refusal, whose reason is caught and logged inside "Not loading the compile cache".
NOT_MESSAGES = {
    ("call/views.py", "AttributeError"),
    ("call/padding_side.py", "AttributeError"),
    ("compile/archive.py", "_Refused"),
}

# Raises whose text is made elsewhere and passed on as a variable: `{(file, exception): [(file that makes the text,
# its opening)]}`. Each opening must be in that file, and have a row.
RELAYED = {
    ("call/decision.py", "ValueError"): [
        ("call/decision.py", "The prefill bucket fields ({_FIELDS}) support decoder-only models")
    ],
    ("compile/aot_forward.py", "RuntimeError"): [
        ("upstream/checks.py", "`prefill_buckets.aot_forward` can't compile ahead of time on torch")
    ],
    ("distributed.py", "ValueError"): [
        ("distributed.py", "The tensor-parallel ranks of this model called `generate` with different")
    ],
    ("serving.py", "error_class"): [
        ("upstream/transformers_serve.py", "transformers serve needs FastAPI and uvicorn"),
        ("serving_loads.py", "prefill-buckets serve prepares the served model where transformers serve loads it"),
        ("serving.py", "--continuous-batching schedules requests' tokens itself"),
    ],
    # `--buckets` relays `validate_buckets`'s own messages (buckets.py, found there).
    ("serving.py", "ArgumentTypeError"): [("buckets.py", "must be")],
    # `precompile`'s progress lines (`_say`: stderr with `progress=True`, else logged at info).
    ("compile/precompile.py", "info"): [
        ("compile/precompile.py", "precompile: {len(calls)} warm-up call"),
        ("compile/precompile.py", "precompile: warm-up call {index + 1}/{len(calls)} done"),
        ("compile/precompile.py", "precompile: done, {len(calls)} warm-up calls compiled"),
    ],
    ("upstream/gate.py", "RuntimeError"): [
        ("upstream/checks.py", "prefill_buckets can't bucket `generate` on transformers"),
        ("upstream/selftest.py", "prefill_buckets' self-test failed on transformers"),
    ],
}


def normalized(text: str) -> str:
    return " ".join(text.replace("`", "").split())


@dataclass(frozen=True)
class Message:
    where: str  # file:line
    kind: str  # the log level, or the exception's class
    parts: tuple  # the message's literal texts, None for each placeholder

    def opening(self) -> str | None:
        """A pattern for the message's first literal words (placeholders match any text), or None without words."""
        skeleton = normalized("".join("\x00" if part is None else part for part in self.parts))
        taken, words = [], 0
        for token in skeleton.split(" "):
            if words >= WORDS:
                break
            taken.append(token)
            words += bool(re.search(r"\w", token.replace("\x00", "")))
        if not words:
            return None
        # A placeholder at either end matches wherever the row's text starts or goes on.
        text = " ".join(taken).strip("\x00 ")
        return ".+?".join(re.escape(piece) for piece in text.split("\x00"))


def literal_parts(node) -> list:
    """The literal texts of a message expression, None for each part that is not literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [value.value if isinstance(value, ast.Constant) else None for value in node.values]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return literal_parts(node.left) + literal_parts(node.right)
    return [None]


def messages_in(source: str, relative: str) -> list[Message]:
    """The messages a module logs (`logger.LEVEL(...)`) or raises (`raise Name(...)`), in the order they appear."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LOG_LEVELS
            and isinstance(node.func.value, ast.Name)
            and "log" in node.func.value.id.lower()
            and node.args
        ):
            kind, message = node.func.attr, node.args[0]
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
            function = node.exc.func
            kind = function.id if isinstance(function, ast.Name) else getattr(function, "attr", "?")
            message = node.exc.args[0]
        else:
            continue
        found.append(Message(f"{relative}:{node.lineno}", kind, tuple(literal_parts(message))))
    return sorted(found, key=lambda message: int(message.where.rsplit(":", 1)[1]))


def source_messages() -> list[Message]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        relative = path.relative_to(SOURCE).as_posix()
        if relative.split("/")[0] in EXCLUDED:
            continue
        found += [
            message
            for message in messages_in(path.read_text(encoding="utf-8"), relative)
            if (relative, message.kind) not in NOT_MESSAGES
        ]
    return found


def table_rows(page_text: str) -> list[list[str]]:
    """The cells of every table row of a page (header and separator rows left out)."""
    rows = []
    for line in page_text.splitlines():
        if not line.startswith("|") or re.match(r"^\|\s*-+", line):
            continue
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return [row for row in rows if row[0] not in ("Message starts with", "Symptom")]


def missing_rows(messages: list[Message], page_text: str) -> list[str]:
    """The messages (`where: opening`) whose opening is in no row's first cell; messages without words too."""
    first_cells = [normalized(row[0]) for row in table_rows(page_text)]
    missing = []
    for message in messages:
        where = message.where.rsplit(":", 1)[0]
        opening = message.opening()
        if opening is None:
            relayed = RELAYED.get((where, message.kind))
            if relayed is None:
                missing.append(f"{message.where}: a {message.kind} whose text is not literal: add it to RELAYED")
                continue
            # The relayed text's own placeholders (`{name}`) match any text, as a message's do.
            patterns = [".+?".join(map(re.escape, re.split(r"\{[^}]*\}", normalized(text)))) for _, text in relayed]
        else:
            patterns = [opening]
        for pattern in patterns:
            if not any(re.search(pattern, cell) for cell in first_cells):
                missing.append(f"{message.where}: {pattern}")
    return missing


class MessagesPageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.page = MESSAGES_PAGE.read_text(encoding="utf-8")
        cls.messages = source_messages()

    def test_the_source_has_messages(self):
        kinds = {message.kind for message in self.messages}
        self.assertGreaterEqual(len(self.messages), 89)
        self.assertTrue({"warning", "warning_once", "info", "ValueError", "RuntimeError"} <= kinds, kinds)

    def test_every_message_has_a_row(self):
        self.assertEqual(missing_rows(self.messages, self.page), [], "add a row to docs/source/en/messages.md")

    def test_relayed_texts_are_in_their_sources(self):
        for (site, kind), relayed in RELAYED.items():
            self.assertTrue(
                any(m.where.startswith(f"{site}:") and m.kind == kind for m in self.messages), (site, kind)
            )
            for source, text in relayed:
                self.assertIn(text, (SOURCE / source).read_text(encoding="utf-8"), f"{source} no longer says {text!r}")

    def test_a_missing_row_fails(self):
        # Positive control: take out the row of one message, and that message (only) is reported.
        message = next(m for m in self.messages if m.where.startswith("kvcache/sizing.py") and m.kind != "ValueError")
        opening = message.opening()
        lines = [
            line
            for line in self.page.splitlines()
            if not (line.startswith("|") and re.search(opening, normalized(line.split(" | ")[0])))
        ]
        self.assertLess(len(lines), len(self.page.splitlines()))
        missing = missing_rows(self.messages, "\n".join(lines))
        self.assertIn(f"{message.where}: {opening}", missing)

    def test_a_new_message_needs_a_row(self):
        # Positive control: a module with a new warning, an f-string error and a relayed text.
        source = (
            "def f(x, reason):\n"
            "    logger.warning_once(f'The frobnicator of {x} is out of order today')\n"
            "    raise ValueError(f'`{x}` must be a positive integer, but is {x}.')\n"
            "    raise RuntimeError(reason)\n"
        )
        messages = messages_in(source, "new.py")
        self.assertEqual([m.kind for m in messages], ["warning_once", "ValueError", "RuntimeError"])
        self.assertEqual(messages[0].opening(), re.escape("The frobnicator of ") + ".+?" + re.escape(" is out"))
        missing = missing_rows(messages, self.page)
        self.assertEqual(len(missing), 2, missing)  # the ValueError matches an existing row
        self.assertIn("new.py:2", missing[0])
        self.assertIn("text is not literal", missing[1])

    def test_no_cell_is_over_60_words(self):
        # The docs' style: a table cell says one thing; the rest goes in the text around the table. Every page's.
        pages = sorted(MESSAGES_PAGE.parent.rglob("*.md")) + [REPO / "README.md"]
        for page in pages:
            for row in table_rows(page.read_text(encoding="utf-8")):
                for cell in row:
                    self.assertLessEqual(len(cell.split()), MAX_CELL_WORDS, f"{page.name}: {cell[:80]}")
        self.assertGreater(len(table_rows("| a | b |\n| --- | --- |\n| " + "word " * 61 + "| c |")[1][0].split()), 60)


if __name__ == "__main__":
    unittest.main()

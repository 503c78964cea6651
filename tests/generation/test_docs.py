# The documentation runs: every ```python block of docs/source/en/**/*.md is executed, and its cross-references
# resolve (utils/check_doc_links.py).
#
# The blocks of one page run in order, in one namespace, so a page reads like a session: a later block uses what an
# earlier one defined. Each page starts with the names the docs say they assume: `model` (a tiny random
# LlamaForCausalLM), `tokenizer` (a character-level tokenizer with a pad token and `padding_side="left"`), `prompt` (a
# string) and `inputs` (`tokenizer(prompt, return_tensors="pt")`). Nothing is downloaded.
#
# The docs compile with the default backend (inductor), which takes seconds per graph. Here `torch.compile` is patched
# so that the default backend is "eager": dynamo still traces, counts and guards every graph, so a block that compiles
# more than the docs say still shows up, but no code is generated. Other backends (a `GraphCounter`) are kept.
#
# What a block prints is checked where the docs show it: comment lines right after a `print(...)` line are the
# expected output, and must appear, in order, as whole lines of what the block printed (consecutive comment lines are
# one output line, wrapped). Outputs that depend on the model (generated text) are simply not shown.
#
# A checkpoint the docs load by name (`CHECKPOINTS`) is the page's own tiny model and tokenizer, saved to a folder that
# `from_pretrained` reads, and `aot_forward` compiles with the saveable "aot_eager" backend in place of inductor. A
# block opts out with `<!-- skip-test -->` on the line before it; only a block that can't run in one process may (the
# tensor-parallel script, started by `torchrun` on several devices: `test_distributed.py` runs what it does).
# Shell snippets are ```bash blocks, and outputs ```text blocks: neither runs.

import contextlib
import functools
import importlib.util
import io
import logging
import os
import re
import tempfile
import unittest
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
from parameterized import parameterized
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.compiler._cache import CacheArtifactManager  # private: a page starts with none, as a new process
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import prefill_buckets
from prefill_buckets.testing_utils import as_new_process

from .tiny_models import CACHE


REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "source" / "en"
README = REPO / "README.md"  # its blocks run too, as a page: the quick start first
CHECK_DOC_LINKS = REPO / "utils" / "check_doc_links.py"

SKIP_MARKER = "<!-- skip-test -->"
PYTHON_LANGUAGES = ("python", "py")
PROMPT = "The theory of special relativity states"  # the quick start's prompt: 39 tokens with this tokenizer

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class CodeBlock:
    page: Path
    line: int  # line of the first line of code in the page (1-based)
    language: str
    code: str
    skip: bool

    def __str__(self) -> str:
        page = self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page
        return f"{page}:{self.line}"


def code_blocks(page: Path) -> list[CodeBlock]:
    """The fenced code blocks of a markdown page, in order, dedented to their fence."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks = []
    index = 0
    while index < len(lines):
        opening = _FENCE.match(lines[index])
        if opening is None:
            index += 1
            continue
        fence, indent = opening["fence"], opening["indent"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$")
        end = index + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[index + 1 : end]]
        before = next((line.strip() for line in reversed(lines[:index]) if line.strip()), "")
        info = opening["info"].strip()
        blocks.append(
            CodeBlock(
                page=page,
                line=index + 2,
                language=info.split()[0].lower() if info else "",
                code="\n".join(body),
                skip=before == SKIP_MARKER,
            )
        )
        index = end + 1
    return blocks


def expected_outputs(code: str) -> list[str]:
    """The outputs a block shows: the comment lines right after a `print(...)` line, wrapped lines joined."""
    expected, current, after_print = [], [], False
    for line in code.splitlines() + [""]:
        stripped = line.strip()
        if after_print and stripped.startswith("# "):
            current.append(stripped[2:])
            continue
        if current:
            expected.append(" ".join(current))
            current = []
        after_print = stripped.startswith("print(")
    return expected


def _normalized(text: str) -> str:
    return " ".join(text.split())


def check_outputs(block: CodeBlock, printed: str) -> None:
    """Raises `AssertionError` unless every expected output is a line of `printed`, in order."""
    lines = [_normalized(line) for line in printed.splitlines()]
    position = 0
    for expected in expected_outputs(block.code):
        try:
            position = lines.index(_normalized(expected), position) + 1
        except ValueError:
            raise AssertionError(
                f"{block}: the docs show the output {expected!r}, but the block printed:\n{printed}"
            ) from None


def doc_pages() -> list[Path]:
    """The docs pages, and the README: every page whose code blocks run."""
    return sorted(DOCS.rglob("*.md")) + [README]


def python_blocks(page: Path) -> list[CodeBlock]:
    return [block for block in code_blocks(page) if block.language in PYTHON_LANGUAGES]


def pages_with_python() -> list[str]:
    """Each page with python blocks, relative to the repository."""
    return [page.relative_to(REPO).as_posix() for page in doc_pages() if python_blocks(page)]


# ---- what a page starts with ------------------------------------------------------------------------------------


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character (printable ASCII), with `<pad>`, `</s>`, `<s>` and `<unk>`: no download."""
    specials = ["<pad>", "</s>", "<s>", "<unk>"]
    vocab = {token: index for index, token in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
        unk_token="<unk>",
        padding_side="left",
    )


def tiny_model(tokenizer: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """A randomly initialised one-layer Llama over the tokenizer's vocabulary: traced by dynamo in about a second."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def page_namespace() -> dict:
    tokenizer = tiny_tokenizer()
    return {
        "__name__": "__docs__",
        "model": tiny_model(tokenizer),
        "tokenizer": tokenizer,
        "prompt": PROMPT,
        "inputs": tokenizer(PROMPT, return_tensors="pt"),
    }


_torch_compile = torch.compile


def eager_by_default_compile(*args, backend=None, **kwargs):
    """`torch.compile` with "eager" in place of the default inductor backend (`CompileConfig` passes "inductor")."""
    if backend is None or backend == "inductor":
        backend = "eager"
        kwargs.pop("options", None)  # inductor's options
    return _torch_compile(*args, backend=backend, **kwargs)


TORCH_DEFAULT_RECOMPILE_LIMIT = 8


# The checkpoints the docs load by name. A page loads them from a local copy of its tiny model and tokenizer, with
# transformers' own `from_pretrained`: nothing is downloaded, and the blocks that load them run too.
CHECKPOINTS = ("HuggingFaceTB/SmolLM2-135M-Instruct",)


def from_local_copy(load, folder: str):
    """`load` (a `from_pretrained`), reading `folder` for a name of `CHECKPOINTS`."""

    @functools.wraps(load)
    def from_pretrained(name, *args, **kwargs):
        return load(folder if name in CHECKPOINTS else name, *args, **kwargs)

    return from_pretrained


_aot_forward = prefill_buckets.aot_forward


def aot_eager_by_default(model, backend="inductor", options=None):
    """`aot_forward` with torch's saveable "aot_eager" backend in place of inductor: dynamo traces, nothing compiles."""
    return _aot_forward(model, "aot_eager" if backend == "inductor" else backend, options)


@contextlib.contextmanager
def isolated_page(namespace: dict | None = None):
    """
    Runs a page in a temporary working directory, and undoes what it changes in transformers and torch. With the
    page's `namespace`, its model and tokenizer are what `from_pretrained` loads for the names of `CHECKPOINTS`.
    """
    recompile_limit = torch._dynamo.config.recompile_limit
    cwd = os.getcwd()
    torch._dynamo.reset()
    # A page runs as in a fresh process, so that what it logs is what a user sees: torch's default limit, not one a
    # bucketed call of an earlier test raised (nor the package's memory of having raised it), and no compile artifacts
    # of earlier tests for `save_compile_cache` to find (`torch._dynamo.reset` keeps them).
    torch._dynamo.config.recompile_limit = TORCH_DEFAULT_RECOMPILE_LIMIT
    CacheArtifactManager.clear()
    with as_new_process(), contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        stack.enter_context(mock.patch("torch.compile", eager_by_default_compile))
        stack.enter_context(mock.patch("prefill_buckets.aot_forward", aot_eager_by_default))
        if namespace is not None:
            checkpoint = os.path.join(tmp, "checkpoint")
            namespace["model"].save_pretrained(checkpoint)
            namespace["tokenizer"].save_pretrained(checkpoint)
            for auto in (AutoModelForCausalLM, AutoTokenizer):
                loader = from_local_copy(auto.from_pretrained, checkpoint)
                stack.enter_context(mock.patch.object(auto, "from_pretrained", loader))
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(cwd)
            prefill_buckets.disable()
            torch._dynamo.config.recompile_limit = recompile_limit
            torch._dynamo.reset()


# The loggers whose warnings a page's blocks are checked for: the package's, transformers' and torch's compiler's (its
# "hit config.recompile_limit"). torch's and transformers' loggers don't propagate, so each gets the handler itself.
WARNING_LOGGERS = ("prefill_buckets", "transformers", "torch._dynamo")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def captured_warnings():
    """The warnings logged inside, in order (`warning_once` forgotten first, so each is said as in a new process)."""
    logging.Logger.warning_once.cache_clear()
    records = _Records()
    loggers = [logging.getLogger(name) for name in WARNING_LOGGERS]
    for logger in loggers:
        logger.addHandler(records)
    try:
        yield records.messages
    finally:
        for logger in loggers:
            logger.removeHandler(records)


def run_blocks(blocks: list[CodeBlock], namespace: dict) -> list[tuple[int, str]]:
    """
    Runs the blocks in order in `namespace`, and checks what each prints against the output the docs show. Returns
    the warnings they logged, as `(index of the block among those run, message)`.
    """
    warnings = []
    for index, block in enumerate(blocks):
        # Leading newlines make a traceback point at the line in the page.
        code = compile("\n" * (block.line - 1) + block.code, str(block.page), "exec")
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), captured_warnings() as logged:
                exec(code, namespace)
        finally:
            print(printed.getvalue(), end="")  # shown by pytest when the test fails
        warnings += [(index, message) for message in logged]
        check_outputs(block, printed.getvalue())
    return warnings


def load_check_doc_links():
    spec = importlib.util.spec_from_file_location("check_doc_links", CHECK_DOC_LINKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- tests -------------------------------------------------------------------------------------------------------


# What each page's examples log, run in order on one model: `(index of the block among the page's python blocks that
# run, start of the message)`. A correct call logs nothing; these are the warnings the docs mean to show.
EXPECTED_WARNINGS = {
    "README.md": [
        # The quick start's upstream run, on purpose (the README says what it logs): the package's advice once, then
        # torch's own warning when the fifth length passes its limit.
        (0, "The model's forward is compiled (model.compile()) and generates with a static cache, so each new prompt"),
        (0, "torch._dynamo hit config.recompile_limit (8)"),
    ],
    "docs/source/en/llm_optims.md": [
        # "Compile up front and start warm": `model.compile()` compiles one prefill graph for every bucket, within
        # torch's limit. The test compiles with the eager backend in place of inductor, so there is nothing to save:
        # with inductor the file is written.
        (3, "Nothing compiled in this process can be saved (no inductor artifacts)."),
    ],
    "docs/source/en/usage_reference.md": [
        # "Compile every graph up front" (static shapes) and "A warm start that traces nothing": precompile needs more
        # graphs than torch's default limit, and says it raised the limit.
        (8, "precompile's calls need 12 compiled graphs of the forward of `LlamaForCausalLM`"),
        (9, "precompile's calls need 18 compiled graphs of the forward of `LlamaForCausalLM"),
    ],
}


class DocCodeBlocksTest(unittest.TestCase):
    @parameterized.expand([(name,) for name in pages_with_python()])
    def test_python_blocks_run(self, name):
        if CACHE != "cache":
            # The docs are written for the newest supported transformers; `make test-oldest` tests the older ones.
            self.skipTest("the docs pass and read the cache as `cache`, which is `past_key_values` before 5.24")
        blocks = [block for block in python_blocks(REPO / name) if not block.skip]
        namespace = page_namespace()
        with isolated_page(namespace):
            warnings = run_blocks(blocks, namespace)
        # Every warning the page's examples log, in order, with its text: each said once, and none unexpected.
        expected = EXPECTED_WARNINGS.get(name, [])
        shown = "\n".join(f"  block {index}: {message[:200]}" for index, message in warnings)
        self.assertEqual(len(warnings), len(expected), f"{name} logged:\n{shown}")
        for (index, message), (want_index, want) in zip(warnings, expected):
            self.assertEqual(index, want_index, f"{name} logged:\n{shown}")
            self.assertTrue(
                message.startswith(want), f"{name}, block {index}: {message!r} does not start with {want!r}"
            )

    def test_there_are_python_blocks(self):
        self.assertIn("docs/source/en/llm_optims.md", pages_with_python())
        self.assertIn("docs/source/en/index.md", pages_with_python())

    def test_readme_quick_start_runs_offline(self):
        # The quick start is the README's first python block: it builds its model from a config (no `model` from the
        # page's namespace, no `from_pretrained`), and shows what it prints.
        first = python_blocks(README)[0]
        self.assertFalse(first.skip)
        self.assertNotIn("from_pretrained", first.code)
        self.assertIn("GraphCounter", first.code)
        self.assertGreaterEqual(len(expected_outputs(first.code)), 2)
        self.assertIn("pip install", README.read_text(encoding="utf-8").split("## Quick start")[0])

    def test_skip_marker_only_for_scripts_of_several_processes(self):
        skipped = [block for page in doc_pages() for block in code_blocks(page) if block.skip]
        for block in skipped:
            self.assertIn("torchrun", block.code, f"{block}: only a script of several processes skips")
        self.assertEqual(len(skipped), 1, [str(block) for block in skipped])

    def test_skip_marker_is_followed_by_a_block(self):
        for page in doc_pages():
            lines = page.read_text(encoding="utf-8").splitlines()
            for number, line in enumerate(lines):
                if line.strip() == SKIP_MARKER:
                    following = next((later for later in lines[number + 1 :] if later.strip()), "")
                    self.assertTrue(following.lstrip().startswith("```"), f"{page}:{number + 1}: dangling marker")

    def test_python_blocks_are_scripts_not_doctests(self):
        for page in doc_pages():
            for block in python_blocks(page):
                self.assertNotRegex(block.code, r"(?m)^>>> ", f"{block}: write a script, not a doctest")

    def test_code_block_parser(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        page = Path(tmp.name) / "page.md"
        page.write_text(
            "Text\n\n```python\nx = 1\n```\n\n<!-- skip-test -->\n```py\nmodel = load()\n```\n\n"
            "<Tip>\n\n  ```python\n  y = x + 1\n  ```\n\n</Tip>\n\n```bash\npip install .\n```\n",
            encoding="utf-8",
        )
        blocks = code_blocks(page)
        self.assertEqual([b.language for b in blocks], ["python", "py", "python", "bash"])
        self.assertEqual([b.skip for b in blocks], [False, True, False, False])
        self.assertEqual([b.line for b in blocks], [4, 9, 15, 21])
        self.assertEqual(blocks[2].code, "y = x + 1")

    def test_expected_outputs(self):
        code = "x = 1\nprint(x)\n# 1\n# (wrapped)\ny = 2  # not an output\nprint(y)\n\n# a comment, not an output\n"
        self.assertEqual(expected_outputs(code), ["1 (wrapped)"])
        block = CodeBlock(page=DOCS / "page.md", line=1, language="python", code="print(6)\n# 6\n", skip=False)
        check_outputs(block, "6\n")
        with self.assertRaisesRegex(AssertionError, "the docs show the output '6'"):
            check_outputs(block, "4\n")

    def test_tokenizer_pads_on_the_left_to_a_multiple(self):
        tokenizer = tiny_tokenizer()
        inputs = tokenizer(["Hello world", "Hi"], padding=True, pad_to_multiple_of=16, return_tensors="pt")
        self.assertEqual(tuple(inputs["input_ids"].shape), (2, 16))
        self.assertEqual(inputs["attention_mask"][1].tolist(), [0] * 14 + [1, 1])
        self.assertEqual(inputs["input_ids"][1, 0].item(), tokenizer.pad_token_id)
        self.assertEqual(tokenizer.batch_decode(inputs["input_ids"], skip_special_tokens=True), ["Hello world", "Hi"])

    def test_compile_defaults_to_eager_in_pages(self):
        with isolated_page():
            self.assertIs(torch.compile, eager_by_default_compile)
            compiled = torch.compile(lambda x: x + 1)
            self.assertTrue(torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0)))
        self.assertIs(torch.compile, _torch_compile)


class CheckDocLinksTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.check = load_check_doc_links()

    def run_check(self, docs: Path) -> tuple[int, str]:
        output = []
        with mock.patch("builtins.print", lambda *args, **kwargs: output.append(" ".join(map(str, args)))):
            status = self.check.main([str(docs)])
        return status, "\n".join(output)

    def make_docs(self, pages: dict[str, str]) -> Path:
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        docs = Path(tmp.name)
        toctree = "- sections:\n" + "".join(f"  - local: {name}\n    title: {name}\n" for name in pages)
        (docs / "_toctree.yml").write_text(toctree + "  title: Docs\n", encoding="utf-8")
        for name, text in pages.items():
            (docs / f"{name}.md").parent.mkdir(parents=True, exist_ok=True)
            (docs / f"{name}.md").write_text(text, encoding="utf-8")
        return docs

    def test_real_docs_pass(self):
        status, output = self.run_check(DOCS)
        self.assertEqual(status, 0, output)

    def test_good_links_pass(self):
        docs = self.make_docs(
            {
                "index": "# Home\n\nSee [the guide](./guide), [again](guide.md#usage) and [api](api/ref).\n",
                "guide": "# Guide\n\n## Usage\n\n[`precompile`], [`~prefill_buckets.BucketPolicy`], "
                "[`compile.compiled_calls.GraphCounter`], [`~transformers.GenerationConfig`], [home](./index#home).\n",
                "api/ref": "# Ref\n\n[[autodoc]] precompile\n\n[[autodoc]] compile.compiled_calls.GraphCounter\n\n"
                "Back to [the guide](../guide#usage) or [`precompile`](../api/ref#prefill_buckets.precompile).\n",
            }
        )
        status, output = self.run_check(docs)
        self.assertEqual(status, 0, output)

    def test_broken_link_fails(self):
        docs = self.make_docs({"index": "# Home\n\nSee [the guide](./guide).\n"})
        status, output = self.run_check(docs)
        self.assertEqual(status, 1)
        self.assertIn("index.md:3: link to `./guide`", output)

    def test_each_kind_of_problem_is_listed(self):
        docs = self.make_docs(
            {
                "index": "# Home\n\n[a](./missing) [b](./guide#nowhere) [`nothing_here`] [`generation._pad_inputs`]\n\n"
                "[[autodoc]] NotAnObject\n\n```python\n[skipped](./in_a_code_block) [`in_code`]\n```\n\n"
                "A [link text wrapped\nover two lines](./wrapped_missing).\n",
                "guide": "# Guide\n",
            }
        )
        status, output = self.run_check(docs)
        self.assertEqual(status, 1)
        problems = [line for line in output.splitlines() if ".md:" in line]
        self.assertEqual(len(problems), 6, output)
        for expected in ("`./missing`", "#nowhere", "[`nothing_here`]", "_pad_inputs", "NotAnObject", "index.md:12:"):
            self.assertIn(expected, output)
        self.assertNotIn("in_a_code_block", output)
        self.assertNotIn("in_code", output)


class WarningsTableTest(unittest.TestCase):
    """Every warning `src/` logs has a row in the Messages page's tables: its first words are found there (every other
    message too: `test_messages.py`)."""

    @staticmethod
    def normalize(text: str) -> str:
        return re.sub(r"\s+", " ", text.replace("`", ""))

    def warning_openings(self):
        import ast

        for path in sorted((REPO / "src" / "prefill_buckets").rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("warning", "warning_once")
                    and getattr(node.func.value, "id", None) == "logger"
                ):
                    continue
                message = node.args[0]
                parts = message.values if isinstance(message, ast.JoinedStr) else [message]
                # The first literal run of the message long enough to be recognisable (placeholders vary).
                literals = [self.normalize(p.value).strip() for p in parts if isinstance(p, ast.Constant)]
                opening = next((text for text in literals if len(text) >= 15), None)
                yield f"{path.name}:{node.lineno}", opening

    def test_every_warning_is_documented(self):
        page = (DOCS / "messages.md").read_text()
        table = self.normalize(page[page.index("## Symptoms that log nothing") :])
        openings = list(self.warning_openings())
        self.assertGreaterEqual(len(openings), 10)
        for where, opening in openings:
            with self.subTest(where=where):
                self.assertIsNotNone(opening, "a warning without a literal opening can't be looked up")
                self.assertIn(opening[:24], table, f"{where}: add a row for this warning to the Messages page")

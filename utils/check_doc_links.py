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
Checks the cross-references of the documentation source, which `doc-builder build` renders without checking:

- a markdown link between pages (`[text](./llm_optims)`, `[text](../llm_optims#choosing-buckets)`,
  `[text](api/config.md)`) must name a page of the docs, and its `#anchor`, if any, a heading of that page (or an
  object documented there with `[[autodoc]]`);
- `[[autodoc]] name` must name an object that imports from `prefill_buckets` (`precompile`,
  `compile.compiled_calls.GraphCounter`);
- a doc-builder object reference, [`precompile`], [`~prefill_buckets.precompile`] or [`precompile#batch_sizes`], must
  resolve to a public object defined in `prefill_buckets`. References into transformers (`transformers.`,
  `~transformers.`, `~generation.`) are left to doc-builder, which links them to the transformers docs;
- every `local:` entry of `_toctree.yml` must name a page.

Links to other sites (`https://...`) are not fetched. Code blocks, inline code and HTML comments are skipped.

Usage: `python utils/check_doc_links.py [DOCS_DIR]` (defaults to docs/source/en). Lists each problem as
`path:line: message` and exits with status 1 when there is any.
"""

import argparse
import importlib
import inspect
import re
import sys
from dataclasses import dataclass
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
DEFAULT_DOCS = REPO / "docs" / "source" / "en"
PACKAGE = "prefill_buckets"
PAGE_SUFFIXES = (".md", ".mdx")

# Object references doc-builder resolves against another library's docs.
EXTERNAL_PREFIXES = ("transformers.", "~transformers.", "~generation.")

_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
_HTML_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_INLINE_CODE = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)")
_AUTODOC = re.compile(r"^\s*\[\[autodoc\]\]\s+(\S+)\s*$")
_AUTODOC_MEMBER = re.compile(r"^\s+-\s+(\w+)\s*$")
# doc-builder's own pattern: [`name`] not followed by `(`, which would make it a markdown link.
_OBJECT_REFERENCE = re.compile(r"\[`([^`]+)`\](?!\()")
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t#]*$")
_EXPLICIT_ANCHOR = re.compile(r"\[\[([^\]]+)\]\]\s*$")


@dataclass(frozen=True)
class Problem:
    path: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def _blank(match: re.Match) -> str:
    """The matched text with everything but newlines replaced by spaces, so line and column numbers are kept."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose_lines(text: str) -> list[str]:
    """The lines of a page with code blocks and HTML comments blanked out (line numbers unchanged)."""
    text = _HTML_COMMENT.sub(_blank, text)
    lines = text.split("\n")
    fence = None  # the opening fence while inside a code block
    for index, line in enumerate(lines):
        match = _FENCE.match(line)
        if fence is None:
            if match:
                fence = match.group(1)
                lines[index] = ""
            continue
        lines[index] = ""
        closes = (
            match is not None
            and match.group(1)[0] == fence[0]
            and len(match.group(1)) >= len(fence)
            and not line[match.end() :].strip()
        )
        if closes:
            fence = None
    return lines


def slugify(title: str) -> str:
    """The anchor the Hub renderer gives a heading (GitHub's rule): lowercase, punctuation dropped, spaces to `-`."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading keeps its text
    title = title.replace("`", "").strip().lower()
    title = re.sub(r"[^\w\- ]", "", title)
    return title.replace(" ", "-")


def import_package(name: str = PACKAGE):
    try:
        return importlib.import_module(name)
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))
        return importlib.import_module(name)


def resolve(name: str, package):
    """
    The object `name` names inside `package` (`precompile`, `prefill_buckets.precompile`,
    `compile.compiled_calls.GraphCounter`, `BucketPolicy.bucket`), importing submodules as needed, as doc-builder
    does; `None` when it does not resolve.
    """
    parts = name.split(".")
    if parts[0] == package.__name__:
        parts = parts[1:]
    if not parts or not all(parts):
        return None
    obj = package
    for part in parts:
        found = getattr(obj, part, None)
        if found is None and inspect.ismodule(obj):
            try:
                importlib.import_module(f"{obj.__name__}.{part}")
            except ImportError:
                return None
            found = getattr(obj, part, None)
        if found is None:
            return None
        obj = found
    return obj


def is_public(name: str, obj, package) -> bool:
    """Whether `name` (already resolved to `obj`) is a public name of an object defined in `package`."""
    parts = [part for part in name.split(".") if part != package.__name__]
    if any(part.startswith("_") for part in parts):
        return False
    if isinstance(obj, property):
        obj = obj.fget
    module = obj.__name__ if inspect.ismodule(obj) else getattr(obj, "__module__", None)
    # Plain values (such as the field-name constants) have no module: a public attribute path is enough for them.
    return module is None or module == package.__name__ or module.startswith(package.__name__ + ".")


class DocsChecker:
    def __init__(self, docs: Path, package):
        self.docs = docs.resolve()
        self.package = package
        self.problems: list[Problem] = []
        self.pages = sorted(p for p in self.docs.rglob("*") if p.suffix in PAGE_SUFFIXES and p.is_file())
        self._anchors: dict[Path, set[str]] = {}
        self.counts = {"links": 0, "autodoc": 0, "references": 0}

    def report(self, path: Path, line: int, message: str) -> None:
        try:
            path = path.resolve().relative_to(Path.cwd())
        except ValueError:
            pass  # outside the working directory: keep the absolute path
        self.problems.append(Problem(path, line, message))

    def anchors(self, page: Path) -> set[str]:
        """The anchors of `page`: its headings (slugged, or their explicit `[[anchor]]`) and its autodoc objects."""
        if page not in self._anchors:
            anchors, seen = set(), {}
            lines = prose_lines(page.read_text(encoding="utf-8"))
            for index, line in enumerate(lines):
                heading = _HEADING.match(line)
                if heading:
                    title = heading.group(2)
                    explicit = _EXPLICIT_ANCHOR.search(title)
                    if explicit:
                        anchors.add(explicit.group(1))
                        continue
                    slug = slugify(title)
                    count = seen.get(slug, 0)
                    seen[slug] = count + 1
                    anchors.add(slug if count == 0 else f"{slug}-{count}")
                autodoc = _AUTODOC.match(line)
                if autodoc:
                    name = autodoc.group(1)
                    full = name if name.startswith(self.package.__name__ + ".") else f"{self.package.__name__}.{name}"
                    anchors.add(full)
                    for member_line in lines[index + 1 :]:
                        member = _AUTODOC_MEMBER.match(member_line)
                        if member is None:
                            break
                        anchors.add(f"{full}.{member.group(1)}")
            self._anchors[page] = anchors
        return self._anchors[page]

    def find_page(self, base: Path, target: str) -> Path | None:
        """The file a relative link names, trying the page suffixes as doc-builder links omit them."""
        candidate = (base / target).resolve() if target else base
        options = [candidate] if candidate.suffix else []
        options += [candidate.with_name(candidate.name + suffix) for suffix in PAGE_SUFFIXES]
        options += [candidate / f"index{suffix}" for suffix in PAGE_SUFFIXES]
        return next((option for option in options if option.is_file()), None)

    def check_link(self, page: Path, line: int, target: str) -> None:
        self.counts["links"] += 1
        if _SCHEME.match(target) or target.startswith("/"):
            return  # another site, or an absolute path on the docs site: not checked here
        path, _, anchor = target.partition("#")
        found = page if not path else self.find_page(page.parent, path)
        if found is None:
            self.report(
                page, line, f"link to `{target}`: no page `{path}` (tried it with `.md`, `.mdx` and `/index.md`)"
            )
            return
        if self.docs not in found.parents:
            self.report(page, line, f"link to `{target}` leaves the docs folder: it will be broken once rendered")
            return
        if anchor and found.suffix in PAGE_SUFFIXES and anchor not in self.anchors(found):
            known = ", ".join(sorted(a for a in self.anchors(found) if "." not in a)) or "none"
            self.report(
                page, line, f"link to `{target}`: `{found.name}` has no anchor `#{anchor}` (headings: {known})"
            )

    def check_reference(self, page: Path, line: int, reference: str) -> None:
        self.counts["references"] += 1
        if reference.startswith(EXTERNAL_PREFIXES):
            return
        name = reference.removeprefix("~").split("#", 1)[0]
        obj = resolve(name, self.package)
        if obj is None:
            self.report(page, line, f"[`{reference}`] does not resolve to an object of `{self.package.__name__}`")
        elif not is_public(name, obj, self.package):
            self.report(
                page, line, f"[`{reference}`] is not a public object of `{self.package.__name__}` (it is {obj!r})"
            )

    def check_autodoc(self, page: Path, line: int, name: str) -> None:
        self.counts["autodoc"] += 1
        obj = resolve(name, self.package)
        if obj is None:
            self.report(page, line, f"[[autodoc]] {name}: `{name}` does not import from `{self.package.__name__}`")
        elif not is_public(name, obj, self.package):
            self.report(page, line, f"[[autodoc]] {name}: not a public object of `{self.package.__name__}`")

    def check_page(self, page: Path) -> None:
        lines = prose_lines(page.read_text(encoding="utf-8"))
        for number, line in enumerate(lines, start=1):
            autodoc = _AUTODOC.match(line)
            if autodoc:
                self.check_autodoc(page, number, autodoc.group(1))
                lines[number - 1] = ""
        # References and links are matched on the whole text: a link's text may be wrapped over several lines.
        text = "\n".join(lines)
        for reference in _OBJECT_REFERENCE.finditer(text):
            self.check_reference(page, text.count("\n", 0, reference.start()) + 1, reference.group(1))
        text = _INLINE_CODE.sub(_blank, text)
        for link in _LINK.finditer(text):
            self.check_link(page, text.count("\n", 0, link.start(1)) + 1, link.group(1))

    def check_toctree(self) -> None:
        toctree = self.docs / "_toctree.yml"
        if not toctree.is_file():
            self.report(toctree, 0, "missing: doc-builder needs a _toctree.yml")
            return
        for number, line in enumerate(toctree.read_text(encoding="utf-8").splitlines(), start=1):
            match = re.match(r"^\s*-?\s*local:\s*(\S+)\s*$", line)
            if match and self.find_page(self.docs, match.group(1).strip("'\"")) is None:
                self.report(toctree, number, f"`local: {match.group(1)}` names no page")

    def run(self) -> list[Problem]:
        self.check_toctree()
        for page in self.pages:
            self.check_page(page)
        return self.problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("docs", nargs="?", type=Path, default=DEFAULT_DOCS, help="the docs source folder")
    args = parser.parse_args(argv)
    if not args.docs.is_dir():
        print(f"check_doc_links: {args.docs} is not a folder", file=sys.stderr)
        return 1
    checker = DocsChecker(args.docs, import_package())
    problems = checker.run()
    for problem in problems:
        print(problem)
    counts = checker.counts
    summary = (
        f"{len(checker.pages)} pages, {counts['links']} links, {counts['autodoc']} [[autodoc]] names, "
        f"{counts['references']} object references"
    )
    if problems:
        print(f"check_doc_links: {len(problems)} problem(s) in {summary}")
        return 1
    print(f"check_doc_links: {summary}: all resolve")
    return 0


if __name__ == "__main__":
    sys.exit(main())

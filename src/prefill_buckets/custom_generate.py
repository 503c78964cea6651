"""Bucketing without patching transformers: a model folder whose `generate` is bucketed, through transformers' own
extension point, `custom_generate/generate.py` (`save_custom_generate` writes one that calls `prefill_buckets.generate`).
"""

import json
import os
from pathlib import Path

from transformers.utils import logging

from .config import FIELDS
from .version import __version__


logger = logging.get_logger(__name__)


# What `save_custom_generate` writes. transformers imports it as a module of its own (it must import only installed
# packages) and calls `generate(model=model, **arguments)`; a model loaded from the folder calls
# `functools.partial(generate, model=model)(*args, **kwargs)`, so positional arguments come before `model`.
GENERATE_PY = f'''"""`generate` with bucketed prefill, written by `prefill_buckets.save_custom_generate`.

The bucket fields come from the call's keyword arguments or generation config, as for `prefill_buckets.generate`:
{", ".join(f"`{field}`" for field in FIELDS)}.
"""

import prefill_buckets


def generate(*args, model, **kwargs):
    return prefill_buckets.generate(model, *args, **kwargs)
'''
REQUIREMENTS_TXT = f"transformers-prefill-buckets>={__version__}\n"


def save_custom_generate(save_directory: str | os.PathLike) -> Path:
    r"""
    Writes `custom_generate/generate.py` (and its `requirements.txt`) into `save_directory`, so that transformers runs
    [`generate`] with bucketed prefill for it, without `enable()`.

    Either load a model saved there with `from_pretrained(save_directory, trust_remote_code=True)`: its `generate` is
    then bucketed; or pass `custom_generate=save_directory, trust_remote_code=True` to any model's `generate`. Set the
    bucket fields on a `GenerationConfig` of your own (one derived from the model config loses them when loaded), or
    pass them to the call.

    Args:
        save_directory (`str` or `os.PathLike`):
            A model folder (as written by `save_pretrained`), or any folder to pass as `custom_generate`.

    Returns:
        `Path`: the `generate.py` written.

    Example:

    ```python
    >>> model.generation_config = GenerationConfig(cache_implementation="static", prefill_buckets="pow2-quarters", ...)
    >>> model.save_pretrained("my-model")
    >>> prefill_buckets.save_custom_generate("my-model")
    >>> model = AutoModelForCausalLM.from_pretrained("my-model", trust_remote_code=True)  # generate is bucketed
    ```
    """
    _warn_if_fields_dropped(Path(save_directory) / "generation_config.json")
    folder = Path(save_directory) / "custom_generate"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "requirements.txt").write_text(REQUIREMENTS_TXT, encoding="utf-8")
    path = folder / "generate.py"
    path.write_text(GENERATE_PY, encoding="utf-8")
    return path


def _warn_if_fields_dropped(config_file: Path) -> None:
    """Warns when the folder's generation config sets bucket fields that transformers will drop when it loads it."""
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    fields = [field for field in FIELDS if saved.get(field) is not None]
    if fields and saved.get("_from_model_config"):
        logger.warning(
            f"{config_file} sets {', '.join(f'`{f}`' for f in fields)}, but it is a generation config derived from the "
            "model config (`_from_model_config`), and transformers drops the fields it does not know when it loads "
            "one: the loaded model would not bucket. Set `model.generation_config = GenerationConfig(...)` with the "
            "fields and save the model again."
        )

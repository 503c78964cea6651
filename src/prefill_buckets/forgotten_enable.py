"""The warning that `enable()` was forgotten, said by the package's own entry points.

A model whose generation config sets bucket fields generates bucketed only through the package: after `enable()`,
through the functional `prefill_buckets.generate`, or through a saved `custom_generate` (`save_custom_generate`).
Without `enable()`, `model.generate` is upstream's, and transformers keeps a field it does not know on the config and
never reads it: the model compiles a graph per prompt length, and nothing says so. Importing the package can't notice
(it must not change transformers), and upstream `generate` runs none of its code. What the package can do is speak
when the user calls it: `precompile`, `aot_forward`, `save_compile_cache` and `load_compile_cache` call
`warn_if_enable_forgotten`, which warns once per entry point when `GenerationMixin.generate` is upstream's and a
generation config they are given (the model's own, or one passed in) sets bucket fields; an invalid value is named
too. `load_compile_cache` is given no model: it warns whenever `generate` is upstream's.
"""

from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from .config import BUCKET_FIELDS, FIELDS, validate_fields
from .upstream import torch_api, transformers_api


logger = logging.get_logger(__name__)


def generate_is_upstreams() -> bool:
    """Whether `model.generate` is transformers' own: `enable()` is not in effect."""
    return GenerationMixin.__dict__.get("generate") is transformers_api.UPSTREAM_GENERATE


def bucket_fields_set(generation_config) -> dict:
    """The fields a generation config sets (with or without `enable()`: transformers keeps unknown ones), by name."""
    return {
        field: getattr(generation_config, field)
        for field in FIELDS
        if getattr(generation_config, field, None) is not None
    }


def generation_configs(*models) -> list:
    """The generation configs of `models` (a `torch.compile` wrapper's module's own)."""
    return [getattr(torch_api.unwrap(model), "generation_config", None) for model in models]


def warn_if_enable_forgotten(entry_point: str, configs=(), model_known: bool = True) -> None:
    """
    Warns once (per entry point) when `generate` is upstream's and one of the generation configs `configs` sets a bucket
    field; with `model_known=False` (an entry point that is given no model: `load_compile_cache`), whenever
    `generate` is upstream's.
    """
    if not generate_is_upstreams():
        return
    found = (bucket_fields_set(config) for config in configs)
    fields = next((fields for fields in found if any(field in fields for field in BUCKET_FIELDS)), None)
    if fields is None and model_known:
        return
    how = (
        "Call `prefill_buckets.enable()` before generating (or generate with `prefill_buckets.generate(model, ...)`, "
        "or load the model from a folder written by `prefill_buckets.save_custom_generate`)."
    )
    if fields is None:
        logger.warning_once(
            f"`{entry_point}` ran while `prefill_buckets.enable()` is not in effect: `model.generate` is "
            "transformers' own, which ignores the bucket fields, so the bucketed graphs serve only calls made through "
            f"the package. {how}"
        )
        return
    described = ", ".join(f"`{name}={value!r}`" for name, value in fields.items())
    try:
        validate_fields(**fields)
        invalid = ""
    except ValueError as error:
        invalid = f" The fields are not valid either: {error}"
    logger.warning_once(
        f"`{entry_point}` got a model whose generation config sets {described}, but `prefill_buckets.enable()` is not "
        "in effect: `model.generate` is transformers' own, which ignores these fields and says nothing (compiled, it "
        f"compiles a graph per prompt length). {how}{invalid}"
    )

"""The warning that `enable()` was forgotten, said by the package's own entry points.

Without `enable()`, `model.generate` is upstream's, which keeps bucket fields on a config and never reads them: a
compiled model then compiles a graph per prompt length, silently. `precompile`, `aot_forward`, `save_compile_cache`
and `load_compile_cache` call `warn_if_enable_forgotten`, which says so once per entry point.
"""

from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from .config import BUCKET_FIELDS, FIELDS, validate_fields
from .upstream import torch_api, transformers_api


logger = logging.get_logger(__name__)


def generation_configs(*models) -> list:
    """The generation configs of `models` (a `torch.compile` wrapper's module's own)."""
    return [getattr(torch_api.unwrap(model), "generation_config", None) for model in models]


def warn_if_enable_forgotten(entry_point: str, configs=(), model_known: bool = True) -> None:
    """
    Warns once (per entry point) when `generate` is upstream's and one of the generation configs `configs` sets a bucket
    field; with `model_known=False` (an entry point that is given no model: `load_compile_cache`), whenever
    `generate` is upstream's.
    """
    if GenerationMixin.__dict__.get("generate") is not transformers_api.UPSTREAM_GENERATE:
        return  # `enable()` is in effect
    # The fields each config sets (without `enable()`, transformers keeps unknown ones).
    found = ({field: getattr(c, field) for field in FIELDS if getattr(c, field, None) is not None} for c in configs)
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

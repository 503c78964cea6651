"""`enable()` / `disable()`: install the fields and the bucketed `generate` into transformers, reversibly.

`enable()` makes `GenerationConfig` take, validate and document the fields (`prefill_pad_to_multiple_of`,
`prefill_buckets`, `prefill_batch_buckets`, `prefill_padding_side`), `GenerationMixin.generate` the bucketed
`generate`, and `OptimizedModule.generate` the bucketed `generate` on the `torch.compile(model)` wrapper (so a call
runs the wrapper's compiled forward, not the wrapped module's eager one). `disable()` puts back exactly what it had.
"""

import functools

from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from .call import generation, hooks
from .config import FIELD_DOCS, FIELDS, validate_fields
from .state import PATCH_LOCK, PROCESS
from .upstream import torch_api


def is_enabled() -> bool:
    """Whether `enable()` is in effect."""
    return bool(PROCESS.patched)


def enable() -> None:
    """
    Teaches transformers' own `GenerationConfig` and `model.generate` the four fields `prefill_pad_to_multiple_of`,
    `prefill_buckets`, `prefill_batch_buckets` and `prefill_padding_side`. Idempotent and thread-safe; undone by
    [`disable`].

    Example:

    ```python
    >>> import prefill_buckets
    >>> from transformers import GenerationConfig

    >>> prefill_buckets.enable()
    >>> GenerationConfig(prefill_buckets="pow2").prefill_buckets
    'pow2'
    >>> prefill_buckets.disable()
    ```
    """
    hooks.check_upstream(generate=generation.generate)
    with PATCH_LOCK:
        originals = PROCESS.patched  # (owner, attribute) -> what transformers had
        if originals:
            return
        original_init = GenerationConfig.__init__
        original_validate = GenerationConfig.validate

        @functools.wraps(original_init)
        def __init__(self, **kwargs):
            # Set before upstream's `__init__`, which ends by calling `validate()`.
            for field in FIELDS:
                setattr(self, field, kwargs.pop(field, None))
            original_init(self, **kwargs)

        @functools.wraps(original_validate)
        def validate(self, *args, **kwargs):
            validate_fields(**{field: getattr(self, field, None) for field in FIELDS})
            return original_validate(self, *args, **kwargs)

        @functools.wraps(generation.UPSTREAM_GENERATE)
        def generate(self, *args, **kwargs):
            return generation.generate(self, *args, **kwargs)

        def compiled_generate(self):
            module_generate = getattr(torch_api.unwrap(self), "generate")  # AttributeError when the module has none

            @functools.wraps(module_generate)
            def generate(*args, **kwargs):
                return generation.generate(self, *args, **kwargs)

            return generate

        originals[(GenerationConfig, "__init__")] = original_init
        originals[(GenerationConfig, "validate")] = original_validate
        originals[(GenerationConfig, "__doc__")] = GenerationConfig.__doc__
        originals[(GenerationMixin, "generate")] = GenerationMixin.__dict__["generate"]
        GenerationConfig.__init__ = __init__
        GenerationConfig.validate = validate
        GenerationConfig.__doc__ = (GenerationConfig.__doc__ or "") + FIELD_DOCS
        GenerationMixin.generate = generate
        torch_api.OptimizedModule.generate = property(compiled_generate)


def disable() -> None:
    """Restores transformers exactly as it was before [`enable`]. Idempotent; a no-op when not enabled."""
    with PATCH_LOCK:
        originals = PROCESS.patched
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
        if originals:
            # Upstream has none: attribute lookup falls back to the wrapped module.
            del torch_api.OptimizedModule.generate
        originals.clear()

"""The version gate: whether this transformers and torch can be bucketed on, decided once per model class and per
process (`check_upstream`). setup.py sets no upper bound on either, so outside the tested ranges the first bucketed
call also runs the self-test. What the gate needs of the package above `upstream/` comes in as arguments.
"""

import functools
import threading
from collections.abc import Callable

import torch
import transformers
from packaging import version
from transformers import PreTrainedModel
from transformers.generation.utils import GenerationMixin
from transformers.utils import logging

from . import checks, selftest, versions


logger = logging.get_logger(__name__)

# Held while a verdict is made, so a concurrent first call waits for it. Reentrant: the self-test's own bucketed calls
# re-enter.
VERDICT_LOCK = threading.RLock()
# The self-test's verdict before it has run, and while it runs (its own bucketed calls come back to the gate).
SELF_TEST_PENDING, SELF_TEST_RUNNING = object(), object()


class _GenerativeModel(PreTrainedModel, GenerationMixin):
    """What `enable()` checks when no model is known yet: the upstream classes every generative model inherits."""


def check_upstream(
    model_class: type = _GenerativeModel,
    *,
    generate: Callable,
    hook_targets: Callable[[], dict[str, tuple[tuple[str, ...], bool]]],
    verdicts,
) -> None:
    """
    Raises `RuntimeError` when a private name the package relies on is missing or reshaped (`checks.upstream_problems`)
    and, outside the tested range, when the self-test fails. The verdict is kept per class (the self-test's, per
    process): a class that failed keeps raising.

    Args:
        model_class (`type`, *optional*):
            The model's class; by default the upstream classes every generative model inherits (what `enable()` checks).
        generate (`Callable`):
            The package's bucketed `generate`, which the self-test compares with upstream's.
        hook_targets (`Callable`):
            Returns the hook targets to check (`checks.upstream_problems`); called once per class.
        verdicts:
            Where the verdicts are kept (`state.PROCESS`): `upstream_verdicts`, `self_test_verdict`, `upstream_passed`.
    """
    with VERDICT_LOCK:
        kept = verdicts.upstream_verdicts
        if model_class not in kept:
            kept[model_class] = checks.upstream_problems(model_class, hook_targets())
        failure = kept[model_class]
        if failure is None and not is_tested_range():
            failure = _self_test_failure(generate, verdicts)
        if failure is None and verdicts.self_test_verdict is not SELF_TEST_RUNNING:
            verdicts.upstream_passed.add(model_class)  # for good: neither verdict changes once made
    if failure is not None:
        raise RuntimeError(failure)


def is_tested_range() -> bool:
    """Whether the installed transformers and torch are both within their tested ranges (by minor version)."""
    return is_tested_transformers() and is_tested_torch()


def is_tested_transformers() -> bool:
    """Whether the installed transformers is within `versions.TESTED_TRANSFORMERS` (by minor version)."""
    return _within(versions.TRANSFORMERS_VERSION, versions.TESTED_TRANSFORMERS)


def is_tested_torch() -> bool:
    """Whether the installed torch is within `versions.TESTED_TORCH` (by minor version, ignoring a local build tag)."""
    return _within(versions.TORCH_VERSION, versions.TESTED_TORCH)


@functools.lru_cache(maxsize=16)  # every bucketed call asks, with the same versions
def _within(installed: version.Version, tested: tuple[str, ...]) -> bool:
    oldest, newest = (version.parse(v).release[:2] for v in (tested[0], tested[-1]))
    return oldest <= installed.release[:2] <= newest and not installed.is_prerelease


def _self_test_failure(generate, verdicts) -> str | None:
    """The self-test's verdict (`None`: passed, or its message), run once and kept; its own bucketed calls pass."""
    verdict = verdicts.self_test_verdict
    if verdict is SELF_TEST_RUNNING:
        return None
    if verdict is not SELF_TEST_PENDING:
        return verdict
    tested, tested_torch = versions.TESTED_TRANSFORMERS, versions.TESTED_TORCH
    outside = [f"transformers {transformers.__version__}"] if not is_tested_transformers() else []
    outside += [f"torch {torch.__version__}"] if not is_tested_torch() else []
    logger.warning(
        f"prefill_buckets is tested on transformers {tested[0]} to {tested[-1]} and torch {tested_torch[0]} to "
        f"{tested_torch[-1]}, and this is {' with '.join(outside) or 'outside them'}. Every private step it hooks is "
        "present with the parameters it reads; its self-test (a tiny model, bucketed against unpadded) runs now, and "
        "every bucketed call raises if it fails. Compare a few of your own outputs against an unbucketed call."
    )
    verdicts.self_test_verdict = SELF_TEST_RUNNING
    verdict = SELF_TEST_PENDING  # interrupted (`KeyboardInterrupt`): no verdict, the next call runs it again
    try:
        selftest.self_test(generate)
        verdict = None
    except Exception as error:  # any failure of a bucketed call on this version is the verdict, kept
        verdict = str(error) if isinstance(error, RuntimeError) else f"prefill_buckets' self-test failed: {error!r}"
    finally:
        verdicts.self_test_verdict = verdict
    return verdict

"""The hook declarations: the steps of upstream `generate` a bucketed call replaces on the model instance.

Each hook is declared where it is written with `@hook(target, reads=..., positional=..., side=...)`, which registers
nothing: `hooks.HOOKS` lists them (`hook_table`). A hook body gets the plan and the step's arguments (`StepArguments`),
and runs upstream's method with `step.call()`, with the arguments in the form upstream passed them, so an override of
the step with its own signature is called as upstream calls it.
"""

import contextvars
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel
from transformers.generation.utils import GenerationMixin


# The plan of the bucketed call running in this context (thread, task): hooks act for its model only.
_ACTIVE_PLAN: contextvars.ContextVar[Any] = contextvars.ContextVar("prefill_buckets_plan", default=None)


@dataclasses.dataclass(frozen=True)
class Hook:
    """One hooked step of upstream `generate`."""

    # The `GenerationMixin` method replaced on the model instance for the duration of a bucketed call.
    target: str
    # `body(plan, step)`: runs in place of the method while the model has an active plan (`active_plan`).
    body: Callable
    # The parameters of `target` the hook reads or changes by name, which `check_upstream` checks every override takes.
    reads: tuple[str, ...]
    # Whether upstream `generate` passes `reads` by position (in this order): an override must take them there, or
    # pass `*args` on. Otherwise they come by keyword, and an override may take them through `**kwargs`.
    positional: bool
    # `"left"` or `"right"`: the hook acts on calls padded on that side only (`None`: both).
    side: str | None = None


def hook(target: str, *, reads: tuple[str, ...], positional: bool = False, side: str | None = None):
    """Declares the decorated `body(plan, step)` as the hook of `target` (see `Hook`): sets `body.hook`, nothing else."""

    def declare(body):
        body.hook = Hook(target, body, tuple(reads), positional, side)
        return body

    return declare


def hook_table(*bodies: Callable) -> dict[str, Hook]:
    """`{target: Hook}` of the functions `bodies`, each declared with `@hook`; raises when two hook one target."""
    table = {}
    for body in bodies:
        declared = getattr(body, "hook", None)
        if not isinstance(declared, Hook):
            raise TypeError(f"`{body.__name__}` is not declared as a hook: decorate it with `@hook(target, ...)`.")
        if declared.target in table:
            raise RuntimeError(
                f"Two hooks are declared for `{declared.target}`: `{table[declared.target].body.__name__}` and "
                f"`{body.__name__}`."
            )
        table[declared.target] = declared
    return table


def active_plan(model):
    """The plan of the bucketed call running on `model` in this context, or `None`."""
    plan = _ACTIVE_PLAN.get()
    return plan if plan is not None and plan.model is model else None


@functools.cache
def _upstream_parameters(target: str) -> tuple[dict[str, int], dict[str, Any]]:
    """The positions of upstream's method `target`'s positional parameters (after `self`) by name, and its defaults."""
    method = getattr(GenerationMixin, target, None) or getattr(PreTrainedModel, target)
    parameters = list(inspect.signature(method).parameters.values())[1:]
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return {name: index for index, name in enumerate(positional)}, defaults


class StepArguments:
    """
    The arguments of one call of a hooked step, as upstream passed them: `step[name]` reads one by upstream's name for
    it (its default when left out), `step[name] = value` changes it where it was passed, `step.call()` runs the step.
    """

    __slots__ = ("original", "args", "kwargs", "_positions", "_defaults")

    def __init__(self, target: str, original: Callable, args: tuple, kwargs: dict):
        self.original = original
        self.args = args  # a tuple until a hook changes one of them
        self.kwargs = kwargs  # the hooked function's own `**kwargs`: already a new dict
        self._positions, self._defaults = _upstream_parameters(target)

    def _index(self, name: str) -> int | None:
        index = self._positions.get(name)
        return index if index is not None and index < len(self.args) else None

    def __getitem__(self, name: str):
        if name in self.kwargs:
            return self.kwargs[name]
        index = self._index(name)
        if index is not None:
            return self.args[index]
        return self._defaults.get(name)

    def __setitem__(self, name: str, value) -> None:
        index = self._index(name)
        if index is not None and name not in self.kwargs:
            args = list(self.args)
            args[index] = value
            self.args = tuple(args)
        else:
            self.kwargs[name] = value

    def call(self):
        """Runs the method the hook replaces with the arguments as they are now."""
        return self.original(*self.args, **self.kwargs)


def make_hooked(entry: Hook, original: Callable, model) -> Callable:
    """The function installed on `model` in place of `original`: `entry.body` while `model` has an active plan."""
    body, target, only = entry.body, entry.target, entry.side

    def hooked(*args, **kwargs):
        plan = _ACTIVE_PLAN.get()
        if plan is None or plan.model is not model or (only is not None and plan.side != only):
            return original(*args, **kwargs)
        return body(plan, StepArguments(target, original, args, kwargs))

    return wraps(hooked, original)


def hooked_method(model, state, entry: Hook, original: Callable) -> Callable:
    """
    `make_hooked(entry, original, model)`, made once per model (`state.hooked`) and reused while it replaces the same
    function bound to the same model (not a deep copy's, whose state holds its original's).
    """
    function = getattr(original, "__func__", original)
    made = state.hooked.get(entry.target)
    if made is not None and made[0] is entry and made[1] is function:
        bound_to = getattr(made[2].__wrapped__, "__self__", None)  # a deep copy's state holds its original's
        if bound_to is model:
            return made[2]
    hooked = make_hooked(entry, original, model)
    state.hooked[entry.target] = (entry, function, hooked)
    return hooked


def wraps(wrapper: Callable, wrapped: Callable) -> Callable:
    """`functools.update_wrapper(wrapper, wrapped)` at a fraction of its cost (a call installs one per hook)."""
    try:
        wrapper.__module__, wrapper.__name__ = wrapped.__module__, wrapped.__name__
        wrapper.__qualname__, wrapper.__doc__ = wrapped.__qualname__, wrapped.__doc__
        wrapper.__annotations__ = wrapped.__annotations__
        if sys.version_info >= (3, 12):
            wrapper.__type_params__ = wrapped.__type_params__
    except AttributeError:  # a callable without them: functools copies those it has
        return functools.update_wrapper(wrapper, wrapped)
    wrapper.__dict__.update(getattr(wrapped, "__dict__", {}))
    wrapper.__wrapped__ = wrapped
    return wrapper

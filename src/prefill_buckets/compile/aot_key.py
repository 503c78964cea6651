"""What tells apart the graphs `aot_forward` compiles for one model: the dispatch key, and the audit of the guards a
saved graph drops (`AOTForward._keep_guard`).

Dropped guards on the code (module globals, the forward's decorator closures, what is reached through a class) are
covered by the model's fingerprint and the compile cache file's environment. Dropped guards on the state of a call's
inputs (an object set on an instance, checked by identity) must be named by `DispatchKey`: the right-padded prefill of
a fresh cache sets `get_query_offset` on the cache (`transformers_api.reports_empty`), and its graph takes the query
offset to be 0. `uncovered` audits each new graph: a dropped guard that neither the key nor the fingerprint
(`module_functions`: what is set on the model's modules when it is built, as tensor parallelism's forwards and hub
kernels' wrappers) names means its calls run eagerly, with a warning.

What the package sets on instances while a bucketed call runs, and how each is covered (torch 2.13, transformers
5.24; `test_aot_forward.py` checks that no guard is uncovered):

| set on | attribute | does the forward read it? | covered by |
|---|---|---|---|
| the cache | `get_query_offset` (a fresh cache's right-padded prefill) | yes: an identity guard, dropped | the key |
| the cache | `_prefill_buckets_record` (`cache.CacheRecord`) | no | - |
| a cache layer | `window` (full-attention layers, `windows.py`) | yes: a value guard, saved | the key, guards |
| a cache layer | `cumulative_length` (a tensor, written in place) | yes, as data: no guard | - |
| a cache layer | `overflow` (rings) | where a forward builds its mask (then 0): a value guard, saved | guards |
| the model | the hooks (`call.hooks.HOOKS`), `forward`, `_prefill_buckets_state` | no | - |
| `transformers.masking_utils` | `_ignore_causal_mask_sdpa` (a global) | yes: upstream's own while compiling | the code |

A new state is one line: a field of `DispatchKey` and the value it takes in `dispatch_key`.
"""

import dataclasses
import json
import re
import sys
import types

import torch

from ..kvcache.windows import has_windows, windows_read
from ..upstream import torch_api


# Where a name of a guard is on the code, not on the state of an input (torch's guard names are Python expressions):
# reached through a class. Functions set on instances, and their closures, are state.
_CODE_PARTS = ("type(", "__class__", "__mro__")
# A guard on an attribute of an argument of the traced forward, or on what that attribute holds:
# `kwargs['cache'].get_query_offset` (a decorated forward, traced as `wrapper(*args, **kwargs)`),
# `cache.get_query_offset` (a plain one), `args[1].x` (`args[0]` is the model, the call's positional arguments come
# after it).
_ARGUMENT_ATTRIBUTE = re.compile(
    r"(?:kwargs\['(?P<keyword>\w+)'\]|args\[(?P<index>\d+)\]|(?P<parameter>\w+))\.(?P<attribute>\w+)(?P<rest>[.\[].*)?"
)
# A guard on an attribute of one of the model's modules: `args[0]._modules['model']._modules['embed_tokens'].forward`
# (a decorated forward), `self._modules['model']...` (a plain one).
_MODULE_ATTRIBUTE = re.compile(
    r"(?:args\[0\]|self)(?P<path>(?:\._modules\['[^']+'\])*)\.(?P<attribute>\w+)(?P<rest>[.\[].*)?"
)
_MODULE_NAME = re.compile(r"\._modules\['([^']+)'\]")
# What the key says of a function it can't name across processes (a lambda, a closure, a bound method): a state the
# key can't tell apart, if the graph reads it.
UNNAMED = "<unnamed>"
_PLAIN_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.device)
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType)


@dataclasses.dataclass(frozen=True)
class DispatchKey:
    """What a call's graph depends on besides its saved guards: plain values, the same in every process (`text`)."""

    # Per argument, by position then name: `(name, shape, dtype)` of a tensor, `(name, type)` of another value.
    inputs: tuple
    # Per object argument (the cache): `(name, attribute, qualified name)` of each function set on its instance. A
    # fresh cache of a right-padded prefill has one (`transformers_api.reports_empty`), a continued one none.
    instance_functions: tuple
    # Per cache argument whose layers read attention windows: `(name, window of each layer)`. Their saved guards tell
    # two windows apart too, but the key names the window, so a file's graphs are found by it.
    windows: tuple = ()

    def text(self) -> str:
        """The key as saved in a compile cache file, and looked up by."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def names(self, name: str, attribute: str) -> bool:
        """Whether the key names the function set as `attribute` on the argument `name`."""
        return any(
            (arg, attr) == (name, attribute) and function != UNNAMED for arg, attr, function in self.instance_functions
        )


def dispatch_key(args: tuple, kwargs: dict) -> DispatchKey:
    """The `DispatchKey` of a forward's call: its positional arguments (the model excluded) and keyword arguments."""
    arguments = [(str(index), value) for index, value in enumerate(args)] + sorted(kwargs.items())
    inputs, functions, windows = [], [], []
    for name, value in arguments:
        if isinstance(value, torch.Tensor):
            inputs.append((name, tuple(value.shape), str(value.dtype)))
            continue
        inputs.append((name, type(value).__name__))
        if not isinstance(value, _PLAIN_VALUES + (tuple, list, dict)):
            for attribute, member in sorted(getattr(value, "__dict__", {}).items()):
                if isinstance(member, _FUNCTIONS):
                    functions.append((name, attribute, qualified_name(member)))
            if isinstance(getattr(value, "layers", None), list) and has_windows(value):
                windows.append((name, windows_read(value)))
    return DispatchKey(inputs=tuple(inputs), instance_functions=tuple(functions), windows=tuple(windows))


def qualified_name(function) -> str:
    """`module:qualname` of a function defined at a module's top level (or in a class there), else `UNNAMED`."""
    module_name, qualname = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    if not isinstance(function, types.FunctionType) or not module_name or "<" in qualname:
        return UNNAMED
    found = sys.modules.get(module_name)
    for part in qualname.split("."):
        found = getattr(found, part, None)
    return f"{module_name}:{qualname}" if found is function else UNNAMED


def module_functions(model) -> tuple:
    """
    `(module path, attribute, code)` of each function set on the instance of one of `model`'s modules (the model's own
    `forward` excepted; tensor parallelism sets `forward` on every sharded layer), and of each object of a local type
    such an instance holds, by itself or in a dict (from transformers 5.25, with `kernels`, each attention module's
    `_kernel_funcs`, whose type torch can't save a guard on). Part of the model's fingerprint.
    """
    found = []
    for path, module in model.named_modules():
        for attribute, member in sorted(vars(module).items()):
            if isinstance(member, _FUNCTIONS) and not (module is model and attribute == "forward"):
                function = getattr(member, "__func__", member)
                code = f"{getattr(function, '__module__', None)}:{getattr(function, '__qualname__', type(function))}"
                found.append((path, attribute, code))
            elif attribute not in _MODULE_DICTS:
                held = member.items() if isinstance(member, dict) else ((None, member),)
                for key, value in held:
                    if torch_api.is_local_type(type(value)):
                        found.append((path, attribute, _local_object(key, value)))
    return tuple(found)


# A module's own dicts of what it registers (its submodules, parameters, buffers): not helpers set on it.
_MODULE_DICTS = ("_modules", "_parameters", "_buffers")


def _local_object(key, value) -> str:
    """An object of a local type, in the fingerprint: its key in the dict holding it, its type, and what it sets on
    itself (`kernels.kernelize` sets the `forward` of the kernel it picks)."""
    own = sorted(
        f"{name}={qualified_name(getattr(f, '__func__', f))}"
        for name, f in getattr(value, "__dict__", {}).items()
        if callable(f)
    )
    cls = type(value)
    return f"{'' if key is None else f'[{key!r}] '}{cls.__module__}:{cls.__qualname__}({', '.join(own)})"


def is_on_code(guard_name: str, is_global: bool, closure_names: set[str]) -> bool:
    """Whether a guard is on the model's code (see the module docstring), given the forward's closure variables."""
    root = guard_name.split(".")[0].split("[")[0]
    return is_global or root in closure_names or any(part in guard_name for part in _CODE_PARTS)


def uncovered(key: DispatchKey, state_guards: list[str], model_functions: tuple) -> list[str]:
    """
    The dropped guards on the state of a call's inputs that neither `key` nor the model's fingerprint
    (`model_functions`) names, on a function or on what it holds: those of a graph that can't be told apart from
    another graph of the same key.
    """
    on_modules = {(path, attribute) for path, attribute, _ in model_functions}
    missing = set()
    for guard_name in state_guards:
        module = _MODULE_ATTRIBUTE.fullmatch(guard_name)
        if module is not None:
            path = ".".join(_MODULE_NAME.findall(module["path"]))
            if (path, module["attribute"]) in on_modules:
                continue
        match = _ARGUMENT_ATTRIBUTE.fullmatch(guard_name)
        if match is None:
            missing.add(guard_name)
            continue
        index = match["index"]
        name = match["keyword"] or match["parameter"] or (str(int(index) - 1) if index != "0" else None)
        if name is None or not key.names(name, match["attribute"]):
            missing.add(guard_name)
    return sorted(missing)

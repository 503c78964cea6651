"""What the package needs of the installed transformers and torch, checked: `upstream_problems` lists what is missing
or reshaped, for the version gate (`gate.check_upstream`) to raise, so that a release that renamed a hooked step fails
loudly instead of running with a hook silently skipped.
"""

import functools
import inspect
import pkgutil

import torch
import transformers
from transformers import StaticCache, StaticLayer, StaticSlidingWindowLayer, masking_utils

from . import torch_api, versions


# Other private methods called on the model.
CALLED_METHODS = ("_valid_auto_compile_criteria", "_merge_criteria_processor_list")


def upstream_problems(model_class: type, hook_targets: dict[str, tuple[tuple[str, ...], bool]]) -> str | None:
    """
    What `gate.check_upstream` raises for `model_class`, or `None`: the hook targets (`{method: (parameters the hook
    reads, whether upstream passes them by position)}`) and other private names that are missing or reshaped.
    """
    problems = [
        problem
        for name, (parameters, positional) in hook_targets.items()
        if (problem := _hook_target_problem(model_class, name, parameters, positional)) is not None
    ]
    for name in CALLED_METHODS:
        if not callable(getattr(model_class, name, None)):
            problems.append(f"`{model_class.__name__}.{name}` does not exist")
    if not callable(getattr(StaticCache, "get_query_offset", None)):
        problems.append("`transformers.StaticCache.get_query_offset` does not exist")
    problems.extend(_static_layer_problems())
    if not callable(getattr(masking_utils, "_ignore_causal_mask_sdpa", None)):
        problems.append("`transformers.masking_utils._ignore_causal_mask_sdpa` does not exist")
    problems.extend(torch_problems())
    if not problems:
        return None
    return (
        f"prefill_buckets can't bucket `generate` on transformers {transformers.__version__} with torch "
        f"{torch.__version__}: "
        + "; ".join(problems)
        + f". It is tested on transformers {' to '.join(versions.TESTED_TRANSFORMERS)} and torch "
        f"{' to '.join(versions.TESTED_TORCH)}: "
        "install versions in those ranges, or unset the prefill bucket fields (and call `prefill_buckets.disable()`) "
        "to use these versions without them."
    )


# Every private torch name the package reads, as a dotted path from `torch`: `upstream_problems` names a missing one.
PRIVATE_TORCH_NAMES = (
    "torch._dynamo.config.recompile_limit",
    "torch._dynamo.eval_frame.OptimizedModule",
    "torch._dynamo.exc.BackendCompilerFailed",
    "torch._dynamo.lookup_backend",
    "torch._dynamo.maybe_mark_dynamic",
    "torch._dynamo.utils.counters",
    "torch._dynamo.eval_frame._debug_get_cache_entry_list",
    "torch._TorchCompileInductorWrapper",
    "torch._inductor.runtime.cache_dir_utils.cache_dir",
    "torch.nn.Module._call_impl",
)
# Read where torch has them, with a stated fallback where it has not (see their accessors in `torch_api.py`).
OPTIONAL_TORCH_NAMES = (
    "torch._dynamo.config.accumulated_recompile_limit",
    "torch._inductor.cpu_vec_isa",
    "torch._dynamo.eval_frame._TorchDynamoContext",
    "torch._dynamo.config._config",  # its entries say whether the config is per thread (`DYNAMO_CONFIG_PER_THREAD`)
    "torch._C._dynamo.guards.GlobalStateGuard",  # the global state dynamo guards on (`global_state`)
)
# What `aot_forward` alone reads: `aot_compile_problem` checks them when one is made.
AOT_TORCH_NAMES = (
    "torch._dynamo.guards.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES",
    "torch._dynamo.aot_compile.AOTCompiledFunction.disable_guard_check",
    "torch._dynamo.aot_compile.AOTCompiledFunction.guard_check",
    "torch._dynamo.aot_compile.AOTCompiledFunction.serialize",
    "torch.compiler.load_compiled_function",
    "torch._dynamo.config.patch",  # to set `enable_aot_compile` where it is off (`compile_for_aot`)
)


def _missing_torch_names(paths: tuple[str, ...]) -> list[str]:
    missing = []
    for path in paths:
        try:
            pkgutil.resolve_name(path)  # imports the modules on the way
        except AttributeError:
            missing.append(f"`{path}` does not exist (torch {torch.__version__})")
    return missing


@functools.cache
def torch_problems() -> tuple[str, ...]:
    """What is missing of the private torch names and attributes the package relies on (checked once per process)."""
    return (*_missing_torch_names(PRIVATE_TORCH_NAMES), *_torch_object_problems())


def _probe_function(x):
    return x


def _torch_object_problems() -> list[str]:
    """The private attributes of what `torch.compile` makes that the package reads, probed with the `eager` backend."""
    problems = []
    try:
        module = torch.nn.Identity()
        if not isinstance(getattr(module, "_modules", None), dict):
            problems.append("`torch.nn.Module._modules` does not exist")
        wrapper = torch.compile(module, backend="eager")
        if getattr(wrapper, "_orig_mod", None) is not module:
            problems.append("`torch.compile(module)._orig_mod` is not the module")
        if not callable(getattr(wrapper, "dynamo_ctx", None)):
            problems.append("`torch.compile(module).dynamo_ctx` does not exist")
        if torch_api.eager_callable(torch.compile(_probe_function, backend="eager")) is not _probe_function:
            problems.append("`torch.compile(function)._torchdynamo_orig_callable` is not the function")
        module.compile(backend="eager")
        if not callable(torch_api.compiled_call_impl(module)):
            problems.append("`module.compile()` sets no `_compiled_call_impl`")
    except Exception as error:  # a reshaped torch.compile: reported, not raised from the check
        problems.append(f"`torch.compile` can't be probed ({type(error).__name__}: {error})")
    return problems


@functools.cache
def aot_compile_problem() -> str | None:
    """
    Why `aot_forward` can't compile ahead of time on this torch, or `None`: torch is older than
    `versions.AOT_FORWARD_TORCH`, a name it reads is missing, or `torch.compile(function)` has no `aot_compile`.
    """
    if versions.TORCH_VERSION.release[:2] < versions.AOT_FORWARD_TORCH:
        problems = [f"it needs torch {'.'.join(map(str, versions.AOT_FORWARD_TORCH))} or newer"]
    else:
        problems = _missing_torch_names(AOT_TORCH_NAMES)
        if not problems and not hasattr(torch_api.compile_for_aot(_probe_function, backend="eager"), "aot_compile"):
            problems.append("`torch.compile(function).aot_compile` does not exist")
    if not problems:
        return None
    return (
        f"`prefill_buckets.aot_forward` can't compile ahead of time on torch {torch.__version__}: "
        + "; ".join(problems)
        + f" (the package is tested on torch {' to '.join(versions.TESTED_TORCH)}). Compile with `torch.compile` or "
        "`model.compile()` on this version instead: the compile cache then holds torch's own artifacts."
    )


def _hook_target_problem(model_class: type, name: str, parameters: tuple[str, ...], positional: bool) -> str | None:
    """
    What is wrong with `model_class`'s hook target `name` for a hook that reads `parameters`, or `None`. Checked along
    the MRO: a parameter a definition passes on (`**kwargs`, `*args`) must be named by the one it extends.
    """
    for owner in model_class.__mro__:
        if name not in owner.__dict__:
            continue
        method = getattr(model_class, name) if owner is model_class else owner.__dict__[name]
        if method is None or not callable(method):
            return f"`{model_class.__name__}.{name}` does not exist"
        signature = inspect.signature(method)
        accepted = [p.name for p in signature.parameters.values() if p.name != "self"]
        kinds = {p.kind for p in signature.parameters.values()}
        passes_on = inspect.Parameter.VAR_POSITIONAL if positional else inspect.Parameter.VAR_KEYWORD
        missing = [p for p in parameters if p not in accepted]
        if missing and passes_on not in kinds:
            return f"`{owner.__name__}.{name}` takes no parameter `{missing[0]}`"
        named = [p for p in parameters if p in accepted]
        if positional and named and accepted[: len(named)] != named:
            return f"`{owner.__name__}.{name}` takes `{named[0]}` at another position"
        if not missing:
            return None
        parameters = tuple(missing)  # passed on: the definition it extends must take them
    if getattr(model_class, name, None) is None:
        return f"`{model_class.__name__}.{name}` does not exist"
    return f"`{model_class.__name__}.{name}` takes no parameter `{parameters[0]}` (only through `**kwargs`)"


def _static_layer_problems() -> list[str]:
    """What attention windows rely on: `StaticLayer.update` returns every slot, and its mask spans them all from 0."""
    problems = []
    for name, parameters in (("update", ("key_states", "value_states")), ("get_mask_sizes", ("query_length",))):
        method = getattr(StaticLayer, name, None)
        accepted = inspect.signature(method).parameters if callable(method) else {}
        if not all(p in accepted for p in parameters):
            problems.append(f"`transformers.StaticLayer.{name}` does not take `{', '.join(parameters)}`")
    if not problems:
        layer = StaticLayer(max_cache_len=8)
        keys = torch.zeros(1, 1, 2, 4)
        if tuple(layer.get_mask_sizes(2)) != (8, 0) or layer.update(keys, keys)[0].shape[-2] != 8:
            problems.append("`transformers.StaticLayer` no longer reads every slot of its cache")
    return problems


@functools.cache
def sliding_layer_problem() -> str | None:
    """
    What the sliding-window rings (`kvcache/ring.py`) rely on and this transformers does not do, or `None`: a
    `StaticSlidingWindowLayer` keeps its last `max_cache_len` tokens in order, counted in `cumulative_length_int`
    (and a tensor `cumulative_length`). Checked on a 4-slot layer fed 3, 2 and 1 tokens.
    """
    try:
        layer = StaticSlidingWindowLayer(max_cache_len=16, sliding_window=4)
        held = []
        for new in (3, 2, 1):
            positions = torch.arange(len(held), len(held) + new, dtype=torch.float32)
            held += positions.tolist()
            keys = positions.view(1, 1, new, 1)
            layer.update(keys, keys)
        stored = layer.keys.view(-1).tolist()
        if layer.max_cache_len != 4 or stored != held[-4:] or layer.cumulative_length_int != len(held):
            return (
                "`transformers.StaticSlidingWindowLayer` no longer keeps the last tokens in order, counted in an int"
            )
        if not isinstance(layer.cumulative_length, torch.Tensor):
            return "`transformers.StaticSlidingWindowLayer` has no tensor `cumulative_length`"
    except Exception as error:  # a reshaped upstream layer: its own path, unchanged
        return f"`transformers.StaticSlidingWindowLayer` can't be checked ({type(error).__name__}: {error})"
    return None


# The checks made once per process: what `testing_utils.as_new_process` clears.
CACHED_CHECKS = (torch_problems, aot_compile_problem, sliding_layer_problem)

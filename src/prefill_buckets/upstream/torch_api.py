"""Every private torch name the package reads, behind an accessor each (the package's rule: no module outside
`upstream/` names one): dynamo's configuration and caches, the objects `torch.compile` makes, inductor, and the
ahead-of-time compile `aot_forward` uses. Each is listed in `checks.py`, so a torch that renamed one fails the version
gate naming it (`tests/generation/test_checks.py` checks the lists hold every name read here).
"""

import contextlib
import contextvars
import functools
import pkgutil

import torch


class _Missing(Exception):
    """A torch class this version lacks (`checks.torch_problems` names it): nothing is one, nothing raises it."""


def _torch_class(path: str) -> type:
    try:
        return pkgutil.resolve_name(path)
    except AttributeError:
        return _Missing


OptimizedModule = _torch_class("torch._dynamo.eval_frame.OptimizedModule")  # what `torch.compile(model)` returns
# A compiler backend raised while compiling a graph.
BackendCompilerFailed = _torch_class("torch._dynamo.exc.BackendCompilerFailed")
# The dynamo context a `torch.compile`d function closes over: its `fullgraph` (optional: without it, `False`).
TorchDynamoContext = _torch_class("torch._dynamo.eval_frame._TorchDynamoContext")


def recompile_limit() -> int:
    """`torch._dynamo.config.recompile_limit`: the graphs dynamo compiles per code object before it runs it eagerly."""
    return torch._dynamo.config.recompile_limit


def set_recompile_limit(limit: int) -> None:
    torch._dynamo.config.recompile_limit = limit


def global_state() -> str:
    """The global state dynamo guards every graph on (autocast, dtype, threads, ...), or `""` where torch can't say."""
    guard_class = getattr(torch._C._dynamo.guards, "GlobalStateGuard", None)
    if guard_class is None:
        return ""
    last_guard, last_state = _LAST_GLOBAL_STATE
    try:
        if last_guard is not None and last_guard.check():  # unchanged since the last read: a tenth of reading it
            return last_state
        guard = guard_class()
        state = guard.__getstate__()
    except Exception:  # a torch whose guard keeps its state to itself
        return ""
    _remember_global_state(guard, state)
    return state


# The guard of the last state read (which tells whether the state is still that one), and that state: a memo.
_LAST_GLOBAL_STATE: tuple = (None, "")


def _remember_global_state(guard, state: str) -> None:
    global _LAST_GLOBAL_STATE
    _LAST_GLOBAL_STATE = (guard, state)


def autocast_enabled() -> bool:
    """Whether `torch.autocast` is on for any device type."""
    for device in ("cpu", "cuda", "xpu", "mps"):
        try:
            if torch.is_autocast_enabled(device):
                return True
        except Exception:  # a device type this torch has no autocast for
            continue
    return False


# Whether dynamo's config keeps what a user sets per thread (from torch 2.13, in a `ContextVar`: another thread starts
# from torch's default).
DYNAMO_CONFIG_PER_THREAD = isinstance(
    getattr(getattr(torch._dynamo.config, "_config", {}).get("recompile_limit"), "user_override", None),
    contextvars.ContextVar,
)


def accumulated_recompile_limit() -> int | None:
    """The cap on any one code object's graphs, whatever the recompile limit (`None` where torch has none)."""
    return getattr(torch._dynamo.config, "accumulated_recompile_limit", None)


def set_accumulated_recompile_limit(limit: int) -> None:
    torch._dynamo.config.accumulated_recompile_limit = limit


def lookup_backend(name: str):
    """The compiler backend `torch.compile(backend=name)` would use."""
    return torch._dynamo.lookup_backend(name)


def inductor_backend(mode: str | None, options: dict | None):
    """Inductor as `torch.compile(mode=mode, options=options)` configures it: a backend taking `(gm, example_inputs)`."""
    return torch._TorchCompileInductorWrapper(mode, options, False)


def inductor_cache_dir() -> str:
    """The folder inductor writes its compiled kernels to."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_cpu_vec_isa():
    """Inductor's module of CPU vector instruction sets (`torch._inductor.cpu_vec_isa`), or `None` where absent."""
    try:
        from torch._inductor import cpu_vec_isa
    except ImportError:
        return None
    return cpu_vec_isa


def call_impl(module):
    """What `module(...)` runs when the module is not compiled: `nn.Module._call_impl`, bound to it."""
    return module._call_impl


def submodule(module, name: str):
    """The child module registered on `module` as `name`, or `None`."""
    return module._modules.get(name)


def forward_pre_hook_keywords(model, names) -> set[str]:
    """Those of `names` that a `with_kwargs` forward pre-hook of `model`'s modules binds as a `functools.partial` (PEFT)."""
    found = set()
    for module in model.modules():
        hooks = module._forward_pre_hooks
        if not hooks:
            continue
        takes_kwargs = module._forward_pre_hooks_with_kwargs
        for key, hook in hooks.items():
            if takes_kwargs.get(key) and isinstance(hook, functools.partial):
                found.update(name for name in hook.keywords if name in names)
    return found


def is_compiled_wrapper(model) -> bool:
    """Whether `model` is the `OptimizedModule` that `torch.compile(model)` returns."""
    return isinstance(model, OptimizedModule)


def unwrap(model):
    """The module a `torch.compile(model)` wrapper wraps, or `model` itself."""
    return model._orig_mod if is_compiled_wrapper(model) else model


def compile_with_wrapper(wrapper, function):
    """`function` compiled by the wrapper's own dynamo context: same backend, mode and options."""
    return wrapper.dynamo_ctx(function)


def compiled_call_impl(module):
    """What `module.compile()` installed as the module's compiled call, or `None`."""
    return module.__dict__.get("_compiled_call_impl")


def set_compiled_call_impl(module, function) -> None:
    object.__setattr__(module, "_compiled_call_impl", function)


def forward_graphs(model) -> int:
    """
    The graphs dynamo holds for `model`'s forward, as its recompile limit counts them: the most cache entries on a code
    object a compiled forward starts in (the forward or a decorator's wrapper), shared by every model with that code.
    """
    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if entries is None:
        return 0
    return max((len(entries(code)) for code in _forward_codes(model)), default=0)


def forward_graph_codes(model) -> dict:
    """By code object a compiled forward starts in (as `forward_graphs`), the code dynamo compiled for each graph."""
    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if entries is None:
        return {}
    return {code: {entry.code for entry in entries(code)} for code in _forward_codes(model)}


def _forward_codes(model) -> frozenset:
    forward = getattr(type(model), "forward", None)
    try:  # a class's forward is looked up once: a bucketed call counts its graphs twice
        codes = _class_forward_codes(forward)
    except TypeError:  # not hashable
        codes = _wrapped_codes(forward)
    instance_forward = model.__dict__.get("forward")
    if instance_forward is not None:  # `torch.compile(model.forward)`, or a forward set on the instance
        codes = codes | _wrapped_codes(eager_callable(instance_forward)) | _wrapped_codes(instance_forward)
    return codes


def _wrapped_codes(function) -> frozenset:
    """The code objects of `function` and of the functions it wraps (`__wrapped__`, at most 64)."""
    function = getattr(function, "__func__", function)
    codes = set()
    while function is not None and len(codes) < 64:
        code = getattr(function, "__code__", None)
        if code is not None:
            codes.add(code)
        function = getattr(function, "__wrapped__", None)
    return frozenset(codes)


_class_forward_codes = functools.lru_cache(maxsize=256)(_wrapped_codes)


def _dynamo_context(compiled):
    """The dynamo context a `torch.compile`d function's wrapper closes over (following `__wrapped__`), or `None`."""
    for _ in range(8):
        code, closure = getattr(compiled, "__code__", None), getattr(compiled, "__closure__", None)
        if code is not None and closure and "self" in code.co_freevars:
            context = closure[code.co_freevars.index("self")].cell_contents
            if isinstance(context, TorchDynamoContext):
                return context
        compiled = getattr(compiled, "__wrapped__", None)
        if compiled is None:
            break
    return None


def compiled_with_fullgraph(compiled) -> bool:
    """Whether `compiled` (a `torch.compile`d function, or a wrapper of one) was compiled with `fullgraph=True`."""
    context = _dynamo_context(compiled)
    return context is not None and bool(context.fullgraph)


def compiled_dynamic(compiled) -> bool | None:
    """The `dynamic` argument `compiled` (as `compiled_with_fullgraph` takes it) was compiled with; `False` if unknown."""
    return getattr(_dynamo_context(compiled), "_dynamic", False)  # `None` has none


def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """`torch._dynamo.maybe_mark_dynamic`: one graph for every size, unless the model's code needs it fixed."""
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def compile_counters():
    """dynamo's counters for this process, by kind (`"stats"`, `"graph_break"`, `"inductor"`): `.clear()` resets them."""
    return torch._dynamo.utils.counters


def graphs_compiled() -> int:
    """The graphs dynamo has compiled in this process so far (every frame, every model)."""
    return compile_counters()["stats"]["unique_graphs"]


def limit_refusals() -> int:
    """
    The compiles dynamo refused in this process so far at its recompile limits (it then runs the frame eagerly, and
    never compiles that code object again): counted under `"unimplemented"` by the reason's first line.
    """
    refused = compile_counters()["unimplemented"]
    return sum(count for reason, count in refused.items() if reason.startswith("Dynamo recompile limit exceeded"))


def eager_callable(compiled):
    """The original function of a `torch.compile`d function, or `None` when `compiled` is not one."""
    return getattr(compiled, "_torchdynamo_orig_callable", None)


# ---- torch's ahead-of-time compile (`compile/aot_forward.py`), experimental in torch 2.11 to 2.14 -------------------


def _aot_compile_enabled():
    """Sets `torch._dynamo.config.enable_aot_compile` where torch has it (off by default before 2.13, on from 2.13)."""
    if getattr(torch._dynamo.config, "enable_aot_compile", True):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(enable_aot_compile=True)


def compile_for_aot(function, **kwargs):
    """`torch.compile(function, **kwargs)`, with the `aot_compile` method torch gives it only while it is enabled."""
    with _aot_compile_enabled():
        return torch.compile(function, **kwargs)


def aot_compile(compiled, args: tuple, kwargs: dict):
    """`compiled.aot_compile((args, kwargs))`: one serializable graph for these inputs, its guards left to the caller."""
    with _aot_compile_enabled():
        function = compiled.aot_compile((args, kwargs))
    skip_guard_check(function)
    return function


def skip_guard_check(function) -> None:
    """Makes an ahead-of-time compiled function skip its own guard check (its caller checks `guard_check` first)."""
    function.disable_guard_check()


# The guards that check an object's type, which torch saves by the type's qualified name (`TYPE_MATCH` in
# `torch._dynamo.guards`): it raises a `TypeError` on saving one whose type is defined in a function or a class.
_TYPE_GUARDS = ("TYPE_MATCH", "BUILTIN_MATCH", "FAKE_SCRIPT_TYPE_MATCH")


def guard_can_be_saved(entry) -> bool:
    """
    Whether torch can save a guard (an entry of a `guard_filter_fn`) with an ahead-of-time compiled function: none of
    the kinds it can't save (object identity and the like), nor a type check of an object whose type is local
    (transformers from 5.25, with `kernels`, has such `_kernel_funcs`).
    """
    from torch._dynamo.guards import CheckFunctionManager

    unserializable = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
    if entry.guard_type in unserializable or unserializable.intersection(entry.derived_guard_types):
        return False
    return not (entry.guard_type in _TYPE_GUARDS and entry.has_value and is_local_type(type(entry.value)))


def is_local_type(cls: type) -> bool:
    """Whether `cls` is defined in a function or a class: torch can't save a guard on it by its name."""
    return cls.__qualname__ != cls.__name__


def serialize_compiled(function, external_data: dict) -> bytes:
    """The bytes `torch.compiler.load_compiled_function` reads back."""
    return type(function).serialize(function, external_data).serialized_data


def external_refs(function) -> set[str]:
    """The global names an ahead-of-time compiled function's bytecode reads, which torch does not save."""
    return function._artifacts.runtime_env.external_refs

"""Every private transformers and torch name the package touches, with its version gates, and a check that they exist.

Bucketing works by hooking a few private steps of upstream `generate` for the duration of a call. A transformers
release that renames or reshapes one of them must fail loudly, never run with a hook silently skipped (a missed
`_prepare_generated_length` hook, for instance, would shift `max_length` by the padding). `upstream_problems` lists
what is missing; `support.check_upstream` (run by `enable()` and the first bucketed call on each model class) raises
it, and on a transformers outside `TESTED_TRANSFORMERS` or a torch outside `TESTED_TORCH` also runs the self-test.
Every private torch name is listed in `PRIVATE_TORCH_NAMES` (or probed by `_torch_object_problems`) and checked the same
way, and the ones only `aot_forward` reads by `aot_compile_problem`.

This module is the package's bottom floor: it imports nothing of the package, and no other module names a private
torch or transformers name (`tests/generation/test_imports.py` checks both).
"""

import contextlib
import functools
import importlib
import inspect

import torch
import transformers
from packaging import version
from transformers import PreTrainedModel, StaticCache, StaticLayer, StaticSlidingWindowLayer, masking_utils
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.generation.utils import GenerationMixin
from transformers.utils import output_capturing as _output_capturing


TESTED_TRANSFORMERS = ("5.17.0", "5.24.0")  # oldest and newest, both run in CI
TRANSFORMERS_VERSION = version.parse(transformers.__version__)
# Oldest and newest torch, both run in CI (constraints/oldest.txt, constraints/newest.txt; .venv runs 2.13.0 between).
TESTED_TORCH = ("2.11.0", "2.14.1")
TORCH_VERSION = version.parse(torch.__version__)

# Before transformers 5.21, chunked prefill feeds the whole `input_ids` from position 0, even when the cache already
# holds their start: a call continuing from a cache must then prefill in one (eager) forward.
CHUNKED_PREFILL_RESUMES = TRANSFORMERS_VERSION.release >= (5, 21)

__all__ = [
    "ALL_STATIC_CACHE_IMPLEMENTATIONS",
    "StaticLayer",
    "StaticSlidingWindowLayer",
    "UPSTREAM_GENERATE",
    "UPSTREAM_GENERATE_SIGNATURE",
]

# Captured at import, before `enable()` can replace it.
UPSTREAM_GENERATE = GenerationMixin.generate
UPSTREAM_GENERATE_SIGNATURE = inspect.signature(UPSTREAM_GENERATE)

# Other private methods called on the model.
CALLED_METHODS = ("_valid_auto_compile_criteria",)


class _GenerativeModel(PreTrainedModel, GenerationMixin):
    """What `enable()` checks when no model is known yet: the upstream classes every generative model inherits."""


def upstream_problems(model_class: type, hook_targets: dict[str, tuple[tuple[str, ...], bool]]) -> str | None:
    """
    What `support.check_upstream` raises for `model_class`: the hook targets (`{method: (parameters the hook reads,
    whether upstream passes them by position)}`, `hook_registry.hook_targets`) and other private names the package
    relies on that are missing, or no longer take the parameters the hooks read. `None` when every one is in place.
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
        + f". It is tested on transformers {' to '.join(TESTED_TRANSFORMERS)} and torch {' to '.join(TESTED_TORCH)}: "
        "install versions in those ranges, or unset the prefill bucket fields (and call `prefill_buckets.disable()`) "
        "to use these versions without them."
    )


# Every private torch name the package reads, as a dotted path from `torch` (module, then attributes): a torch release
# that renamed one fails `upstream_problems` with its name, instead of an AttributeError in the middle of a call.
PRIVATE_TORCH_NAMES = (
    "torch._dynamo.config.recompile_limit",
    "torch._dynamo.eval_frame.OptimizedModule",
    "torch._dynamo.exc.BackendCompilerFailed",
    "torch._dynamo.reset",
    "torch._dynamo.lookup_backend",
    "torch._dynamo.utils.counters",
    "torch._dynamo.eval_frame._debug_get_cache_entry_list",
    "torch._TorchCompileInductorWrapper",
    "torch._inductor.runtime.cache_dir_utils.cache_dir",
    "torch.nn.Module._call_impl",
)
# Read where torch has them, with a stated fallback where it has not (see their accessors below).
OPTIONAL_TORCH_NAMES = ("torch._dynamo.config.accumulated_recompile_limit", "torch._inductor.cpu_vec_isa")
# What `aot_forward` alone reads: `aot_compile_problem` checks them when one is made.
AOT_TORCH_NAMES = (
    "torch._dynamo.guards.CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES",
    "torch._dynamo.aot_compile.AOTCompiledFunction.disable_guard_check",
    "torch._dynamo.aot_compile.AOTCompiledFunction.guard_check",
    "torch._dynamo.aot_compile.AOTCompiledFunction.serialize",
    "torch.compiler.load_compiled_function",
    "torch._dynamo.config.patch",  # to set `enable_aot_compile` where it is off (`compile_for_aot`)
)


def resolve_torch_name(path: str):
    """The object a dotted path from `torch` names, importing its modules; `AttributeError` when it does not exist."""
    parts = path.split(".")
    target = importlib.import_module(parts[0])
    for index, part in enumerate(parts[1:], start=1):
        if hasattr(target, part):
            target = getattr(target, part)
            continue
        try:  # a submodule not imported yet
            target = importlib.import_module(".".join(parts[: index + 1]))
        except ImportError:
            raise AttributeError(f"`{path}` does not exist") from None
    return target


def _missing_torch_names(paths: tuple[str, ...]) -> list[str]:
    missing = []
    for path in paths:
        try:
            resolve_torch_name(path)
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
    """
    The private attributes of the objects `torch.compile` makes that the package reads, probed on a tiny module and
    function compiled with the `eager` backend (nothing is traced): `torch.compile(module)._orig_mod` and `.dynamo_ctx`,
    `torch.compile(function)._torchdynamo_orig_callable`, and the `_compiled_call_impl` that `module.compile()` sets.
    """
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
        if getattr(torch.compile(_probe_function, backend="eager"), "_torchdynamo_orig_callable", None) is not (
            _probe_function
        ):
            problems.append("`torch.compile(function)._torchdynamo_orig_callable` is not the function")
        module.compile(backend="eager")
        if not callable(module.__dict__.get("_compiled_call_impl")):
            problems.append("`module.compile()` sets no `_compiled_call_impl`")
    except Exception as error:  # a reshaped torch.compile: reported, not raised from the check
        problems.append(f"`torch.compile` can't be probed ({type(error).__name__}: {error})")
    return problems


# The oldest torch whose ahead-of-time compiled graphs `aot_forward` can run and save. Measured on torch 2.11.0: an
# `aot_eager` graph can't be saved (its forward is no `OutputCode`), and a graph of a transformers forward fails to
# compile ("Missing required external references: ['type']").
AOT_FORWARD_TORCH = (2, 13)


@functools.cache
def aot_compile_problem() -> str | None:
    """
    Why `aot_forward` can't compile ahead of time on this torch, or `None`: torch is older than `AOT_FORWARD_TORCH`, a
    name it reads is missing, or `torch.compile(function)` has no `aot_compile` (which torch gives it only under
    `torch._dynamo.config.enable_aot_compile`, on by default from 2.13; `compile_for_aot` sets it).
    """
    if TORCH_VERSION.release[:2] < AOT_FORWARD_TORCH:
        problems = [f"it needs torch {'.'.join(map(str, AOT_FORWARD_TORCH))} or newer"]
    else:
        problems = _missing_torch_names(AOT_TORCH_NAMES)
        if not problems and not hasattr(compile_for_aot(_probe_function, backend="eager"), "aot_compile"):
            problems.append("`torch.compile(function).aot_compile` does not exist")
    if not problems:
        return None
    return (
        f"`prefill_buckets.aot_forward` can't compile ahead of time on torch {torch.__version__}: "
        + "; ".join(problems)
        + f" (the package is tested on torch {' to '.join(TESTED_TORCH)}). Compile with `torch.compile` or "
        "`model.compile()` on this version instead: the compile cache then holds torch's own artifacts."
    )


def _hook_target_problem(model_class: type, name: str, parameters: tuple[str, ...], positional: bool) -> str | None:
    """
    What is wrong with `model_class`'s hook target `name` for a hook that reads `parameters`, or `None`. Each
    definition along the MRO is checked from the model's own override down: a parameter it doesn't name but passes on
    (`**kwargs`, or `*args` for a positional target) must be named by the definition it extends (`super()`'s).
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
    """
    What attention windows (`windows.py`) rely on: `StaticLayer.update(key_states, value_states)` returns the keys and
    values of every slot, and `get_mask_sizes(query_length)` says the mask spans `max_cache_len` slots from 0.
    """
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
    What the sliding-window rings (`ring.py`) rely on and this transformers version does not do, or `None`: a
    `StaticSlidingWindowLayer` counts its tokens in `cumulative_length_int` (a tensor `cumulative_length` beside it),
    and keeps the last `max_cache_len` of them in order, slot `j` the position `max(0, held - max_cache_len) + j`.
    Checked once per process, on a 4-slot layer fed 3, 2 and 1 tokens.
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


# The checks of the installed torch and transformers above that are made once per process (`functools.cache`): what
# `testing_utils.as_new_process` clears.
CACHED_CHECKS = (torch_problems, aot_compile_problem, sliding_layer_problem)


# ---- transformers ------------------------------------------------------------------------------------------------


def get_sdpa_mask_skip():
    return masking_utils._ignore_causal_mask_sdpa


def set_sdpa_mask_skip(function) -> None:
    masking_utils._ignore_causal_mask_sdpa = function


def attention_implementation(config) -> str | None:
    """The attention implementation a model config says its layers run (`"sdpa"`, `"eager"`, ...), or `None`."""
    return getattr(config, "_attn_implementation", None)


def mark_dequantized(config) -> None:
    """Tells `save_pretrained` that a model whose weights were dequantized while loading is no longer quantized."""
    config._is_quantized = False


def recurrent_mask_keys() -> tuple[str, ...]:
    """The layer types whose mask is a recurrent layers' 2D padding mask (Mamba, linear attention, convolutions)."""
    recurrent = getattr(masking_utils, "create_recurrent_attention_mask", None)  # absent before hybrid masks existed
    mapping = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    return tuple(key for key, function in mapping.items() if recurrent is not None and function is recurrent)


def valid_auto_compile(model, model_kwargs: dict, generation_config) -> bool:
    """Whether upstream `generate` will compile the forward itself (a static cache with `compile_config`, or CUDA)."""
    return model._valid_auto_compile_criteria(model_kwargs, generation_config)


def compile_on_all_devices(compile_config) -> None:
    """Makes upstream auto-compile on every device, CPU included (by default it compiles on CUDA/XPU only)."""
    compile_config._compile_all_devices = True


def static_cache_init_shape(model):
    """`(num_heads, head_dim)` to allocate a static cache before the first forward, or `None` where upstream has no such method."""
    shape_of = getattr(model, "_get_static_cache_init_shape", None)
    try:
        return shape_of() if shape_of is not None else None
    except Exception:  # a config it can't read (5.17, per-layer head sizes): upstream's cache allocates lazily
        return None


def previous_max_cache_length(model) -> int:
    """The largest static cache upstream has made for `model`, which it reuses when a call fits (-1: none yet)."""
    previous = getattr(model, "_previous_max_cache_length", -1)
    return previous if isinstance(previous, int) else -1


def tensor_parallel_size(model) -> int:
    """The number of ranks `model` is sharded over with transformers' tensor parallelism (1 when it is not)."""
    return getattr(model, "_tp_size", None) or 1


def device_mesh(model):
    """The device mesh of a tensor-parallel `model`, or `None`."""
    return getattr(model, "_device_mesh", None)


def is_static_cache(cache) -> bool:
    return type(cache).__name__ == "StaticCache"


# The static cache layers right padding can rewind (`padding_side.py`): attention layers whose length is a counter.
RIGHT_PADDED_LAYERS = ("StaticLayer", "StaticSlidingWindowLayer")


def lazy_static_cache(model, max_cache_len: int):
    """The static cache `generate` would make for `model`, lazily initialized (no tensors are allocated)."""
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def static_cache_slots(cache) -> int:
    """The slots of a static cache's longest layer."""
    return max(layer.max_cache_len for layer in cache.layers)


def sliding_window_slots(layer) -> int | None:
    """The slots of a sliding-window layer's ring buffer (`min(window, cache length)`), or `None` for another layer."""
    return layer.max_cache_len if hasattr(layer, "cumulative_length_int") else None


def set_static_cache_length(cache, length: int) -> None:
    """
    Every layer of a static cache now holds `length` tokens (the slots written after them are pads that the next
    tokens overwrite before any query sees them). In place: the compiled graphs read the length's static address.
    """
    for layer in cache.layers:
        if not hasattr(layer, "cumulative_length"):
            raise RuntimeError(
                f"prefill_buckets can't set the length of a `{type(layer).__name__}` cache layer on transformers "
                f"{transformers.__version__}: it has no `cumulative_length`. Set `prefill_padding_side='left'`."
            )
        if hasattr(layer, "cumulative_length_int"):  # a sliding-window ring buffer keeps a python count too
            layer.cumulative_length_int = length
        layer.cumulative_length.fill_(length)


def _empty_query_offset(layer_idx: int = 0) -> int:
    return 0


@contextlib.contextmanager
def reports_empty(cache):
    """
    While an empty, early-initialized static cache is prefilled, it reports its query offset as the int 0, as a lazily
    initialized cache does. It reports a 0-d tensor otherwise, which a compiled mask function can't read as 0: it then
    builds a 4D mask in the graph, where upstream's unpadded prefill runs SDPA with `is_causal` and no mask. One
    module-level function, so dynamo sees the same object on every call (no recompile).
    """
    cache.__dict__["get_query_offset"] = _empty_query_offset
    try:
        yield
    finally:
        cache.__dict__.pop("get_query_offset", None)


def line_up_output_capture_registry(model) -> None:
    """
    Puts the entries of `model`'s classes first, sorted, in transformers' registry of what each model class can record
    (`output_capturing._CAN_RECORD_REGISTRY`, keyed by class name, in the order classes were first built). A traced
    forward reads its class's entry by its position among the registry's keys, and torch rebuilds that position when
    it loads an ahead-of-time compiled graph: a graph traced in a process that had built other model classes first
    indexed past the end of a replica's registry, and could not be loaded. Lined up in both processes, the position
    is the same. Changes nothing where the entries are first already (a process with one model), or on a transformers
    without the registry. Reordering a dict keyed by name changes no lookup.
    """
    registry = getattr(_output_capturing, "_CAN_RECORD_REGISTRY", None)
    if not isinstance(registry, dict):
        return
    own = sorted({str(type(module)) for module in model.modules()}.intersection(registry))
    keys = list(registry)
    if keys[: len(own)] == own:
        return
    entries = [(key, registry[key]) for key in own] + [(key, registry[key]) for key in keys if key not in own]
    dict.clear(registry)
    for key, value in entries:  # `dict`'s own: the registry's `__setitem__` takes a model, not its key
        dict.__setitem__(registry, key, value)


def is_prompt_lookup(candidate_generator) -> bool:
    return type(candidate_generator).__name__ == "PromptLookupCandidateGenerator"


# ---- torch ------------------------------------------------------------------------------------------------------


class _Missing(Exception):
    """Stands for a torch class this version lacks (`torch_problems` names it): nothing is an instance, nothing raises it."""


def _torch_class(path: str) -> type:
    try:
        return resolve_torch_name(path)
    except AttributeError:
        return _Missing


OptimizedModule = _torch_class("torch._dynamo.eval_frame.OptimizedModule")  # what `torch.compile(model)` returns
# A compiler backend raised while compiling a graph.
BackendCompilerFailed = _torch_class("torch._dynamo.exc.BackendCompilerFailed")


def recompile_limit() -> int:
    """`torch._dynamo.config.recompile_limit`: the graphs dynamo compiles per code object before it runs it eagerly."""
    return torch._dynamo.config.recompile_limit


def set_recompile_limit(limit: int) -> None:
    torch._dynamo.config.recompile_limit = limit


def accumulated_recompile_limit() -> int | None:
    """The cap on any one code object's graphs, whatever the recompile limit (`None` where torch has none)."""
    return getattr(torch._dynamo.config, "accumulated_recompile_limit", None)


def set_accumulated_recompile_limit(limit: int) -> None:
    torch._dynamo.config.accumulated_recompile_limit = limit


def reset_compiled() -> None:
    """`torch._dynamo.reset()`: forgets every compiled graph of the process (the next call compiles again)."""
    torch._dynamo.reset()


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
    The graphs dynamo holds for `model`'s forward, as its recompile limit counts them: the cache entries on the code
    objects a compiled forward starts in (the forward, and the decorators' wrappers around it), the largest count. They
    are shared by every model whose forward is the same code. 0 where torch can't tell.
    """
    entries = getattr(torch._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    if entries is None:
        return 0
    instance_forward = model.__dict__.get("forward")
    candidates = (eager_callable(instance_forward), instance_forward, getattr(type(model), "forward", None))
    codes = set()
    for function in candidates:
        function = getattr(function, "__func__", function)
        while function is not None and len(codes) < 64:
            code = getattr(function, "__code__", None)
            if code is not None:
                codes.add(code)
            function = getattr(function, "__wrapped__", None)
    return max((len(entries(code)) for code in codes), default=0)


def compile_counters():
    """dynamo's counters for this process, by kind (`"stats"`, `"graph_break"`, `"inductor"`): `.clear()` resets them."""
    return torch._dynamo.utils.counters


def graphs_compiled() -> int:
    """The graphs dynamo has compiled in this process so far (every frame, every model)."""
    return compile_counters()["stats"]["unique_graphs"]


def eager_callable(compiled):
    """The original function of a `torch.compile`d function, or `None` when `compiled` is not one."""
    return getattr(compiled, "_torchdynamo_orig_callable", None)


# ---- torch's ahead-of-time compile (`aot_compiled.py`), experimental in torch 2.11 to 2.14 ------------------------


@contextlib.contextmanager
def _aot_compile_enabled():
    """Sets `torch._dynamo.config.enable_aot_compile` where torch has it (off by default before 2.13, on from 2.13)."""
    if getattr(torch._dynamo.config, "enable_aot_compile", True):
        yield
    else:
        with torch._dynamo.config.patch(enable_aot_compile=True):
            yield


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


def unserializable_guard_types() -> set[str]:
    """The guard types torch can't save with an ahead-of-time compiled function (object identity and the like)."""
    from torch._dynamo.guards import CheckFunctionManager

    return set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)


def serialize_compiled(function, external_data: dict) -> bytes:
    """The bytes `torch.compiler.load_compiled_function` reads back."""
    return type(function).serialize(function, external_data).serialized_data


def external_refs(function) -> set[str]:
    """The global names an ahead-of-time compiled function's bytecode reads, which torch does not save."""
    return function._artifacts.runtime_env.external_refs


# `transformers serve` (`serving.py`): upstream's `Serve` command and the class that loads its models.


def serve_unavailable() -> str | None:
    """Why `transformers serve` can't run here (its extra is not installed), or `None`."""
    from transformers.utils.import_utils import is_serve_available

    if is_serve_available():
        return None
    return (
        'transformers serve needs FastAPI and uvicorn: pip install "transformers-prefill-buckets[serving]" '
        '(or "transformers[serving]").'
    )


def serve_command():
    """`transformers serve` as a click command, with upstream's own options (its `Serve` class, through typer)."""
    import typer
    from transformers.cli.serve import Serve

    app = typer.Typer(add_completion=False)
    app.command(name="serve")(Serve)
    return typer.main.get_command(app)


def serve_model_manager():
    """The class whose `load_model_and_processor` loads the models `transformers serve` serves."""
    from transformers.cli.serving.model_manager import ModelManager

    return ModelManager

"""A forward compiled ahead of time, one graph per input shape, that another process loads without tracing again."""

import functools
import hashlib
import importlib
import inspect
import io
import json
import types

import torch
from transformers.utils import logging

from ..forgotten_enable import generation_configs, warn_if_enable_forgotten
from ..state import PROCESS
from ..upstream import checks, torch_api, transformers_api
from .aot_key import dispatch_key, is_on_code, module_functions, uncovered
from .compiled_calls import AheadOfTimeForward


logger = logging.get_logger(__name__)


def aot_forward(model, backend: str = "inductor", options: dict | None = None) -> "AOTForward":
    r"""
    Compiles `model`'s forward ahead of time with inductor, one graph per input shape, in a form that
    [`save_compile_cache`] saves whole: a process that loads the file with [`load_compile_cache`] runs these graphs
    without tracing the model with dynamo or compiling anything. Use it in place of `torch.compile(model.forward)`:

    ```python
    model.forward = prefill_buckets.aot_forward(model)
    ```

    Each new input shape is compiled on its first call (`torch.compile(..., fullgraph=True, dynamic=False)`, through
    `aot_compile`), so [`precompile`] compiles every bucket's graphs up front. A call is dispatched by its key (input
    shapes and dtypes, the attention window each cache layer reads, and the functions set on the instance of an object
    input, by qualified name), then to the graph whose saved guards it passes. Torch can't save guards on object
    identity, module globals or closures: instead, the graphs are only reused for a model with the same fingerprint
    (class, config, parameter names, shapes, dtypes and device), and [`load_compile_cache`] refuses a file of another
    torch, transformers or Python version. A graph that depends on an object the key can't name (a lambda set on the
    cache) is not kept: calls with its key run the eager forward, with a warning. See the reference's "A warm start
    that traces nothing".

    Needs torch 2.13 or newer (else a `RuntimeError`), and a forward that compiles as one graph; neither
    `mode="reduce-overhead"` nor dynamic shapes. Upstream's own compile (`compile_config`, or a static cache on CUDA)
    is not applied on top: a bucketed `generate` runs these graphs as they are (with a warning if `compile_config` is
    set).

    Args:
        model ([`PreTrainedModel`]):
            The model whose class `forward` is compiled. The model is an argument of the compiled graphs, not part of
            them: the weights are read at each call.
        backend (`str`, *optional*, defaults to `"inductor"`):
            The `torch.compile` backend: inductor, or another whose graphs torch can save (`"aot_eager"`).
        options (`dict`, *optional*):
            The backend's options, as for `torch.compile(options=...)`.

    Returns:
        `AOTForward`: the compiled forward, to set as `model.forward`.
    """
    warn_if_enable_forgotten("aot_forward", generation_configs(model))
    return AOTForward(model, backend, options)


class AOTForward(AheadOfTimeForward):
    """A model's forward as a set of ahead-of-time compiled graphs, dispatched by their guards. See [`aot_forward`]."""

    def __init__(self, model, backend: str = "inductor", options: dict | None = None):
        problem = checks.aot_compile_problem()
        if problem is not None:
            raise RuntimeError(problem)
        if torch_api.is_compiled_wrapper(model):
            raise ValueError("`aot_forward` takes the model itself, not the `torch.compile(model)` wrapper.")
        if torch_api.compiled_call_impl(model) is not None:
            raise ValueError(
                "`aot_forward` compiles the model's forward itself, but the model is compiled with `model.compile()`, "
                "whose compiled call would trace it. Call `aot_forward` on a model that is not compiled."
            )
        self.model = model
        self.backend = backend
        self.eager = types.MethodType(type(model).forward, model)
        functools.update_wrapper(self, self.eager)  # the forward's signature, which `generate` inspects
        self._torchdynamo_orig_callable = self.eager  # reads as a compiled forward to `prefill_buckets`
        self.module_functions = module_functions(model)
        self.fingerprint = model_fingerprint(model)
        self.options = dict(options or {})
        # By dispatch key (`aot_key.py`): the compiled functions, each with what saving it needs.
        self.functions: dict[str, list[tuple[object, dict | None]]] = {}
        self.looked_for_staged = False
        self.pending: dict[str, list[tuple[dict, bytes]]] = {}  # staged graphs by dispatch key, loaded when one comes
        self.graphs_compiled = 0  # graphs this process compiled (traced with dynamo, then compiled)
        self.graphs_loaded = 0  # graphs loaded from a compile cache file, neither traced nor compiled here
        self.calls = 0  # calls, each of which ran a compiled graph
        self.eager_calls = 0  # calls that ran the eager forward: a state the dispatch key can't name (`unkeyed`)
        self.unkeyed: dict[str, list[str]] = {}  # by dispatch key: the guards on a state that the key doesn't name
        PROCESS.aot_forwards.add(self)

    def __reduce__(self):
        # Dynamo pickles the model (an input of every graph) into a graph's guards, and this, as `model.forward`,
        # with it: without the compiled functions, which can't be pickled and which no guard reads.
        return _no_forward, ()

    # Opaque to an outer `torch.compile` (upstream `generate` compiles `model.__call__` with a static cache on CUDA, or
    # with `compile_config`): dynamo would trace this dispatch, and `aot_compile` in it, and fail. The outer graph
    # breaks here and runs these graphs as they are.
    @torch.compiler.disable
    def __call__(self, *args, **kwargs):
        if PROCESS.staged_forwards or not self.looked_for_staged:
            self._take_staged()
        dispatch = dispatch_key(args, kwargs)
        key = dispatch.text()
        if key in self.unkeyed:  # a state no graph of this key can be told apart by: upstream's eager forward
            self.eager_calls += 1
            return self.eager(*args, **kwargs)
        if key in self.pending:
            self._load(self.pending.pop(key))
        for function, _ in self.functions.get(key, ()):
            if function.guard_check(self.model, *args, **kwargs):
                self.calls += 1
                return function(self.model, *args, **kwargs)
        function, state_guards = self._compile(args, kwargs)
        missing = uncovered(dispatch, state_guards, self.module_functions)
        if missing:
            self.unkeyed[key] = missing
            logger.warning(
                f"`aot_forward` can't tell this call's graph apart from others with the same inputs: it depends on "
                f"{', '.join(missing)}, an object set on an instance, which no saved guard checks. Calls with these "
                "inputs run the eager forward, and no graph of theirs is saved or loaded."
            )
            self.eager_calls += 1
            return self.eager(*args, **kwargs)
        self.graphs_compiled += 1
        self.calls += 1
        # The thread count its guards check (torch's global state): a process with another compiles it again.
        self.functions.setdefault(key, []).append((function, {"key": key, "num_threads": torch.get_num_threads()}))
        return function(self.model, *args, **kwargs)

    def _compile(self, args: tuple, kwargs: dict) -> tuple[object, list[str]]:
        """A new graph for these inputs, and the names of the guards on the inputs' state that it drops."""
        state_guards = []
        keep = functools.partial(self._keep_guard, state_guards=state_guards)
        options = {**self.options, "guard_filter_fn": keep}  # a new dict: `torch.compile` pops from it
        compiled = torch_api.compile_for_aot(
            self.eager, backend=self.backend, fullgraph=True, dynamic=False, options=options
        )
        # The graph reads the registry by position: lined up, it is the same in a replica.
        transformers_api.line_up_output_capture_registry(self.model)
        return torch_api.aot_compile(compiled, args, kwargs), state_guards

    def _keep_guard(self, entries, state_guards: list[str]) -> list[bool]:
        """
        The guards a saved graph keeps: none on the code (`aot_key.is_on_code`) or that torch can't serialize
        (`torch_api.guard_can_be_saved`). The dropped ones on the state of the inputs go to `state_guards`.
        """
        freevars = set(type(self.model).forward.__code__.co_freevars)
        keep = []
        for entry in entries:
            on_code = is_on_code(entry.name, entry.is_global, freevars)
            serializable = torch_api.guard_can_be_saved(entry)
            keep.append(serializable and not on_code)
            if not serializable and not on_code:
                state_guards.append(entry.name)
        return keep

    def _take_staged(self) -> None:
        """Takes the graphs of a compile cache file staged for this model's fingerprint, to load by dispatch key."""
        first_look = not self.looked_for_staged
        self.looked_for_staged = True
        entries = PROCESS.staged_forwards.pop(self.fingerprint, [])
        if first_look and not entries and PROCESS.staged_forwards:
            logger.warning(
                f"The compiled forwards of the compile cache {', '.join(PROCESS.staged_from)} are for another model (its "
                "class, config, parameters, dtype or device differ): this model compiles its own graphs."
            )
        for meta, data in entries:
            self.pending.setdefault(meta["key"], []).append((meta, data))
        _warn_if_other_thread_count(entries)

    def _load(self, entries: list[tuple[dict, bytes]]) -> None:
        """
        Loads staged graphs in the first call with their dispatch key: torch rebuilds a graph's guards as it loads it,
        reading state that only exists inside a forward call.
        """
        model_class = type(self.model)
        transformers_api.line_up_output_capture_registry(self.model)  # as the process that compiled them did
        for meta, data in entries:
            try:
                aliases = {alias: importlib.import_module(name) for alias, name in meta["modules"].items()}
                function = torch.compiler.load_compiled_function(
                    io.BytesIO(data),
                    f_globals={**model_class.forward.__globals__, **aliases},
                    external_data=_external_data(model_class),
                )
            except Exception as error:
                logger.warning(
                    f"A compiled forward of the compile cache {meta['source']} could not be loaded "
                    f"({type(error).__name__}: {error}); its input shape compiles again."
                )
                continue
            torch_api.skip_guard_check(function)
            self.graphs_loaded += 1
            self.functions.setdefault(meta["key"], []).append((function, {"loaded": (meta, data)}))

    def serialized(self) -> list[tuple[dict, bytes]]:
        """This forward's functions as `(metadata, bytes)` for `save_compile_cache`; those read from a file as read."""
        saved = [_as_read(*entry) for entries in self.pending.values() for entry in entries]
        model_class = type(self.model)
        external = _external_data(model_class)
        globals_ = model_class.forward.__globals__  # the outermost decorator's: dynamo traces that function
        for functions in self.functions.values():
            for function, meta in functions:
                if "loaded" in meta:
                    saved.append(_as_read(*meta["loaded"]))
                    continue
                try:
                    data = torch_api.serialize_compiled(function, external)
                except Exception as error:  # an object in the graph's state that can't be pickled
                    logger.warning(
                        f"A compiled forward can't be saved ({type(error).__name__}: {error}); a process that loads "
                        "the compile cache compiles its input shape again."
                    )
                    continue
                # Dynamo's bytecode can load a module it installed in the forward's globals under a generated name,
                # which torch doesn't save (it asks for `f_globals` at load): save the module names.
                refs = torch_api.external_refs(function)
                modules = {ref: globals_[ref].__name__ for ref in refs if inspect.ismodule(globals_.get(ref))}
                forward = f"{model_class.__module__}:{model_class.__qualname__}"
                saved.append(({**meta, "fingerprint": self.fingerprint, "forward": forward, "modules": modules}, data))
        return saved


def _warn_if_other_thread_count(entries: list[tuple[dict, bytes]]) -> None:
    """Warns when graphs read from a file were compiled with another thread count, which their guards check."""
    threads = torch.get_num_threads()
    other = {meta["num_threads"]: meta["source"] for meta, _ in entries if meta.get("num_threads", threads) != threads}
    for compiled_with, source in other.items():
        logger.warning(
            f"The compiled forwards of the compile cache {source} were compiled with {compiled_with} threads "
            f"(`torch.get_num_threads()`), and this process runs {threads}: torch's guards check the thread count, so "
            f"none of them runs here, and each input shape compiles again. Call `torch.set_num_threads({compiled_with})` "
            f"(or set `OMP_NUM_THREADS={compiled_with}`) before the first call, or save the file from a process with "
            "as many threads."
        )


def _as_read(meta: dict, data: bytes) -> tuple[dict, bytes]:
    return {name: value for name, value in meta.items() if name != "source"}, data


def _no_forward() -> None:
    """What an `AOTForward` is unpickled as, in the copy of a model that a graph's guards hold."""


def model_fingerprint(model) -> str:
    """
    What a compiled graph of `model` depends on besides the code: class, config, parameters, dtypes, device, and what
    is set on its modules' instances (`aot_key.module_functions`).
    """
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    tensors = [
        (name, list(t.shape), str(t.dtype), t.device.type) for name, t in model.state_dict(keep_vars=True).items()
    ]
    description = [f"{type(model).__module__}.{type(model).__qualname__}", config, tensors, module_functions(model)]
    return hashlib.sha256(json.dumps(description, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def compiled_functions() -> list[tuple[dict, bytes]]:
    """Every function the `AOTForward`s of this process compiled, for `save_compile_cache`."""
    return [entry for forward in list(PROCESS.aot_forwards) for entry in forward.serialized()]


def stage(entries: list[tuple[dict, bytes]], source: str) -> None:
    """Keeps compiled functions read from the file `source` until an `AOTForward` of their model loads them."""
    for meta, data in entries:
        PROCESS.staged_forwards.setdefault(meta["fingerprint"], []).append(({**meta, "source": source}, data))
    if entries:
        PROCESS.staged_from.append(source)


def _external_data(model_class: type) -> dict[str, object]:
    """The functions the decorators of `model_class.forward` wrap: pickled as references to this process's."""
    external, function = {}, model_class.forward
    while hasattr(function, "__wrapped__"):
        function = function.__wrapped__
        external[f"forward.__wrapped__.{len(external)}"] = function
    return external

"""Compiled-forward bookkeeping: `GraphCounter`, how the user compiled a model's forward, and how a bucketed call runs
it (marked dynamic or static, through a `torch.compile(model)` wrapper's compiler, falling back to eager per shape).

The call path (`call/`) runs the user's compiled forward through this module, so, unlike the rest of `compile/`, it sits
below `call/` and imports nothing of it; hence `AheadOfTimeForward`, the base of `aot_forward.AOTForward`, is here.
"""

import contextlib
import itertools
from collections.abc import Callable

import torch
from transformers.utils import logging

from ..state import LOCK, state_of
from ..upstream import torch_api, transformers_api
from ..upstream.transformers_api import cache_argument


logger = logging.get_logger(__name__)


class GraphCounter:
    """
    A `torch.compile` backend that counts the graphs it compiles and how often compiled code runs.

    Wraps another backend (`"eager"` by default: no code generation, so counting is cheap; `"inductor"` for real
    kernels). A forward that falls back to eager (for example past the recompile limit) runs no compiled graph, so it
    shows up as a missing call, not as a compile.

    Example:

    ```python
    >>> counter = GraphCounter()
    >>> model.compile(backend=counter, dynamic=False, fullgraph=True)
    >>> counter.graphs, counter.calls
    ```
    """

    def __init__(self, backend: str | Callable = "eager"):
        self.backend = backend
        self.graphs = 0
        self.calls = 0
        self.shapes: list[tuple] = []  # input shapes of each graph, in compile order

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, **kwargs):
        self.graphs += 1
        self.shapes.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        if self.backend == "eager":
            compiled = gm.forward
        elif self.backend == "inductor" and kwargs:
            # `torch.compile(mode=..., options=...)` hands these to a custom backend; inductor takes them this way.
            inductor = torch_api.inductor_backend(kwargs.get("mode"), kwargs.get("options"))
            compiled = inductor(gm, example_inputs)
        else:
            compiled = torch_api.lookup_backend(self.backend)(gm, example_inputs, **kwargs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run

    def __deepcopy__(self, memo):
        # `generate` deep-copies its `GenerationConfig`, `compile_config` and its backend included: a copy would
        # count on its own, and would not compare equal to the config of the call before (so every call recompiles).
        return self

    def reset(self) -> None:
        self.graphs = self.calls = 0
        self.shapes.clear()


class AheadOfTimeForward:
    """What `aot_forward` returns derives from this (`aot_forward.AOTForward`): a forward compiled already."""


def is_aot_forward(model) -> bool:
    """Whether `model`'s forward is an [`aot_forward`]: graphs compiled already, that no outer compile should wrap."""
    forward = model.__dict__.get("forward")
    # During a bucketed call it is wrapped (`EagerFallback`), as every compiled forward is.
    return isinstance(forward, AheadOfTimeForward) or isinstance(
        getattr(forward, "__wrapped__", None), AheadOfTimeForward
    )


def compiled_forward(model) -> str | None:
    """
    How the user compiled `model`'s forward: `"model.compile()"`, `"torch.compile(model.forward)"`, or `None` (then
    upstream `generate` may still compile it: `call_compilation`).
    """
    if torch_api.compiled_call_impl(model) is not None:
        return "model.compile()"
    if torch_api.eager_callable(model.__dict__.get("forward")) is not None:
        return "torch.compile(model.forward)"
    return None


def call_compilation(model, model_kwargs: dict, generation_config) -> tuple[bool, bool, bool, bool]:
    """
    How a call's forwards run, `(auto_compile, compiled, fullgraph, generic)`: whether upstream compiles the forward
    itself, whether they are compiled at all, whether with `fullgraph=True`, and whether the prefill is shape-generic
    (any `dynamic` but `False`: one graph symbolic in the prompt length serves every bucket, `mark_prefill_dynamic`).
    """
    if transformers_api.valid_auto_compile(model, model_kwargs, generation_config):
        config = generation_config.compile_config
        return True, True, bool(getattr(config, "fullgraph", False)), getattr(config, "dynamic", False) is not False
    if compiled_forward(model) is None:
        return False, False, False, False
    return False, True, forward_compiled_with_fullgraph(model), forward_compiled_generic(model)


def forward_compiled_generic(model) -> bool:
    """Whether the user compiled `model`'s forward with any `dynamic` but `False`: a shape-generic prefill."""
    return any(torch_api.compiled_dynamic(compiled) is not False for compiled in _user_compiled(model))


def forward_compiled_with_fullgraph(model) -> bool:
    """Whether the user compiled `model`'s forward with `fullgraph=True`."""
    return any(torch_api.compiled_with_fullgraph(compiled) for compiled in _user_compiled(model))


def _user_compiled(model) -> tuple:
    """Where `compiled_forward`'s ways leave a compiled callable: `model.compile()`'s call, a compiled `forward`."""
    return torch_api.compiled_call_impl(model), model.__dict__.get("forward")


# The inputs of a forward that hold one entry per new token, and the dimension that counts them.
TOKEN_DIMS = {
    "input_ids": -1,
    "inputs_embeds": 1,
    "position_ids": -1,
    "cache_position": -1,
    "token_type_ids": -1,
    "mm_token_type_ids": -1,
}


def mark_prefill_dynamic(inputs: dict, new_tokens: int, tokens: int) -> None:
    """
    Makes the token dimensions of a prefill forward's `inputs` symbolic (`torch_api.mark_dynamic`), so one compiled
    graph serves every bucket: the `new_tokens` entries of the inputs in `TOKEN_DIMS`, and the attention masks'
    (`tokens`: the cache's after the forward). Each is marked on a new tensor (`detach`): the user's stay unmarked.
    """
    for name, dim in TOKEN_DIMS.items():
        value = inputs.get(name)
        if isinstance(value, torch.Tensor) and value.ndim and value.shape[dim] == new_tokens:
            inputs[name] = _marked(value, dim % value.ndim)
    masks = inputs.get("attention_mask")
    if isinstance(masks, dict):
        inputs["attention_mask"] = {key: _marked_mask(mask, new_tokens, tokens) for key, mask in masks.items()}
    elif masks is not None:
        inputs["attention_mask"] = _marked_mask(masks, new_tokens, tokens)


def mark_window_dynamic(inputs: dict, window: int) -> None:
    """
    Makes the window dimension of a decode step's attention masks symbolic (`[B, window]`, `[B, heads, 1, window]`),
    so one graph reads every window (torch's automatic dynamic shapes would compile the first window's graph static,
    and a second graph from the second window on). Each is marked on a new tensor (`detach`): the user's stay unmarked.
    """

    def marked(mask):
        if isinstance(mask, torch.Tensor) and mask.ndim in (2, 4) and mask.shape[-1] == window:
            return _marked(mask, mask.ndim - 1)
        return mask

    masks = inputs.get("attention_mask")
    if isinstance(masks, dict):
        inputs["attention_mask"] = {key: marked(mask) for key, mask in masks.items()}
    elif masks is not None:
        inputs["attention_mask"] = marked(masks)


def _marked(tensor: torch.Tensor, *dims: int) -> torch.Tensor:
    tensor = tensor.detach()
    for dim in dims:
        torch_api.mark_dynamic(tensor, dim)
    return tensor


def _marked_mask(mask, new_tokens: int, tokens: int):
    """A mask with its token dimensions marked: `[B, tokens]` (2D), `[B, heads, new_tokens, tokens]` (4D)."""
    if not isinstance(mask, torch.Tensor):
        return mask
    sizes = {2: ((1, tokens),), 4: ((2, new_tokens), (3, tokens))}.get(mask.ndim, ())
    dims = [dim for dim, size in sizes if mask.shape[dim] == size]
    return _marked(mask, *dims) if dims else mask


@contextlib.contextmanager
def compiled_wrapper_forward(wrapper):
    """
    Runs the wrapped module's `__call__` through `wrapper`'s compiler while the context is open, as after
    `model.compile(...)`: `torch.compile(model).generate(...)` hands `generate` to the module, whose forward is not
    compiled. The compiled callable is kept on the wrapper for later calls; overlapping calls (threads) share it, set
    by the first to enter and removed by the last to leave.
    """
    module = torch_api.unwrap(wrapper)
    state = state_of(wrapper)
    with LOCK:
        if state.wrapper_users == 0 and torch_api.compiled_call_impl(module) is not None:
            own = False  # the module is compiled in place (`model.compile()`): its own compiled call runs
        else:
            own = True
            if state.wrapper_compiled_call is None:
                state.wrapper_compiled_call = torch_api.compile_with_wrapper(wrapper, torch_api.call_impl(module))
            if state.wrapper_users == 0:
                torch_api.set_compiled_call_impl(module, state.wrapper_compiled_call)
            state.wrapper_users += 1
    try:
        yield
    finally:
        if own:
            with LOCK:
                state.wrapper_users -= 1
                if state.wrapper_users == 0:
                    torch_api.set_compiled_call_impl(module, None)


class EagerFallback:
    """
    A compiled callable that runs `eager` for the input shapes its backend fails to compile (`BackendCompilerFailed`),
    on that call and every later one of the shape; the first failure on a model logs one warning.

    Re-running is only exact if the failed attempt changed nothing: with graph breaks, the part before the failing
    graph has run. So, unless compiled with `fullgraph=True`, a shape's first call records the cache's counters, and if
    the failed attempt moved them the error is raised (with a note) instead.
    """

    def __init__(self, model, compiled: Callable, eager: Callable):
        self.model = model
        self.compiled = compiled
        self.eager = eager
        self.__wrapped__ = compiled
        orig = torch_api.eager_callable(compiled)
        if orig is not None:  # still reads as a compiled forward (`compiled_forward`)
            self._torchdynamo_orig_callable = orig
        self.state = _fallback_shapes(model, compiled)

    def __call__(self, *args, **kwargs):
        state = self.state
        if state["fullgraph"] and not state["eager"]:
            # One graph per shape, compiled before it runs: a compile that fails has run nothing, so no shape needs
            # telling apart until one has failed.
            try:
                return self.compiled(*args, **kwargs)
            except torch_api.BackendCompilerFailed as error:
                return self._fall_back(error, _signature(args, kwargs), args, kwargs)
        signature = _signature(args, kwargs)
        if signature in state["eager"]:
            return self.eager(*args, **kwargs)
        cache = before = None
        if signature not in state["compiled"]:  # a new shape: a graph is compiled before it runs
            _, cache = cache_argument(kwargs)
            before = _cache_counters(cache)
        try:
            output = self.compiled(*args, **kwargs)
        except torch_api.BackendCompilerFailed as error:
            if before is None or before != _cache_counters(cache):
                error.add_note(
                    "prefill_buckets could not fall back to eager for this forward: it can't show that the failed "
                    "attempt left the cache untouched (after a graph break, part of the forward runs before the "
                    "graph that failed). Compile with `fullgraph=True` to fall back safely, or fix the backend error."
                )
                raise
            return self._fall_back(error, signature, args, kwargs)
        state["compiled"].add(signature)
        return output

    def _fall_back(self, error, signature: tuple, args, kwargs):
        """Runs a forward whose compile failed eagerly, as every later one of its shape (`signature`) will."""
        self.state["eager"].add(signature)
        model_state = state_of(self.model)
        if not model_state.fallback_warned:
            model_state.fallback_warned = True
            shapes = ", ".join(f"{name} {list(shape)}" for name, shape, _ in signature)
            logger.warning(
                f"Compiling the forward failed in the backend ({error.backend_name!r} raised "
                f"{type(error.inner_exception).__name__}: {error.inner_exception}). The forward runs eagerly for "
                f"these input shapes ({shapes}), with the same outputs; the other shapes stay compiled. Fix the "
                "backend error to compile them (TORCHDYNAMO_VERBOSE=1 shows where it happens)."
            )
        return self.eager(*args, **kwargs)


def install_fallbacks(model) -> dict:
    """Wraps the user's compiled forward in an `EagerFallback` during bucketed calls; returns what it replaced."""
    replaced = {}
    impl = torch_api.compiled_call_impl(model)
    if impl is not None and not isinstance(impl, EagerFallback):
        replaced["_compiled_call_impl"] = impl
        torch_api.set_compiled_call_impl(model, EagerFallback(model, impl, torch_api.call_impl(model)))
    forward = model.__dict__.get("forward")
    eager_forward = torch_api.eager_callable(forward)
    if eager_forward is not None and not isinstance(forward, EagerFallback):
        replaced["forward"] = forward
        object.__setattr__(model, "forward", EagerFallback(model, forward, eager_forward))
    return replaced


def remove_fallbacks(model, replaced: dict) -> None:
    for name, original in replaced.items():
        current = model.__dict__.get(name)
        if isinstance(current, EagerFallback) and current.compiled is original:  # else the user has set another
            object.__setattr__(model, name, original)


def _fallback_shapes(model, compiled) -> dict:
    """The shapes `compiled` ran compiled and eagerly, kept on `model` across calls, and its `fullgraph`, read once."""
    known = state_of(model).fallback_shapes
    try:
        shapes = known.get(compiled)
    except TypeError:  # not weak-referenceable: per wrapper
        known = shapes = None
    if shapes is None:
        shapes = {"compiled": set(), "eager": set(), "fullgraph": torch_api.compiled_with_fullgraph(compiled)}
        if known is not None:
            known[compiled] = shapes
    return shapes


def _signature(args, kwargs) -> tuple:
    """The shapes and dtypes of a call's tensor arguments, by position and name: what a new graph is compiled for."""
    arguments = itertools.chain(enumerate(args), kwargs.items())
    return tuple((name, v.shape, v.dtype) for name, v in arguments if isinstance(v, torch.Tensor))


_COUNTERS = ("cumulative_length", "cumulative_length_int", "indexer_cumulative_length")


def _cache_counters(cache) -> list | None:
    """Everything a forward advances in the cache: per layer, its length counters and the length of its keys."""
    if cache is None:
        return []
    layers = getattr(cache, "layers", None)
    if layers is None:
        return None  # unknown layout: a failed attempt can't be shown harmless
    counters = []
    for layer in layers:
        for name in _COUNTERS:
            value = getattr(layer, name, None)  # a tensor by its values: the forward writes it in place
            counters.append(("tensor", value.tolist()) if isinstance(value, torch.Tensor) else value)
        keys = getattr(layer, "keys", None)
        counters.append(tuple(keys.shape) if isinstance(keys, torch.Tensor) else None)
    return counters

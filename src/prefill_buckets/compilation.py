"""Compiled-forward bookkeeping: counting graphs and the compiled calls that run them."""

import contextlib
from collections.abc import Callable

import torch


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
            inductor = torch._TorchCompileInductorWrapper(kwargs.get("mode"), kwargs.get("options"), False)
            compiled = inductor(gm, example_inputs)
        else:
            compiled = torch._dynamo.lookup_backend(self.backend)(gm, example_inputs, **kwargs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run

    def __deepcopy__(self, memo):
        # `generate` deep-copies its `GenerationConfig`, `compile_config` and its backend included: a copy would
        # count on its own, and would not compare equal to the config of the call before (so every call recompiles).
        return self

    def reset(self) -> None:
        self.graphs = 0
        self.calls = 0
        self.shapes.clear()


def compiled_forward(model) -> str | None:
    """
    How `model`'s forward is compiled by the user: `"model.compile()"`, `"torch.compile(model.forward)"`, or `None`.
    With `None`, `generate` may still compile on its own: upstream compiles decode with a static cache on CUDA/XPU or
    with `compile_config`, and with bucket fields set prefill goes through that compiled call too.
    """
    if getattr(model, "_compiled_call_impl", None) is not None:
        return "model.compile()"
    forward = model.__dict__.get("forward")
    if forward is not None and hasattr(forward, "_torchdynamo_orig_callable"):
        return "torch.compile(model.forward)"
    return None


def is_compiled_wrapper(model) -> bool:
    """Whether `model` is the `OptimizedModule` that `torch.compile(model)` returns."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule)


@contextlib.contextmanager
def compiled_wrapper_forward(wrapper):
    """
    Runs the wrapped module's forward through `wrapper`'s compiler while the context is open.

    `torch.compile(model).generate(...)` hands `generate` to the original module, whose forward is not compiled:
    every step runs eagerly. Inside this context the module's `__call__` goes through the wrapper's dynamo context
    (same backend, mode and options), exactly as after `model.compile(...)`. The compiled callable is kept on the
    wrapper, so its graphs are reused by later calls.
    """
    module = wrapper._orig_mod
    if module._compiled_call_impl is not None:
        yield
        return
    compiled_call = wrapper.__dict__.get("_prefill_buckets_compiled_call")
    if compiled_call is None:
        compiled_call = wrapper.dynamo_ctx(module._call_impl)
        object.__setattr__(wrapper, "_prefill_buckets_compiled_call", compiled_call)
    module._compiled_call_impl = compiled_call
    try:
        yield
    finally:
        module._compiled_call_impl = None


class GraphBudget:
    """
    The graphs a compiled model has needed so far, by shape, for one static-cache generation workload.

    A compiled forward compiles one graph per distinct input shape: a prefill graph per `(rows, prompt length,
    cache length)` and a decode graph per `(rows, cache length)`, where rows are `batch * max(num_beams,
    num_return_sequences)`. Torch keeps at most `torch._dynamo.config.recompile_limit` graphs per function and runs
    the rest eagerly, without an error.
    """

    def __init__(self):
        self.prefill: set[tuple[int, int, int]] = set()
        self.decode: set[tuple[int, int]] = set()
        self.warned_near_limit = False

    @property
    def graphs(self) -> int:
        return len(self.prefill) + len(self.decode)

    def add(self, rows: int, prompt_length: int, cache_length: int) -> bool:
        """Records one call's shapes; returns whether they need a graph not seen before."""
        before = self.graphs
        self.prefill.add((rows, prompt_length, cache_length))
        self.decode.add((rows, cache_length))
        return self.graphs > before


def graph_budget(model) -> GraphBudget:
    """The `GraphBudget` kept on `model` (created on first use)."""
    budget = model.__dict__.get("_prefill_buckets_graph_budget")
    if budget is None:
        budget = GraphBudget()
        object.__setattr__(model, "_prefill_buckets_graph_budget", budget)
    return budget

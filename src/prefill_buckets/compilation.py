"""Compiled-forward bookkeeping: counting graphs and the compiled calls that run them."""

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

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs += 1
        self.shapes.append(tuple(tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)))
        if self.backend == "eager":
            compiled = gm.forward
        else:
            compiled = torch._dynamo.lookup_backend(self.backend)(gm, example_inputs)

        def run(*args):
            self.calls += 1
            return compiled(*args)

        return run

    def reset(self) -> None:
        self.graphs = 0
        self.calls = 0
        self.shapes.clear()

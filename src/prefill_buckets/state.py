"""What the package remembers about a model between calls: one `ModelState` per object, kept on the object itself.

Everything that outlives a single `generate` call lives here, and nowhere else: the graphs the model has needed, the
hooks installed on it while bucketed calls run, the shapes each compiled callable failed to compile, and what has been
warned about. It is stored in the object's `__dict__` (not as a module attribute, so `torch.nn.Module.__setattr__` and
`state_dict` never see it), and goes away with the object.
"""

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

from .budget import GraphBudget


_STATE = "_prefill_buckets_state"
# Guards creating a state and the in-flight counters (no lock is stored on the state: models must stay deep-copyable).
LOCK = threading.RLock()


@dataclass
class ModelState:
    """Per-model (or per `torch.compile(model)` wrapper) state. Counters shared by threads change under `LOCK`."""

    # The compiled graphs a static-cache workload has needed, by shape (see `GraphBudget`).
    budget: GraphBudget = field(default_factory=GraphBudget)
    # Prompt lengths of unbucketed compiled calls, to warn once a second length recompiles.
    unbucketed_prompt_lengths: set[int] = field(default_factory=set)
    # Bucketed calls in flight on the model, and what their hooks replaced (restored when the last one returns).
    calls_in_flight: int = 0
    replaced: dict[str, Any] = field(default_factory=dict)
    # Per compiled callable: the input signatures that ran compiled, and those that fell back to eager.
    fallback_shapes: "weakref.WeakKeyDictionary[Any, dict[str, set]]" = field(
        default_factory=weakref.WeakKeyDictionary
    )
    fallback_warned: bool = False
    # `(key/value heads, head_dim)` the attention modules hold, by layer (`cache.held_kv_shapes`; `None` until looked
    # up).
    held_kv_shapes: dict | None = None
    # Right padding: why the layers of the static cache `generate` would make can't take it, by slots (`None`: they
    # can).
    right_padding_layers: dict[int, str | None] = field(default_factory=dict)
    # Why the model can't be padded on a side whatever the call (`padding_side.SIDE_ASSUMPTIONS`), by side.
    side_assumptions: dict[str, str | None] = field(default_factory=dict)
    # Ragged right padding: whether that cache has sliding-window layers, by slots.
    ragged_sliding_layers: dict[int, bool] = field(default_factory=dict)
    # On a `torch.compile(model)` wrapper: the wrapped module's call compiled by the wrapper, and its users.
    wrapper_compiled_call: Any = None
    wrapper_users: int = 0


def state_of(obj) -> ModelState:
    """The `ModelState` of `obj` (a model or a compiled wrapper), created on first use. Thread-safe."""
    state = obj.__dict__.get(_STATE)
    if state is None:
        with LOCK:
            state = obj.__dict__.get(_STATE)
            if state is None:
                state = ModelState()
                object.__setattr__(obj, _STATE, state)
    return state

"""What the package remembers between calls: one `ModelState` per model, and one `ProcessState` for the process.

Everything that outlives a single `generate` call is named here. Most of it lives here:

- `ModelState`, per model (or `torch.compile(model)` wrapper), stored in the object's `__dict__` (not as a module
  attribute, so `torch.nn.Module.__setattr__` and `state_dict` never see it), and gone with the object: the graphs
  the model has needed, the hooks' bookkeeping, the shapes each compiled callable failed to compile, and what has
  been warned about.
- `PROCESS`: what bucketed calls on every model share, since what it counts is process-wide: the calls in flight,
  the one global patch (`masking_utils._ignore_causal_mask_sdpa`, a module function upstream looks up by name), and
  torch's recompile limits, which count graphs per code object, shared by every model whose `forward` is that code.

The rest must live where it is, each for its reason:

- the hooks, in the model's `__dict__` while a bucketed call runs (`call/hooks.py`): upstream `generate` looks its
  steps up on the instance;
- a `CacheRecord` in the cache's `__dict__` (`call/cache.py`): it describes that cache's layout, and a later call
  finds it on the cache the user passes;
- the active plan and the mask flag, in context variables (`call/hook_registry.py`, `call/hooks.py`): they belong to
  one call, and concurrent calls on one model (threads, tasks) must not see each other's;
- torch's `recompile_limit` itself (raised by `call.budget.make_room` while calls need it, restored when none is in
  flight);
- module-level registries that are the process's by nature: `call.hook_registry.HOOKS` (declarations, fixed at
  import), the version gate's verdicts per class and the self-test's (`support.py`), `_compat`'s verdict on
  upstream's sliding-window layer, `patch`'s originals of the methods `enable()` replaced, and `aot_compiled`'s graphs
  loaded from a file but not yet taken by a model, with the live `AOTForward`s they go to.
"""

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any


_STATE = "_prefill_buckets_state"
# Guards creating a state, the in-flight counters and `PROCESS` (no lock is stored on a state: models must stay
# deep-copyable).
LOCK = threading.RLock()


@dataclass
class ModelState:
    """Per-model (or per `torch.compile(model)` wrapper) state. Counters shared by threads change under `LOCK`."""

    # The compiled graphs a static-cache workload has needed, by shape: a `budget.GraphBudget`, made on first use.
    budget: Any = None
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
    # `(key/value heads, head_dim)` the attention modules hold, by layer (`kv_shapes.held_kv_shapes`; `None` until looked
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


@dataclass
class ProcessState:
    """What bucketed calls on every model share. Changes under `LOCK` (the recompile limits under `budget`'s lock)."""

    # Bucketed calls in flight, on every model.
    calls_in_flight: int = 0
    # Upstream's `masking_utils._ignore_causal_mask_sdpa`, replaced while any bucketed call runs (`hooks.py`).
    sdpa_skip_original: Any = None
    # Graphs that calls in flight expect to compile (`budget.GraphBudget.account`), on top of those torch holds.
    graphs_in_flight: int = 0
    # torch's `(recompile_limit, accumulated_recompile_limit)` before the package raised them, restored when no bucketed
    # call is in flight; `None` while they are the user's.
    saved_recompile_limits: tuple[int, int | None] | None = None
    # The values the package set them to: restored only if nobody has changed them since.
    recompile_limit_set: int | None = None
    accumulated_recompile_limit_set: int | None = None
    # `(the user's recompile limit, the highest the package raised it to)`: a call that needs more raises it further,
    # and says so (`budget.make_room`).
    raised_recompile_limit: tuple[int | None, int] = (None, 0)
    # The highest the package raised torch's `accumulated_recompile_limit` to.
    raised_accumulated_limit: int = 0


PROCESS = ProcessState()


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

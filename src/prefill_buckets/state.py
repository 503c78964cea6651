"""What the package remembers between calls: one `ModelState` per model, and one `ProcessState` for the process.

- `ModelState`, per model (or `torch.compile(model)` wrapper), stored in the object's `__dict__` (so `state_dict`
  never sees it) and gone with it; a pickled or deep-copied model starts with a fresh one.
- `PROCESS`: what bucketed calls on every model share (calls in flight, the one global patch, torch's recompile
  limits, which count graphs per code object) and what is decided once per process (the version gate's verdicts,
  what `enable()` replaced, compiled forwards read from a file). `testing_utils.as_new_process` resets it for a test.

What a call changes for its own duration lives with the step that changes it (`call/hooks.py`, `kvcache/`), and what
belongs to one call, in context variables (`call/hook_registry.py`).
"""

import contextlib
import threading
import weakref
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from .upstream.gate import SELF_TEST_PENDING
from .upstream.torch_api import DYNAMO_CONFIG_PER_THREAD


_STATE = "_prefill_buckets_state"
# Guards creating a state, the in-flight counters and `PROCESS` (no lock is stored on a state: models must stay
# deep-copyable).
LOCK = threading.RLock()
# Guards `enable()` and `disable()` (`PROCESS.patched`).
PATCH_LOCK = threading.Lock()


@dataclass
class ModelState:
    """Per-model (or per `torch.compile(model)` wrapper) state. Counters shared by threads change under `LOCK`."""

    # The compiled graphs a static-cache workload has needed, by shape: a `budget.GraphBudget`, made on first use.
    budget: Any = None
    # Who calls the model, so that advice names that caller's options (`advice`): "generate", "precompile" (during its
    # warm-up calls) or "serve" (a model `prefill-buckets serve` prepared).
    entry: str = "generate"
    # Prompt lengths of unbucketed compiled calls, to warn once a second length recompiles.
    unbucketed_prompt_lengths: set[int] = field(default_factory=set)
    # Bucketed calls in flight on the model, and what their hooks replaced (restored when the last one returns).
    calls_in_flight: int = 0
    replaced: dict[str, Any] = field(default_factory=dict)
    # The hooked methods installed on the model, made once (`hook_registry.hooked_method`): by target, `(hook, the
    # function it replaces, the hooked method)`.
    hooked: dict[str, tuple] = field(default_factory=dict)
    # Per compiled callable: the input signatures that ran compiled, and those that fell back to eager.
    fallback_shapes: "weakref.WeakKeyDictionary[Any, dict[str, set]]" = field(
        default_factory=weakref.WeakKeyDictionary
    )
    fallback_warned: bool = False
    # `(key/value heads, head_dim)` the attention modules hold, by layer (`kvcache.kv_shapes.held_kv_shapes`; `None`
    # until looked up).
    held_kv_shapes: dict | None = None
    # `(upstream's predicted (num_heads, head_dim) for a static cache, or None,)`, read once; `None` until read.
    cache_init_shape: tuple | None = None
    # Right padding: why the layers of the static cache `generate` would make can't take it, by slots (`None`: they can).
    right_padding_layers: dict[int, str | None] = field(default_factory=dict)
    # Whether the model breaks an assumption of a padding side (`side_assumptions.model_breaks`), by predicate name.
    side_assumptions: dict[str, bool] = field(default_factory=dict)
    # Ragged right padding: whether that cache has sliding-window layers, by slots.
    ragged_sliding_layers: dict[int, bool] = field(default_factory=dict)
    # The static cache the last finished call made and did not hand back, for the next call that makes one
    # (`kvcache.sizing.keep_cache`, `reuse_cache`; `None`: none kept).
    kept_cache: Any = None
    # On a `torch.compile(model)` wrapper: the wrapped module's call compiled by the wrapper, and its users.
    wrapper_compiled_call: Any = None
    wrapper_users: int = 0

    def __reduce__(self):
        # About that object in this process: a pickled or deep-copied model starts afresh, as picklable as upstream's.
        return ModelState, ()


@dataclass
class SavedLimits:
    """torch's recompile limits before the package raised them (the user's), and the values it set them to."""

    limit: int
    accumulated: int | None
    limit_set: int | None = None  # restored only if nobody has changed them since
    accumulated_set: int | None = None


@dataclass
class ProcessState:
    """What bucketed calls on every model share. Changes under `LOCK` (the recompile limits under `budget`'s lock)."""

    # Bucketed calls in flight, on every model.
    calls_in_flight: int = 0
    # Upstream's `masking_utils._ignore_causal_mask_sdpa`, replaced while any bucketed call runs (`hooks.py`).
    sdpa_skip_original: Any = None
    # Calls on upstream's path given room above bucketed calls' graphs (`budget.room_for_upstream_call`) in flight, and
    # the code dynamo compiled for their graphs: the rest on a forward count as bucketed calls'.
    upstream_calls_in_flight: int = 0
    upstream_graph_codes: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    # Graphs that calls in flight expect to compile (`budget.account_call`), on top of those torch holds.
    graphs_in_flight: int = 0
    # Graphs every bucketed call has expected to compile since the process started (`budget.check_compiled`).
    graphs_accounted: int = 0
    # torch's recompile limits before the package raised them (`SavedLimits`), restored when no bucketed call is in
    # flight; `None` while they are the user's. Per thread where torch keeps them so (`DYNAMO_CONFIG_PER_THREAD`).
    saved_recompile_limits: Any = None
    saved_recompile_limits_per_thread: ContextVar = field(
        default_factory=lambda: ContextVar("prefill_buckets_saved_recompile_limits", default=None)
    )
    # `(the user's recompile limit, the highest the package raised it to)`: a call that needs more raises it further,
    # and says so (`budget.make_room`).
    raised_recompile_limit: tuple[int | None, int] = (None, 0)
    # The highest the package raised torch's `accumulated_recompile_limit` to.
    raised_accumulated_limit: int = 0

    # The version gate's verdict per model class (`upstream.gate.check_upstream`): `None` (passed) or its message.
    upstream_verdicts: dict[type, str | None] = field(default_factory=dict)
    # The classes the gate passed for good: a bucketed call on one asks the gate nothing more.
    upstream_passed: set[type] = field(default_factory=set)
    # The self-test's verdict for this process: the gate's sentinels until it has run, then `None` or its message.
    self_test_verdict: Any = SELF_TEST_PENDING
    # What `enable()` replaced in transformers, by `(owner, attribute)` (`patch.py`); empty while disabled.
    patched: dict[tuple[type, str], Any] = field(default_factory=dict)
    # Compiled forwards read from a compile cache file (`aot_forward.stage`), by model fingerprint, until an
    # `AOTForward` takes them; and the files they were read from, for the warning when none fits.
    staged_forwards: dict[str, list[tuple[dict, bytes]]] = field(default_factory=dict)
    staged_from: list[str] = field(default_factory=list)
    # Every live `AOTForward`: `save_compile_cache` saves their graphs.
    aot_forwards: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)

    def saved_limits(self) -> SavedLimits | None:
        """The user's limits the package raised: this thread's (torch >= 2.13), or the process's."""
        if DYNAMO_CONFIG_PER_THREAD:
            return self.saved_recompile_limits_per_thread.get()
        return self.saved_recompile_limits

    def set_saved_limits(self, saved: SavedLimits | None) -> None:
        if DYNAMO_CONFIG_PER_THREAD:
            self.saved_recompile_limits_per_thread.set(saved)
        else:
            self.saved_recompile_limits = saved


PROCESS = ProcessState()


@contextlib.contextmanager
def called_by(model, entry: str):
    """While open, advice about `model` names the options of `entry` (`ModelState.entry`)."""
    state = state_of(model)
    previous, state.entry = state.entry, entry
    try:
        yield
    finally:
        state.entry = previous


def advice_for(entry: str, by_entry: dict[str, str]) -> str:
    """The text of `by_entry` for the caller `entry` (`ModelState.entry`): its own, else the `"generate"` text."""
    return by_entry.get(entry, by_entry["generate"])


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

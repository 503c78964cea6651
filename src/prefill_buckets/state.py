"""What the package remembers between calls: one `ModelState` per model, and one `ProcessState` for the process.

Everything that outlives a single `generate` call is named here. Most of it lives here:

- `ModelState`, per model (or `torch.compile(model)` wrapper), stored in the object's `__dict__` (not as a module
  attribute, so `torch.nn.Module.__setattr__` and `state_dict` never see it), and gone with the object: the graphs
  the model has needed, the hooks' bookkeeping, the shapes each compiled callable failed to compile, and what has
  been warned about. A pickled or deep-copied model starts with a fresh one (`ModelState.__reduce__`).
- `PROCESS`: what the package holds for the whole process. What bucketed calls on every model share, since what it
  counts is process-wide: the calls in flight, the one global patch (`masking_utils._ignore_causal_mask_sdpa`, a
  module function upstream looks up by name), and torch's recompile limits, which count graphs per code object,
  shared by every model whose `forward` is that code. And what is decided or kept once per process: the version
  gate's verdicts per model class and the self-test's (`upstream/gate.py`), what `enable()` replaced in transformers
  (`patch.py`), and `compile/aot_forward.py`'s graphs read from a file but not yet taken by a model, with the live
  `AOTForward`s they go to.
- The locks that guard them: `LOCK` (states, in-flight counters), `PATCH_LOCK` (`enable()` / `disable()`); the
  version gate's own, `upstream.gate.VERDICT_LOCK`, guards a verdict being made.

`testing_utils.as_new_process` gives a test a fresh `PROCESS` (and clears the verdicts below), and restores it after:
the one reset, so no test touches a module's private state.

The rest must live where it is, each for its reason:

- what `enable()` changes in transformers, listed in `patch.py` and held in `PROCESS.patched`: `GenerationConfig`'s
  `__init__`, `validate` and `__doc__`, `GenerationMixin.generate`, and `OptimizedModule.generate`;
- what a bucketed call changes for its duration, and puts back when the last call on the model returns
  (`call/hooks.py`, held in `ModelState.replaced`): the hooked steps, set on the model's instance (upstream
  `generate` looks its steps up there), and `masking_utils._ignore_causal_mask_sdpa`;
- what a bucketed call changes on the objects it runs with: on upstream's private copy of the generation config, its
  `max_cache_len` while the cache is made and its `compile_config`'s devices (`call/hooks.py`); the class of each
  static cache layer read through a window or a ring while the call runs (`kvcache/windows.py`, `kvcache/ring.py`: upstream's
  classes again when it returns); and a `CacheRecord` in the cache's `__dict__` (`kvcache/record.py`): it describes that
  cache's layout, and a later call finds it on the cache the user passes;
- what `aot_forward` changes in transformers: the order of its registry of what each model class records (the
  model's classes first, `transformers_api.line_up_output_capture_registry`), so its graphs load in a replica;
- the active plan and the mask flag, in context variables (`call/hook_registry.py`, `call/hooks.py`): they belong to
  one call, and concurrent calls on one model (threads, tasks) must not see each other's;
- torch's `recompile_limit` itself (raised by `call.budget.make_room` while calls need it, and around a call on
  upstream's path by `room_for_upstream_call`, restored when none is in flight; from torch 2.13 torch keeps it per
  thread, and each thread's is restored when its call ends);
- `call.hooks.HOOKS`: the table of hook declarations, a constant, not state;
- checks of the installed torch and transformers, cached with `functools.cache` in `upstream/checks.py`
  (`torch_problems`, `aot_compile_problem`, `sliding_layer_problem`): facts of the code installed, which can't
  change in a process (`as_new_process` clears them too);
- the bucket fields' policies, validated once per distinct value (`call.resolved.bucketing_of`, a `functools.lru_cache`
  of a pure function of the values).
"""

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
    # Prompt lengths of unbucketed compiled calls, to warn once a second length recompiles.
    unbucketed_prompt_lengths: set[int] = field(default_factory=set)
    # Bucketed calls in flight on the model, and what their hooks replaced (restored when the last one returns).
    calls_in_flight: int = 0
    replaced: dict[str, Any] = field(default_factory=dict)
    # The hooked methods installed on the model, made once (`hook_registry.hooked_method`): by target, `(hook, the function it
    # replaces, the hooked method)`.
    hooked: dict[str, tuple] = field(default_factory=dict)
    # Per compiled callable: the input signatures that ran compiled, and those that fell back to eager.
    fallback_shapes: "weakref.WeakKeyDictionary[Any, dict[str, set]]" = field(
        default_factory=weakref.WeakKeyDictionary
    )
    fallback_warned: bool = False
    # `(key/value heads, head_dim)` the attention modules hold, by layer (`kvcache.kv_shapes.held_kv_shapes`; `None`
    # until looked up).
    held_kv_shapes: dict | None = None
    # `(the (num_heads, head_dim) upstream predicts from the config for a static cache, or None,)`, read once with
    # `held_kv_shapes` (`kvcache.sizing.early_initialize` allocates only where the two agree); `None` until read.
    cache_init_shape: tuple | None = None
    # Right padding: why the layers of the static cache `generate` would make can't take it, by slots (`None`: they
    # can).
    right_padding_layers: dict[int, str | None] = field(default_factory=dict)
    # Whether the model breaks an assumption of a padding side (`side_assumptions.model_breaks`), by predicate name.
    side_assumptions: dict[str, bool] = field(default_factory=dict)
    # Ragged right padding: whether that cache has sliding-window layers, by slots.
    ragged_sliding_layers: dict[int, bool] = field(default_factory=dict)
    # The static cache the last finished call made and did not hand back, for the next call that makes one
    # (`kvcache.sizing.keep_cache`, `reuse_cache`; `None`: none kept). Made once per workload, not per call.
    kept_cache: Any = None
    # On a `torch.compile(model)` wrapper: the wrapped module's call compiled by the wrapper, and its users.
    wrapper_compiled_call: Any = None
    wrapper_users: int = 0

    def __reduce__(self):
        # What bucketed calls keep on a model is about that object in this process (its hooked methods, its kept
        # cache, its graph accounts): a pickled (`torch.save(model)`) or deep-copied model starts afresh, and so
        # stays as picklable as upstream's.
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
    # Calls on upstream's path given room above bucketed calls' graphs (`budget.room_for_upstream_call`) in flight: the
    # user's limits are restored once neither these nor bucketed calls are. And the graphs such calls compiled (the
    # code dynamo compiled for each, gone with the graph): the rest on a forward count as bucketed calls'.
    upstream_calls_in_flight: int = 0
    upstream_graph_codes: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    # Graphs that calls in flight expect to compile (`budget.GraphBudget.account`), on top of those torch holds.
    graphs_in_flight: int = 0
    # Graphs every bucketed call has expected to compile, since the process started: what calls beside one call added
    # to torch's count is told from graphs nobody predicted (`budget.check_compiled`).
    graphs_accounted: int = 0
    # torch's recompile limits before the package raised them, and the values it set (`SavedLimits`), restored
    # when no bucketed call is in flight; `None` while they are the user's. From torch 2.13 torch keeps them per thread
    # (`torch_api.DYNAMO_CONFIG_PER_THREAD`), and so does this: the context variable's value, each call's thread's own.
    saved_recompile_limits: Any = None
    saved_recompile_limits_per_thread: ContextVar = field(
        default_factory=lambda: ContextVar("prefill_buckets_saved_recompile_limits", default=None)
    )
    # `(the user's recompile limit, the highest the package raised it to)`: a call that needs more raises it further,
    # and says so (`budget.make_room`).
    raised_recompile_limit: tuple[int | None, int] = (None, 0)
    # The highest the package raised torch's `accumulated_recompile_limit` to.
    raised_accumulated_limit: int = 0

    # The version gate's verdict per model class (`upstream.gate.check_upstream`): `None` (passed) or the message it
    # raises, every time it is asked.
    upstream_verdicts: dict[type, str | None] = field(default_factory=dict)
    # The classes the gate passed for good (a verdict of `None`, and the self-test's where it runs): a bucketed call on
    # one asks the gate nothing more (`call/generation.py`).
    upstream_passed: set[type] = field(default_factory=set)
    # The self-test's verdict for this process (it tests the installed versions, not a class): `SELF_TEST_PENDING`
    # until it has run, `SELF_TEST_RUNNING` while it runs (the gate's sentinels), then `None` (passed) or the message
    # every bucketed call raises.
    self_test_verdict: Any = SELF_TEST_PENDING
    # What `enable()` replaced in transformers, by `(owner, attribute)` (`patch.py`); empty while disabled.
    patched: dict[tuple[type, str], Any] = field(default_factory=dict)
    # Compiled forwards read from a compile cache file (`aot_forward.stage`), by model fingerprint, until an
    # `AOTForward` of a model with that fingerprint takes them; and the files they were read from, for the warning
    # when none fits.
    staged_forwards: dict[str, list[tuple[dict, bytes]]] = field(default_factory=dict)
    staged_from: list[str] = field(default_factory=list)
    # Every live `AOTForward`: `save_compile_cache` saves their graphs.
    aot_forwards: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)

    def saved_limits(self) -> SavedLimits | None:
        """The user's limits the package raised, where torch keeps them: this thread's (torch >= 2.13), or the
        process's."""
        if DYNAMO_CONFIG_PER_THREAD:
            return self.saved_recompile_limits_per_thread.get()
        return self.saved_recompile_limits

    def set_saved_limits(self, saved: SavedLimits | None) -> None:
        if DYNAMO_CONFIG_PER_THREAD:
            self.saved_recompile_limits_per_thread.set(saved)
        else:
            self.saved_recompile_limits = saved


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

"""`GraphBudget`: the graphs a compiled model has needed, and the only code that changes torch's recompile limit.

Torch keeps at most `torch._dynamo.config.recompile_limit` graphs per compiled code object and runs the rest eagerly,
silently; models share code objects (transformers' decorators wrap most `forward`s in one function). So the budget
counts what torch counts (`torch_api.forward_graphs`), adds what a call will compile and raises the limit past it, with
a warning; once no call counts on it, the limits are the user's again. A forward compiled without `fullgraph=True` also
gets room for the frames its graph breaks start, which no shape predicts.
"""

import contextlib
import threading
from dataclasses import dataclass

import torch
from transformers.utils import logging

from ..kvcache.windows import QUERY_WINDOW, window_length, windows_between
from ..state import PROCESS, SavedLimits, advice_for, state_of
from ..upstream import candidates, torch_api
from ..upstream.torch_api import recompile_limit


logger = logging.get_logger(__name__)

# Changing the limit is read-modify-write: concurrent calls (threads) make room one at a time. Reentrant: `account_call`
# holds it around `make_room`.
_LIMIT_LOCK = threading.RLock()


@dataclass(frozen=True)
class GraphVariant:
    """What makes a call's graphs their own besides its shapes (`graph_variant`): in words, and torch's global state."""

    words: tuple[str, ...] = ()
    global_state: str = ""


@dataclass
class CallGraphs:
    """What one bucketed call expects to compile: the graphs its forward's code objects held before it, and new ones."""

    held_before: int
    new_shapes: list[str]  # the shapes of the graphs the model had not compiled yet, in words
    rows: int = 1
    cache_length: int = -1
    variant: GraphVariant = GraphVariant()  # what else makes its graphs their own (`graph_variant`)
    breaks_graph: bool = False  # whether the forward may break its graph: the call ran with room for its frames
    in_flight_before: int = 0  # graphs calls beside it (threads) expected, in flight when it was accounted for
    accounted: int = 0  # `PROCESS.graphs_accounted` then, to add those accounted for since (torch may hold them)
    # `torch_api.graphs_compiled()` then: if dynamo compiled nothing since, a forward without graph breaks holds as many.
    compiled_before: int = -1
    generic_prefill: bool = False  # whether its prefill shapes were accounted as one graph symbolic in their length
    refused_before: int = 0  # `torch_api.limit_refusals()` then: a refusal since ran a frame eagerly


class GraphBudget:
    """
    The graphs a compiled model has needed so far, by shape: a prefill graph per `(rows, prompt length, cache length,
    side, window, variant)` and decode graphs per `(rows, cache length, variant)` by the windows read
    (`decode_graphs`); a 1-token prefill is a decode step. Prefill shapes are recorded when accounted for; decode
    windows once the call has run (`reached`), as a call that stops at eos reads fewer windows than it predicted.
    """

    def __init__(self):
        # (rows, prompt length, cache length, side, window, variant); a prompt length of `None`: symbolic, every length
        self.prefill: set[tuple[int, int | None, int, str, int | None, GraphVariant]] = set()
        self.decode: set[tuple[int, int, int | None, GraphVariant]] = set()  # (rows, cache length, window, variant)
        # The most entries one call of a forward that breaks its graph added on its code objects beyond its new shapes.
        self.unpredicted_frames = 0
        # Whether a shape-generic prefill compiled more graphs than one: the model's code fixed its length (a guard on
        # it), so each bucket is a graph of its own, and is counted so from then on.
        self.prefill_specializes = False

    @property
    def graphs(self) -> int:
        return len(self.prefill) + len(self.decode)

    def add(
        self,
        rows: int,
        prefill_shapes,
        cache_length: int,
        side: str = "left",
        decode_windows=(None,),
        variant=GraphVariant(),
        generic: bool = False,
    ) -> list[str]:
        """
        Records one call's prefill shapes, `(prompt length, window)` per prefill forward, and returns, in words, those
        and the graphs of the `decode_windows` its decode steps may read that no call has compiled yet (see `reached`;
        `generic`: the forward is compiled with any `dynamic` but `False`, see `decode_graphs`).
        """
        new = []
        decode_windows = set(decode_windows)
        returning = "".join(f", {what}" for what in variant.words)
        for prompt_length, window in sorted(prefill_shapes, key=str):
            if prompt_length == 1:  # a 1-token prefill into the allocated cache is a decode step: its graph
                decode_windows.add(window)
            elif (rows, prompt_length, cache_length, side, window, variant) not in self.prefill:
                self.prefill.add((rows, prompt_length, cache_length, side, window, variant))
                length = "any length" if prompt_length is None else prompt_length
                new.append(
                    f"prefill [{rows}, {length}] with a {cache_length}-slot cache ({side}{_read(window)}{returning})"
                )
        held = {window for r, c, window, v in self.decode if (r, c, v) == (rows, cache_length, variant)}
        for window in decode_graphs(held, decode_windows, cache_length, generic):
            new.append(f"decode [{rows}, 1] with a {cache_length}-slot cache{_read(window)}{returning}")
        return new

    def reached(self, rows: int, cache_length: int, decode_windows, variant=GraphVariant()) -> None:
        """Records the windows a call's decode steps read (`None`: a cache without windows): graphs torch now holds."""
        self.decode.update((rows, cache_length, window, variant) for window in decode_windows)

    def held_graphs(self, model) -> int:
        """
        The graphs torch holds on `model`'s forward's code objects, as it counts them against the limit; where it can
        tell of none, the shapes the model has needed (too many, never too few).
        """
        return torch_api.forward_graphs(model) or self.graphs


def account_call(plan, chunk: int | None, max_cache_length: int, embeds: bool) -> CallGraphs:
    """
    A bucketed call's graphs, accounted for once its cache is made: one per prefill forward's (length, window), chunks
    included, and one per window the decode steps reach (`GraphBudget.add`; `embeds`: a prompt of embeddings), with
    the recompile limit raised above the graphs the process needs (`make_room`). Returns what the call expects to
    compile, for `check_compiled`.
    """
    rows, prefill, cached = plan.padded_rows, plan.prefill_tokens, plan.call.past_length
    cache_length = plan.run.static_cache_length
    chunks = [prefill] if chunk is None else [min(chunk, prefill - start) for start in range(0, prefill, chunk)]
    # A shape-generic prefill is one graph for every length (`None`), unless the model's code fixed it; a bucket of the
    # cache's length is a graph of its own (torch specializes a length equal to the cache's).
    budget, fullgraph, generic = budget_of(plan.model), plan.run.fullgraph, plan.run.generic_prefill
    symbolic_prefill = generic and not budget.prefill_specializes
    shapes, filled = set(), cached
    for length in chunks:
        filled += length
        query = filled == plan.run.query_window_tokens and filled == length and plan.run.reads_windows
        window = QUERY_WINDOW if query else window_of(plan, filled, cache_length)
        symbolic = symbolic_prefill and length == prefill > 1 and length != cache_length
        shapes.add((None if symbolic else length, window))
    decode_windows = {None}
    if plan.run.reads_windows:  # from the first decode step (at least) to the last
        first = (plan.prompt_slots if plan.right is None else cached) + 1
        decode_windows = windows_between(first, max(first, max_cache_length), cache_length)
    # On the right, a prefill onto an empty cache reads its query offset as 0 (`prefill_right`): a graph of its own.
    side = "right, onto cached tokens" if plan.right is not None and cached else plan.side
    side += ", from embeddings" if embeds else ""
    variant = graph_variant(plan.settings.returned_outputs)
    with _LIMIT_LOCK:
        held = budget.held_graphs(plan.model)
        new = budget.add(rows, shapes, cache_length, side, decode_windows, variant, generic)
        # New graphs of calls still running, which torch's count may not hold yet: concurrent calls, on one model or
        # several, make room for each other's too.
        in_flight = PROCESS.graphs_in_flight
        make_room(
            plan.model, held + in_flight, len(new), "Bucketed calls", not fullgraph, _advice(plan.model, generic)
        )
        PROCESS.graphs_in_flight += len(new)
        PROCESS.graphs_accounted += len(new)
        accounted = PROCESS.graphs_accounted
    return CallGraphs(
        held_before=held,
        new_shapes=new,
        rows=rows,
        cache_length=cache_length,
        variant=variant,
        breaks_graph=not fullgraph,
        in_flight_before=in_flight,
        accounted=accounted,
        compiled_before=torch_api.graphs_compiled(),
        generic_prefill=generic,
        refused_before=torch_api.limit_refusals(),
    )


# A decode graph symbolic in the window it reads (`decode_graphs`).
ANY_WINDOW = -1


def decode_graphs(held, windows, cache_length: int, generic: bool) -> list[int | None]:
    """
    The decode graphs reading `windows` of a `cache_length`-slot cache compiles where those reading `held` exist: one
    per window (`None`: no windows) compiled with `dynamic=False`; else one symbolic in the window for every window
    (`ANY_WINDOW`, `compiled_calls.mark_window_dynamic`) and one for a window of the whole cache, which only a call
    that fills the cache to its last slot reads (`windows.window_length`) and inductor specializes.
    """
    new = set(windows) - set(held)
    if not generic or new <= {None}:
        return sorted(new, key=str)
    graphs = [cache_length] if cache_length in new else []
    if new - {cache_length} and not set(held) - {cache_length}:
        graphs.append(ANY_WINDOW)
    return graphs


def account_candidates(plan, generator, max_length: int) -> None:
    """
    Room for the graphs of assisted and prompt-lookup decoding's candidate counts (up to `candidates.most_drafted`,
    each a graph in every window): they depend on the text, so room is made on every such call, and not recorded.
    """
    expected, filled, slots = plan.run.expected_graphs, plan.prompt_slots, plan.run.static_cache_length
    drafted = candidates.most_drafted(generator, max_length - filled - 1)
    if expected is None or drafted < 1:
        return
    windows = windows_between(filled + 2, max(filled + 2, max_length), slots) if plan.run.reads_windows else {None}
    shapes = {(plan.prefill_tokens + k, window_of(plan, filled + k, slots)) for k in range(1, drafted + 1)}
    shapes |= {(k + 1, window) for k in range(1, drafted + 1) for window in windows}
    new = [f"[{expected.rows}, {n}] with candidates{_read(w)}" for n, w in sorted(shapes, key=str)]
    with _LIMIT_LOCK:  # `graphs_in_flight` holds this call's own new graphs too
        held = expected.held_before + PROCESS.graphs_in_flight
        make_room(
            plan.model,
            held,
            len(new),
            "Bucketed calls",
            not plan.run.fullgraph,
            _advice(plan.model, expected.generic_prefill),
        )
        PROCESS.graphs_in_flight += len(new)
        PROCESS.graphs_accounted += len(new)
        expected.accounted += len(new)
        expected.new_shapes.extend(new)


def graph_variant(returned_outputs: tuple[str, ...] = ()) -> GraphVariant:
    """
    The `GraphVariant` of a call, what dynamo guards on besides shapes: the outputs returned besides the logits,
    `torch.inference_mode()`, autocast and torch's global state (`torch_api.global_state`).
    """
    words = tuple(f"returning {name}" for name in returned_outputs)
    if torch.is_inference_mode_enabled():
        words += ("under `torch.inference_mode()`",)
    if torch_api.autocast_enabled():
        words += ("under `torch.autocast`",)
    return GraphVariant(words, torch_api.global_state())


def window_of(plan, tokens: int, cache_length: int) -> int | None:
    """The window a forward reads after which the cache holds `tokens` tokens (`None`: no windowed layers)."""
    return window_length(tokens, cache_length) if plan.run.reads_windows else None


def _room(frames_room: int) -> str:
    frames = "a forward compiled without `fullgraph=True` starts frames after a graph break, counted alike"
    return f" (and {frames_room} more while its calls run: {frames})" if frames_room else ""


def _in_this_thread() -> str:
    """Where torch keeps its config per thread, and this is not the main thread: says whose limit it is."""
    if not torch_api.DYNAMO_CONFIG_PER_THREAD or threading.current_thread() is threading.main_thread():
        return ""
    return " in this thread: from torch 2.13 each thread has its own, and one set in another thread is not this one's"


def _read(window: int | None) -> str:
    if window == QUERY_WINDOW:
        return ", reading its own tokens' slots"
    if window == ANY_WINDOW:
        return ", reading any window (symbolic in its length)"
    return "" if window is None else f", reading {window} slots"


def budget_of(model) -> "GraphBudget":
    """The `GraphBudget` of `model`, made on first use (kept in its `ModelState`)."""
    state = state_of(model)
    with _LIMIT_LOCK:
        if state.budget is None:
            state.budget = GraphBudget()
    return state.budget


# What to do when the forward is at torch's limit with graphs a call did not expect, in the options of who calls.
_AT_THE_LIMIT = {
    "generate": "Raise `torch._dynamo.config.recompile_limit`, or call `prefill_buckets.precompile`.",
    "precompile": "Raise `torch._dynamo.config.recompile_limit` and call `precompile` again.",
    "serve": "Start `prefill-buckets serve` with `--precompile`, and with fewer `--buckets` or a smaller `--max-prompt`.",
}


# What to do to need fewer graphs, by caller; a `generate` call's depends on whether its prefill is shape-generic.
_FEWER_GRAPHS = {
    "generate": "To need fewer graphs: compile with `model.compile()` (`dynamic=None`: one prefill graph for every "
    "bucket, where `dynamic=False` compiles one per bucket), pin `max_cache_len` (one decode graph per batch size), use "
    "fewer buckets, or call `prefill_buckets.precompile` to compile them all up front.",
    "generic": "To need fewer graphs: pin `max_cache_len` (one cache, one decode graph for its windows), use fewer "
    "batch sizes, or call `prefill_buckets.precompile` to compile them all up front.",
    "precompile": "To need fewer graphs: pass `precompile` fewer batch sizes, or a bucket set with fewer buckets.",
    "serve": "To need fewer graphs: start `prefill-buckets serve` with `--precompile`, or with fewer `--buckets`.",
}


def _advice(model, generic: bool) -> str:
    """What to do to need fewer graphs, for a call whose prefill is shape-generic or static per bucket."""
    entry = state_of(model).entry
    return advice_for("generic" if generic and entry == "generate" else entry, _FEWER_GRAPHS)


def make_room(model, held: int, graphs: int, who: str, breaks_graph: bool = False, advice: str | None = None) -> None:
    """
    Raises torch's recompile limits, if needed, so `model`'s forward can hold `held` graphs plus `graphs` more, and
    room for the frames graph breaks start while calls run (`breaks_graph`). The warning ends with `advice`.
    """
    needed = held + graphs
    with _LIMIT_LOCK:
        limit = recompile_limit()
        # The limit as it would be had the package never put it back between calls: raised once per new high, and
        # said then, not again for each call. A limit the user changed starts over.
        if PROCESS.saved_limits() is None and PROCESS.raised_recompile_limit[0] != limit:
            PROCESS.raised_recompile_limit = (limit, limit)
        user_limit, highest = PROCESS.raised_recompile_limit
        frames_room = max(user_limit or limit, budget_of(model).unpredicted_frames) if breaks_graph else 0
        effective = max(limit, highest)
        raised = effective
        if needed > effective:
            raised = max(needed, 2 * effective)
            logger.warning_once(
                f"{who} need {needed} compiled graphs of the forward of `{model_name(model)}` (the "
                f"graphs of every model whose forward is the same code, as torch counts them), more than torch's "
                f"`torch._dynamo.config.recompile_limit` ({effective}{_in_this_thread()}), past which torch silently "
                f"runs the forward eagerly. Raised the limit to {raised}{_room(frames_room)}. "
                f"{_advice(model, False) if advice is None else advice}"
            )
            PROCESS.raised_recompile_limit = (user_limit, raised)
        # While calls run, the limit is the highest it was raised to: a call doesn't lower it under graphs another
        # call counted on.
        raised = max(raised, needed + frames_room)
        if raised > limit:
            _save_user_recompile_limits().limit_set = raised
            torch_api.set_recompile_limit(raised)
        needed += frames_room
        accumulated = torch_api.accumulated_recompile_limit()
        if accumulated is not None and max(needed, PROCESS.raised_accumulated_limit) > accumulated:
            # The cap on any one code object's graphs (256), raised alike.
            saved = _save_user_recompile_limits()
            if needed > max(accumulated, PROCESS.raised_accumulated_limit):
                logger.warning_once(
                    f"Raised torch's `torch._dynamo.config.accumulated_recompile_limit` from {accumulated} to "
                    f"{needed}, the compiled graphs the forward of `{model_name(model)}` needs."
                )
            PROCESS.raised_accumulated_limit = max(needed, PROCESS.raised_accumulated_limit)
            saved.accumulated_set = PROCESS.raised_accumulated_limit
            torch_api.set_accumulated_recompile_limit(PROCESS.raised_accumulated_limit)


def check_compiled(model, expected: CallGraphs | None, limit: int | None = None, decode_windows_read=()) -> None:
    """
    Ends a bucketed call's accounting: records the windows its decode steps read, and warns when torch may have run
    some of its forwards eagerly: it refused a compile at its limit during the call, or the forward's code is at the
    limit without graphs the call expected (refused in an earlier call, after which torch compiles none on that code).
    """
    if expected is None:
        return
    with _LIMIT_LOCK:
        PROCESS.graphs_in_flight -= len(expected.new_shapes)
        beside = expected.in_flight_before + PROCESS.graphs_accounted - expected.accounted
        budget = budget_of(model)
        budget.reached(expected.rows, expected.cache_length, decode_windows_read, expected.variant)
    unchanged = not expected.breaks_graph and torch_api.graphs_compiled() == expected.compiled_before
    held = expected.held_before if unchanged else torch_api.forward_graphs(model)  # one entry per graph: none added
    own = expected.held_before + len(expected.new_shapes)
    if expected.breaks_graph:  # what its graph breaks added, room for the next call's
        budget.unpredicted_frames = max(budget.unpredicted_frames, held - own - beside)
    elif expected.generic_prefill and held > own + beside and not budget.prefill_specializes:
        budget.prefill_specializes = True
        logger.info(
            f"The prefill of `{model_name(model)}` compiled a graph per prompt length although its length was marked "
            "symbolic: the model's code fixes it. Each bucket is counted as a graph of its own from now on."
        )
    limit = recompile_limit() if limit is None else limit  # the call's own, once it has put the user's back
    # At the limit with more graphs than expected is not enough: a forward that breaks its graph may fill it exactly.
    refused = torch_api.limit_refusals() - expected.refused_before
    if refused > 0 or (held >= limit and held < own):
        shapes = "; ".join(expected.new_shapes) or "shapes the package did not predict"
        others = f" (and up to {beside} of calls beside it)" if beside else ""
        times = "once" if refused == 1 else f"{refused} times"
        refusals = f" (torch refused to compile past it {times} during the call)" if refused > 0 else ""
        logger.warning(
            f"The compiled forward of `{model_name(model)}` holds {held} graphs, torch's "
            f"`torch._dynamo.config.recompile_limit` is {limit}{refusals}, where this call expected "
            f"{expected.held_before} plus {len(expected.new_shapes)} new ({shapes}){others}: torch may have run some "
            f"of its forwards eagerly (same outputs, uncompiled). {advice_for(state_of(model).entry, _AT_THE_LIMIT)}"
        )


def model_name(model) -> str:
    """The model's class, and where it was loaded from when it says."""
    path = getattr(getattr(model, "config", None), "name_or_path", "")
    return f"{type(model).__name__}" + (f" ({path})" if path else "")


def restore_recompile_limit(at_least: int | None) -> None:
    """Puts the limit back to `at_least` if lowered during a call (transformers < 5.23's chunked prefill sets 64)."""
    if at_least is not None and recompile_limit() < at_least:
        torch_api.set_recompile_limit(at_least)


def _save_user_recompile_limits() -> SavedLimits:
    """The user's limits, saved before the first raise (kept until they are restored)."""
    saved = PROCESS.saved_limits()
    if saved is None:
        saved = SavedLimits(recompile_limit(), torch_api.accumulated_recompile_limit())
        PROCESS.set_saved_limits(saved)
    return saved


@contextlib.contextmanager
def room_for_upstream_call(model):
    """
    Around a call on upstream's path: the graphs bucketed calls left on its forward don't count against the user's
    recompile limit, so it has the room it would have without them. Free until a bucketed call has run.
    """
    if not PROCESS.graphs_accounted:
        yield
        return
    with _LIMIT_LOCK:
        before = torch_api.forward_graph_codes(model)
        upstream = PROCESS.upstream_graph_codes
        left = max((sum(code not in upstream for code in graphs) for graphs in before.values()), default=0)
        PROCESS.upstream_calls_in_flight += 1
        saved = PROCESS.saved_limits()
        needed = (recompile_limit() if saved is None else saved.limit) + left
        if needed > recompile_limit():
            _save_user_recompile_limits().limit_set = needed
            torch_api.set_recompile_limit(needed)
        if needed > (torch_api.accumulated_recompile_limit() or needed):
            _save_user_recompile_limits().accumulated_set = needed
            torch_api.set_accumulated_recompile_limit(needed)
    try:
        yield
    finally:
        with _LIMIT_LOCK:
            for code, graphs in torch_api.forward_graph_codes(model).items():
                upstream.update(graphs.difference(before.get(code, ())))
            PROCESS.upstream_calls_in_flight -= 1
            restore_user_recompile_limits()


def restore_user_recompile_limits() -> None:
    """
    Puts torch's recompile limits back to the user's once no call that counts on them is in flight (per thread from
    torch 2.13); a limit someone else set since is left as it is.
    """
    with _LIMIT_LOCK:
        saved = PROCESS.saved_limits()
        in_flight = PROCESS.calls_in_flight + PROCESS.upstream_calls_in_flight
        if saved is None or (in_flight and not torch_api.DYNAMO_CONFIG_PER_THREAD):
            return
        PROCESS.set_saved_limits(None)
        if recompile_limit() == saved.limit_set:
            torch_api.set_recompile_limit(saved.limit)
        current = torch_api.accumulated_recompile_limit()
        if saved.accumulated is not None and current == saved.accumulated_set:
            torch_api.set_accumulated_recompile_limit(saved.accumulated)

"""`GraphBudget`: the graphs a compiled model has needed, and the only code that changes torch's recompile limit.

Torch keeps at most `torch._dynamo.config.recompile_limit` graphs per compiled function (8 by default) and runs the
rest eagerly, without an error. Bucketed calls need a known, bounded set of graphs; when that set is larger than the
limit, the limit is raised here, with a warning, and never lowered below what the workload needs.
"""

import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)


def recompile_limit() -> int:
    return torch._dynamo.config.recompile_limit


class GraphBudget:
    """
    The graphs a compiled model has needed so far, by shape, for one static-cache generation workload.

    A compiled forward compiles one graph per distinct input shape: a prefill graph per `(rows, prompt length,
    cache length, window)` and a decode graph per `(rows, cache length, window)`, where rows are `batch *
    max(num_beams, num_return_sequences)` and the window is the slots the forward reads (`windows.py`; `None`
    where the cache has no windowed layers).
    """

    def __init__(self):
        self.prefill: set[tuple[int, int, int, int | None]] = set()
        self.decode: set[tuple[int, int, int | None]] = set()
        self.warned_near_limit = False

    @property
    def graphs(self) -> int:
        return len(self.prefill) + len(self.decode)

    def add(self, rows: int, prompt_length: int, cache_length: int, window=None, decode_windows=(None,)) -> bool:
        """Records one call's shapes; returns whether they need a graph not seen before."""
        before = self.graphs
        self.prefill.add((rows, prompt_length, cache_length, window))
        self.decode.update((rows, cache_length, decode_window) for decode_window in decode_windows)
        return self.graphs > before

    def account(self, rows: int, prompt_length: int, cache_length: int, window=None, decode_windows=(None,)) -> None:
        """A bucketed call's shapes: keeps the recompile limit above the graphs needed, and says so when it raises it."""
        if not self.add(rows, prompt_length, cache_length, window, decode_windows):
            return
        limit = recompile_limit()
        if self.graphs > limit:
            raised = max(self.graphs, 2 * limit)
            torch._dynamo.config.recompile_limit = raised
            logger.warning_once(
                f"Prefill buckets have needed {self.graphs} compiled graphs so far ({len(self.prefill)} prefill, "
                f"{len(self.decode)} decode shapes), more than torch's `torch._dynamo.config.recompile_limit` "
                f"({limit}), past which torch silently runs the forward eagerly. Raised the limit to {raised}. To need "
                "fewer graphs: pin `max_cache_len` (one decode graph per batch size), use fewer buckets, or call "
                "`prefill_buckets.precompile` to compile them all up front."
            )

    def account_unbucketed(self, rows: int, prompt_length: int, cache_length: int) -> None:
        """
        An unbucketed compiled call's shapes. They share the compiled function's limit with bucketed ones, so they are
        counted, but the limit is left alone: this only warns, once, when the next new length will pass it.
        """
        from .config import PREFILL_BUCKETS

        self.add(rows, prompt_length, cache_length)
        limit = recompile_limit()
        if self.graphs + 1 >= limit and not self.warned_near_limit:
            self.warned_near_limit = True
            logger.warning(
                f"The compiled forward has needed {self.graphs} graphs (one prefill graph per prompt length, and "
                f"decode graphs per cache length), and torch's `torch._dynamo.config.recompile_limit` is {limit}: "
                f"past it, torch silently runs the forward eagerly. Set `{PREFILL_BUCKETS}` to bound the graphs."
            )

    def make_room(self, graphs: int) -> None:
        """Raises the recompile limit, if needed, to hold the graphs compiled so far plus `graphs` more (`precompile`)."""
        needed = self.graphs + graphs
        limit = recompile_limit()
        if needed > limit:
            torch._dynamo.config.recompile_limit = needed
            logger.warning(
                f"precompile raised torch's `torch._dynamo.config.recompile_limit` from {limit} to {needed}: the graphs "
                f"this config needs, plus those the model has compiled before. Past the limit, torch silently runs the "
                "forward eagerly."
            )


def restore_recompile_limit(at_least: int | None) -> None:
    """
    Puts the limit back to `at_least` if something lowered it during a call: transformers < 5.23 sets it to 64 before
    every chunked prefill, which a bucketed call with `compile_config` runs.
    """
    if at_least is not None and recompile_limit() < at_least:
        torch._dynamo.config.recompile_limit = at_least

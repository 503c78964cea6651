"""Compile every graph a bucket config can need, up front."""

import copy
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ALL_STATIC_CACHE_IMPLEMENTATIONS
from transformers.utils import logging

from ..buckets import BucketPolicy, check_positive_int, is_positive_int
from ..call.budget import budget_of, decode_graphs, make_room
from ..call.decision import capped_bucket
from ..call.generation import generate
from ..call.resolved import resolve_fields, resolve_settings
from ..config import PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF
from ..forgotten_enable import generation_configs, warn_if_enable_forgotten
from ..kvcache.sizing import aligned_cache_length
from ..kvcache.windows import decode_warmups, windows_between
from ..state import called_by
from ..upstream import torch_api, transformers_api
from ..upstream.torch_api import graphs_compiled
from .compiled_calls import compiled_forward, forward_compiled_generic


logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class CompiledShape:
    """One batch size and bucket of [`precompile`]: the shapes its warm-up calls compiled for, and what they cost."""

    batch_size: int
    prompt_length: int
    cache_length: int | None  # `None` with a dynamic cache
    graphs: int  # graphs dynamo compiled during the call (0 when they already existed)
    seconds: float


def bucket_lengths(policy: BucketPolicy, max_prompt_length: int, max_positions: int | None = None) -> list[int]:
    """
    Every padded length `policy` gives a prompt of 1 to `max_prompt_length` tokens, increasing. With `max_positions`
    (the model's `max_position_embeddings`), a bucket past it is capped there, as `generate` caps it.
    """
    lengths, length = [], 1
    # Longer prompts than the model has positions for are not padded: no bucket to warm up.
    while length <= max_prompt_length and (max_positions is None or length <= max_positions):
        padded = policy.bucket(length)
        lengths.append(padded if max_positions is None else min(padded, max_positions))
        length = lengths[-1] + 1
    return lengths


def precompile(
    model,
    generation_config: GenerationConfig | None = None,
    batch_sizes: tuple[int, ...] | list[int] = (1,),
    max_prompt_length: int | None = None,
    progress: bool = True,
    min_prompt_length: int | None = None,
    prompt_lengths: Iterable[int] | None = None,
    generate_kwargs: dict | None = None,
) -> list[CompiledShape]:
    r"""
    Compiles every graph that `generate` with `generation_config` can need for prompts of `min_prompt_length` (1 by
    default) to `max_prompt_length` tokens, so that later calls with such prompts compile nothing.

    Runs one short `generate` (2 new tokens) per batch size and bucket, longest first, on a prompt that exactly fits
    the bucket, with the padding side later calls take (with `"auto"`, a batch size above 1 also with rows of
    different lengths). With a static cache and no `max_cache_len`, the cache is pinned to what the longest bucket
    needs with `max_new_tokens`, rounded up to a multiple of 64 (or of `prefill_pad_to_multiple_of`), so every later
    call uses that one cache shape; where decode crosses attention windows of that cache, more warm-up calls compile a
    decode graph per window. That is with `dynamic=False`. With any other `dynamic`, the graphs are shape-generic:
    one prefill graph serves every bucket and one decode graph every window, so only the buckets at both ends are
    warmed up (every bucket if the model's code fixes the prompt length). The reference's "Compile every graph up front" counts the graphs. As in `generate`, a bucket past the
    model's `max_position_embeddings` is capped there, and longer prompts are not padded, so none is warmed up.

    Args:
        model ([`PreTrainedModel`]):
            The model, compiled the way it will serve (`model.compile()`, a compiled `forward`, `compile_config`, or
            the `torch.compile(model)` wrapper).
        generation_config ([`~generation.GenerationConfig`], *optional*):
            The config later calls will use; `prefill_buckets` and/or `prefill_pad_to_multiple_of` must be set on it
            or on `model.generation_config`. Defaults to `model.generation_config`.
        batch_sizes (`tuple[int]`, *optional*, defaults to `(1,)`):
            The batch sizes later calls will use. Each is its own set of graphs; with `prefill_batch_buckets`, each
            is warmed up at its batch bucket.
        max_prompt_length (`int`, *optional*):
            The longest prompt later calls will send. Required unless `prefill_buckets` is a list, in which case it
            defaults to the largest bucket.
        progress (`bool`, *optional*, defaults to `True`):
            Print the plan and a line per warm-up call as it ends to stderr. `False`: to the logger, at info level.
        min_prompt_length (`int`, *optional*):
            The shortest prompt later calls will send: the buckets below its bucket are not warmed up. Defaults to 1,
            every bucket.
        prompt_lengths (`Iterable[int]`, *optional*):
            A sample of the prompt lengths later calls will send, from which `min_prompt_length` and
            `max_prompt_length` are taken (not together with either).
        generate_kwargs (`dict`, *optional*):
            More keyword arguments every warm-up call passes to `generate`, as later calls will (upstream hands some to
            the forward, such as `transformers serve`'s `tokenizer`, and other keyword arguments compile again). Not
            `input_ids`, `attention_mask` or `generation_config`.

    Returns:
        `list[CompiledShape]`: one entry per batch size and bucket warmed up, longest first, with the graphs torch
        compiled for it. Torch's recompile limit is raised to hold them all first.

    Example:

    ```python
    >>> model.compile()
    >>> config = GenerationConfig(cache_implementation="static", max_new_tokens=8, prefill_buckets=[16, 64])
    >>> compiled = prefill_buckets.precompile(model, config, batch_sizes=(1,), progress=False)
    >>> [shape.prompt_length for shape in compiled]
    [64, 16]
    ```
    """
    if prompt_lengths is not None:
        if max_prompt_length is not None or min_prompt_length is not None:
            raise ValueError(
                "Pass either `prompt_lengths` (a sample, from which the shortest and longest prompt are taken) or "
                "`min_prompt_length` / `max_prompt_length`, not both."
            )
        lengths = list(prompt_lengths)
        bad = [n for n in lengths if not is_positive_int(n)]
        if not lengths or bad:
            raise ValueError(
                f"`prompt_lengths` must be a non-empty sample of positive integers (prompt lengths in tokens), but "
                f"{'is empty' if not lengths else f'holds {bad[0]!r}'}."
            )
        min_prompt_length, max_prompt_length = min(lengths), max(lengths)
    generate_kwargs = dict(generate_kwargs or {})
    taken = sorted(set(generate_kwargs) & {"input_ids", "attention_mask", "generation_config", "inputs"})
    if taken:
        raise ValueError(
            f"`generate_kwargs` must not hold {taken}: every warm-up call sets its own prompt, mask and config."
        )
    wrapper = model
    module = torch_api.unwrap(model)
    original = generation_config
    generation_config = copy.deepcopy(generation_config if generation_config is not None else module.generation_config)
    warn_if_enable_forgotten("precompile", [generation_config, *generation_configs(module)])
    fields = resolve_fields(module, generation_config, {})
    settings = resolve_settings(module, generation_config, {}, {})
    policy = settings.policy
    if fields[PREFILL_BUCKETS] is None and fields[PREFILL_PAD_TO_MULTIPLE_OF] is None:
        raise ValueError(
            "`precompile` needs `prefill_buckets` or `prefill_pad_to_multiple_of` on `generation_config` (or on "
            "`model.generation_config`): without buckets every prompt length is its own graph."
        )
    if max_prompt_length is None:
        if policy.largest_bucket is None or policy.pad_to_multiple_of is not None:
            raise ValueError(
                f"`max_prompt_length` is required with {policy}: the buckets have no upper end. Pass the longest "
                "prompt your calls will send."
            )
        max_prompt_length = policy.largest_bucket
    check_positive_int(max_prompt_length, "max_prompt_length")
    if min_prompt_length is not None:
        check_positive_int(min_prompt_length, "min_prompt_length")
        if min_prompt_length > max_prompt_length:
            raise ValueError(
                f"`min_prompt_length` ({min_prompt_length}) must not be larger than `max_prompt_length` "
                f"({max_prompt_length})."
            )
    if not batch_sizes or not all(is_positive_int(b) for b in batch_sizes):
        raise ValueError(f"`batch_sizes` must be a non-empty list of positive integers, but is {batch_sizes!r}.")

    batch_policy = settings.batch_policy  # calls run at the batch buckets, not at the sizes they were given
    batch_sizes = sorted(
        {batch_policy.bucket(b) if batch_policy is not None else b for b in batch_sizes}, reverse=True
    )
    lengths = sorted(bucket_lengths(policy, max_prompt_length, settings.max_positions), reverse=True)
    if min_prompt_length is not None:
        lengths = [length for length in lengths if length >= capped_bucket(settings, min_prompt_length, warn=False)]
    max_new_tokens = settings.new_tokens(1)
    static = settings.cache_implementation in ALL_STATIC_CACHE_IMPLEMENTATIONS
    if static and generation_config.max_cache_len is None:
        # Pinned, so one decode graph whatever its size: the slots the longest bucket needs, rounded up to a
        # multiple of 64 (not to the next power of two, which a growing cache uses to bound its sizes).
        generation_config.max_cache_len = aligned_cache_length(policy, lengths[0] + max_new_tokens - 1)

    # Warm-up calls: 2 new tokens = one prefill and one decode step; sampling and stopping don't change the graphs.
    # With a static cache, more where decode crosses attention windows (`windows.decode_warmups`).
    generation_config.min_new_tokens = None
    generation_config.max_length = None
    slots = generation_config.max_cache_len
    shortest = {length: (lengths[i + 1] + 1 if i + 1 < len(lengths) else 1) for i, length in enumerate(lengths)}
    if min_prompt_length is not None:
        shortest[lengths[-1]] = max(shortest[lengths[-1]], min_prompt_length)

    # Compiled with any `dynamic` but `False` (`compiled_calls.call_compilation`), the graphs are shape-generic: one
    # prefill graph for every bucket, unless the model's code fixes the length (the budget learns it), and one decode
    # graph for every window (`budget.decode_graphs`).
    if compiled_forward(module) is not None:
        generic = forward_compiled_generic(module)
    else:  # compiled by upstream, with `compile_config`'s `dynamic` (`False` without one too)
        generic = getattr(generation_config.compile_config, "dynamic", False) is not False
    generic = generic and not budget_of(module).prefill_specializes
    if generic:
        # The buckets at both ends compile those graphs (the longest's decode reading every window it reaches, a
        # 1-token bucket a decode step's); a model that fixes the length is found there and warmed per bucket below.
        lengths = sorted({lengths[0], lengths[-1], min((n for n in lengths if n > 1), default=1)}, reverse=True)

    def warmups(length: int) -> list[tuple[int, int]]:
        if not static or slots is None:
            return [(length, 2)]
        calls = decode_warmups(length, shortest[length], max_new_tokens, slots)
        return calls[:1] if generic else calls  # generic: the windows inside the bucket share the symbolic graph

    both_sides = len([b for b in batch_sizes if b > 1]) if settings.padding_side == "auto" else 0
    # (a 1-token bucket's prefill is a decode step: decode's graph)
    prefill_graphs = 1 + (slots in lengths) if generic else len([length for length in lengths if length > 1])
    if generic:
        warm = [call for length in lengths for call in warmups(length)]
        windows = {w for n, new in warm for w in windows_between(n + 1, n + new - 1, slots)} if static else {None}
        decode_graphs_per_batch = len(decode_graphs(set(), windows, slots, True))
    else:
        decode_graphs_per_batch = 1 + sum(len(warmups(length)) - 1 for length in lengths)  # a graph per window
    expected = (len(batch_sizes) + both_sides) * prefill_graphs + len(batch_sizes) * decode_graphs_per_batch
    held = budget_of(module).held_graphs(module)
    # Room for every graph before the first call, in precompile's words: the budget then never warns mid-warm-up.
    make_room(module, held, expected, "precompile's calls", advice="They are compiled now, before any other call.")

    # Every warm-up call, planned up front: (batch size, bucket, prompt length, new tokens, rows of different lengths).
    calls = []
    for batch_size in batch_sizes:
        for length in lengths:
            calls += [(batch_size, length, n, new_tokens, False) for n, new_tokens in warmups(length)]
            if batch_size > 1 and length > 1 and settings.padding_side == "auto":
                calls.append((batch_size, length, length, 2, True))
    _say(progress, _plan(calls, lengths, batch_sizes, slots if static else None, expected, len(shortest)))

    device = module.device
    compiled, compiled_before = [], graphs_compiled()
    shape_start = total_start = time.perf_counter()
    for index, (batch_size, length, prompt_length, new_tokens, ragged) in enumerate(calls):
        call_graphs, call_start = graphs_compiled(), time.perf_counter()
        generation_config.max_new_tokens = generation_config.min_new_tokens = new_tokens
        input_ids = torch.full((batch_size, prompt_length), 0, dtype=torch.long, device=device)
        attention_mask = torch.ones_like(input_ids)
        if ragged:
            # Batches usually come with rows of different lengths: where they take the left side (its own prefill
            # graph per bucket; decode shares the graph), warm that one too, with a last row one token shorter.
            attention_mask[-1, 0] = 0
        with called_by(module, "precompile"):  # advice in precompile's words, not "call precompile"
            generate(
                wrapper,
                input_ids,
                attention_mask=attention_mask,
                generation_config=generation_config,
                **generate_kwargs,
            )
        cache_length = transformers_api.previous_max_cache_length(module) if static else -1
        cache_length = cache_length if cache_length >= 0 else None
        graphs = graphs_compiled() - call_graphs
        _say(
            progress,
            f"precompile: warm-up call {index + 1}/{len(calls)} done: rows {batch_size}, prompt {prompt_length}"
            f"{'' if prompt_length == length else f' (bucket {length})'}, cache "
            f"{'dynamic' if cache_length is None else cache_length}, {new_tokens} new tokens"
            f"{', rows of different lengths' if ragged else ''}: {graphs} graph{'' if graphs == 1 else 's'} compiled "
            f"in {time.perf_counter() - call_start:.1f} s; {len(calls) - index - 1} left",
        )
        if index + 1 == len(calls) or calls[index + 1][:2] != (batch_size, length):  # its shape's last call
            now, graphs_now = time.perf_counter(), graphs_compiled()
            shape = CompiledShape(batch_size, length, cache_length, graphs_now - compiled_before, now - shape_start)
            compiled.append(shape)
            shape_start, compiled_before = now, graphs_now
    graphs = sum(c.graphs for c in compiled)
    _say(
        progress,
        f"precompile: done, {len(calls)} warm-up calls compiled {graphs} graph{'' if graphs == 1 else 's'} in "
        f"{time.perf_counter() - total_start:.1f} s",
    )
    if generic and budget_of(module).prefill_specializes:
        _say(
            progress, "precompile: the model's code fixes the prompt length (a graph per bucket): warming every bucket"
        )
        again = precompile(
            model, original, batch_sizes, max_prompt_length, progress, min_prompt_length, None, generate_kwargs
        )
        first = {(shape.batch_size, shape.prompt_length): shape for shape in compiled}  # the ends' warm-ups, merged
        return [
            replace(shape, graphs=shape.graphs + warmed.graphs, seconds=shape.seconds + warmed.seconds)
            if (warmed := first.get((shape.batch_size, shape.prompt_length)))
            else shape
            for shape in again
        ]
    return compiled


def _plan(calls: list, lengths: list[int], batch_sizes: list[int], slots: int | None, expected: int, of: int) -> str:
    """What `precompile` is about to do, in one line: its warm-up calls, and the graphs it expects."""
    cache = f"a static cache of {slots} slots" if slots is not None else "a dynamic cache"
    ends = f" of {of}, the ends: shape-generic graphs serve the buckets between" if len(lengths) < of else ""
    return (
        f"precompile: {len(calls)} warm-up call{'' if len(calls) == 1 else 's'} for batch size"
        f"{'' if len(batch_sizes) == 1 else 's'} {', '.join(map(str, batch_sizes))} and bucket"
        f"{'' if len(lengths) == 1 else 's'} {', '.join(map(str, lengths))} (longest first{ends}), {cache}: "
        f"{expected} graph{'' if expected == 1 else 's'} at most (`model.compile()`: one prefill graph for every "
        "bucket; `dynamic=False`: one per bucket). Each call that compiles takes seconds to minutes."
    )


def _say(progress: bool, message: str) -> None:
    """A progress line: on stderr with `progress`, else to the package's logger (info, hidden by default)."""
    if progress:
        print(message, file=sys.stderr, flush=True)
    else:
        logger.info(message)

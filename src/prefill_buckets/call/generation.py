"""`generate` with bucketed prefill: upstream `generate`, on the padded prompt, with the padding stripped again.

The steps of one bucketed call, as `generate` numbers them: 1. resolve (`resolved.py`); 2. check support
(`hooks.check_upstream`); 3. decide the padding, or why the call runs unpadded or raises (`decision.choose_side`);
4. plan it (`plan.plan_call`); 5. agree across ranks (steps 1 to 4 inside `distributed.ranks_agree`); 6. run upstream
`generate`, hooked (`hooks.bucketed_call`); 7. mark the cache for a call that continues it (`kvcache.record`), and keep
one the call made (`kvcache.sizing.keep_cache`); 8. strip the padding (`views.strip_output`). A call without bucket
fields is upstream `generate`, unchanged: this module only warns when it will recompile.
"""

import contextlib
import dataclasses
from collections.abc import Callable

import torch
from transformers.utils import ModelOutput, logging

from ..compile.compiled_calls import compiled_wrapper_forward
from ..config import BUCKET_FIELDS, PREFILL_BUCKETS, PREFILL_PAD_TO_MULTIPLE_OF
from ..distributed import generate_call, ranks_agree
from ..kvcache.record import passed_cache, record_call
from ..kvcache.sizing import allocated_as_early, keep_cache
from ..state import PROCESS, state_of
from ..upstream import torch_api, transformers_api
from ..upstream.transformers_api import cache_seq_length, tensor_parallel_group
from . import hooks
from .budget import budget_of, check_compiled, graph_variant, model_name, room_for_upstream_call
from .decision import choose_side
from .hook_registry import active_plan
from .hooks import bucketed_call
from .plan import Plan, plan_call
from .resolved import ResolvedCall, bind_call, resolve_call
from .views import strip_output


logger = logging.get_logger(__name__)

UPSTREAM_GENERATE = transformers_api.UPSTREAM_GENERATE


def generate(model, *args, **kwargs):
    r"""
    [`~generation.GenerationMixin.generate`] with bucketed prefill, without patching transformers.

    Takes exactly the arguments of `model.generate`, plus the four fields `prefill_pad_to_multiple_of`,
    `prefill_buckets`, `prefill_batch_buckets` and `prefill_padding_side` (as keyword arguments or on
    `generation_config`). When none of the first three is set, this is upstream `generate`, unchanged. When one is
    set, the prompt is padded to its bucket (and the batch, with `prefill_batch_buckets`, to its bucket with dummy
    rows): on the right, with no mask, where that is exact (`prefill_padding_side`, see `decision.py`), else on
    the left with masked pad tokens; upstream `generate` runs, and the padding is stripped again: the returned
    sequences have the shape and ids of an unpadded run, and `max_new_tokens`, `max_length` and `min_length` mean
    what they mean without padding.

    Args:
        model ([`PreTrainedModel`]):
            A decoder-only model with a language modeling head, or the `torch.compile(model)` wrapper of one.
        args (*optional*):
            The positional arguments of `model.generate`.
        kwargs (*optional*):
            The keyword arguments of `model.generate`, and the bucket fields.

    Returns:
        What `model.generate` returns, with the padding removed from `sequences` and from the per-position outputs
        (prefill `hidden_states`, the query axis of prefill `attentions`, and any key axis that spans the padded
        sequence; a static cache's attentions have upstream's key axis on every layer and step), and the dummy rows
        removed from every output. A returned cache records the call's bucket fields and any padding it holds (left
        padding, dummy rows): a later call that continues from it (multi-turn chat) and sets no bucket field of its
        own is bucketed the same way, its prompt lined up with that padding (and its batch brought to the cache's
        rows).

    Example:

    ```python
    >>> import prefill_buckets
    >>> from transformers import GenerationConfig

    >>> config = GenerationConfig(cache_implementation="static", max_new_tokens=8, do_sample=False)
    >>> out = prefill_buckets.generate(model, **inputs, generation_config=config, prefill_buckets=[16, 64])
    >>> out.shape[1] == inputs["input_ids"].shape[1] + 8
    True
    ```
    """
    # 1. Resolve the call: bound as upstream's `generate` binds it, the bucket fields taken out.
    wrapper = model if torch_api.is_compiled_wrapper(model) else None
    model = torch_api.unwrap(model)  # an `OptimizedModule` hands `generate` to the module it wraps
    arguments, model_kwargs, field_kwargs = bind_call(model, args, kwargs)
    if active_plan(model) is not None:
        # Re-entered from inside a bucketed call (a model whose own `generate` calls ours): already padded.
        return UPSTREAM_GENERATE(model, **arguments, **model_kwargs)

    # 5. Agree across ranks: steps 1 to 4 run inside it, and any error they raise is raised on every rank.
    if tensor_parallel_group(model) is not None:
        agreed = ranks_agree(model, *generate_call(model, arguments, model_kwargs, field_kwargs))
    else:
        agreed = contextlib.nullcontext()  # one process: nothing to agree on, nothing to summarize
    with agreed:
        call = resolve_call(model, wrapper, arguments, model_kwargs, field_kwargs)
        prepared = _prepare(call)
    if prepared.plan is None:
        # The fields were set, and the call runs unpadded: says so if torch runs its forwards eagerly. A call without
        # fields is upstream's, unchanged: nothing is read for it.
        refused = torch_api.limit_refusals() if call.bucketed else None
        with room_for_upstream_call(model):  # the graphs bucketed calls left don't count against the user's limit
            output = UPSTREAM_GENERATE(model, **prepared.arguments, **prepared.model_kwargs)
        if prepared.after is not None:
            prepared.after()
        if refused is not None:
            _warn_refused(model, torch_api.limit_refusals() - refused)
        return output

    # 6. Run upstream `generate` on the padded inputs, hooked.
    plan = prepared.plan
    compiled_wrapper = compiled_wrapper_forward(wrapper) if wrapper is not None else contextlib.nullcontext()
    try:
        with compiled_wrapper, bucketed_call(plan):
            output = UPSTREAM_GENERATE(model, **prepared.arguments, **prepared.model_kwargs)
    finally:
        # Says so if torch ran some of the call's forwards eagerly, against the limit the call ran under.
        check_compiled(model, plan.run.expected_graphs, plan.run.recompile_limit, plan.run.decode_windows_read)

    # 7. Mark the cache, passed in or returned, for a call that continues from it; keep one the call made and did not
    # return, for the next call's.
    returned = passed_cache(output) if isinstance(output, ModelOutput) else None
    for cache in (call.cache, returned if returned is not call.cache else None):  # often one cache: recorded once
        if cache is not None:
            record_call(cache, plan, prepared.model_kwargs.get("attention_mask"), continues=call.continued is not None)
    made = plan.run.made_cache
    # Allocated before its first forward, or by an eager call's as it would have been: not inside a compiled first
    # forward (the next call's would find it allocated: a graph of its own), nor of a shape upstream did not predict.
    kept = made is not None and made is not returned
    if kept and (plan.run.allocated_early or (not plan.run.compiled and allocated_as_early(model, made))):
        written = max(plan.prompt_slots, cache_seq_length(made) or 0)  # a right-padded prefill's pads included
        keep_cache(model, made, plan.run.made_cache_slots, written)

    # 8. Strip the padding off what the user gets back.
    return strip_output(output, plan)


@dataclasses.dataclass(frozen=True)
class PreparedCall:
    """What steps 1 to 4 decided: the arguments upstream `generate` runs with, and the plan of a bucketed call."""

    arguments: dict
    model_kwargs: dict
    plan: Plan | None = None  # `None`: upstream's call, as the user made it
    after: Callable[[], None] | None = None  # an unbucketed call: what to record once it ran


def _prepare(call: ResolvedCall) -> PreparedCall:
    """Steps 2 to 4 of a resolved call: its support, its padding decided, its plan (see the module docstring)."""
    if not call.bucketed:
        return PreparedCall(call.arguments, call.model_kwargs, after=_warn_unbucketed(call))
    # 2. Check support: the hooked steps of upstream `generate` (once per class that passes: the gate keeps it).
    if type(call.model) not in PROCESS.upstream_passed:
        hooks.check_upstream(type(call.model), generate=generate)
    # 3. Decide: left, right or unpadded (every reason the call runs unpadded, or raises, is decided there).
    side = choose_side(call)
    if side.side == "unpadded":
        logger.warning_once(
            f"The prefill bucket fields ({', '.join(f'`{f}`' for f in BUCKET_FIELDS)}) are ignored for this call: "
            f"{side.reason}."
        )
        return PreparedCall(call.arguments, call.model_kwargs)
    # 4. Plan: pad the prompt and the batch.
    plan, arguments, model_kwargs = plan_call(call, side)
    return PreparedCall(arguments, model_kwargs, plan=plan)


def _warn_refused(model, refused: int) -> None:
    """Warns when torch refused `refused` compiles at its recompile limit during a call that ran unpadded."""
    if refused > 0:
        times = "once" if refused == 1 else f"{refused} times"
        logger.warning(
            f"Torch refused to compile the forward of `{model_name(model)}` {times} at its "
            f"`torch._dynamo.config.recompile_limit` ({torch_api.recompile_limit()}) during this call, which ran "
            "unpadded (the warning that the prefill bucket fields are ignored says why): as in upstream's own call, it "
            "ran those forwards eagerly (same outputs, uncompiled). Raise the limit for calls like this one."
        )


def _warn_unbucketed(call: ResolvedCall):
    """
    The advice for a call without buckets: upstream runs unchanged, this only says what it will cost. Returns a
    function to call after the call (it records the shapes the call compiled for), or `None`.
    """
    model, compiled = call.model, call.compiled_forward
    if call.wrapper is not None and compiled is None:
        logger.warning_once(
            "`generate` was called on the `torch.compile(model)` wrapper (an `OptimizedModule`), which hands "
            "`generate` to the module it wraps: every forward of this call runs eagerly, and no compiled graph is "
            f"used. Set `{PREFILL_BUCKETS}` (the call then runs through the wrapper's compiled forward, with one graph "
            "per bucket), or compile in place with `model.compile(...)`."
        )
    if compiled is None:
        return None
    prompt = call.prompt
    if not isinstance(prompt, torch.Tensor) or prompt.ndim < 2 or not call.static_cache:
        return None
    state = state_of(model)
    state.unbucketed_prompt_lengths.add(call.prompt_length)
    if len(state.unbucketed_prompt_lengths) == 2:
        logger.warning_once(
            f"The model's forward is compiled ({compiled}) and generates with a static cache, so each new prompt "
            f"length recompiles it, and past torch's `torch._dynamo.config.recompile_limit` ({torch_api.recompile_limit()} "
            f"graphs of the forward) torch runs the rest eagerly. Set `{PREFILL_BUCKETS}` (for example 'pow2-quarters') "
            f"or `{PREFILL_PAD_TO_MULTIPLE_OF}`, or pad with the tokenizer's `pad_to_multiple_of` and "
            "`padding_side='left'`."
        )
    rows, length = call.output_rows, call.prompt_length

    def record():  # its shapes share the limit: counted, the limit left alone
        cache_length = transformers_api.previous_max_cache_length(model)
        budget_of(model).add(rows, ((length, None),), cache_length, variant=graph_variant())

    return record

"""The benchmark's strategies: the ways to run the workload, and which of them each kind of run uses."""

from dataclasses import dataclass, field

from ..buckets import BucketPolicy


CHUNK = 128  # chunk size (and padding multiple) of the `chunked` strategy
SHUFFLE_SEED = 0  # the order of a `shuffled` strategy's prompts: the same in every run
TINY_SLIDING = "tiny-sliding"  # the tiny Gemma-3-like model of `sliding.py`, built from a config


@dataclass(frozen=True)
class Strategy:
    """One way to run the workload."""

    name: str
    summary: str
    compiled: bool = True
    dynamic: bool | None = False  # `torch.compile(model.forward, dynamic=...)`
    fields: dict = field(default_factory=dict)  # prefill-buckets fields; empty: plain upstream `generate`
    prefill_chunk_size: int | None = None
    warm: bool = False  # precompile from a compile cache saved by a separate, earlier process
    pin_cache: bool = False  # `max_cache_len` for the workload's longest prompt, as a server would set it
    shuffled: bool = False  # the prompts in a seeded random order, not the file's
    # "generate": one `generate` call per prompt; "batch": every prompt in one `generate` call; "continuous":
    # transformers' continuous batching, `model.generate_batch` (see `batched.py`).
    kind: str = "generate"
    cb_config: dict = field(default_factory=dict)  # `ContinuousBatchingConfig` fields of a "continuous" strategy
    # Started from torch's own saved compile artifacts (`torch.compiler.save_cache_artifacts`), which the process of
    # the strategy named here saved at its end, after the same workload.
    artifacts_from: str | None = None
    model: str | None = None  # None: the run's model; `TINY_SLIDING`: the tiny sliding-window model
    # Upstream's own recipe: `generation_config.compile_config = CompileConfig(**compile_config)` (on CPU with its
    # private `_compile_all_devices`), so `generate` compiles the decode step itself and runs prefill eagerly; the
    # forward itself is not compiled. `None`: the strategy compiles (or not) `model.forward` as `compiled` and
    # `dynamic` say.
    compile_config: dict | None = None


# The reference strategy of each model: it runs first, uncompiled, and its tokens are what the others must equal.
REFERENCE = {None: "eager", TINY_SLIDING: "sliding-eager"}


STRATEGIES = {
    s.name: s
    for s in (
        Strategy("eager", "no compile, static cache (the reference tokens)", compiled=False),
        Strategy("upstream-static", "torch.compile(model.forward, dynamic=False), static cache, no padding"),
        Strategy(
            "decode-only",
            "upstream's own recipe: generation_config.compile_config = CompileConfig() (prefill eager, decode compiled "
            "by generate, on CPU with compile_on_all_devices), static cache, max_cache_len for the longest prompt, "
            "no bucket fields",
            compile_config={},
            pin_cache=True,
        ),
        Strategy("dynamic-auto", "torch.compile(model.forward, dynamic=None): automatic dynamic shapes", dynamic=None),
        Strategy(
            "dynamic-auto-warm",
            "dynamic-auto started from torch's own compile artifacts (torch.compiler.save_cache_artifacts after "
            "dynamic-auto's cold pass, load_cache_artifacts in a new process): the warm peer of pow2-warm",
            dynamic=None,
            artifacts_from="dynamic-auto",
        ),
        Strategy("dynamic-true", "torch.compile(model.forward, dynamic=True)", dynamic=True),
        Strategy(
            "pow2-default",
            'the simplest config: prefill_buckets="pow2", dynamic=False, no max_cache_len, no precompile, the prompts '
            f"in a shuffled order (seed {SHUFFLE_SEED})",
            fields={"prefill_buckets": "pow2"},
            shuffled=True,
        ),
        Strategy(
            "quarters-default",
            'prefill_buckets="pow2-quarters" (4 buckets per doubling: at most 25% padding), '
            "torch.compile(model.forward) with dynamic=None (model.compile()'s default: the prefill's token dimension "
            "dynamic, one prefill graph for the buckets), no max_cache_len, no precompile, the prompts in a shuffled "
            f"order (seed {SHUFFLE_SEED})",
            dynamic=None,
            fields={"prefill_buckets": "pow2-quarters"},
            shuffled=True,
        ),
        Strategy(
            "quarters-static",
            "quarters-default compiled with dynamic=False: one static prefill graph per bucket",
            fields={"prefill_buckets": "pow2-quarters"},
            shuffled=True,
        ),
        Strategy("pow2", 'prefill_buckets="pow2", dynamic=False', fields={"prefill_buckets": "pow2"}),
        Strategy(
            "multiple-of-64", "prefill_pad_to_multiple_of=64, dynamic=False", fields={"prefill_pad_to_multiple_of": 64}
        ),
        Strategy(
            "chunked",
            f"prefill_pad_to_multiple_of={CHUNK}, prefill_chunk_size={CHUNK}, no max_cache_len (bounded by default: "
            "one cache for the workload), dynamic=False",
            fields={"prefill_pad_to_multiple_of": CHUNK},
            prefill_chunk_size=CHUNK,
        ),
        Strategy(
            "chunked-pinned",
            f"prefill_pad_to_multiple_of={CHUNK}, prefill_chunk_size={CHUNK}, max_cache_len for the longest prompt, "
            "dynamic=False",
            fields={"prefill_pad_to_multiple_of": CHUNK},
            prefill_chunk_size=CHUNK,
            pin_cache=True,
        ),
        Strategy(
            "pow2-warm",
            'prefill_buckets="pow2" (the powers of two the prompts reach) + precompile(), compiled with aot_forward, '
            "from a compile cache saved by an earlier process (which traces and compiles nothing)",
            fields={"prefill_buckets": "pow2"},
            warm=True,
        ),
        Strategy(
            "quarters-warm",
            'pow2-warm with prefill_buckets="pow2-quarters"',
            fields={"prefill_buckets": "pow2-quarters"},
            warm=True,
        ),
        Strategy(
            "sliding-eager",
            "tiny Gemma-3-like model (a sliding-window layer and a full one, built from a config): no compile, static "
            "cache (the reference tokens of the sliding pair)",
            compiled=False,
            model=TINY_SLIDING,
        ),
        Strategy(
            "sliding-upstream-static",
            "tiny Gemma-3-like model: torch.compile(model.forward, dynamic=False), static cache, no padding",
            model=TINY_SLIDING,
        ),
        Strategy(
            "sliding-pow2",
            'tiny Gemma-3-like model: prefill_buckets="pow2", dynamic=False, no max_cache_len',
            fields={"prefill_buckets": "pow2"},
            model=TINY_SLIDING,
        ),
        Strategy(
            "batch-eager",
            "every prompt in one generate() call (left-padded to the longest), no compile, static cache",
            compiled=False,
            kind="batch",
        ),
        Strategy(
            "batch-pow2",
            'every prompt in one generate() call: prefill_buckets="pow2", prefill_batch_buckets="pow2", '
            "precompile() for the batch's shape, then the call; dynamic=False",
            fields={"prefill_buckets": "pow2", "prefill_batch_buckets": "pow2"},
            kind="batch",
        ),
        Strategy(
            "cb-eager",
            "continuous batching: model.generate_batch(every prompt), paged cache sized for the workload, no compile",
            compiled=False,
            kind="continuous",
        ),
        Strategy(
            "cb-level1",
            "continuous batching, default_compile_level=1 (varlen path: mode=default, dynamic=True; the decode fast "
            "path is CUDA/XPU only)",
            kind="continuous",
            cb_config={"default_compile_level": 1},
        ),
        Strategy(
            "cb-level3",
            "continuous batching, default_compile_level=3 (varlen path: mode=max-autotune-no-cudagraphs, "
            "dynamic=False)",
            kind="continuous",
            cb_config={"default_compile_level": 3},
        ),
        Strategy(
            "cb-static",
            "continuous batching, varlen_compile_config=CompileConfig(dynamic=False, fullgraph=False, mode=default): "
            "static shapes, queries padded to q_padding_interval_size (64)",
            kind="continuous",
            cb_config={"varlen_compile_config": {"dynamic": False, "fullgraph": False, "mode": "default"}},
        ),
    )
}

# The default run: eager; upstream's own recipe (`decode-only`: `compile_config`, prefill eager, decode compiled by
# `generate`), the peer a compiled, bucketed prefill has to beat (issue 66); the strongest upstream recipe on CPU that
# compiles prefill too (automatic dynamic shapes); and the bucketed config the guide recommends
# (`prefill_buckets="pow2-quarters"`, issue 35), compiled as `model.compile()` compiles by default (`dynamic=None`: one
# shape-generic prefill graph serves the buckets, decode static per cache size and window). Compiling dominates its
# time: one inductor graph of SmolLM2 takes 30-130 s on a shared 2-core CPU. `quarters-static` (one static graph per
# bucket: `dynamic=False`), `pow2-default` and `chunked` run with `--full` or `--strategies`, as `upstream-static`
# (which stops compiling at the recompile limit and runs the rest eagerly) and `pow2-warm` (whose saved cache costs a
# second, compiling process) do.
DEFAULT_STRATEGIES = ("eager", "decode-only", "dynamic-auto", "quarters-default")
# The reference of the report's "against upstream's recipe" table: compiled strategies' first token by bucket, total
# time and payback are measured against it, side by side in one run.
BASELINE = "decode-only"
QUICK_STRATEGIES = ("eager", "pow2")
# The sliding-window pair (issue 28): upstream's static cache + compile against bucketed + compile, on a tiny model.
SLIDING_STRATEGIES = ("sliding-upstream-static", "sliding-pow2")
# Batch against batch: continuous batching and bucketed generate with every prompt in one call (`--full` runs them).
BATCH_STRATEGIES = ("batch-eager", "batch-pow2", "cb-eager", "cb-level1", "cb-static")


def compiles_prefill(strategy: Strategy) -> bool:
    """
    Whether the strategy's prefill runs compiled: a compiled strategy's, but not upstream's own recipe's
    (`compile_config`: decode only) nor continuous batching's (its own step function)."""
    return strategy.compiled and strategy.compile_config is None and strategy.kind != "continuous"


def bucket_policy(strategy: Strategy) -> BucketPolicy | None:
    """The strategy's prompt-length policy (what `padding_waste` measures), or None for an unbucketed one."""
    if not strategy.fields:
        return None
    if strategy.kind != "generate":
        return None  # a batch is padded to its longest prompt's bucket, and continuous batching packs the prompts
    return BucketPolicy(
        buckets=strategy.fields.get("prefill_buckets"),
        pad_to_multiple_of=strategy.fields.get("prefill_pad_to_multiple_of"),
    )

"""
GPU tests: bucketed `generate` on CUDA, compiled by inductor with `mode="reduce-overhead"` (CUDA graphs), in bf16.

Run them with `RUN_SLOW=1 python -m pytest tests/generation/test_gpu.py -rs` on a machine with a CUDA GPU, or with
`bash utils/gpu_check.sh`, which also runs the GPU benchmark and writes a summary. Elsewhere every test skips, with
its reason (`test requires CUDA`, or `test is slow` without `RUN_SLOW`).

Setup (once for the class: compiling is what takes the time)
- A random Llama-shaped model in bf16 on CUDA: hidden size 512, 4 layers, 8 heads (4 key/value heads), vocabulary 256,
  initializer range 0.006 (see the tolerance rule for why), and an uncompiled copy with the same weights as the
  eager reference.
- Compiled through upstream's own compiled call: `compile_config=CompileConfig(backend=COUNTER_BACKEND,
  mode="reduce-overhead", fullgraph=True, dynamic=False)`. With bucket fields set, prefill goes through that compiled
  call too (one chunk of the padded prompt), so every forward of a call runs compiled. `COUNTER_BACKEND` is a
  registered name whose backend is a `GraphCounter` around inductor.
- Buckets `[32, 64, 128]`, static cache pinned to 256 (`max_cache_len`), batch size 1, then `precompile`.

What is counted
- Graphs: `GraphCounter` (`graphs`: graphs compiled, `calls`: runs of compiled code) and dynamo's own
  `counters["stats"]["unique_graphs"]`. Bound after `precompile`: one prefill graph per bucket and one decode graph,
  `len(BUCKETS) + 1 = 4`. `GraphCounter("inductor")` cannot be used as is here: `torch.compile` hands the mode to a
  non-inductor backend as `mode="reduce-overhead"`, and `GraphCounter` passes it on to inductor's `compile_fx`, which
  takes no `mode` (TypeError). So the counter wraps `_inductor_backend`, which applies `mode` and `options` the way
  `torch.compile(backend="inductor")` does (`torch._TorchCompileInductorWrapper`).
- CUDA graphs: torch keeps no counter of recorded CUDA graphs (read in the 2.13 source; 2.11 is taken to be alike,
  with the fallbacks below if not). `counters["inductor"]` has `cudagraph_skips`
  (graphs that cudagraph trees refused to capture, each with a logged reason) and
  `cudagraph_recorded_non_static_inputs` (a count of inputs, not graphs). `CudaGraphRecorder` counts captures by
  wrapping `torch._inductor.cudagraph_trees.CUDAGraphTreeManager.record_function`, which runs once per CUDA graph
  recorded, a first recording or a re-recording (cudagraph trees run a function eagerly once as a warm-up, record it
  on its second run, then replay it; they re-record when a static input moved or a function is reached from a new
  place in the tree). If that method is missing it counts the nodes of the cudagraph trees instead
  (`get_manager(device).roots`, recursively), and if that is missing too, the CUDA-graph test skips. It also keeps
  the skip messages (the `warning`s of `torch._inductor.cudagraph_utils`' loggers) and why recorded graphs could not
  be replayed (`CUDAGraphNode.check_invariants` statuses), for the failure messages. Bound: at most one CUDA graph
  per compiled graph, no skips, and nothing recorded once every graph has run twice.

Tolerance rule (tokens against eager, bf16)
For each prompt, the compiled, bucketed run (C) and the eager, unpadded run of the reference model (E) generate
`NEW_TOKENS` tokens greedily (`min_new_tokens == max_new_tokens`), with `output_logits=True`: the raw logits of
every step, float32 copies of the model's bf16 logits. Let `k` be the first step whose tokens differ (`k = N` when
all are equal). Up to `k` both runs see the same context, so:
1. Logits agree: at every step `t <= min(k, N - 1)`, `max_v |C_t[v] - E_t[v]| <= LOGIT_TOL * max_v |E_t[v]|`, with
   `LOGIT_TOL = 2**-5`, that is 4 to 8 bf16 units in the last place of the largest logit (bf16 keeps 8 significant
   bits). A non-finite compiled logit fails.
2. A divergence is a near-tie: if `k < N`, eager's own margin for its token over the compiled token,
   `(E_k[e_k] - E_k[c_k]) / max_v |E_k[v]|`, is at most `TIE_TOL = 2**-5`. Tokens after `k` are not compared (the
   contexts differ).
3. Most prompts are exact: at least `MIN_EXACT_SHARE = 0.9` of the prompts have `k = N`, or diverge at an exact tie:
   eager's logits for `e_k` and `c_k` are the same bf16 number (margin 0), so eager's greedy choice was made by token
   index alone, and any rounding difference may pick the other one.
A masking, position or cache bug moves logits by a good part of their scale, which rule 1 catches at once. Rounding
differences (padding changes the kernels' shapes; inductor fuses ops that eager rounds to bf16 one by one) move them
by a few units in the last place, and only flip a token where eager's top two logits (nearly) tie. A random model has
many near-ties, its logits being close to Gaussian, and bf16 logits tie exactly on about 1% of steps. Measured on CPU
in bf16 with this model (inductor, bucketed, against eager, unpadded; 60 prompts of 5-120 tokens, 8 new tokens):
logits differed by at most 0.0102 of the largest logit, 56 prompts were exact, and the 4 divergences came at margins
0, 0, 0 and 0.004. With the default initializer range (0.02) noise is amplified more through the layers (even eager
padded against eager unpadded: 54 of 60 exact, against 60 of 60 at 0.006), and a larger vocabulary has more
near-ties (1024: 57 of 60 eager): hence the small initializer range and the vocabulary of 256.

Decode time
Median per-token decode time (CUDA events recorded at every step of `generate` by a stopping criterion, without a
synchronize) of the bucketed model against upstream's own fast path on the same prompt: a static cache and the
default `compile_config`, which on CUDA compiles decode only (inductor, `reduce-overhead`) and runs prefill eagerly.
Ours must be at most `DECODE_SLOWDOWN = 1.05` times upstream's, plus `DECODE_EPS_MS = 0.1` ms for timing jitter and
the few Python calls the bucket hooks add to a step.

Numbers measured here (precompile time, graph and CUDA-graph counts, decode medians, exact share) are written to
`$PREFILL_BUCKETS_GPU_RESULTS/gpu_test_metrics.json` when that variable is set (`utils/gpu_check.sh` sets it).
"""

import json
import logging
import os
import random
import statistics
import time
import unittest
from collections import Counter
from dataclasses import dataclass

import torch
from torch._dynamo.backends.registry import register_backend
from transformers import (
    CompileConfig,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    StoppingCriteria,
    StoppingCriteriaList,
)
from transformers.testing_utils import require_torch_gpu, slow

import prefill_buckets
from prefill_buckets import GraphCounter


PAD, EOS, BOS = 0, 1, 2
VOCAB = 256
FIRST_PROMPT_ID = 3  # prompt ids are above pad, eos and bos
BUCKETS = [32, 64, 128]
CACHE_LEN = 256  # holds the largest bucket plus DECODE_NEW_TOKENS
GRAPH_BOUND = len(BUCKETS) + 1  # batch size 1: a prefill graph per bucket and one decode graph
NEW_TOKENS = 8
NUM_RANDOM_LENGTHS = 50
NUM_TOKEN_PROMPTS = 50

LOGIT_TOL = 2**-5
TIE_TOL = 2**-5
MIN_EXACT_SHARE = 0.9

DECODE_PROMPT_LENGTH = 100
DECODE_NEW_TOKENS = 64
DECODE_WARMUP_CALLS = 3
DECODE_REPEATS = 5
DECODE_SLOWDOWN = 1.05
DECODE_EPS_MS = 0.1

DEVICE = "cuda"
RESULTS_ENV = "PREFILL_BUCKETS_GPU_RESULTS"
METRICS: dict[str, object] = {}


def record_metric(name: str, value) -> None:
    """Keeps a measured number for the summary of `utils/gpu_check.sh` (written at once: a later crash keeps it)."""
    METRICS[name] = value
    folder = os.environ.get(RESULTS_ENV)
    if folder:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "gpu_test_metrics.json"), "w") as f:
            json.dump(METRICS, f, indent=1)


# ---- counting backend ------------------------------------------------------------------------------------------------


def _inductor_backend(gm, example_inputs, mode=None, options=None, **kwargs):
    """Inductor, with `torch.compile`'s `mode` and `options` applied as `torch.compile(backend="inductor")` does."""
    return torch._TorchCompileInductorWrapper(mode, options, False)(gm, example_inputs, **kwargs)


# `generate` deep-copies `compile_config` and recompiles when the copy differs from the last one: a registered name
# compares equal. It is registered once per process, and hands each graph to the counter of the running class.
COUNTER_BACKEND = "pb_gpu_inductor_counter"
_active_counter: dict[str, GraphCounter | None] = {"counter": None}


def _counting_backend(gm, example_inputs, **kwargs):
    counter = _active_counter["counter"]
    if counter is None:
        raise RuntimeError(f"The `{COUNTER_BACKEND}` backend was used outside the GPU tests that set its counter.")
    return counter(gm, example_inputs, **kwargs)


if COUNTER_BACKEND not in torch._dynamo.list_backends(exclude_tags=()):
    register_backend(name=COUNTER_BACKEND, compiler_fn=_counting_backend)


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def cudagraph_skips() -> int:
    return torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def prefill_lengths(graph_shapes: list[tuple]) -> list[int]:
    """Sequence lengths of the prefill graphs (first input `input_ids` [B, S], S > 1), in compile order."""
    return [shapes[0][1] for shapes in graph_shapes if shapes and len(shapes[0]) == 2 and shapes[0][1] > 1]


# ---- counting CUDA graphs --------------------------------------------------------------------------------------------


class CudaGraphRecorder:
    """
    Counts the CUDA graphs that cudagraph trees (inductor's `mode="reduce-overhead"`) record, and keeps why graphs
    were skipped or re-recorded. See the module docstring for what is counted and the fallbacks.
    """

    def __init__(self):
        self.method: str | None = None
        self.skip_messages: list[str] = []
        self.replay_misses: Counter = Counter()  # non-success `check_invariants` statuses, by name
        self._recorded = 0
        self._paused = False
        self._undo: list = []

    def start(self) -> None:
        try:
            from torch._inductor import cudagraph_trees, cudagraph_utils
        except ImportError:
            return
        manager_cls = getattr(cudagraph_trees, "CUDAGraphTreeManager", None)
        if manager_cls is not None and "record_function" in vars(manager_cls):
            self._wrap_method(manager_cls, "record_function", self._count_recording)
            self.method = "CUDAGraphTreeManager.record_function calls"
        elif hasattr(cudagraph_trees, "get_manager"):
            self.method = "cudagraph tree nodes"
        node_cls = getattr(cudagraph_trees, "CUDAGraphNode", None)
        if node_cls is not None and "check_invariants" in vars(node_cls):
            self._wrap_method(node_cls, "check_invariants", self._note_invariants)
        for name in ("cudagraphs_log", "perf_hint_log"):
            logger = getattr(cudagraph_utils, name, None)
            if isinstance(logger, logging.Logger) and "warning" not in vars(logger):
                self._wrap_warning(logger)

    def stop(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap_method(self, owner, name: str, make_wrapper) -> None:
        original = vars(owner)[name]
        setattr(owner, name, make_wrapper(original))
        self._undo.append(lambda: setattr(owner, name, original))

    def _count_recording(self, original):
        def record_function(manager, *args, **kwargs):
            if not self._paused:
                self._recorded += 1
            return original(manager, *args, **kwargs)

        return record_function

    def _note_invariants(self, original):
        def check_invariants(node, *args, **kwargs):
            result = original(node, *args, **kwargs)
            status = result[0] if isinstance(result, tuple) else result
            name = getattr(status, "name", repr(status))
            if name not in ("SUCCESS", "True") and not self._paused:
                self.replay_misses[name] += 1
            return result

        return check_invariants

    def _wrap_warning(self, logger: logging.Logger) -> None:
        original = logger.warning

        def warning(msg, *args, **kwargs):
            if not self._paused:
                try:
                    self.skip_messages.append(str(msg) % args if args else str(msg))
                except (TypeError, ValueError):
                    self.skip_messages.append(str(msg))
            return original(msg, *args, **kwargs)

        logger.warning = warning
        self._undo.append(lambda: vars(logger).pop("warning", None))

    @property
    def recorded(self) -> int:
        """CUDA graphs recorded so far (see `method`)."""
        if self.method is not None and self.method.startswith("CUDAGraphTreeManager"):
            return self._recorded
        return self._tree_nodes()

    def _tree_nodes(self) -> int:
        from torch._inductor import cudagraph_trees

        manager = cudagraph_trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
        if manager is None or getattr(manager, "roots", None) is None:
            return 0
        nodes = [node for roots in manager.roots.values() for node in roots]
        count = 0
        while nodes:
            node = nodes.pop()
            count += 1
            nodes.extend(child for children in node.children.values() for child in children)
        return count

    def paused(self):
        """A context in which recordings, misses and messages are not counted (another model's graphs)."""
        recorder = self

        class _Paused:
            def __enter__(self):
                recorder._paused = True

            def __exit__(self, *exc):
                recorder._paused = False

        return _Paused()

    def describe(self) -> str:
        messages = Counter(message.splitlines()[0][:300] for message in self.skip_messages)
        return (
            f"counted with: {self.method}; re-record reasons (check_invariants): {dict(self.replay_misses)}; "
            f"cudagraph warnings: {dict(messages)}"
        )


# ---- models, prompts, configs ----------------------------------------------------------------------------------------


def make_model() -> LlamaForCausalLM:
    """A random Llama-shaped model, bf16 on CUDA. Built in fp32 on CPU from a fixed seed, so its weights don't depend on
    the GPU."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        initializer_range=0.006,
        pad_token_id=PAD,
        eos_token_id=EOS,
        bos_token_id=BOS,
    )
    return LlamaForCausalLM(config).eval().to(device=DEVICE, dtype=torch.bfloat16)


def copy_model(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """An uncompiled model with the weights of `model`."""
    copy = LlamaForCausalLM(model.config).eval().to(device=DEVICE, dtype=torch.bfloat16)
    copy.load_state_dict(model.state_dict())
    return copy


def make_prompt(length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * seed + length)
    return torch.randint(FIRST_PROMPT_ID, VOCAB, (1, length), generator=generator).to(DEVICE)


def bucketed_config(max_new_tokens: int = NEW_TOKENS, **kwargs) -> GenerationConfig:
    """Greedy, static cache pinned to `CACHE_LEN`, exactly `max_new_tokens` forwards per call, compiled through
    `compile_config` with CUDA graphs, buckets `BUCKETS` (stored on the config: `prefill_buckets.generate` reads them
    without `enable()`)."""
    return GenerationConfig(
        cache_implementation="static",
        max_cache_len=CACHE_LEN,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        compile_config=CompileConfig(backend=COUNTER_BACKEND, mode="reduce-overhead", fullgraph=True, dynamic=False),
        prefill_buckets=BUCKETS,
        **kwargs,
    )


def eager_config(max_new_tokens: int = NEW_TOKENS, **kwargs) -> GenerationConfig:
    """The reference: the same generation, unpadded and uncompiled (upstream would auto-compile decode on CUDA)."""
    return GenerationConfig(
        cache_implementation="static",
        max_cache_len=CACHE_LEN,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        disable_compile=True,
        **kwargs,
    )


# ---- the tolerance rule ----------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """One prompt under the tolerance rule of the module docstring."""

    length: int
    exact: bool
    problem: str | None  # why the prompt breaks rule 1 or 2, or None
    max_logit_diff: float  # max over the compared steps of max|C - E| / max|E|
    diverged_at: int | None = None
    margin: float | None = None  # eager's relative margin for its token over the compiled one, at the divergence

    @property
    def exact_or_tied(self) -> bool:
        """Exact for rule 3: equal tokens, or a first divergence at an exact tie of eager's bf16 logits."""
        return self.exact or (self.problem is None and self.margin == 0.0)


def compare_to_eager(
    length: int,
    compiled_tokens: list[int],
    compiled_logits: torch.Tensor,
    eager_tokens: list[int],
    eager_logits: torch.Tensor,
) -> Comparison:
    """
    Applies rules 1 and 2 to one prompt. Tokens: the new tokens only; logits: [steps, vocab] float32, step t being the
    logits the t-th new token was chosen from.
    """
    steps = len(eager_tokens)
    if len(compiled_tokens) != steps:
        return Comparison(length, False, f"{len(compiled_tokens)} new tokens, eager has {steps}", float("inf"))
    k = next((t for t in range(steps) if compiled_tokens[t] != eager_tokens[t]), steps)
    worst = 0.0
    for t in range(min(k + 1, steps)):
        scale = eager_logits[t].abs().max().item()
        diff = (compiled_logits[t] - eager_logits[t]).abs()
        relative = float("inf") if not torch.isfinite(diff).all() else diff.max().item() / scale
        worst = max(worst, relative)
        if relative > LOGIT_TOL:
            return Comparison(
                length, False, f"step {t}: logits differ by {relative:.4f} of the largest (> {LOGIT_TOL})", worst
            )
    if k == steps:
        return Comparison(length, True, None, worst)
    eager_token, compiled_token = eager_tokens[k], compiled_tokens[k]
    scale = eager_logits[k].abs().max().item()
    margin = (eager_logits[k][eager_token] - eager_logits[k][compiled_token]).item() / scale
    problem = None
    if margin > TIE_TOL:
        problem = (
            f"step {k}: compiled chose {compiled_token}, eager {eager_token} by a margin of {margin:.4f} of the "
            f"largest logit, not a near-tie (<= {TIE_TOL})"
        )
    return Comparison(length, False, problem, worst, diverged_at=k, margin=margin)


# ---- per-step timing -------------------------------------------------------------------------------------------------


class StepEvents(StoppingCriteria):
    """Records a CUDA event at every step of `generate` (after its token is chosen), without synchronizing."""

    def __init__(self):
        self.events: list[torch.cuda.Event] = []

    def __call__(self, input_ids, scores, **kwargs):
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append(event)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def step_ms(self) -> list[float]:
        """Milliseconds between consecutive steps: the decode steps (the first event closes prefill)."""
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in zip(self.events, self.events[1:])]


# ---- the tests -------------------------------------------------------------------------------------------------------


@require_torch_gpu
@slow
class BucketedCudaGraphsTest(unittest.TestCase):
    """Shares one compiled and precompiled model; each test checks its own calls, in any order."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        torch._dynamo.reset()
        cls.addClassCleanup(torch._dynamo.reset)
        cls.addClassCleanup(setattr, torch._dynamo.config, "recompile_limit", torch._dynamo.config.recompile_limit)
        cls.counter = GraphCounter(_inductor_backend)
        _active_counter["counter"] = cls.counter
        cls.addClassCleanup(_active_counter.__setitem__, "counter", None)
        cls.cuda_graphs = CudaGraphRecorder()
        cls.cuda_graphs.start()
        cls.addClassCleanup(cls.cuda_graphs.stop)
        cls.skips_before = cudagraph_skips()

        cls.model = make_model()
        cls.reference = copy_model(cls.model)
        cls.config = bucketed_config()
        start = time.perf_counter()
        cls.compiled = prefill_buckets.precompile(cls.model, cls.config, batch_sizes=(1,), progress=False)
        torch.cuda.synchronize()
        record_metric("precompile_seconds", round(time.perf_counter() - start, 1))
        cls.graphs_after_precompile = cls.counter.graphs
        cls.calls_after_precompile = cls.counter.calls
        cls.shapes_after_precompile = list(cls.counter.shapes)
        record_metric("graphs_after_precompile", cls.graphs_after_precompile)
        record_metric("graph_bound", GRAPH_BOUND)

    def generate(self, input_ids: torch.Tensor, config: GenerationConfig | None = None, **kwargs):
        return prefill_buckets.generate(
            self.model,
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config if config is not None else self.config,
            **kwargs,
        )

    def assert_no_new_graphs(self, graphs: int, unique: int, what: str):
        self.assertEqual(self.counter.graphs, graphs, f"{what} compiled a graph: {self.counter.shapes}")
        self.assertEqual(unique_graphs(), unique, f"{what} compiled a graph (dynamo's unique_graphs)")

    def test_graph_count_after_precompile(self):
        shapes = self.shapes_after_precompile
        self.assertEqual(self.graphs_after_precompile, GRAPH_BOUND, f"graphs: {shapes}")
        self.assertEqual(sorted(prefill_lengths(shapes)), BUCKETS, f"graphs: {shapes}")
        self.assertEqual(sum(shape.graphs for shape in self.compiled), GRAPH_BOUND, f"{self.compiled}")
        self.assertEqual([shape.prompt_length for shape in self.compiled], sorted(BUCKETS, reverse=True))
        self.assertEqual({shape.cache_length for shape in self.compiled}, {CACHE_LEN})
        # Every warm-up forward ran compiled: one prefill and one decode step per bucket.
        self.assertEqual(self.calls_after_precompile, 2 * len(BUCKETS), "a warm-up forward ran eagerly")

    def test_no_recompiles_across_random_lengths(self):
        rng = random.Random(0)
        lengths = [rng.randint(1, BUCKETS[-1]) for _ in range(NUM_RANDOM_LENGTHS)]
        graphs, unique = self.counter.graphs, unique_graphs()
        for call, length in enumerate(lengths):
            calls = self.counter.calls
            output = self.generate(make_prompt(length, seed=call))
            self.assertEqual(tuple(output.shape), (1, length + NEW_TOKENS))
            self.assertEqual(
                self.counter.calls - calls,
                NEW_TOKENS,
                f"call {call} (length {length}): {self.counter.calls - calls} compiled calls for {NEW_TOKENS} "
                "forwards; fewer means forwards ran eagerly",
            )
            self.assert_no_new_graphs(graphs, unique, f"call {call} (length {length})")
        self.assertLessEqual(self.counter.graphs, GRAPH_BOUND)

    def test_tokens_match_eager_within_bf16_rule(self):
        compiled_config = bucketed_config(return_dict_in_generate=True, output_logits=True)
        reference_config = eager_config(return_dict_in_generate=True, output_logits=True)
        rng = random.Random(1)
        comparisons = []
        for index in range(NUM_TOKEN_PROMPTS):
            length = rng.randint(1, BUCKETS[-1])
            input_ids = make_prompt(length, seed=100 + index)
            outputs = {}
            for name, run in (
                ("compiled", lambda: self.generate(input_ids, compiled_config)),
                (
                    "eager",
                    lambda: self.reference.generate(
                        input_ids, attention_mask=torch.ones_like(input_ids), generation_config=reference_config
                    ),
                ),
            ):
                output = run()  # a `ModelOutput`: keep copies of what is compared, and let the rest go
                outputs[name] = (
                    output.sequences[0, length:].tolist(),
                    torch.stack([logits[0] for logits in output.logits]).float().cpu(),
                )
                del output
            comparisons.append(compare_to_eager(length, *outputs["compiled"], *outputs["eager"]))

        exact = sum(c.exact_or_tied for c in comparisons)
        diverged = [(c.length, c.diverged_at, round(c.margin, 4)) for c in comparisons if c.diverged_at is not None]
        record_metric("token_prompts_identical", f"{sum(c.exact for c in comparisons)}/{len(comparisons)}")
        record_metric("token_prompts_exact_or_tied", f"{exact}/{len(comparisons)}")
        record_metric("token_max_logit_diff", round(max(c.max_logit_diff for c in comparisons), 5))
        record_metric("token_divergences (length, step, margin)", diverged)
        problems = [f"length {c.length}: {c.problem}" for c in comparisons if c.problem is not None]
        self.assertEqual(problems, [], "prompts that break the tolerance rule")
        self.assertGreaterEqual(
            exact / len(comparisons),
            MIN_EXACT_SHARE,
            f"{exact}/{len(comparisons)} prompts exact (or diverged at an exact tie); divergences (length, step, "
            f"margin): {diverged}",
        )

    def test_cuda_graphs_recorded_once_per_graph(self):
        recorder = self.cuda_graphs
        if recorder.method is None:
            self.skipTest("this torch exposes neither CUDAGraphTreeManager.record_function nor the cudagraph trees")
        graphs, unique = self.counter.graphs, unique_graphs()
        # Every bucket twice (its exact fit and a padded prompt): each prefill graph has had its warm-up run (the
        # precompile call) and its recording, and the decode graph ran many times.
        for bucket in BUCKETS:
            for length in (bucket, bucket - 5):
                self.generate(make_prompt(length, seed=3))
        settled = recorder.recorded
        rng = random.Random(2)
        for call in range(20):
            self.generate(make_prompt(rng.randint(1, BUCKETS[-1]), seed=200 + call))
        torch.cuda.synchronize()
        self.assert_no_new_graphs(graphs, unique, "traffic after precompile")
        skips = cudagraph_skips() - self.skips_before
        recorded = recorder.recorded
        record_metric("cuda_graphs_recorded", recorded)
        record_metric("cuda_graph_skips", skips)
        record_metric("cuda_graphs_counted_with", recorder.method)
        detail = f"{recorded} CUDA graphs recorded for {self.counter.graphs} compiled graphs; {recorder.describe()}"
        self.assertEqual(
            skips, 0, f"cudagraph trees skipped {skips} graph(s), which then run without CUDA graphs; {detail}"
        )
        self.assertGreaterEqual(recorded, 1, f"no CUDA graph was recorded; {detail}")
        self.assertLessEqual(recorded, self.counter.graphs, f"more CUDA graphs than compiled graphs; {detail}")
        self.assertEqual(recorded, settled, f"traffic re-recorded CUDA graphs ({settled} before it); {detail}")

    def test_decode_time_not_worse_than_upstream(self):
        upstream = copy_model(self.model)
        input_ids = make_prompt(DECODE_PROMPT_LENGTH, seed=7)
        attention_mask = torch.ones_like(input_ids)
        # Upstream's fast path: static cache and the default `compile_config` (decode compiled with CUDA graphs).
        upstream_config = GenerationConfig(
            cache_implementation="static",
            max_cache_len=CACHE_LEN,
            max_new_tokens=DECODE_NEW_TOKENS,
            min_new_tokens=DECODE_NEW_TOKENS,
            do_sample=False,
        )
        ours_config = bucketed_config(DECODE_NEW_TOKENS)
        graphs = self.counter.graphs

        def run_upstream(events):
            with self.cuda_graphs.paused():
                return upstream.generate(
                    input_ids,
                    attention_mask=attention_mask,
                    generation_config=upstream_config,
                    stopping_criteria=StoppingCriteriaList([events]),
                )

        def run_ours(events):
            return self.generate(input_ids, ours_config, stopping_criteria=StoppingCriteriaList([events]))

        runs = {"upstream": run_upstream, "prefill_buckets": run_ours}
        for _ in range(DECODE_WARMUP_CALLS):  # compile, CUDA-graph warm-up and recording
            for run in runs.values():
                run(StepEvents())
        samples = {name: [] for name in runs}
        for _ in range(DECODE_REPEATS):  # interleaved, so drift hits both alike
            for name, run in runs.items():
                events = StepEvents()
                output = run(events)
                self.assertEqual(output.shape[1], DECODE_PROMPT_LENGTH + DECODE_NEW_TOKENS)
                samples[name].extend(events.step_ms())
        self.assertEqual(self.counter.graphs, graphs, "the timed calls compiled a graph")

        medians = {name: statistics.median(values) for name, values in samples.items()}
        ratio = medians["prefill_buckets"] / medians["upstream"]
        record_metric("decode_ms_per_token_upstream", round(medians["upstream"], 4))
        record_metric("decode_ms_per_token_prefill_buckets", round(medians["prefill_buckets"], 4))
        record_metric("decode_ratio", round(ratio, 3))
        self.assertLessEqual(
            medians["prefill_buckets"],
            DECODE_SLOWDOWN * medians["upstream"] + DECODE_EPS_MS,
            f"median decode step: prefill_buckets {medians['prefill_buckets']:.4f} ms, upstream "
            f"{medians['upstream']:.4f} ms ({ratio:.2f}x; allowed {DECODE_SLOWDOWN}x + {DECODE_EPS_MS} ms); "
            f"CUDA graphs: {self.cuda_graphs.describe()}",
        )


if __name__ == "__main__":
    unittest.main()

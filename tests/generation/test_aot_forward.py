# Tests `compile/aot_forward.py`, and `compile/aot_key.py` through it (the guards a saved graph keeps; its dispatch key
# directly in test_aot_key.py); was test_aot_compiled.py.
#
# `aot_forward`: graphs compiled ahead of time that a compile cache file carries whole, so that a process that loads
# it traces nothing and compiles nothing.
#
# The fast tests compile with `aot_eager` (torch saves its graphs like inductor's, without generating code) and play
# the second process in this one: a new model object, dynamo reset, torch's counters cleared. The @slow test runs
# two real processes with inductor.

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
import zipfile
from unittest import mock

import torch
from torch._dynamo.utils import counters
from transformers import GenerationConfig, StaticCache
from transformers.testing_utils import CaptureLogger, slow
from transformers.utils import logging

import prefill_buckets
from prefill_buckets.compile import aot_forward
from prefill_buckets.state import PROCESS
from prefill_buckets.testing_utils import as_new_process
from prefill_buckets.upstream import checks

from .tiny_models import CACHE, tiny_llama


logger = logging.get_logger("prefill_buckets.compile.aot_forward")
# `aot_forward` raises a clear error on a torch older than 2.13 (tests/generation/test_checks.py tests it there).
AOT_FORWARD_SKIP = unittest.skipIf(checks.aot_compile_problem() is not None, "`aot_forward` raises on this torch")
CONFIG = {"cache_implementation": "static", "max_new_tokens": 3, "min_new_tokens": 3, "prefill_buckets": [4, 8]}
PROMPTS = [torch.tensor([[5, 6, 7]]), torch.tensor([[9, 8, 7, 6, 5, 4, 3]])]


def traced() -> int:
    """What dynamo traced in this process, by any path: ops captured (`aot_compile` doesn't count frames)."""
    return counters["stats"]["calls_captured"] + counters["frames"]["total"]


@AOT_FORWARD_SKIP
class AOTForwardTest(unittest.TestCase):
    def setUp(self):
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.path = os.path.join(tmp.name, "compile_cache.bin")
        torch._dynamo.reset()
        counters.clear()
        self.addCleanup(torch._dynamo.reset)
        self.enterContext(as_new_process())  # each test plays a new process: no compiled forwards of others to save

    def compiled_model(self, **overrides):
        model = tiny_llama(**overrides)
        model.forward = prefill_buckets.aot_forward(model, backend="aot_eager")
        return model

    def run_prompts(self, model) -> list[list[int]]:
        config = GenerationConfig(**CONFIG)
        prefill_buckets.precompile(model, config, progress=False)
        return [prefill_buckets.generate(model, prompt, generation_config=config).tolist() for prompt in PROMPTS]

    def expected(self, **overrides) -> list[list[int]]:
        """The tokens of the same prompts, uncompiled and unpadded."""
        model = tiny_llama(**overrides)
        config = GenerationConfig(**{k: v for k, v in CONFIG.items() if k != "prefill_buckets"})
        return [model.generate(prompt, generation_config=config).tolist() for prompt in PROMPTS]

    def new_process(self) -> None:
        """What a new process starts without: dynamo's compiled code, torch's counters, the compiled forwards."""
        torch._dynamo.reset()
        counters.clear()
        PROCESS.aot_forwards.clear()

    def test_warm_start_traces_nothing(self):
        tokens = self.run_prompts(self.compiled_model())
        self.assertEqual(tokens, self.expected())
        self.assertGreater(traced(), 0)  # the positive control: the cold process traced its graphs
        graphs = counters["stats"]["unique_graphs"]
        self.assertEqual(graphs, 3)  # prefill 8, prefill 4, decode
        saved = prefill_buckets.save_compile_cache(self.path)
        with open(self.path, "rb") as f:
            manifest = json.loads(zipfile.ZipFile(f).read("manifest.json"))
        self.assertEqual(len(manifest["aot_forwards"]), graphs)

        self.new_process()
        self.assertTrue(prefill_buckets.load_compile_cache(self.path, sha256=saved.sha256))
        model = self.compiled_model()
        self.assertEqual(self.run_prompts(model), tokens)
        self.assertEqual(traced(), 0, dict(counters["stats"]))
        self.assertEqual(counters["stats"]["unique_graphs"], 0)
        self.assertEqual(counters["aot_autograd"]["total"], 0)

        # The warm process saves the graphs it loaded: a third process starts as warm from its file.
        prefill_buckets.save_compile_cache(self.path)
        self.new_process()
        self.assertTrue(prefill_buckets.load_compile_cache(self.path))
        self.assertEqual(self.run_prompts(self.compiled_model()), tokens)
        self.assertEqual(traced(), 0, dict(counters["stats"]))

    def test_another_model_compiles_its_own(self):
        self.run_prompts(self.compiled_model())
        prefill_buckets.save_compile_cache(self.path)

        self.new_process()
        self.assertTrue(prefill_buckets.load_compile_cache(self.path))
        other = {"rope_theta": 500.0}  # same shapes: only the fingerprint tells the graphs apart
        model = self.compiled_model(**other)
        with CaptureLogger(logger) as captured:
            tokens = self.run_prompts(model)
        self.assertIn("are for another model", captured.out)
        self.assertEqual(captured.out.count("are for another model"), 1)
        self.assertEqual(counters["stats"]["unique_graphs"], 3)
        self.assertEqual(tokens, self.expected(**other))

    def test_another_thread_count_says_so(self):
        # torch's guards check `torch.get_num_threads()`: a replica that runs another count compiles every shape again,
        # which it says, naming the count to set. The same count warns nothing.
        threads = torch.get_num_threads()
        self.addCleanup(torch.set_num_threads, threads)
        torch.set_num_threads(2)
        tokens = self.run_prompts(self.compiled_model())
        prefill_buckets.save_compile_cache(self.path)
        for replica_threads, compiled in ((2, 0), (1, 3)):
            with self.subTest(replica_threads=replica_threads):
                self.new_process()
                torch.set_num_threads(replica_threads)
                self.assertTrue(prefill_buckets.load_compile_cache(self.path))
                model = self.compiled_model()
                with CaptureLogger(logger) as captured:
                    self.assertEqual(self.run_prompts(model), tokens)
                self.assertEqual((model.forward.graphs_loaded, model.forward.graphs_compiled), (3, compiled))
                said = "were compiled with 2 threads (`torch.get_num_threads()`), and this process runs 1"
                self.assertEqual(captured.out.count(said), 1 if compiled else 0, captured.out)
                if compiled:
                    self.assertIn("Call `torch.set_num_threads(2)`", captured.out)

    def test_new_shape_after_warm_start_compiles(self):
        self.run_prompts(self.compiled_model())
        prefill_buckets.save_compile_cache(self.path)
        self.new_process()
        prefill_buckets.load_compile_cache(self.path)
        model = self.compiled_model()
        self.run_prompts(model)
        self.assertEqual(traced(), 0)
        # A prompt past the buckets: a shape the file doesn't hold is compiled, and exact.
        config = GenerationConfig(**CONFIG)
        prompt = torch.arange(3, 15).view(1, -1)
        output = prefill_buckets.generate(model, prompt, generation_config=config)
        self.assertGreater(traced(), 0)
        reference = tiny_llama().generate(
            prompt, generation_config=GenerationConfig(**{k: v for k, v in CONFIG.items() if k != "prefill_buckets"})
        )
        self.assertEqual(output.tolist(), reference.tolist())

    def outer_compile_config(self):
        """A `compile_config` on every device: upstream compiles `model.__call__`, as with a static cache on CUDA."""
        from transformers import CompileConfig

        compile_config = CompileConfig(backend="eager", mode=None)
        compile_config._compile_all_devices = True
        return compile_config

    def test_upstream_compile_around_it_runs_its_graphs(self):
        # Plain `generate`: dynamo traces `model.__call__` and breaks at the forward, which runs its own graphs. Without
        # the break, dynamo traced the dispatch and `aot_compile` inside it and raised.
        model = self.compiled_model()
        config = GenerationConfig(**{k: v for k, v in CONFIG.items() if k != "prefill_buckets"})
        config.compile_config = self.outer_compile_config()
        tokens = [model.generate(prompt, generation_config=config).tolist() for prompt in PROMPTS]
        self.assertEqual(tokens, self.expected())
        self.assertEqual(model.forward.calls, 2 * 3)  # every forward ran one of its graphs
        self.assertEqual(model.forward.graphs_compiled, 4)  # per prompt: its prefill, and decode on a cache its size

    def test_bucketed_generate_does_not_compile_around_it(self):
        model = self.compiled_model()
        config = GenerationConfig(**CONFIG, compile_config=self.outer_compile_config())
        with CaptureLogger(logging.get_logger("prefill_buckets.call.hooks")) as captured:
            tokens = [prefill_buckets.generate(model, prompt, generation_config=config).tolist() for prompt in PROMPTS]
        self.assertEqual(tokens, self.expected())
        self.assertEqual(counters["frames"]["total"], 0)  # no outer `torch.compile` traced a frame
        self.assertEqual(model.forward.graphs_compiled, 3)  # prefill 4, prefill 8, decode
        self.assertEqual(captured.out.count("`compile_config` is not applied"), 1)

    def test_compiled_model_raises(self):
        model = tiny_llama()
        with self.assertRaisesRegex(ValueError, "not the `torch.compile\\(model\\)` wrapper"):
            prefill_buckets.aot_forward(torch.compile(model))
        model.compile()
        with self.assertRaisesRegex(ValueError, "the model is compiled with `model.compile\\(\\)`"):
            prefill_buckets.aot_forward(model)

    def test_fingerprint(self):
        base = aot_forward.model_fingerprint(tiny_llama())
        self.assertEqual(aot_forward.model_fingerprint(tiny_llama(seed=1)), base)  # weights are inputs, not part
        self.assertNotEqual(aot_forward.model_fingerprint(tiny_llama(rope_theta=500.0)), base)
        self.assertNotEqual(aot_forward.model_fingerprint(tiny_llama().to(torch.bfloat16)), base)
        self.assertNotEqual(aot_forward.model_fingerprint(tiny_llama(hidden_size=64)), base)

    def test_two_right_padded_turns_match_upstream(self):
        # The second turn's prefill is a bucket of 32 like the first, on a cache that holds the first turn: a graph of
        # its own (its query offset is read from the cache), not the fresh cache's (offset 0).
        model = self.compiled_model()
        tokens, logits = run_conversation(model, bucketed=True, padding_side="right")
        expected, expected_logits = run_conversation(tiny_llama(), bucketed=False)
        self.assertEqual(tokens, expected)
        for turn, (ours, theirs) in enumerate(zip(logits, expected_logits)):
            torch.testing.assert_close(ours, theirs, msg=f"turn {turn}")
        self.assertEqual(model.forward.graphs_compiled, 3)  # prefill on a fresh cache, on a continued one, decode
        self.assertEqual((model.forward.unkeyed, model.forward.eager_calls), ({}, 0))

        # The file carries the key: a new process dispatches the second turn to its own graph, tracing nothing.
        prefill_buckets.save_compile_cache(self.path)
        with zipfile.ZipFile(self.path) as archive:
            keys = [json.loads(meta["key"]) for meta in json.loads(archive.read("manifest.json"))["aot_forwards"]]
        self.assertEqual(len(keys), 3)
        self.assertIn([[CACHE, "get_query_offset", "prefill_buckets.upstream.transformers_api:_empty_query_offset"]],
                      [key["instance_functions"] for key in keys])  # fmt: skip
        self.new_process()
        self.assertTrue(prefill_buckets.load_compile_cache(self.path))
        model = self.compiled_model()
        self.assertEqual(run_conversation(model, bucketed=True, padding_side="right")[0], expected)
        self.assertEqual(traced(), 0)
        self.assertEqual((model.forward.graphs_loaded, model.forward.graphs_compiled), (3, 0))

    def test_two_left_padded_turns_match_upstream(self):
        model = self.compiled_model()
        tokens, logits = run_conversation(model, bucketed=True, padding_side="left")
        expected, expected_logits = run_conversation(tiny_llama(), bucketed=False)
        self.assertEqual(tokens, expected)
        for turn, (ours, theirs) in enumerate(zip(logits, expected_logits)):
            torch.testing.assert_close(ours, theirs, msg=f"turn {turn}")
        self.assertEqual((model.forward.unkeyed, model.forward.eager_calls), ({}, 0))
        prefill_buckets.save_compile_cache(self.path)
        self.new_process()
        self.assertTrue(prefill_buckets.load_compile_cache(self.path))
        model = self.compiled_model()
        self.assertEqual(run_conversation(model, bucketed=True, padding_side="left")[0], expected)
        self.assertEqual(traced(), 0)

    def test_state_the_key_cannot_name_runs_eagerly(self):
        # A closure set on the cache, which the forward calls: no saved guard and no key tells two of them apart.
        model = self.compiled_model()

        def cache_with_closure():
            cache = StaticCache(config=model.config, max_cache_len=64)

            def get_mask_sizes(*args, **kwargs):
                return StaticCache.get_mask_sizes(cache, *args, **kwargs)

            cache.get_mask_sizes = get_mask_sizes
            return cache

        config = GenerationConfig(**{k: v for k, v in CONFIG.items() if k != "cache_implementation"})
        with CaptureLogger(logger) as captured:
            tokens = prefill_buckets.generate(
                model, PROMPTS[0], generation_config=config, **{CACHE: cache_with_closure()}
            )
            self.assertEqual(tokens.tolist(), self.expected()[0])
            # The prefill calls it (decode gets its 4D mask from `generate`): it runs eagerly, decode compiled.
            forward = model.forward
            self.assertEqual((forward.eager_calls, forward.calls, forward.graphs_compiled), (1, 2, 1))
            self.assertEqual(len(aot_forward.compiled_functions()), 1)  # the prefill's graph is not saved
            # Another cache with another closure: the same key, eager at once, nothing compiled again.
            tokens = prefill_buckets.generate(
                model, PROMPTS[0], generation_config=config, **{CACHE: cache_with_closure()}
            )
            self.assertEqual(tokens.tolist(), self.expected()[0])
            self.assertEqual((forward.eager_calls, forward.calls, forward.graphs_compiled), (2, 4, 1))
        self.assertEqual(captured.out.count("can't tell this call's graph apart"), 1)
        self.assertIn(f"kwargs['{CACHE}'].get_mask_sizes", captured.out)

    def test_functions_set_on_modules_are_in_the_fingerprint(self):
        # Tensor parallelism sets `forward` on each sharded layer: a closure over the layer, its mesh and its plan.
        # Set when the model is built, it is part of the model (its fingerprint), and its graphs are kept.
        model = tiny_llama()
        mlp = model.model.layers[0].mlp
        original = mlp.forward

        def forward(*args, **kwargs):
            return original(*args, **kwargs)

        mlp.forward = forward
        self.assertNotEqual(aot_forward.model_fingerprint(model), aot_forward.model_fingerprint(tiny_llama()))
        model.forward = prefill_buckets.aot_forward(model, backend="aot_eager")
        self.assertEqual(self.run_prompts(model), self.expected())
        self.assertEqual((model.forward.graphs_compiled, model.forward.eager_calls, model.forward.unkeyed), (3, 0, {}))

    def test_objects_of_a_local_type_on_modules_are_in_the_fingerprint(self):
        # transformers 5.25 (which requires `kernels`) gives each attention module, in its `__init__`, wrappers of its
        # functions in `_kernel_funcs`, of a type defined in a function, which its forward reads: torch raised a
        # `TypeError` saving the guard on their type, and every forward of `aot_forward` failed. Played here on
        # transformers' own classes: an attention forward that reads such a wrapper (the same graphs, one more guard).
        class Identity(torch.nn.Module):  # defined here: its qualified name is not its name
            def forward(self, hidden_states):
                return hidden_states

        expected = self.expected()
        attention_class = type(tiny_llama().model.layers[0].self_attn)
        original = attention_class.forward

        def forward(self, *args, **kwargs):
            output = original(self, *args, **kwargs)
            return (self._kernel_funcs["identity"](output[0]), *output[1:])

        self.enterContext(mock.patch.object(attention_class, "forward", forward))

        def with_wrappers(model):
            for layer in model.model.layers:
                layer.self_attn.__dict__.setdefault("_kernel_funcs", {})["identity"] = Identity()
            return model

        model = with_wrappers(tiny_llama())
        self.assertNotEqual(aot_forward.model_fingerprint(model), aot_forward.model_fingerprint(tiny_llama()))
        model.forward = prefill_buckets.aot_forward(model, backend="aot_eager")
        tokens = self.run_prompts(model)
        self.assertEqual(tokens, expected)
        self.assertEqual((model.forward.graphs_compiled, model.forward.eager_calls, model.forward.unkeyed), (3, 0, {}))
        saved = prefill_buckets.save_compile_cache(self.path)

        self.new_process()
        self.assertTrue(prefill_buckets.load_compile_cache(self.path, sha256=saved.sha256))
        model = with_wrappers(tiny_llama())
        model.forward = prefill_buckets.aot_forward(model, backend="aot_eager")
        self.assertEqual(self.run_prompts(model), tokens)
        self.assertEqual(traced(), 0, dict(counters["stats"]))

    def test_two_right_padded_turns_in_a_second_process(self):
        model = self.compiled_model()
        expected = run_conversation(model, bucketed=True, padding_side="right")[0]
        self.assertEqual(expected, run_conversation(tiny_llama(), bucketed=False)[0])
        prefill_buckets.save_compile_cache(self.path)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        result = subprocess.run(
            [sys.executable, "-c", _CONVERSATION_PROCESS, root, self.path],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        second = json.loads(result.stdout.strip().splitlines()[-1])
        self.assertTrue(second["loaded"])
        self.assertEqual(second["tokens"], expected)
        self.assertEqual(
            (second["traced"], second["graphs_loaded"], second["graphs_compiled"]), (0, 3, 0), result.stderr[-3000:]
        )

    def test_a_file_saved_after_other_model_classes_loads(self):
        # A traced forward reads transformers' registry of what each model class records by its key's position, and
        # torch rebuilds that position when it loads the graph. A process that built a Mistral and a GPT-2 before its
        # Llama saves graphs whose position a replica, which builds the Llama alone, must have too.
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        runs = []
        for mode in ("save", "load"):
            result = subprocess.run(
                [sys.executable, "-c", _OTHER_CLASSES_FIRST_PROCESS, root, self.path, mode],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            self.assertEqual(result.returncode, 0, result.stderr[-3000:])
            runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
            self.assertNotIn("could not be loaded", result.stderr)
        saved, loaded = runs
        self.assertEqual((saved["graphs_loaded"], saved["graphs_compiled"]), (0, 3))  # the positive control
        self.assertEqual(loaded["tokens"], saved["tokens"])
        self.assertEqual(saved["tokens"], self.expected())
        self.assertEqual((loaded["traced"], loaded["graphs_loaded"], loaded["graphs_compiled"]), (0, 3, 0))


def run_conversation(model, bucketed: bool, padding_side: str = "auto") -> tuple[list, list]:
    """
    Two turns on one static cache: a prompt of 20 tokens, then the conversation plus 7 new tokens; bucketed with one
    bucket of 32 (or upstream's unpadded `generate`). The tokens of each turn and its logits.
    """
    cache = StaticCache(config=model.config, max_cache_len=96)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, return_dict_in_generate=True, output_logits=True)
    fields = {"prefill_buckets": [32], "prefill_padding_side": padding_side} if bucketed else {}
    ids = torch.randint(3, 128, (1, 20), generator=torch.Generator().manual_seed(0))
    tokens, logits = [], []
    for turn in range(2):
        if bucketed:
            out = prefill_buckets.generate(model, ids, generation_config=config, **{CACHE: cache}, **fields)
        else:
            out = model.generate(ids, generation_config=config, **{CACHE: cache})
        tokens.append(out.sequences.tolist())
        logits.append(torch.stack(out.logits))
        user = torch.randint(3, 128, (1, 7), generator=torch.Generator().manual_seed(turn + 1))
        ids = torch.cat([out.sequences, user], dim=1)
    return tokens, logits


# A second process: loads the file, runs the two right-padded turns, says what it traced.
_CONVERSATION_PROCESS = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from torch._dynamo.utils import counters
    import prefill_buckets
    from tests.generation.test_aot_forward import run_conversation, traced
    from tests.generation.tiny_models import tiny_llama

    loaded = prefill_buckets.load_compile_cache(sys.argv[2])
    model = tiny_llama()
    model.forward = prefill_buckets.aot_forward(model, backend="aot_eager")
    tokens = run_conversation(model, bucketed=True, padding_side="right")[0]
    forward = model.forward
    print(json.dumps(dict(
        loaded=loaded, tokens=tokens, traced=traced(), graphs_loaded=forward.graphs_loaded,
        graphs_compiled=forward.graphs_compiled,
    )))
    """
)

# A process that saves (after building two other model classes) or loads a file, then runs `CONFIG`'s prompts.
_OTHER_CLASSES_FIRST_PROCESS = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, sys.argv[1])
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GenerationConfig, MistralConfig, MistralForCausalLM
    import prefill_buckets
    from tests.generation.test_aot_forward import CONFIG, PROMPTS, traced
    from tests.generation.tiny_models import tiny_llama

    path, mode = sys.argv[2], sys.argv[3]
    if mode == "save":  # other classes first: the Llama's come after theirs in transformers' registry
        MistralForCausalLM(MistralConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
        GPT2LMHeadModel(GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2))
    else:
        prefill_buckets.load_compile_cache(path)
    model = tiny_llama()
    model.forward = prefill_buckets.aot_forward(model, backend="aot_eager")
    config = GenerationConfig(**CONFIG)
    tokens = [prefill_buckets.generate(model, prompt, generation_config=config).tolist() for prompt in PROMPTS]
    if mode == "save":
        prefill_buckets.save_compile_cache(path)
    forward = model.forward
    print(json.dumps(dict(
        tokens=tokens, traced=traced(), graphs_loaded=forward.graphs_loaded, graphs_compiled=forward.graphs_compiled,
    )))
    """
)


_PROCESS = textwrap.dedent(
    """
    import json, sys, torch
    from torch._dynamo.utils import counters
    from transformers import GenerationConfig, StaticCache
    import prefill_buckets
    sys.path.insert(0, {tests!r})
    from tiny_models import tiny_llama

    path, load, overrides = sys.argv[1], sys.argv[2] == "load", json.loads(sys.argv[3])
    loaded = prefill_buckets.load_compile_cache(path) if load else None
    model = tiny_llama(**overrides)
    model.forward = prefill_buckets.aot_forward(model)
    config = GenerationConfig(cache_implementation="static", max_new_tokens=3, min_new_tokens=3, prefill_buckets=[8])
    prefill_buckets.precompile(model, config, progress=False)
    tokens = prefill_buckets.generate(model, torch.tensor([[5, 6, 7, 8, 9]]), generation_config=config).tolist()
    reference = tiny_llama(**overrides).generate(
        torch.tensor([[5, 6, 7, 8, 9]]),
        generation_config=GenerationConfig(cache_implementation="static", max_new_tokens=3, min_new_tokens=3),
    ).tolist()
    if not load:
        prefill_buckets.save_compile_cache(path)
    print(json.dumps(dict(
        loaded=loaded, tokens=tokens, reference=reference,
        traced=counters["frames"]["total"] + counters["stats"]["calls_captured"],
        compiled=counters["aot_autograd"]["autograd_cache_miss"] + counters["inductor"]["fxgraph_cache_miss"],
        graphs=counters["stats"]["unique_graphs"],
    )))
    """
)


@slow
@AOT_FORWARD_SKIP
class AOTForwardProcessTest(unittest.TestCase):
    """Two processes with real inductor: the first compiles and saves, the second loads and compiles nothing."""

    def run_process(self, tmp: str, name: str, load: bool, overrides: dict) -> dict:
        script = _PROCESS.format(tests=os.path.dirname(__file__))
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, f"inductor-{name}"))
        command = [sys.executable, "-c", script, os.path.join(tmp, "cache.bin"), "load" if load else "save"]
        result = subprocess.run(
            command + [json.dumps(overrides)], env=env, capture_output=True, text=True, timeout=1500
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr

    def test_second_process_compiles_and_traces_nothing(self):
        with tempfile.TemporaryDirectory() as tmp:
            cold, _ = self.run_process(tmp, "cold", load=False, overrides={})
            self.assertEqual(cold["tokens"], cold["reference"])
            self.assertGreater(cold["traced"], 0)  # the positive control
            self.assertGreater(cold["compiled"], 0)

            warm, _ = self.run_process(tmp, "warm", load=True, overrides={})
            self.assertTrue(warm["loaded"])
            self.assertEqual((warm["traced"], warm["compiled"], warm["graphs"]), (0, 0, 0))
            self.assertEqual(warm["tokens"], cold["tokens"])

            # Another model config, same shapes: the graphs are refused, compiled cold, exact.
            other, stderr = self.run_process(tmp, "other", load=True, overrides={"rope_theta": 500.0})
            self.assertIn("are for another model", stderr)
            self.assertGreater(other["traced"], 0)
            self.assertGreater(other["compiled"], 0)
            self.assertEqual(other["tokens"], other["reference"])

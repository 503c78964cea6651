# Bucketed generate under transformers' tensor parallelism: 2 CPU ranks, gloo, a tiny Llama loaded with
# `from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))` (4 heads and 2 kv heads: 2 and 1 per
# rank), compiled with the counting backend.
#
# One 2-rank run serves every test: the ranks are started once (`setUpClass`, spawned processes, a process group with
# a short timeout), run every phase, and write what they saw to a JSON file per rank; the tests compare it with one
# process running the same workload on the same weights. The run is bounded: a rank still alive after
# `RUN_TIMEOUT_S` is killed, and the process group's own timeout turns a stuck collective into an error sooner.
# The last phase gives the ranks prompts of different buckets on purpose, and gloo aborts a rank: it comes last.

import contextlib
import datetime
import json
import os
import socket
import tempfile
import time
import traceback
import unittest
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.streamers import BaseStreamer
from transformers.utils import is_accelerate_available

import prefill_buckets
from prefill_buckets import GraphCounter
from prefill_buckets.distributed import check_same_inputs_across_ranks, rank_path, tensor_parallel_group

from .tiny_models import tiny_llama


WORLD_SIZE = 2
RUN_TIMEOUT_S = 240  # the whole 2-rank run, startup included: about 90 s on 2 busy cores
PROCESS_GROUP_TIMEOUT_S = 30
BUCKETS = [16, 32]
MAX_CACHE_LEN = 48
MAX_NEW_TOKENS = 5
LENGTHS = [3, 9, 16, 20, 31, 12]  # both buckets, an exact fit in each
BATCH_BUCKETS = [2, 4]
BATCH_SIZES = [3, 4]  # both padded to 4 rows
BATCH_LENGTH = 10
MODEL = {"num_hidden_layers": 1}  # heads split across 2 ranks; one layer keeps tracing short


def generation_config() -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        cache_implementation="static",
        max_cache_len=MAX_CACHE_LEN,
    )


def prompt(batch_size: int, length: int) -> torch.Tensor:
    """Token ids above pad (0), eos (1) and bos (2); the same on every rank for the same arguments."""
    seed = 1000 * batch_size + length
    return torch.randint(3, 128, (batch_size, length), generator=torch.Generator().manual_seed(seed))


def new_tokens(model, input_ids: torch.Tensor) -> list:
    """Upstream `generate`, unpadded: the reference."""
    return model.generate(input_ids, generation_config=generation_config())[:, input_ids.shape[1] :].tolist()


def run_workload(model, counter: GraphCounter) -> dict:
    """`precompile`, then bucketed calls at every length, then batch buckets: what one rank (or one process) sees."""
    config = generation_config()
    config.prefill_buckets = BUCKETS
    compiled = prefill_buckets.precompile(model, config, progress=False)
    result = {
        "precompiled": [[c.batch_size, c.prompt_length, c.cache_length, c.graphs] for c in compiled],
        "precompile_shapes": [list(map(list, shapes)) for shapes in counter.shapes],
        "graphs_after_precompile": counter.graphs,
        "tokens": {},
    }
    for length in LENGTHS:
        out = prefill_buckets.generate(model, prompt(1, length), generation_config=config)
        result["tokens"][str(length)] = out[:, length:].tolist()
    result["graphs_after_generate"] = counter.graphs
    result["batch_tokens"] = {}
    for batch_size in BATCH_SIZES:
        out = prefill_buckets.generate(
            model, prompt(batch_size, BATCH_LENGTH), generation_config=config, prefill_batch_buckets=BATCH_BUCKETS
        )
        result["batch_tokens"][str(batch_size)] = out[:, BATCH_LENGTH:].tolist()
    result["graphs_after_batch"] = counter.graphs
    return result


def _check_phase(model, rank: int) -> dict:
    """`check_same_inputs_across_ranks` on equal inputs, on other shapes per rank, and on other tokens per rank."""
    outcomes = {}
    cases = {
        "equal": prompt(1, 16),
        "other_shape": prompt(1, 16 if rank == 0 else 32),
        "other_tokens": prompt(1, 16) + rank,
    }
    for name, input_ids in cases.items():
        try:
            check_same_inputs_across_ranks(
                model, input_ids=input_ids, attention_mask=torch.ones_like(input_ids), inputs_embeds=None
            )
            outcomes[name] = None
        except ValueError as error:
            outcomes[name] = str(error)
    return outcomes


class _Tokens(BaseStreamer):
    """A streamer that keeps nothing: rank 0's alone, as a server that prints from rank 0 passes one."""

    def put(self, value):
        pass

    def end(self):
        pass


def _bad_input_phase(model, rank: int) -> dict:
    """
    Calls that only one rank gets wrong: a bad input (an empty prompt, an id outside the vocabulary), other
    `inputs_embeds` of the same shape, another `max_new_tokens`. What each rank raised, and how soon.
    """
    config = generation_config()
    good = prompt(1, 9)
    embeds = torch.randn(1, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    other_embeds = embeds.clone()
    other_embeds[0, 4, 7] = torch.nextafter(other_embeds[0, 4, 7], torch.tensor(1.0))  # one bit, on rank 1
    cases = {
        "empty_prompt": {"inputs": good if rank == 0 else good[:, :0]},
        "out_of_vocabulary": {"inputs": good if rank == 1 else torch.cat([good, torch.tensor([[999]])], dim=1)},
        "inputs_embeds": {"inputs_embeds": embeds if rank == 0 else other_embeds},
        "max_new_tokens": {"inputs": good, "max_new_tokens": MAX_NEW_TOKENS + rank},
        "streamer_on_rank_0": {"inputs": good, "streamer": _Tokens() if rank == 0 else None},  # not compared
    }
    outcomes = {}
    for name, kwargs in cases.items():
        dist.barrier()  # both ranks start the case together: the time is the call's
        start = time.perf_counter()
        try:
            prefill_buckets.generate(model, generation_config=config, prefill_buckets=BUCKETS, **kwargs)
            outcomes[name] = {"outcome": "returned"}
        except Exception as error:  # noqa: BLE001 - what each rank raises is the finding
            outcomes[name] = {"outcome": f"{type(error).__name__}: {error}"}
        outcomes[name]["seconds"] = time.perf_counter() - start
    return outcomes


def _compile_cache_phase(directory: str) -> dict:
    """Each rank saves and loads its own compile cache file (torch's artifact functions mocked: no inductor here)."""
    rank = dist.get_rank()
    artifacts = f"graphs of rank {rank}".encode()
    path = os.path.join(directory, "compile-cache-{rank}.zip")
    with (
        mock.patch.object(torch.compiler, "save_cache_artifacts", return_value=(artifacts, None)),
        mock.patch.object(torch.compiler, "load_cache_artifacts", return_value=object()) as load,
    ):
        prefill_buckets.save_compile_cache(rank_path(path))
        dist.barrier()  # every rank has written its file before any reads one, as in a second launch
        loaded = prefill_buckets.load_compile_cache(rank_path(path))
    try:
        rank_path(os.path.join(directory, "compile-cache.zip"))
        shared_path_error = None
    except ValueError as error:
        shared_path_error = str(error)
    return {
        "file": rank_path(path),
        "loaded": loaded,
        "artifacts_loaded": load.call_args.args[0].decode(),
        "shared_path_error": shared_path_error,
    }


def _aot_warm_start_phase(directory: str) -> dict:
    """
    `aot_forward` on the sharded model: a cold run compiles and saves each rank's file, then a warm one (a new
    process, played by a new model and no compiled forwards) loads it. Torch's counters tell what each traced.
    """
    from torch._dynamo.utils import counters

    from prefill_buckets.testing_utils import as_new_process

    def traced() -> int:
        return counters["stats"]["calls_captured"] + counters["frames"]["total"]

    path = rank_path(os.path.join(directory, "aot-cache-{rank}.zip"))
    config = generation_config()
    config.prefill_buckets = BUCKETS
    results = {}
    for launch in ("cold", "warm"):
        with as_new_process():  # a new process: no compiled forwards of the phases before
            if launch == "warm":
                results["loaded"] = prefill_buckets.load_compile_cache(path)
            before = traced()
            from transformers.distributed import DistributedConfig

            model = AutoModelForCausalLM.from_pretrained(
                os.path.join(directory, "model"), distributed_config=DistributedConfig(tp_plan="auto")
            )
            model.forward = prefill_buckets.aot_forward(model, backend="aot_eager")
            prefill_buckets.precompile(model, config, progress=False)
            tokens = {}
            for length in LENGTHS:
                out = prefill_buckets.generate(model, prompt(1, length), generation_config=config)
                tokens[str(length)] = out[:, length:].tolist()
            results[launch] = {
                "tokens": tokens,
                "traced": traced() - before,
                "graphs_compiled": model.forward.graphs_compiled,
                "graphs_loaded": model.forward.graphs_loaded,
            }
            if launch == "cold":
                results["saved"] = prefill_buckets.save_compile_cache(path) is not None
                dist.barrier()  # every rank has written its file
    return results


def _worker(rank: int, directory: str, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        TORCHINDUCTOR_CACHE_DIR=os.path.join(directory, "inductor"),
    )
    torch.set_num_threads(1)
    results = {}

    def record(key, value):
        results[key] = value
        path = os.path.join(directory, f"rank{rank}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(path + ".tmp", path)

    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=PROCESS_GROUP_TIMEOUT_S)
        )
        from transformers.distributed import DistributedConfig

        model = AutoModelForCausalLM.from_pretrained(
            os.path.join(directory, "model"), distributed_config=DistributedConfig(tp_plan="auto")
        )
        record("sharded", type(model.model.layers[0].self_attn.q_proj.weight).__name__)
        counter = GraphCounter()
        model.compile(backend=counter, dynamic=False, fullgraph=True)
        record("workload", run_workload(model, counter))
        record("check", _check_phase(model, rank))
        record("bad_input", _bad_input_phase(model, rank))
        record("compile_cache", _compile_cache_phase(directory))
        record("aot_warm_start", _aot_warm_start_phase(directory))

        # Other prompts in one bucket: without `generate`'s check the collectives match, and the activations they
        # sum don't...
        length = 10 if rank == 0 else 12
        with mock.patch("prefill_buckets.call.generation.ranks_agree", lambda *args: contextlib.nullcontext()):
            out = prefill_buckets.generate(
                model, prompt(1, length), generation_config=generation_config(), prefill_buckets=BUCKETS
            )
        record("same_bucket_other_prompt", out[:, length:].tolist())
        # ...with it, every rank raises the same error.
        try:
            prefill_buckets.generate(
                model, prompt(1, length), generation_config=generation_config(), prefill_buckets=BUCKETS
            )
            record("same_bucket_other_prompt_checked", "returned")
        except ValueError as error:
            record("same_bucket_other_prompt_checked", str(error))
        record("graphs_before_other_bucket", counter.graphs)

        # Last: prompts of different buckets (16 and 32). Precompiled, so nothing compiles; `generate`'s check raises
        # on every rank before a collective could mismatch.
        dist.barrier()
        record("other_bucket", "started")
        length = 10 if rank == 0 else 20
        start = time.perf_counter()
        try:
            prefill_buckets.generate(
                model, prompt(1, length), generation_config=generation_config(), prefill_buckets=BUCKETS
            )
            record("other_bucket", f"returned after {time.perf_counter() - start:.1f} s")
        except Exception as error:  # noqa: BLE001 - whatever the collective raises is the finding
            record("other_bucket", f"{type(error).__name__} after {time.perf_counter() - start:.1f} s: {error}")
    except BaseException:
        record("error", traceback.format_exc())
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipUnless(
    is_accelerate_available(), "transformers needs `accelerate` for `tp_plan`: pip install accelerate"
)
@unittest.skipUnless(dist.is_available() and dist.is_gloo_available(), "needs torch.distributed with gloo")
class TensorParallelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(tmp.cleanup)
        cls.directory = tmp.name
        tiny_llama(**MODEL).save_pretrained(os.path.join(cls.directory, "model"))

        # The 2-rank run, bounded in time.
        context = mp.get_context("spawn")
        port = _free_port()
        processes = [context.Process(target=_worker, args=(rank, cls.directory, port)) for rank in range(WORLD_SIZE)]
        start = time.perf_counter()
        for process in processes:
            process.start()

        try:
            # Meanwhile, in this process on the same weights: the unpadded tokens (the reference), and the workload.
            model = AutoModelForCausalLM.from_pretrained(os.path.join(cls.directory, "model")).eval()
            cls.reference = {str(length): new_tokens(model, prompt(1, length)) for length in LENGTHS + [10, 12]}
            cls.batch_reference = {str(b): new_tokens(model, prompt(b, BATCH_LENGTH)) for b in BATCH_SIZES}
            torch._dynamo.reset()
            counter = GraphCounter()
            model.compile(backend=counter, dynamic=False, fullgraph=True)
            cls.single = run_workload(model, counter)
            torch._dynamo.reset()

        finally:
            for process in processes:
                process.join(max(0.0, RUN_TIMEOUT_S - (time.perf_counter() - start)))
            cls.hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        cls.exitcodes = [process.exitcode for process in processes]
        cls.ranks = []
        for rank in range(WORLD_SIZE):
            path = os.path.join(cls.directory, f"rank{rank}.json")
            with open(path) if os.path.exists(path) else open(os.devnull) as f:
                cls.ranks.append(json.loads(f.read() or "{}"))

    def rank_results(self, key: str) -> list:
        for rank, results in enumerate(self.ranks):
            self.assertNotIn("error", results, f"rank {rank} failed before the last phase:\n{results.get('error')}")
            self.assertIn(key, results, f"rank {rank} did not get to `{key}` (exit code {self.exitcodes[rank]})")
        return [results[key] for results in self.ranks]

    def test_weights_are_sharded(self):
        self.assertEqual(self.rank_results("sharded"), ["DTensor"] * WORLD_SIZE)

    def test_tokens_equal_single_process_unpadded(self):
        for rank, workload in enumerate(self.rank_results("workload")):
            for length in LENGTHS:
                self.assertEqual(
                    workload["tokens"][str(length)], self.reference[str(length)], f"rank {rank}, {length}"
                )

    def test_graphs_per_rank_equal_single_process_bound(self):
        # Pinned cache: one prefill graph per bucket and one decode graph, then no recompiles for any length.
        self.assertEqual(self.single["graphs_after_precompile"], len(BUCKETS) + 1)
        self.assertEqual(self.single["graphs_after_generate"], self.single["graphs_after_precompile"])
        for rank, workload in enumerate(self.rank_results("workload")):
            for key in ("graphs_after_precompile", "graphs_after_generate", "graphs_after_batch"):
                self.assertEqual(workload[key], self.single[key], f"rank {rank}: {key}")

    def test_precompile_warms_same_graphs_in_same_order_on_every_rank(self):
        workloads = self.rank_results("workload")
        self.assertEqual([[batch, length] for batch, length, _, _ in self.single["precompiled"]], [[1, 32], [1, 16]])
        for rank, workload in enumerate(workloads):
            self.assertEqual(workload["precompiled"], self.single["precompiled"], f"rank {rank}")
            self.assertEqual(workload["precompile_shapes"], workloads[0]["precompile_shapes"], f"rank {rank}")
        self.assertEqual(len(workloads[0]["precompile_shapes"]), len(BUCKETS) + 1)

    def test_batch_buckets(self):
        for rank, workload in enumerate(self.rank_results("workload")):
            self.assertEqual(workload["batch_tokens"], self.batch_reference, f"rank {rank}")
        # One batch bucket (4 rows) for both calls: one prefill graph (bucket 16) and one decode graph.
        self.assertEqual(self.single["graphs_after_batch"] - self.single["graphs_after_generate"], 2)

    def test_check_same_inputs_raises_on_every_rank(self):
        for rank, outcomes in enumerate(self.rank_results("check")):
            self.assertIsNone(outcomes["equal"], f"rank {rank}")
            self.assertIn("different inputs", outcomes["other_shape"])
            self.assertIn("rank 0: attention_mask [1, 16]", outcomes["other_shape"])
            self.assertIn("rank 1: attention_mask [1, 32]", outcomes["other_shape"])
            self.assertIn("inputs_embeds=None", outcomes["other_shape"])
            self.assertIn("same shapes, different values", outcomes["other_tokens"])
        self.assertEqual(self.ranks[0]["check"], self.ranks[1]["check"])  # the same error on every rank

    def test_bad_input_on_one_rank_raises_on_every_rank(self):
        # Without the agreement, the rank with the bad input raised alone and its peer waited in the next collective
        # until the process group's timeout (PROCESS_GROUP_TIMEOUT_S).
        phases = self.rank_results("bad_input")
        expected = {
            "empty_prompt": "ValueError: The prompt is empty (0 tokens).",
            "out_of_vocabulary": "ValueError: `input_ids` holds the id 999, outside the model's vocabulary",
            "inputs_embeds": "ValueError: The tensor-parallel ranks of this model called `generate` with different "
            "inputs (same shapes, different values)",
            "max_new_tokens": "ValueError: The tensor-parallel ranks of this model called `generate` with different "
            "settings",
        }
        for name, opening in expected.items():
            with self.subTest(name):
                for rank, phase in enumerate(phases):
                    self.assertTrue(phase[name]["outcome"].startswith(opening), f"rank {rank}: {phase[name]}")
                    self.assertLess(phase[name]["seconds"], PROCESS_GROUP_TIMEOUT_S / 3, f"rank {rank}")
                self.assertEqual(phases[0][name]["outcome"], phases[1][name]["outcome"])  # the same error on both
        self.assertIn("Raised by tensor-parallel rank 1", phases[0]["empty_prompt"]["outcome"])
        self.assertIn("Raised by tensor-parallel rank 0", phases[1]["out_of_vocabulary"]["outcome"])
        self.assertRegex(phases[0]["inputs_embeds"]["outcome"], r"rank 1: .*inputs_embeds \[1, 9, 32\]")
        self.assertIn(
            f"max_new_tokens: {MAX_NEW_TOKENS} on rank 0, {MAX_NEW_TOKENS + 1} on rank 1",
            phases[0]["max_new_tokens"]["outcome"],
        )
        self.assertEqual([phase["streamer_on_rank_0"]["outcome"] for phase in phases], ["returned"] * WORLD_SIZE)

    def test_check_same_inputs_is_a_no_op_without_tensor_parallelism(self):
        model = tiny_llama(**MODEL)
        self.assertIsNone(tensor_parallel_group(model))
        with mock.patch.object(dist, "all_gather") as all_gather:
            check_same_inputs_across_ranks(model, input_ids=prompt(1, 3))
        all_gather.assert_not_called()

    def test_compile_cache_one_file_per_rank(self):
        caches = self.rank_results("compile_cache")
        self.assertEqual(len({cache["file"] for cache in caches}), WORLD_SIZE)
        for rank, cache in enumerate(caches):
            self.assertTrue(cache["file"].endswith(f"compile-cache-{rank}.zip"))
            self.assertTrue(cache["loaded"])
            self.assertEqual(cache["artifacts_loaded"], f"graphs of rank {rank}")
            self.assertIn("must contain `{rank}`", cache["shared_path_error"])
        self.assertEqual(rank_path("cache-{rank}.zip"), "cache-0.zip")  # one process: rank 0
        self.assertEqual(rank_path("cache.zip"), "cache.zip")

    def test_aot_forward_warm_start_traces_nothing(self):
        expected = {str(length): self.reference[str(length)] for length in LENGTHS}
        for rank, phase in enumerate(self.rank_results("aot_warm_start")):
            with self.subTest(rank=rank):
                self.assertTrue(phase["saved"])
                self.assertTrue(phase["loaded"])
                cold, warm = phase["cold"], phase["warm"]
                self.assertGreater(cold["traced"], 0)  # the positive control: the cold run traced its graphs
                self.assertEqual(cold["graphs_compiled"], len(BUCKETS) + 1)  # a prefill graph per bucket, decode
                self.assertEqual(warm["traced"], 0)
                self.assertEqual(warm["graphs_compiled"], 0)
                self.assertEqual(warm["graphs_loaded"], cold["graphs_compiled"])
                self.assertEqual(cold["tokens"], expected)
                self.assertEqual(warm["tokens"], expected)

    def test_other_prompt_in_same_bucket_is_silently_wrong(self):
        # Why the check matters: without it nothing fails, and both ranks return tokens of neither prompt...
        tokens = self.rank_results("same_bucket_other_prompt")
        self.assertEqual(tokens[0], tokens[1])
        self.assertNotEqual([self.reference["10"], self.reference["12"]], [tokens[0], tokens[1]])
        # ...and `generate` runs it: the same error on every rank.
        errors = self.rank_results("same_bucket_other_prompt_checked")
        # Padded on the right, upstream gets the prompts as passed (10 and 12 tokens): their shapes differ.
        self.assertIn("called `generate` with different inputs", errors[0])
        self.assertRegex(errors[0], r"rank 1: .*input_ids \[1, 12\]")
        self.assertEqual(errors[0], errors[1])

    def test_other_bucket_raises_on_every_rank(self):
        # Without the check, gloo aborts the rank that receives a larger all-reduce than it posted (SIGABRT, "Received
        # data size doesn't match expected size"). `generate`'s check raises one clear error on every rank first.
        self.rank_results("graphs_before_other_bucket")
        self.assertEqual(self.hung, [], f"ranks still running after {RUN_TIMEOUT_S} s")
        outcomes = [results.get("other_bucket") for results in self.ranks]
        for rank, outcome in enumerate(outcomes):
            self.assertTrue(outcome.startswith("ValueError"), f"rank {rank}: {outcome}")
            # The call is padded on the right, so `generate` hands upstream the prompts as passed: 10 and 20 tokens.
            self.assertRegex(outcome, r"rank 0: .*input_ids \[1, 10\]")
            self.assertRegex(outcome, r"rank 1: .*input_ids \[1, 20\]")
        self.assertEqual(self.exitcodes, [0] * WORLD_SIZE)


if __name__ == "__main__":
    unittest.main()


class RanksAgreeTest(unittest.TestCase):
    """`ranks_agree`'s verdict on what the ranks gathered, played in one process: this rank 0, a peer as rank 1."""

    def agree(self, inputs: dict, peer_inputs: dict, error: Exception | None = None, peer_error=None):
        from prefill_buckets import distributed

        peer = distributed._summarize_call(peer_inputs, {})
        peer["error"] = peer_error

        def all_gather_object(gathered, mine, group=None):
            gathered[:] = [mine, peer]

        with (
            mock.patch.object(distributed, "tensor_parallel_group", return_value=object()),
            mock.patch.object(dist, "get_world_size", return_value=2),
            mock.patch.object(dist, "all_gather_object", side_effect=all_gather_object) as gather,
        ):
            try:
                with distributed.ranks_agree(None, inputs, {}):
                    if error is not None:
                        raise error
            finally:
                self.assertEqual(gather.call_count, 1)  # every rank meets in the all-gather, whatever it raised

    def test_the_same_error_on_both_ranks(self):
        ids = {"input_ids": torch.ones(1, 3, dtype=torch.long)}
        with self.assertRaisesRegex(ValueError, r"bad prompt\n\(Raised by tensor-parallel ranks 0, 1;") as raised:
            self.agree(ids, ids, error=ValueError("bad prompt"), peer_error=["ValueError", "bad prompt"])
        self.assertIsInstance(raised.exception.__cause__, ValueError)

    def test_a_peer_s_error_is_raised_here(self):
        ids = {"input_ids": torch.ones(1, 3, dtype=torch.long)}
        with self.assertRaisesRegex(TypeError, r"^wrong type\n\(Raised by tensor-parallel rank 1;"):
            self.agree(ids, ids, peer_error=["TypeError", "wrong type"])
        with self.assertRaisesRegex(RuntimeError, r"^OwnError: odd\n\(Raised by tensor-parallel rank 1;"):
            self.agree(ids, ids, peer_error=["OwnError", "odd"])

    def test_float_inputs_compared_by_their_bits(self):
        zeros = torch.zeros(1, 2, 4)
        self.agree({"inputs_embeds": zeros}, {"inputs_embeds": zeros.clone()})  # equal: nothing raised
        with self.assertRaisesRegex(ValueError, r"different inputs \(same shapes, different values\)"):
            self.agree({"inputs_embeds": zeros}, {"inputs_embeds": -zeros})  # -0.0 == 0.0, but not its bits

"""Tests `serving_loads.py`: `PreparingLoader`, the loader transformers' server hands the process that loads a model
(transformers 5.25), which prepares the model there for `prefill-buckets serve`. Moved from test_serve_process.py,
whose `ModelProcessServeTest` runs both servers as a user does.

`PreparingLoaderTest` runs that loader on every version, in this process, after a pickle round trip, on the tiny Llama
folder of `test_serving.py`.
"""

import functools
import os
import pickle
import tempfile
import unittest
from unittest import mock

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils.import_utils import is_serve_available

import prefill_buckets
from prefill_buckets import GraphCounter, serving, serving_loads
from prefill_buckets.upstream import transformers_serve

from .tiny_models import SERVED_NEW_TOKENS, save_tiny_model


class FolderLoader:
    """Stands in for upstream's `ModelLoader` (5.25): loads a saved folder's model and tokenizer, on the CPU."""

    def load_model_and_processor(self, model_id: str, on_progress=None):
        return AutoModelForCausalLM.from_pretrained(model_id), AutoTokenizer.from_pretrained(model_id)


WARMUPS = []


def record_warmup(model, warm):
    WARMUPS.append(warm)


class PreparingLoaderTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.folder = os.path.join(self.tmp.name, "tiny-llama")
        save_tiny_model(self.folder)
        prefill_buckets.disable()
        self.addCleanup(prefill_buckets.disable)
        WARMUPS.clear()

    def test_the_model_loaded_in_another_process_is_prepared_there(self):
        options = serving.ServeOptions(buckets=[8, 16], max_new_tokens=SERVED_NEW_TOKENS, compile_with="none")
        prepare = functools.partial(serving.prepare_model, options=options)
        loader = pickle.loads(pickle.dumps(serving_loads.PreparingLoader(FolderLoader(), prepare, record_warmup)))
        model, tokenizer = loader.load_model_and_processor(self.folder)
        self.assertEqual(model.generation_config.prefill_buckets, [8, 16])
        self.assertEqual(model.generation_config.cache_implementation, "static")
        self.assertEqual([warm.buckets for warm in WARMUPS], [[8, 16]])
        # Its generate is the bucketed one: exact against upstream's on an unprepared copy, 5-token prompt in bucket 8.
        reference = AutoModelForCausalLM.from_pretrained(self.folder)
        prompt = torch.tensor([[5, 9, 17, 33, 60]])
        bucketed = model.generate(prompt, max_new_tokens=6, do_sample=False, tokenizer=tokenizer)
        prefill_buckets.disable()
        expected = reference.generate(prompt, max_new_tokens=6, do_sample=False)
        self.assertEqual(bucketed.tolist(), expected.tolist())

    @unittest.skipIf(
        not is_serve_available() or transformers_serve.serve_threads_rule() is None,
        "this transformers' server sets no thread count in the model's process",
    )
    def test_the_warm_up_runs_on_the_threads_the_model_serves_with(self):
        # transformers 5.25's model process sets torch to one thread once the model is loaded, for a model on an
        # accelerator; dynamo guards every graph on the thread count, so a warm-up run before would compile again at
        # the first requests. Played on the CPU by making the rule set one thread whatever the device.
        from transformers.cli.serving import utils as serving_utils

        threads = torch.get_num_threads()
        self.addCleanup(torch.set_num_threads, threads)
        torch.set_num_threads(2)
        counter = GraphCounter()
        options = serving.ServeOptions(
            buckets=[8, 16], max_new_tokens=SERVED_NEW_TOKENS, precompile=True, compile_with="model", backend=counter
        )
        loader = serving_loads.PreparingLoader(
            FolderLoader(), functools.partial(serving.prepare_model, options=options), record_warmup
        )
        one_thread = lambda device: torch.set_num_threads(1)  # noqa: E731
        with mock.patch.object(serving_utils, "set_torch_threads_for_serving", one_thread):
            model, tokenizer = loader.load_model_and_processor(self.folder)
            warmed_up = counter.graphs
            self.assertEqual(warmed_up, 2)  # one prefill graph for every bucket (`model.compile()`), and decode's
            transformers_serve.serve_threads_rule()(model.device)  # what the process does next (`run_engine`)
        prompt = torch.tensor([[5, 9, 17, 33, 60]])
        model.generate(prompt, max_new_tokens=4, do_sample=False, tokenizer=tokenizer)
        self.assertEqual(counter.graphs, warmed_up, "graphs compiled again after the warm-up")

    def test_what_cannot_go_to_the_models_process_is_refused_before_the_server_starts(self):
        with (
            mock.patch.object(transformers_serve, "serve_unavailable", return_value=None),
            mock.patch.object(transformers_serve, "serve_model_manager", return_value=None),
            mock.patch.object(transformers_serve, "serve_model_process", return_value=object),
            mock.patch.object(transformers_serve, "serve_command") as serve_command,
        ):
            with self.assertRaisesRegex(
                ValueError, r"`ServeOptions.backend` among them\) and `report` go there pickled"
            ):
                serving.serve("a-model", serving.ServeOptions(), report=lambda model, warm: None)
            with self.assertRaisesRegex(ValueError, "a backend by name"):
                serving.serve("a-model", serving.ServeOptions(backend=lambda gm, inputs: gm))
            serve_command.assert_not_called()


if __name__ == "__main__":
    unittest.main()

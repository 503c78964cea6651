"""Tests `serving.py` (was test_serve.py); `serving_loads.py`'s loader: test_serving_loads.py; a server whose model loads
in a process of its own: test_serve_process.py.

`prefill-buckets serve`: transformers' own server with bucketed, precompiled generate, called with the `openai` client.

Every server here runs in this process (upstream's `--non-blocking`, its option for tests), on 127.0.0.1 at a free
port, on a tiny Llama folder built from a config with an offline word-level tokenizer and a chat template. The
reference is upstream's eager server (`transformers serve` without `--compile`, bucket fields unset) on the same
folder: at temperature 0 every answer's text must be equal.
"""

import contextlib
import io
import json
import logging
import os
import traceback
import unittest
from unittest import mock

import torch
from transformers import GenerationConfig
from transformers.utils.import_utils import is_serve_available

import prefill_buckets
from prefill_buckets import GraphCounter, cli, serving, serving_loads
from prefill_buckets.upstream import torch_api, transformers_serve

from .tiny_models import (
    ASKED_NEW_TOKENS,
    MAX_PROMPT,
    REQUESTS,
    SERVED_NEW_TOKENS,
    ask,
    free_port,
    set_up_tiny_model_folder,
    tiny_llama,
    wait_ready,
    word_prompt,
)


def serve_args(port: int) -> list[str]:
    return ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32", "--non-blocking"]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + "".join(traceback.format_exception(*record.exc_info))
        self.messages.append(text)


@unittest.skipUnless(is_serve_available(), 'needs pip install "transformers-prefill-buckets[serving]"')
@unittest.skipIf(
    is_serve_available() and transformers_serve.serve_model_manager() is None,
    "this transformers' server loads the model in a process of its own (test_serve_process.py)",
)
class ServeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        set_up_tiny_model_folder(cls)
        prefill_buckets.disable()
        torch._dynamo.reset()
        # Upstream's eager server: the reference answers, and its answer to a bad `generation_config`.
        server, client = cls.start(None)
        try:
            cls.expected = [ask(client, cls.folder, *request) for request in REQUESTS]
            cls.expected_own = ask(client, cls.folder, "chat", False, 21, extra_body=cls.own_config())
            cls.expected_long = ask(client, cls.folder, "chat", False, 100)
            # Rejected by `GenerationConfig` itself, in the handler; and by `generate`, on the inference thread.
            cls.upstream_bad = cls.status_of_bad(client, {"max_new_tokens": -1})
            cls.upstream_bad_in_generate = cls.status_of_bad(client, {"num_beams": 0, "max_new_tokens": 4})
        finally:
            server.kill_server()

    @classmethod
    def start(cls, options, report=None):
        """A server on a free loopback port, and an `openai` client for it (no retries: each request is sent once)."""
        port = free_port()
        if options is None:
            server = transformers_serve.serve_command().main(
                args=[cls.folder, *serve_args(port)], prog_name="transformers serve", standalone_mode=False
            )
        else:
            server = serving.serve(cls.folder, options, serve_args(port), report=report)
        client = cls.openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        try:
            wait_ready(client, cls.folder)
        except Exception:
            server.kill_server()
            raise
        return server, client

    @staticmethod
    def own_config() -> dict:
        """A request's own `generation_config` with its own bucket: 100, a length no served bucket has."""
        return {
            "generation_config": json.dumps(
                {"max_new_tokens": ASKED_NEW_TOKENS, "do_sample": False, "prefill_buckets": [100]}
            )
        }

    @classmethod
    def status_of_bad(cls, client, config: dict) -> str:
        """What the client gets for a request with this `generation_config`: an error's class and status."""
        try:
            client.chat.completions.create(
                model=cls.folder,
                messages=[{"role": "user", "content": word_prompt(5)}],
                extra_body={"generation_config": json.dumps(config)},
            )
        except cls.openai.APIError as error:
            return f"{type(error).__name__} {getattr(error, 'status_code', '')}"
        return "answered"

    def setUp(self):
        prefill_buckets.disable()
        torch._dynamo.reset()
        self.addCleanup(prefill_buckets.disable)
        self.addCleanup(torch._dynamo.reset)
        self.records = _Records()
        package_logger = logging.getLogger("prefill_buckets")
        package_logger.addHandler(self.records)
        self.addCleanup(package_logger.removeHandler, self.records)

    def test_precompiled_server_is_exact_and_compiles_nothing(self):
        counter = GraphCounter()
        options = serving.ServeOptions(
            max_prompt=MAX_PROMPT,
            max_new_tokens=SERVED_NEW_TOKENS,
            precompile=True,
            compile_with="static",
            backend=counter,
        )
        warmups = []
        server, client = self.start(options, report=lambda model, warm: warmups.append(warm))
        try:
            (warm,) = warmups
            buckets = warm.buckets
            self.assertEqual(buckets, [1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64])
            # A prefill graph per bucket (`--compile-with static`: each shape is seen in the graphs) and one decode
            # graph, the 1-token bucket's prefill being that decode graph.
            self.assertEqual(counter.graphs, len(buckets))
            self.assertEqual(warm.graphs, counter.graphs)
            after_warmup = counter.graphs

            answers = []
            for request in REQUESTS:
                answers.append(ask(client, self.folder, *request))

            self.assertEqual(answers, self.expected)
            self.assertEqual(counter.graphs, after_warmup, "graphs compiled while serving")

            # A client that goes away mid-stream: generation is cancelled; the next request is exact.
            stream = client.chat.completions.create(
                model=self.folder,
                messages=[{"role": "user", "content": word_prompt(31)}],
                max_tokens=SERVED_NEW_TOKENS,
                temperature=0,
                stream=True,
            )
            next(iter(stream))
            stream.close()
            self.assertEqual(ask(client, self.folder, *REQUESTS[5]), self.expected[5])

            # A bad `generation_config`: upstream's error, and the server keeps serving, exactly.
            # (Upstream's server answers an exception in a handler with a 500 or by closing the connection, which of
            # the two varies from run to run: what is compared is that it fails.) `prefill_buckets="pow3"` fails in
            # `GenerationConfig(...)`, as upstream's own bad fields do, with a ValueError naming the field.
            for config in ({"max_new_tokens": -1}, {"num_beams": 0, "max_new_tokens": 4}, {"prefill_buckets": "pow3"}):
                with self.subTest(config=config):
                    self.assertNotEqual(self.status_of_bad(client, config), "answered")
            self.assertNotEqual(self.upstream_bad, "answered")
            self.assertNotEqual(self.upstream_bad_in_generate, "answered")
            # The server may close the connection of a failed request: the next one comes on a new connection.
            client = self.openai.OpenAI(base_url=client.base_url, api_key="unused", max_retries=0)
            self.assertEqual(ask(client, self.folder, *REQUESTS[-1]), self.expected[-1])
            self.assertEqual(counter.graphs, after_warmup, "graphs compiled while serving")

            # A request's own bucket fields are kept: its prompt is padded to its own bucket, 100.
            self.assertEqual(
                ask(client, self.folder, "chat", False, 21, extra_body=self.own_config()), self.expected_own
            )
            self.assertIn((1, 100), [shape[0] for shape in counter.shapes[after_warmup:]])

            # A prompt longer than the largest bucket: exact, with one warning however often it comes.
            for _ in range(2):
                self.assertEqual(ask(client, self.folder, "chat", False, 100), self.expected_long)
            longer = [m for m in self.records.messages if "longer than the largest of `prefill_buckets`" in m]
            self.assertEqual(len(longer), 1, self.records.messages)
            # In serve's options: the command line has no `prefill_pad_to_multiple_of`.
            self.assertIn("--max-prompt", longer[0])
            self.assertNotIn("prefill_pad_to_multiple_of", longer[0])
        finally:
            server.kill_server()

    def test_warm_start_from_a_compile_cache_compiles_nothing(self):
        path = os.path.join(self.tmp.name, "compile-cache.zip")
        options = serving.ServeOptions(
            max_prompt=16,
            max_new_tokens=SERVED_NEW_TOKENS,
            compile_cache=path,
            precompile=True,
            backend="aot_eager",
            compile_with="aot",
        )
        warmups = []
        server, client = self.start(options, report=lambda model, warm: warmups.append(warm))
        server.kill_server()
        self.assertFalse(warmups[0].cache_loaded)
        self.assertIsNotNone(warmups[0].cache_saved)
        self.assertGreater(warmups[0].graphs, 0)
        self.assertTrue(os.path.exists(path))

        torch._dynamo.reset()  # as a new process: nothing traced in this one is reused
        server, client = self.start(options, report=lambda model, warm: warmups.append(warm))
        try:
            warm = warmups[1]
            self.assertTrue(warm.cache_loaded)
            self.assertEqual(warm.graphs, 0)  # aot_forward's graphs come from the file: nothing traced
            before = torch_api.graphs_compiled()
            short = [request for request in REQUESTS if request[2] < 16]
            answers = [ask(client, self.folder, *request) for request in short]
            self.assertEqual(answers, [self.expected[REQUESTS.index(request)] for request in short])
            self.assertEqual(torch_api.graphs_compiled() - before, 0)
        finally:
            server.kill_server()


@unittest.skipUnless(is_serve_available(), 'needs pip install "transformers-prefill-buckets[serving]"')
class UnsupportedServerTest(unittest.TestCase):
    def test_a_server_with_no_known_place_to_prepare_the_model_is_refused(self):
        # The command prepares the model where upstream loads it: `ModelManager.load_model_and_processor` in the
        # server's process (5.17 to 5.24), or the loader `EngineClient.start_process` hands a model's own process
        # (5.25). transformers 5.25's server, before the second, raised AttributeError, where a hook of the first would
        # never have run and every request would have run unbucketed. Played here by taking both away on any version.
        from transformers.cli.serving import model_manager

        places = [(model_manager.ModelManager, "load_model_and_processor")]
        if hasattr(model_manager, "EngineClient"):
            places.append((model_manager.EngineClient, "start_process"))
        found = [owner for owner, name in places if name in vars(owner)]
        self.assertEqual(len(found), 1, "this transformers' server has exactly one of the places")
        self.assertIn(found[0], (transformers_serve.serve_model_manager(), transformers_serve.serve_model_process()))
        with contextlib.ExitStack() as stack:
            for owner, name in places:
                if name in vars(owner):
                    original = vars(owner)[name]
                    delattr(owner, name)
                    stack.callback(setattr, owner, name, original)
            self.assertIsNone(transformers_serve.serve_model_manager())
            self.assertIsNone(transformers_serve.serve_model_process())
            with self.assertRaisesRegex(RuntimeError, r"has neither.*transformers 5\.25"):
                serving.serve("a-model", serving.ServeOptions())
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exited:
                cli.main(["serve", "a-model"])
            self.assertEqual(exited.exception.code, 2)  # a usage error, before any model loads
            self.assertIn("has neither", stderr.getvalue())
        self.assertIsNone(serving_loads.unsupported_server())

    def test_continuous_batching_is_refused(self):
        # It schedules tokens itself (`generate_batch`): no prompt to pad, so its requests would run unbucketed.
        # Before, the command prepared the model for `generate` and served it that way.
        with self.assertRaisesRegex(ValueError, "--continuous-batching schedules"):
            serving.serve("a-model", serving.ServeOptions(), ["--continuous-batching", "--port", "8000"])
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exited:
            cli.main(["serve", "a-model", "--continuous-batching"])
        self.assertEqual(exited.exception.code, 2)  # a usage error, before any model loads
        self.assertIn("--continuous-batching schedules", stderr.getvalue())
        self.assertIsNone(serving.serve_problem(["--no-continuous-batching", "--port", "8000"]))


class ServeOptionsTest(unittest.TestCase):
    def parse(self, *argv):
        import argparse

        parser = argparse.ArgumentParser()
        serving.add_arguments(parser)
        args = parser.parse_args(["model", *argv])
        return serving.options_from_args(args, parser)

    def test_buckets(self):
        self.assertEqual(self.parse().buckets, "pow2-quarters")
        self.assertEqual(self.parse("--buckets", "64,256").buckets, [64, 256])
        self.assertEqual(self.parse("--buckets", "pow2").buckets, "pow2")

    def test_bad_input_names_the_option(self):
        for argv, text in [
            (("--buckets", "pow3"), "--buckets"),
            (("--buckets", "64,32"), "--buckets"),
            (("--max-prompt", "0"), "--max-prompt"),
            (("--precompile",), "--max-prompt"),
            (("--precompile", "--compile-with", "none"), "--compile-with"),
        ]:
            with self.subTest(argv=argv):
                stderr = io.StringIO()
                with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit):
                    self.parse(*argv)
                self.assertIn(text, stderr.getvalue())

    def test_precompile_refuses_generate_kwargs_it_sets_itself(self):
        model = tiny_llama()
        config = GenerationConfig(cache_implementation="static", max_new_tokens=2, prefill_buckets=[8])
        with self.assertRaisesRegex(ValueError, "`generate_kwargs` must not hold \\['attention_mask'\\]"):
            prefill_buckets.precompile(model, config, progress=False, generate_kwargs={"attention_mask": None})

    def test_without_the_serving_extra_the_server_is_not_read(self):
        # Without FastAPI and uvicorn upstream's server module can't be imported: the command says what to install
        # (ImportError from `serve`, a usage error from the CLI) before it asks where that server loads its models.
        missing = "transformers serve needs FastAPI and uvicorn"
        with (
            mock.patch.object(transformers_serve, "serve_unavailable", return_value=missing),
            mock.patch.object(transformers_serve, "serve_model_manager", side_effect=AssertionError("read")),
            mock.patch.object(transformers_serve, "serve_model_process", side_effect=AssertionError("read")),
        ):
            with self.assertRaisesRegex(ImportError, missing):
                serving.serve("a-model", serving.ServeOptions())
            stderr = io.StringIO()
            with contextlib.redirect_stderr(stderr), self.assertRaises(SystemExit) as exited:
                cli.main(["serve", "a-model"])
            self.assertEqual(exited.exception.code, 2)
            self.assertIn(missing, stderr.getvalue())

    def test_compile_cache_implies_precompile(self):
        options = self.parse("--compile-cache", "f.zip", "--buckets", "16,64")
        self.assertTrue(options.precompile)


if __name__ == "__main__":
    unittest.main()

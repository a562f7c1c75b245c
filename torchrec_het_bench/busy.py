"""A busier machine, as a measurement: processes that take a stated share of every core from the ranks.

``--busy SHARE`` (the benchmark and the microbenchmark) starts one process per core, each
pinned to its core, that spins for ``SHARE`` of every 10 ms and sleeps the rest. The ranks keep
their CPU budget (:mod:`torchrec_het.integration.cpu_budget`); the busy processes are another tenant's work.
A process that slept most of a period is the first the scheduler runs when it wakes, so it takes
about its share of a core whatever the ranks do; what it took is measured (its CPU seconds over
the wall time) and recorded beside the results.
"""

import multiprocessing as mp
import os
import time
from contextlib import contextmanager

from torchrec_het.integration.cpu_budget import machine_cores

PERIOD_S = 0.01


def _spin(core: int, share: float, stop, used) -> None:
    try:
        os.sched_setaffinity(0, {core})
    except (AttributeError, OSError):
        pass
    began = time.process_time()
    while not stop.is_set():
        start = time.perf_counter()
        while time.perf_counter() - start < share * PERIOD_S:
            pass
        time.sleep(max(0.0, PERIOD_S - (time.perf_counter() - start)))
    used.value = time.process_time() - began


@contextmanager
def busy_machine(share: float):
    """Takes ``share`` (0 <= share < 1) of every core while the block runs; yields a dict that, on
    exit, holds ``share`` (as asked), ``cores`` and ``taken`` (the share the busy processes used)."""
    if not 0 <= share < 1:
        raise ValueError(f"--busy takes a share of the CPU in [0, 1), got {share}")
    record = {"share": share, "cores": 0, "taken": 0.0}
    if share == 0:
        yield record
        return
    context = mp.get_context("spawn")
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(machine_cores()))
    stop = context.Event()
    used = [context.Value("d", 0.0) for _ in cores]
    workers = [context.Process(target=_spin, args=(c, share, stop, u), daemon=True) for c, u in zip(cores, used)]
    began = time.perf_counter()
    for worker in workers:
        worker.start()
    try:
        yield record
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=5)
        wall = time.perf_counter() - began
        record.update(cores=len(cores), taken=sum(u.value for u in used) / (wall * len(cores)) if wall else 0.0)

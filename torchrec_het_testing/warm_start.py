"""Ranks started warm: forked from one server process that imported torch, TorchRec and FBGEMM once.

A spawned rank spends about 5 s of CPU importing them; two or three ranks at once on 2 cores make that
the start of every spawned world. Python's ``forkserver`` imports :data:`PRELOAD` in its server the
first time this process starts ranks and forks every later rank from it, so a world starts in
milliseconds. A forked rank would see the server's environment, taken when it started; it gets its
starter's, current one instead (its working directory and ``sys.path`` it gets from
:mod:`multiprocessing` itself), so it runs as a spawned rank would.
"""

import multiprocessing
import multiprocessing.forkserver
import os

THP_ENV = "THP_MEM_ALLOC_ENABLE"  # torch: CPU buffers of 2 MB and more asked for as transparent huge pages
PRELOAD = ["torch", "torchrec", "torchrec.distributed", "fbgemm_gpu", "torchrec_het", "torchrec_het_bench.worker"]


def start_early(huge_pages: bool = False) -> None:
    """Starts the server now, so that it imports while this process still imports its own (a
    command's first lines; standard library only until here). ``huge_pages``: the ranks' large buffers
    in transparent huge pages unless the environment says otherwise (torch reads it once, in the server)."""
    if huge_pages:
        os.environ.setdefault(THP_ENV, "1")
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts
    multiprocessing.forkserver.ensure_running()


def start_processes(fn, args: tuple = (), nprocs: int = 1, warm: bool = True) -> None:
    """``torch.multiprocessing.start_processes(fn, args, nprocs)`` (joined) with ranks forked warm:
    ``fn(rank, *args)`` runs in each, under this process's environment as it is now.

    A forked rank cannot use CUDA: once FBGEMM's CUDA build is imported, torch marks every fork of that
    process ("Cannot re-initialize CUDA in forked subprocess"). Where CUDA is available, or ``warm`` is
    False (ranks that must meet CUDA as a spawned rank does), the ranks are spawned instead."""
    import torch
    import torch.multiprocessing as mp

    method = "forkserver" if warm and not torch.cuda.is_available() else "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts (this process's first world)
    mp.start_processes(
        _in_environment, args=(fn, dict(os.environ), args), nprocs=nprocs, join=True, start_method=method
    )


def _in_environment(rank: int, fn, environment: dict, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environment)
    fn(rank, *args)

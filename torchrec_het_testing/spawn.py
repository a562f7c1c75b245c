"""Spawning a gloo world for a test: every rank runs a body from this package and writes ``rank<r>.json``."""

import gc
import json
import socket
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn_world(run_world: Callable[[int, int, int, str], None], world_size: int, out_dir: str | Path) -> list[dict]:
    """Runs ``run_world(rank, world_size, port, out_dir)`` on ``world_size`` ranks; returns each rank's JSON."""
    mp.spawn(run_world, args=(world_size, free_port(), str(out_dir)), nprocs=world_size, join=True)
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(world_size)]


@contextmanager
def gloo_rank(rank: int, world_size: int, port: int, timeout_s: float = 60) -> Iterator[None]:
    """Inside a spawned rank: quiet warnings, one thread, a gloo group on ``port`` for the block."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        yield
        # Free the block's models (DDP reducers hold gloo work) while the group is alive, and
        # let no rank tear its group down while another still talks to it: a rank of a 3-rank
        # data_parallel test once aborted at teardown ("terminate called without an active exception").
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def write_rank_result(out_dir: str | Path, rank: int, result: object) -> None:
    """What :func:`spawn_world` reads back for ``rank``."""
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))

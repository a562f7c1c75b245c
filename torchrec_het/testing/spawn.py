"""Spawning a gloo world for a test: every rank runs a body from this package and writes ``rank<r>.json``."""

import json
import socket
from collections.abc import Callable
from pathlib import Path

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

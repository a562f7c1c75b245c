"""Process groups for a test: a spawned gloo world whose every rank runs a body from this package
and writes ``rank<r>.json``, or a world of one in this process."""

import gc
import json
import socket
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torchrec_het_testing import warm_start


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def spawn_world(
    run_world: Callable[..., None], world_size: int, out_dir: str | Path, *args: object, warm: bool = True
) -> list[dict]:
    """Runs ``run_world(rank, world_size, port, out_dir, *args)`` on ``world_size`` ranks (``args``
    reach them pickled; the ranks start warm, :mod:`~torchrec_het_testing.warm_start`, unless ``warm`` is
    False); returns each rank's JSON."""
    warm_start.start_processes(run_world, (world_size, free_port(), str(out_dir), *args), world_size, warm)
    return [json.loads(Path(out_dir, f"rank{rank}.json").read_text()) for rank in range(world_size)]


@contextmanager
def gloo_rank(rank: int, world_size: int, port: int, timeout_s: float = 60) -> Iterator[None]:
    """Inside a spawned rank: quiet warnings, one thread, a gloo group on ``port`` for the block."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
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


@contextmanager
def one_rank_group(device: torch.device, store_dir: str | Path | None = None) -> Iterator[None]:
    """A world-size-1 process group in this process for the block: NCCL on CUDA, gloo on the CPU,
    met through a FileStore in ``store_dir`` (a temporary folder if None)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    with tempfile.TemporaryDirectory(dir=store_dir) as folder:
        store = dist.FileStore(str(Path(folder, "store")), 1)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        else:
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def write_rank_result(out_dir: str | Path, rank: int, result: object) -> None:
    """What :func:`spawn_world` reads back for ``rank``."""
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def results_by_world(tmp_path_factory, target, cases: list, prefix: str):
    """A pytest fixture body: ``results(world_size)`` runs ``target`` over the ``cases`` of that world
    size in one process group, the first time it is asked for, and returns ``{name: [result per rank]}``
    (every name the ranks recorded)."""
    done: dict[int, dict[str, list[dict]]] = {}

    def results(world_size: int) -> dict[str, list[dict]]:
        if world_size not in done:
            mine = [c for c in cases if c.world_size == world_size]
            ranks = spawn_world(target, world_size, tmp_path_factory.mktemp(f"{prefix}_ws{world_size}"), mine)
            done[world_size] = {name: [r[name] for r in ranks] for name in ranks[0]}
        return done[world_size]

    return results

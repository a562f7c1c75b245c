"""Rank bodies for gloo jobs on emulated hosts, started with ``torch.multiprocessing`` spawn.

Each body takes ``(rank, envs, netns_of_rank, ...)``: the environment from
:meth:`EmulatedHosts.rank_env` and the namespace of every rank. It joins its
host first, before any socket exists, then starts gloo.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchrec_het_bench.netem import join_host


def _start(rank: int, envs: list[dict[str, str]], netns_of_rank: list[str]) -> None:
    join_host(netns_of_rank[rank])
    os.environ.update(envs[rank])
    dist.init_process_group("gloo", rank=rank, world_size=len(envs))


def _expect_equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if not torch.equal(got, want):
        raise AssertionError(f"rank {dist.get_rank()}: {what} gave {got.tolist()}, expected {want.tolist()}")


def _check_all_reduce(rank: int, world_size: int) -> None:
    values = torch.full((8,), float(rank + 1))
    dist.all_reduce(values)
    _expect_equal("all_reduce", values, torch.full((8,), world_size * (world_size + 1) / 2))


def _check_all_to_all_single(rank: int, world_size: int) -> None:
    per_peer = 3
    # Element k of the block for peer p encodes (sender, receiver, k).
    sent = torch.tensor([100 * rank + 10 * peer + k for peer in range(world_size) for k in range(per_peer)])
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent)
    expected = torch.tensor([100 * sender + 10 * rank + k for sender in range(world_size) for k in range(per_peer)])
    _expect_equal("all_to_all_single", received, expected)


def _check_uneven_all_to_all_single(rank: int, world_size: int) -> None:
    # Rank r sends (peer + 1) copies of r to each peer.
    split_out = [peer + 1 for peer in range(world_size)]
    split_in = [rank + 1] * world_size
    sent = torch.full((sum(split_out),), rank, dtype=torch.int64)
    received = torch.empty(sum(split_in), dtype=torch.int64)
    dist.all_to_all_single(received, sent, output_split_sizes=split_in, input_split_sizes=split_out)
    expected = torch.arange(world_size).repeat_interleave(rank + 1)
    _expect_equal("uneven all_to_all_single", received, expected)


def collectives_rank(rank: int, envs: list[dict[str, str]], netns_of_rank: list[str]) -> None:
    """Checks all_reduce and all_to_all_single (even and uneven splits); raises on a wrong result."""
    _start(rank, envs, netns_of_rank)
    try:
        world_size = dist.get_world_size()
        _check_all_reduce(rank, world_size)
        _check_all_to_all_single(rank, world_size)
        _check_uneven_all_to_all_single(rank, world_size)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def all_to_all_seconds_rank(
    rank: int, envs: list[dict[str, str]], netns_of_rank: list[str], bytes_per_peer: int, repeats: int, out: str
) -> None:
    """Times ``all_to_all_single`` of ``bytes_per_peer`` to every peer; rank 0 writes the best time to ``out``."""
    _start(rank, envs, netns_of_rank)
    try:
        world_size = dist.get_world_size()
        sent = torch.zeros(world_size * bytes_per_peer // 4, dtype=torch.float32)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent)  # warm-up: connections, buffers
        best = float("inf")
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_to_all_single(received, sent)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            best = min(best, elapsed.item())
        if rank == 0:
            Path(out).write_text(json.dumps({"seconds": best, "world_size": world_size}))
    finally:
        dist.destroy_process_group()


def planner_links_rank(rank: int, envs: list[dict[str, str]], netns_of_rank: list[str], out: str) -> None:
    """The links of a job of one rank per host as the benchmark records them (the planner's figures,
    and every probe kind: also one way between hosts); rank 0 writes them to ``out``."""
    from torchrec_het_bench.run_links import measure_run_links

    _start(rank, envs, netns_of_rank)
    try:
        links = measure_run_links(dist.get_world_size(), 1)
        if rank == 0:
            Path(out).write_text(json.dumps(links))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def budget_rank(spec) -> dict:
    """A benchmark body (:func:`torchrec_het_bench.launch.spawn`): takes the rank's CPU budget as the
    benchmark does and reports its intra-op threads and the budget it was given."""
    from torchrec_het_bench.worker import apply_rank_budget

    budget = apply_rank_budget(spec)
    threads = [None] * spec.world_size
    dist.all_gather_object(threads, torch.get_num_threads())
    return {"threads": threads, "budget": budget.as_dict()}


def write_budget(spec, gathered: dict) -> None:
    """``budget_rank``'s rank 0 result, as ``budget.json`` in ``spec.out_dir``."""
    Path(spec.out_dir, "budget.json").write_text(json.dumps(gathered))

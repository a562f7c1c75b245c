"""Rank bodies of tests/distributed/test_replica_held.py: a :class:`~torchrec_het.sharding.row_replicated.replicas.ReplicaBlock`
synced every k steps grows its Adagrad state as k synchronous steps would.

Row 0 is read by rank 0 only, k steps; row 1 by every rank, in one step; row 2 by every rank,
every step. The block starts from known weights and state; before the sync, rank 0's copy of
row 0 has taken its own k steps (the other ranks' copies none); after the sync, row 0's state and
row 1's (weights too) are compared with synchronous steps of the summed gradients, and row 2
with the square of its sum (the rule this replaces).
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist

from torchrec_het._tbe import step_rows
from torchrec_het.sharding.row_replicated.replicas import ReplicaBlock
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

DIM, K, LR = 4, 5, 0.1


def _grads(rank: int, step: int, row: int) -> torch.Tensor:
    return torch.randn(1, DIM, generator=torch.Generator().manual_seed(1000 * rank + 10 * step + row))


def check(optimizer: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    width = DIM if optimizer == "adagrad" else 1
    kernel = SimpleNamespace(learning_rate_tensor=torch.tensor(LR))
    block = ReplicaBlock(
        torch.arange(3),
        DIM,
        optimizer,
        [kernel],
        torch.zeros(3, dtype=torch.int64),
        torch.full((3,), 1e-8, dtype=torch.float64),
        [],
        K,
        dist.group.WORLD,
        torch.device("cpu"),
    )
    start_w = torch.randn(3, DIM, generator=torch.Generator().manual_seed(0))
    start_s = torch.rand(3, width, generator=torch.Generator().manual_seed(1)) + 0.5
    block.load(start_w, start_s)
    for step in range(K):
        slots, grads = [torch.tensor([2])], [_grads(rank, step, 2)]
        if rank == 0:
            slots.append(torch.tensor([0, 0]))  # two reads of row 0 in one step: summed before squaring
            grads.append(torch.cat([_grads(0, step, 0), _grads(0, step, 0)]) / 2)
        if step == 0:
            slots.append(torch.tensor([1]))
            grads.append(_grads(rank, 0, 1))
        block.add_grads(torch.cat(slots), torch.cat(grads))
    local_w, local_s = block.weights[0:1].clone(), block.state[0:1].clone()  # rank 0's own steps, before the sync
    block.wait()
    lr = torch.tensor(LR)
    w0, s0 = start_w[0:1], start_s[0:1]
    for step in range(K):
        w0, s0 = step_rows(optimizer, w0, s0, _grads(0, step, 0), lr, 1e-8)
    w1, s1 = step_rows(optimizer, start_w[1:2], start_s[1:2], sum(_grads(r, 0, 1) for r in range(ws)), lr, 1e-8)
    total = sum(_grads(r, step, 2) for r in range(ws) for step in range(K))
    square_of_sum = step_rows(optimizer, start_w[2:3], start_s[2:3], total, lr, 1e-8)[1]
    per_step = start_s[2:3].clone()
    for step in range(K):
        per_step = step_rows(optimizer, start_w[2:3], per_step, sum(_grads(r, step, 2) for r in range(ws)), lr, 1e-8)[1]
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    return {
        "local_weights": rel(local_w, w0) if rank == 0 else rel(local_w, start_w[0:1]),
        "local_state": rel(local_s, s0) if rank == 0 else rel(local_s, start_s[0:1]),
        "one_rank_state": rel(block.state[0:1], s0),
        "one_step_state": rel(block.state[1:2], s1),
        "one_step_weights": rel(block.weights[1:2], w1),
        "shared_vs_steps": rel(block.state[2:3], per_step),
        "square_of_sum_vs_steps": rel(square_of_sum, per_step),
    }


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port):
        write_rank_result(out_dir, rank, {opt: check(opt) for opt in ("adagrad", "rowwise_adagrad")})

"""Rank bodies of tests/distributed/test_het_held.py: a HET cache that holds k updates of a row before
pushing them (``s_write = k - 1``) grows the owner's Adagrad state as k synchronous steps would.

One table of 8 rows on 2 ranks (rank 0 owns rows 0-3). Rank 1 reads row 1 (rank 0's) once per
step, with the bag's gradient ``coeff[step]`` (the loss is ``sum(pooled * coeff[step])``);
rank 0 reads nothing. After k steps and a flush, row 1's optimizer state at its owner is
compared with k synchronous steps of the same gradients, and with the square of their sum.
Rank 1's cached copy, which keeps the state its owner sent, is compared after the k steps
with the k synchronous steps' weights, and with the local SGD step it replaces.
"""

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import lookup_kernels
from torchrec_het._tbe import row_state, step_rows
from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het_testing.bag_models import sharded
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

K, DIM, LR = 4, 4, 0.1


def _coeff(step: int) -> torch.Tensor:
    return torch.randn(1, DIM, generator=torch.Generator().manual_seed(50 + step))


def check(optimizer: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    configs = [EmbeddingBagConfig(name="t", feature_names=["f"], embedding_dim=DIM, num_embeddings=8)]
    cache = HetCacheConfig(default=CacheSettings(s_read=100, s_write=K - 1, capacity=1.0))
    model = sharded("het", configs, False, optimizer, cache=cache, lr=LR)
    tbe = lookup_kernels(model.module.het_lookups()[0])[0].emb_module
    # row 1 as its owner starts: weight, then state (rank 0 has it; every rank gets it)
    start = torch.zeros(1, 2 * DIM)
    if rank == 0:
        weight, state = row_state(tbe, 0)[0][1:2].detach(), row_state(tbe, 0)[1][1:2].view(1, -1)
        start[:, :DIM], start[:, DIM : DIM + state.size(1)] = weight, state
    dist.broadcast(start, 0)
    start_weight, start_state = start[:, :DIM], start[:, DIM : DIM + (DIM if optimizer == "adagrad" else 1)]
    for step in range(K):
        ids = torch.tensor([1]) if rank == 1 else torch.zeros(0, dtype=torch.int64)
        features = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.tensor([ids.numel()]))
        (model(features)["f"] * _coeff(step)).sum().backward()
    cache = model.module.het_lookups()[0].groups[0].cache
    cached = cache.values[cache.slots_of(torch.tensor([1]))].clone()  # rank 1's copy after its k local steps
    model.module.flush_cache()
    scale = 1.0 / ws if get_gradient_division() else 1.0
    grads = [_coeff(step) * scale for step in range(K)]
    weight, state = start_weight, start_state
    for g in grads:
        weight, state = step_rows(optimizer, weight, state, g, torch.tensor(LR), 1e-8)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    if rank == 1:
        moved = weight - start_weight
        return {
            "cached_vs_steps": rel(cached - start_weight, moved),
            "local_sgd_vs_steps": rel(-LR * sum(grads), moved),
        }
    square_of_sum = step_rows(optimizer, start_weight, start_state, sum(grads), torch.tensor(LR), 1e-8)[1]
    got = row_state(tbe, 0)[1][1:2].view(1, -1)
    return {"state_vs_steps": rel(got, state), "square_of_sum_vs_steps": rel(square_of_sum, state)}


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port):
        write_rank_result(out_dir, rank, {opt: check(opt) for opt in ("adagrad", "rowwise_adagrad")})

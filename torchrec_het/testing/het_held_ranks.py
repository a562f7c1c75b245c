"""Rank bodies of tests/distributed/test_het_held.py: a HET cache that holds k updates of a row before
pushing them (``s_write = k - 1``) grows the owner's Adagrad state as k synchronous steps would.

One table of 8 rows on 2 ranks (rank 0 owns rows 0-3). Rank 1 reads row 1 (rank 0's) once per
step, with the bag's gradient ``coeff[step]`` (the loss is ``sum(pooled * coeff[step])``);
rank 0 reads nothing. After k steps and a flush, row 1's optimizer state at its owner is
compared with k synchronous steps of the same gradients, and with the square of their sum.
"""

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import lookup_kernels
from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.sharding.row_apply import row_state
from torchrec_het.sharding.row_optim import step_rows
from torchrec_het.testing.het_ranks import sharded
from torchrec_het.testing.spawn import gloo_rank, write_rank_result

K, DIM, LR = 4, 4, 0.1


def _coeff(step: int) -> torch.Tensor:
    return torch.randn(1, DIM, generator=torch.Generator().manual_seed(50 + step))


def check(optimizer: str) -> dict:
    rank, ws = dist.get_rank(), dist.get_world_size()
    configs = [EmbeddingBagConfig(name="t", feature_names=["f"], embedding_dim=DIM, num_embeddings=8)]
    cache = HetCacheConfig(default=CacheSettings(s_read=100, s_write=K - 1, capacity=1.0))
    model = sharded("het", configs, False, optimizer, cache=cache, lr=LR)
    tbe = lookup_kernels(model.module.het_lookups()[0])[0].emb_module
    start_state = row_state(tbe, 0)[1].clone() if rank == 0 else None
    start_weight = row_state(tbe, 0)[0].detach().clone() if rank == 0 else None
    for step in range(K):
        ids = torch.tensor([1]) if rank == 1 else torch.zeros(0, dtype=torch.int64)
        features = KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=torch.tensor([ids.numel()]))
        (model(features)["f"] * _coeff(step)).sum().backward()
    model.module.flush_cache()
    if rank != 0:
        return {}
    scale = 1.0 / ws if get_gradient_division() else 1.0
    grads = [_coeff(step) * scale for step in range(K)]
    weight, state = start_weight[1:2], start_state[1:2].view(1, -1)
    for g in grads:
        weight, state = step_rows(optimizer, weight, state, g, torch.tensor(LR), 1e-8)
    square_of_sum = step_rows(optimizer, start_weight[1:2], start_state[1:2].view(1, -1), sum(grads), torch.tensor(LR), 1e-8)[1]
    got = row_state(tbe, 0)[1][1:2].view(1, -1)
    rel = lambda a, b: float((a - b).abs().max() / b.abs().max())  # noqa: E731
    return {"state_vs_steps": rel(got, state), "square_of_sum_vs_steps": rel(square_of_sum, state)}


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port):
        write_rank_result(out_dir, rank, {opt: check(opt) for opt in ("adagrad", "rowwise_adagrad")})

"""Rank body of tests/distributed/test_table_init.py: sharded tables start from the same weights.

Each rank shards a small EmbeddingBagCollection table_wise, row_wise and
data_parallel, sets its weights with :func:`init_tables_by_row`, and compares the
pooled output of a batch with the unsharded computation from :func:`table_rows`.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchrec_het_bench.table_init import init_tables_by_row, table_rows
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

# Sizes straddle the generator's block boundaries and do not split evenly over ranks.
TABLES = [("t_a", "f_a", 8, 37), ("t_b", "f_b", 4, 5003), ("t_c", "f_c", 8, 9000)]
SEED = 7
BATCH = 6


def _configs():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig

    return [EmbeddingBagConfig(name=n, feature_names=[f], embedding_dim=d, num_embeddings=r) for n, f, d, r in TABLES]


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        self.ebc = EmbeddingBagCollection(_configs(), device=torch.device("meta"))

    def forward(self, features):
        return self.ebc(features)


def _batch(rank: int):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    generator = torch.Generator().manual_seed(rank)
    lengths = torch.randint(0, 5, (len(TABLES) * BATCH,), generator=generator)
    per_table = lengths.view(len(TABLES), BATCH).sum(1).tolist()
    ids = [torch.randint(0, rows, (n,), generator=generator) for (_, _, _, rows), n in zip(TABLES, per_table)]
    # Hit the last row and a block boundary of every table.
    for tensor, (_, _, _, rows) in zip(ids, TABLES):
        if tensor.numel() >= 2:
            tensor[0], tensor[1] = rows - 1, min(rows - 1, 4096)
    features = KeyedJaggedTensor.from_lengths_sync(
        keys=[f for _, f, _, _ in TABLES], values=torch.cat(ids), lengths=lengths
    )
    return features, ids, lengths


def _expected(ids, lengths) -> dict[str, torch.Tensor]:
    pooled = {}
    for (tensor, config), table_lengths in zip(zip(ids, _configs()), lengths.view(len(TABLES), BATCH)):
        weight = table_rows(config, SEED, 0, config.num_embeddings)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), table_lengths.cumsum(0)])
        pooled[config.feature_names[0]] = F.embedding_bag(tensor, weight, offsets[:-1], mode="sum")
    return pooled


def _max_error(sharding_type: str, rank: int) -> float:
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    from torchrec_het.sharders.row_wise import CpuRowWiseEmbeddingBagCollectionSharder

    sharder = (
        CpuRowWiseEmbeddingBagCollectionSharder() if sharding_type == "row_wise" else EmbeddingBagCollectionSharder()
    )
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        batch_size=BATCH,
        constraints={n: ParameterConstraints(sharding_types=[sharding_type]) for n, _, _, _ in TABLES},
    )
    model = _Model()
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    init_tables_by_row(dmp, _configs(), SEED)
    features, ids, lengths = _batch(rank)
    with torch.no_grad():
        got = dmp(features).to_dict()  # table_wise orders features by rank: compare by name
    expected = _expected(ids, lengths)
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    return max(float((got[f] - expected[f]).abs().max()) for f in expected)


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: writes ``rank<r>.json`` with the largest output error per sharding type."""
    with gloo_rank(rank, world_size, port):
        errors = {kind: _max_error(kind, rank) for kind in ("table_wise", "row_wise", "data_parallel")}
    write_rank_result(out_dir, rank, errors)

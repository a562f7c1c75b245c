"""The small EmbeddingBagCollection of the behaviour tests (cache bounds, held gradients,
checkpoints, error messages): its tables, batches and loss, and the collection sharded by one type.

Three tables: ``t0`` (width 8, 50 rows), ``t1`` (width 4, 37 rows, read by features ``f1`` and
``f2``) and ``t2`` (width 8, 101 rows, mean-pooled unless weighted). Every model of one seed
starts from the same weights (:func:`~torchrec_het_testing.weights.seeded_tables`).
"""

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.config import HetCacheConfig
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import (
    CpuRowWiseEmbeddingBagCollectionSharder,
    HetEmbeddingBagCollection,
    HetEmbeddingBagCollectionSharder,
)
from torchrec_het.sharding import het_cached_row_wise, het_row_replicated
from torchrec_het_testing.settings import OPTIMIZERS
from torchrec_het_testing.weights import seeded_tables, set_tables

SEED = 3
BATCH = 6
STEPS = 5
# name, features, dim, rows, pooling (mean is summed in the weighted runs)
TABLES = [
    ("t0", ["f0"], 8, 50, PoolingType.SUM),
    ("t1", ["f1", "f2"], 4, 37, PoolingType.SUM),
    ("t2", ["f3"], 8, 101, PoolingType.MEAN),
]


def table_configs(weighted: bool) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=name, feature_names=features, embedding_dim=dim, num_embeddings=rows,
                           pooling=PoolingType.SUM if weighted else pooling)
        for name, features, dim, rows, pooling in TABLES
    ]  # fmt: skip


def batch(rank: int, step: int, weighted: bool, configs: list[EmbeddingBagConfig]) -> KeyedJaggedTensor:
    """A skewed multi-hot batch (empty bags included), the same for every run of (rank, step)."""
    generator = torch.Generator().manual_seed(10_000 * rank + step)
    keys, lengths, values = [], [], []
    for config in configs:
        for feature in config.feature_names:
            n = torch.randint(0, 4, (BATCH,), generator=generator)
            ids = (torch.rand(int(n.sum()), generator=generator) ** 3 * config.num_embeddings).long()
            keys.append(feature)
            lengths.append(n)
            values.append(ids)
    values_tensor = torch.cat(values)
    weights = torch.rand(values_tensor.numel(), generator=generator) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=values_tensor, lengths=torch.cat(lengths), weights=weights
    )


def skewed_bags(
    configs: list[EmbeddingBagConfig], generator: torch.Generator, size: int, power: int, weighted: bool
) -> KeyedJaggedTensor:
    """0..3 ids per bag (empty bags included), row ``rand ** power * rows`` (skewed to small rows);
    a feature that feeds several tables draws ids that fit all of them."""
    rows: dict[str, int] = {}
    for c in configs:
        for f in c.feature_names:
            rows[f] = min(rows.get(f, c.num_embeddings), c.num_embeddings)
    keys, lengths, values = list(rows), [], []
    for key in keys:
        n = torch.randint(0, 4, (size,), generator=generator)
        lengths.append(n)
        values.append((torch.rand(int(n.sum()), generator=generator) ** power * rows[key]).long())
    ids = torch.cat(values)
    weights = torch.rand(ids.numel(), generator=generator) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=torch.cat(lengths), weights=weights)


def projections(configs: list[EmbeddingBagConfig]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    return {f: torch.randn(c.embedding_dim, 3, generator=generator) for c in configs for f in c.feature_names}


def loss_of(pooled, projections: dict[str, torch.Tensor]) -> torch.Tensor:
    """The test loss: every feature's pooled embedding through its projection, squared and summed."""
    return sum(((pooled[f] @ p) ** 2).sum() for f, p in projections.items())


class LossModel(nn.Module):
    """An EBC and the test loss, returning (loss, loss) as TorchRec's train pipelines expect."""

    def __init__(self, ebc: EmbeddingBagCollection, configs) -> None:
        super().__init__()
        self.ebc = ebc
        self.proj = projections(configs)

    def forward(self, features: KeyedJaggedTensor):
        loss = loss_of(self.ebc(features), self.proj)
        return loss, loss.detach()


def ebc_with_optimizer(
    configs, weighted: bool, optimizer: str, device: str, lr: float | None = None
) -> EmbeddingBagCollection:
    """An EBC of ``configs`` on ``device`` with the fused ``optimizer`` (``lr`` overrides its rate)."""
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device(device))
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, ebc.parameters(), dict(kwargs, **({"lr": lr} if lr is not None else {})))
    return ebc


def shard_module(module: nn.Module, path: str, configs, sharder, generator, seed: int = SEED, device: str = "cpu"):
    """``module`` (its EBC, at ``path``, on the meta device) with every table planned by
    ``generator`` and sharded by ``sharder`` on ``device`` over the default group, tables seeded."""
    ebc = module.get_submodule(path) if path else module
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={c.name: generator() for c in configs},
        world_size=dist.get_world_size(),
        device_type=torch.device(device).type,
        sharder=sharder,
    )
    model = DistributedModelParallel(
        module, device=torch.device(device), plan=ShardingPlan({path: plan}), sharders=[sharder]
    )
    set_tables(model, seeded_tables(configs, seed))
    return model


def sharded(kind: str, configs, weighted: bool, optimizer: str, cache: HetCacheConfig | None = None,
            lr: float | None = None, seed: int = SEED):  # fmt: skip
    """The EBC sharded ``het`` (every table het_cached_row_wise, ``cache`` settings) or
    ``row_wise`` (stock), fused ``optimizer`` (``lr`` overrides its rate), tables seeded by ``seed``."""
    ebc = ebc_with_optimizer(configs, weighted, optimizer, "meta", lr)
    if kind == "het":
        return shard_module(ebc, "", configs, HetEmbeddingBagCollectionSharder(cache=cache), het_cached_row_wise, seed)
    return shard_module(ebc, "", configs, CpuRowWiseEmbeddingBagCollectionSharder(), row_wise, seed)


def replicated(configs, weighted: bool, optimizer: str, replication: ReplicationConfig, seed: int = SEED,
               carried: bool = False):  # fmt: skip
    """The EBC with every table ``het_row_replicated``, tables seeded: ``replication`` given to the
    sharder, or carried by the module (a HetEmbeddingBagCollection) if ``carried``."""
    if not carried:
        ebc = ebc_with_optimizer(configs, weighted, optimizer, "meta")
        return shard_module(
            ebc, "", configs, HetEmbeddingBagCollectionSharder(replication=replication), het_row_replicated, seed
        )
    ebc = HetEmbeddingBagCollection(configs, is_weighted=weighted, device=torch.device("meta"), replication=replication)
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, ebc.parameters(), dict(kwargs))
    sharder = HetEmbeddingBagCollectionSharder(module_type=HetEmbeddingBagCollection)
    return shard_module(ebc, "", configs, sharder, het_row_replicated, seed)


def unsharded(configs, weighted: bool, optimizer: str, seed: int = SEED) -> EmbeddingBagCollection:
    """The unsharded EBC, fused ``optimizer``, tables seeded by ``seed``."""
    ebc = ebc_with_optimizer(configs, weighted, optimizer, "cpu")
    set_tables(ebc, seeded_tables(configs, seed))
    return ebc

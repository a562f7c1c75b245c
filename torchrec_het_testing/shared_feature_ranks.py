"""Rank bodies of tests/distributed/test_het_shared_features.py: TorchRec's own model-parallel tables.

The tables of TorchRec's ``ModelParallelTestShared`` (torchrec/distributed/test_utils/
test_model_parallel.py): four tables of widths 16, 24, 32 and 40, two more tables that
read features 0 and 1 again (a feature feeding two tables), and two weighted tables
(widths 8 and 12), in two EmbeddingBagCollections of one model. Sum pooling, or mean
pooling on the unweighted tables as TorchRec's ``mean_tables``.

Every plugin configuration trains, with a fused optimizer, on each rank's own batches,
beside stock ``row_wise`` and the unsharded model trained on the global batch; the rank
records the largest relative difference of the outputs (every step) and of its local
shards of the weights (after the last step).
"""

import torch
import torch.distributed as dist
import torchrec.optim
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het_bench.table_init import init_tables_by_row
from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import CpuRowWiseEmbeddingBagCollectionSharder, HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_cached_row_wise, het_row_replicated
from torchrec_het_testing.replicated_ranks import tiers
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

SEED = 5
BATCH = 5
STEPS = 3
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "rowwise_adagrad": (torchrec.optim.RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8}),
}
# plugin configuration -> (sharding generator, sharder settings)
PLUGINS = {
    "het_exact": (het_cached_row_wise, {"cache": HetCacheConfig(default=CacheSettings(capacity=0.5))}),
    "rep_hot": (het_row_replicated, {"replication": "hot"}),
    "rep_per_host": (het_row_replicated, {"replication": "per_host"}),
}
POOLINGS = ("sum", "mean")


def tables(pooling: str) -> tuple[list[EmbeddingBagConfig], list[EmbeddingBagConfig]]:
    """(unweighted tables, weighted tables) as TorchRec's ModelParallelTestShared builds them."""
    mean = PoolingType.MEAN if pooling == "mean" else PoolingType.SUM
    plain = [
        EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 8, name=f"table_{i}",
                           feature_names=[f"feature_{i}"], pooling=mean)
        for i in range(4)
    ] + [
        EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 8, name=f"table_{i + 4}",
                           feature_names=[f"feature_{i}"], pooling=mean)
        for i in range(2)
    ]
    weighted = [
        EmbeddingBagConfig(num_embeddings=(i + 1) * 10, embedding_dim=(i + 2) * 4, name=f"weighted_table_{i}",
                           feature_names=[f"weighted_feature_{i}"])
        for i in range(2)
    ]
    return plain, weighted


class TwoCollections(nn.Module):
    """An unweighted and a weighted EmbeddingBagCollection; forward returns every pooled key."""

    def __init__(self, plain, weighted, device: str) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=plain, device=torch.device(device))
        self.wbc = EmbeddingBagCollection(tables=weighted, is_weighted=True, device=torch.device(device))

    def forward(self, features: KeyedJaggedTensor, weighted: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        return {**self.ebc(features).to_dict(), **self.wbc(weighted).to_dict()}


def _batch(rank: int, step: int, configs: list[EmbeddingBagConfig], weighted: bool) -> KeyedJaggedTensor:
    """Multi-hot skewed bags (empty ones included); a shared feature's ids fit both its tables."""
    generator = torch.Generator().manual_seed(1000 * rank + 10 * step + int(weighted))
    return skewed_bags(configs, generator, BATCH, 2, weighted)


def skewed_bags(
    configs: list[EmbeddingBagConfig], generator: torch.Generator, batch: int, power: int, weighted: bool
) -> KeyedJaggedTensor:
    """0..3 ids per bag (empty bags included), row ``rand ** power * rows`` (skewed to small rows);
    a feature that feeds several tables draws ids that fit all of them."""
    rows: dict[str, int] = {}
    for c in configs:
        for f in c.feature_names:
            rows[f] = min(rows.get(f, c.num_embeddings), c.num_embeddings)
    keys, lengths, values = list(rows), [], []
    for key in keys:
        n = torch.randint(0, 4, (batch,), generator=generator)
        lengths.append(n)
        values.append((torch.rand(int(n.sum()), generator=generator) ** power * rows[key]).long())
    ids = torch.cat(values)
    weights = torch.rand(ids.numel(), generator=generator) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids, lengths=torch.cat(lengths), weights=weights)


def batches(rank: int, step: int, pooling: str) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    plain, weighted = tables(pooling)
    return _batch(rank, step, plain, False), _batch(rank, step, weighted, True)


def _model(kind: str, pooling: str, optimizer: str, world_size: int):
    plain, weighted = tables(pooling)
    device = "cpu" if kind == "unsharded" else "meta"
    model = TwoCollections(plain, weighted, device)
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, model.parameters(), dict(kwargs))
    if kind != "unsharded":
        if kind == "row_wise":
            generator, sharder = row_wise, CpuRowWiseEmbeddingBagCollectionSharder()
        else:
            generator, settings = PLUGINS[kind]
            settings = dict(settings)
            if "replication" in settings:
                hot = {"hot": {"hot": 3}, "per_host": {"hot": 2, "per_host": 2}}[settings["replication"]]
                plan = tiers(plain + weighted, **hot)
                plan.spans_modules = True  # one sharder shards both collections: each takes its own tables
                settings["replication"] = ReplicationConfig(tiers=plan)
            sharder = HetEmbeddingBagCollectionSharder(**settings)
        plan = ShardingPlan({
            name: construct_module_sharding_plan(
                getattr(model, name), per_param_sharding={c.name: generator() for c in configs},
                world_size=world_size, device_type="cpu", sharder=sharder,
            )
            for name, configs in (("ebc", plain), ("wbc", weighted))
        })
        model = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=[sharder])
    init_tables_by_row(model, plain + weighted, SEED)
    return model


def _projections(pooling: str) -> dict[str, torch.Tensor]:
    plain, weighted = tables(pooling)
    reference = TwoCollections(plain, weighted, "meta")
    generator = torch.Generator().manual_seed(17)
    dims = {**dict(zip(reference.ebc._embedding_names, reference.ebc._lengths_per_embedding)),
            **dict(zip(reference.wbc._embedding_names, reference.wbc._lengths_per_embedding))}
    return {key: torch.randn(dim, 2, generator=generator) for key, dim in dims.items()}


def _loss(pooled: dict[str, torch.Tensor], projections: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(((pooled[key] @ p) ** 2).sum() for key, p in projections.items())


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-6)) if want.numel() else 0.0


def _weights_error(model, reference: TwoCollections) -> float:
    full = {name: bag.weight.detach() for ebc in (reference.ebc, reference.wbc) for name, bag in ebc.embedding_bags.items()}
    worst = 0.0
    for key, value in model.state_dict().items():
        for shard in value.local_shards():
            row0, col0 = shard.metadata.shard_offsets
            rows, cols = shard.tensor.shape
            want = full[key.split(".")[-2]][row0 : row0 + rows, col0 : col0 + cols]
            worst = max(worst, _rel(shard.tensor, want))
    return worst


def equivalence(rank: int, world_size: int, pooling: str, optimizer: str) -> dict[str, float]:
    """Keys ``out/<kind>_vs_<unsharded|row_wise>``, ``weights/<kind>`` (kinds: row_wise and the plugins)."""
    projections = _projections(pooling)
    reference = _model("unsharded", pooling, optimizer, world_size)
    kinds = ["row_wise", *PLUGINS]
    models = {kind: _model(kind, pooling, optimizer, world_size) for kind in kinds}
    errors: dict[str, float] = {}
    for step in range(STEPS):
        every = [batches(r, step, pooling) for r in range(world_size)]
        want = [reference(*b) for b in every]
        outputs = {kind: model(*every[rank]) for kind, model in models.items()}
        for kind, out in outputs.items():
            for key in projections:
                for against, other in (("unsharded", want[rank]), ("row_wise", outputs["row_wise"])):
                    name = f"out/{kind}_vs_{against}"
                    errors[name] = max(errors.get(name, 0.0), _rel(out[key], other[key]))
            _loss(out, projections).backward()
        (sum(_loss(w, projections) for w in want) / world_size).backward()  # TorchRec averages over ranks
    for kind, model in models.items():
        errors[f"weights/{kind}"] = _weights_error(model, reference)
    return errors


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: every pooling and optimizer; writes ``rank<r>.json``."""
    with gloo_rank(rank, world_size, port, timeout_s=300):
        results = {
            f"{pooling}/{optimizer}": equivalence(rank, world_size, pooling, optimizer)
            for pooling in POOLINGS
            for optimizer in OPTIMIZERS
        }
        dist.barrier()
    write_rank_result(out_dir, rank, results)

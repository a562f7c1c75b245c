"""Rank bodies of tests/distributed/test_het_cached.py.

``het_cached_row_wise`` with ``s_read = s_write = 0`` against stock row_wise and
against the unsharded EmbeddingBagCollection trained on the global batch, with the
fused optimizers users use, multi-hot bags, shared tables, sum and mean pooling,
and weighted features.
"""


import torch
import torch.distributed as dist
import torchrec.optim
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het_bench.table_init import init_tables_by_row
from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.sharders import CpuRowWiseEmbeddingBagCollectionSharder, HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_cached_row_wise
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

SEED = 3
BATCH = 6
STEPS = 5
# name, features, dim, rows, pooling (mean is left out of the weighted runs)
TABLES = [
    ("t0", ["f0"], 8, 50, PoolingType.SUM),
    ("t1", ["f1", "f2"], 4, 37, PoolingType.SUM),
    ("t2", ["f3"], 8, 101, PoolingType.MEAN),
]
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    "rowwise_adagrad": (torchrec.optim.RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8}),
}


def table_configs(weighted: bool) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=name,
            feature_names=features,
            embedding_dim=dim,
            num_embeddings=rows,
            pooling=PoolingType.SUM if weighted else pooling,
        )
        for name, features, dim, rows, pooling in TABLES
    ]


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
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values_tensor, lengths=torch.cat(lengths), weights=weights)


def loss_of(pooled, projections: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(((pooled[f] @ p) ** 2).sum() for f, p in projections.items())


def projections(configs: list[EmbeddingBagConfig]) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    return {f: torch.randn(c.embedding_dim, 3, generator=generator) for c in configs for f in c.feature_names}


def _ebc(configs, weighted: bool, optimizer: str, device: str, lr: float | None = None) -> EmbeddingBagCollection:
    ebc = EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device(device))
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, ebc.parameters(), dict(kwargs, **({"lr": lr} if lr is not None else {})))
    return ebc


def sharded(
    kind: str,
    configs,
    weighted: bool,
    optimizer: str,
    cache: HetCacheConfig | None = None,
    lr: float | None = None,
    seed: int = SEED,
):
    """The EBC sharded ``het`` (every table het_cached_row_wise) or ``row_wise`` (stock), weights set.

    ``lr`` overrides the optimizer's learning rate, ``seed`` the weights' seed.
    """
    ebc = _ebc(configs, weighted, optimizer, "meta", lr)
    if kind == "het":
        sharder, generator = HetEmbeddingBagCollectionSharder(cache=cache), het_cached_row_wise
    else:
        sharder, generator = CpuRowWiseEmbeddingBagCollectionSharder(), row_wise
    plan = construct_module_sharding_plan(
        ebc,
        per_param_sharding={c.name: generator() for c in configs},
        world_size=dist.get_world_size(),
        device_type="cpu",
        sharder=sharder,
    )
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])
    init_tables_by_row(model, configs, seed)
    return model


def unsharded(configs, weighted: bool, optimizer: str) -> EmbeddingBagCollection:
    ebc = _ebc(configs, weighted, optimizer, "cpu")
    init_tables_by_row(ebc, configs, SEED)
    return ebc


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-6)) if want.numel() else 0.0


def _pooling(config: EmbeddingBagConfig) -> str:
    return "mean" if config.pooling == PoolingType.MEAN else "sum"


def _local_shard_errors(model, reference: EmbeddingBagCollection, configs, errors: dict, label: str) -> None:
    full = {c.name: reference.embedding_bags[c.name].weight.detach() for c in configs}
    pooling = {c.name: _pooling(c) for c in configs}
    for key, value in model.state_dict().items():
        name = key.split(".")[-2]
        for shard in value.local_shards():
            row0 = shard.metadata.shard_offsets[0]
            want = full[name][row0 : row0 + shard.tensor.size(0)]
            _worst(errors, f"{label}/{pooling[name]}", _rel_error(shard.tensor, want))


def _worst(errors: dict, key: str, value: float) -> None:
    errors[key] = max(errors.get(key, 0.0), value)


def equivalence(rank: int, world_size: int, optimizer: str, weighted: bool) -> dict[str, float]:
    """Largest relative differences over STEPS steps, by pooling of the table.

    Keys: ``<what>/<sum|mean>`` with what in out_het_vs_row_wise, out_het_vs_unsharded,
    out_row_wise_vs_unsharded, weights_het_vs_unsharded, weights_row_wise_vs_unsharded.
    """
    configs = table_configs(weighted)
    proj = projections(configs)
    pooling = {f: _pooling(c) for c in configs for f in c.feature_names}
    het = sharded("het", configs, weighted, optimizer)
    stock = sharded("row_wise", configs, weighted, optimizer)
    reference = unsharded(configs, weighted, optimizer)
    errors: dict[str, float] = {}
    for step in range(STEPS):
        batches = [batch(r, step, weighted, configs) for r in range(world_size)]
        out_het, out_stock = het(batches[rank]), stock(batches[rank])
        ref_outs = [reference(b) for b in batches]
        for f in proj:
            _worst(errors, f"out_het_vs_row_wise/{pooling[f]}", _rel_error(out_het[f], out_stock[f]))
            _worst(errors, f"out_het_vs_unsharded/{pooling[f]}", _rel_error(out_het[f], ref_outs[rank][f]))
            _worst(errors, f"out_row_wise_vs_unsharded/{pooling[f]}", _rel_error(out_stock[f], ref_outs[rank][f]))
        loss_of(out_het, proj).backward()
        loss_of(out_stock, proj).backward()
        (sum(loss_of(o, proj) for o in ref_outs) / world_size).backward()  # TorchRec averages over ranks
    _local_shard_errors(het, reference, configs, errors, "weights_het_vs_unsharded")
    _local_shard_errors(stock, reference, configs, errors, "weights_row_wise_vs_unsharded")
    return errors


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: every optimizer, weighted and not; writes ``rank<r>.json``."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {
            f"{optimizer}/{'weighted' if weighted else 'unweighted'}": equivalence(rank, world_size, optimizer, weighted)
            for optimizer in OPTIMIZERS
            for weighted in (False, True)
        }
        results["pipelined"] = pipelined(rank, world_size)
    write_rank_result(out_dir, rank, results)


__all__ = ["CacheSettings", "run_world", "sharded", "unsharded", "batch", "table_configs", "loss_of", "projections"]


class _LossModel(torch.nn.Module):
    """An EBC and the test loss, returning (loss, loss) as TorchRec's train pipelines expect."""

    def __init__(self, ebc: EmbeddingBagCollection, configs) -> None:
        super().__init__()
        self.ebc = ebc
        self.proj = projections(configs)

    def forward(self, features: KeyedJaggedTensor):
        loss = loss_of(self.ebc(features), self.proj)
        return loss, loss.detach()


def pipelined(rank: int, world_size: int, optimizer: str = "rowwise_adagrad", steps: int = 6) -> float:
    """Largest relative weight difference: het (s = 0) under TrainPipelineSparseDist vs a plain loop.

    At s > 0 the two legitimately differ: under the pipeline a batch's requests leave before
    the previous batch settled, so the cached versions it reports (and what the bound lets it
    keep) differ from the plain loop's; tests/distributed/test_het_pipeline.py checks the bound there.
    """
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
    from torchrec.optim.keyed import CombinedOptimizer

    configs = table_configs(weighted=False)
    cache = HetCacheConfig(default=CacheSettings(s_read=0, s_write=0, capacity=0.2))
    models = []
    for _ in range(2):
        ebc = _ebc(configs, False, optimizer, "meta")
        sharder = HetEmbeddingBagCollectionSharder(cache=cache)
        plan = construct_module_sharding_plan(
            ebc, per_param_sharding={c.name: het_cached_row_wise() for c in configs},
            world_size=world_size, device_type="cpu", sharder=sharder,
        )
        model = DistributedModelParallel(
            _LossModel(ebc, configs), device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
        )
        init_tables_by_row(model, configs, SEED)
        models.append(model)
    plain, piped = models
    batches = [batch(rank, step, False, configs) for step in range(steps)]
    for b in batches:
        loss, _ = plain(b)
        loss.backward()
    pipeline = TrainPipelineSparseDist(piped, CombinedOptimizer([piped.fused_optimizer]), torch.device("cpu"))
    iterator = iter(batches)
    for _ in range(steps):
        pipeline.progress(iterator)
    worst = 0.0
    want = plain.state_dict()
    for key, value in piped.state_dict().items():
        if hasattr(value, "local_shards"):
            for got, ref in zip(value.local_shards(), want[key].local_shards()):
                worst = max(worst, _rel_error(got.tensor, ref.tensor))
    return worst

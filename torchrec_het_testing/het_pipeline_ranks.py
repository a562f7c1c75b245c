"""Rank bodies of tests/distributed/test_het_pipeline.py: ``het_cached_row_wise`` under TorchRec's
``TrainPipelineSparseDist``, which runs the input dist of batch i+1 before the forward of batch i
(that it trains there as the unsharded model at s = 0 is checked by the generic tests,
:mod:`~torchrec_het_testing.equivalence`).

``bounds``
    Every read-bound case of :mod:`~torchrec_het_testing.het_behaviour_ranks` under the
    pipeline: before each ``progress`` the pushes of the last backward are applied (the
    lookup would do it first) and the owners' versions all-gathered; a
    :class:`~torchrec_het_testing.het_behaviour_ranks.ServeRecorder` measures how far each copy
    served lags behind. Then
    ``flush_cache()``: gradient mass produced equals mass applied.
``ahead``
    Tables whose read bound allows one step of lag (het ``s_read >= ws * (s_write + 1)``,
    lease ``s_read >= 1``), under the pipeline and in a plain loop: the lookup fetches in
    the input dist, the model's forward issues no collective (under the pipeline), and the
    read bound and gradient mass hold as above.
``prefetch``
    ``prefetch()`` called on the sharded module the way ``PrefetchTrainPipelineSparseDist``
    calls it (after the input dist of the next batch, before its forward): a model trained
    with it matches one trained without (a bounded cache: an exact one is the fetched-rows tier,
    whose prefetch is TorchRec's), and the requests really arrived there.
"""

import zlib

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.optim.keyed import CombinedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.sharders import CpuRowWiseEmbeddingBagCollectionSharder, HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_cached_row_wise
from torchrec_het_testing import het_behaviour_ranks as behaviour
from torchrec_het_testing.bag_models import ebc_with_optimizer, skewed_bags
from torchrec_het_testing.spawn import gloo_rank, write_rank_result
from torchrec_het_testing.weights import relative_error, seeded_tables, set_tables

SEED = 7
BATCH = 6
STEPS = 7
# name, features, dim, rows, pooling (mean is summed in the weighted runs); "f0" feeds t0 and t3
TABLES = [
    ("t0", ["f0"], 8, 50, PoolingType.SUM),
    ("t1", ["f1", "f2"], 4, 37, PoolingType.SUM),
    ("t2", ["f3"], 8, 61, PoolingType.MEAN),
    ("t3", ["f0"], 4, 29, PoolingType.SUM),
]


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
    """Skewed multi-hot bags (empty ones included); a shared feature's ids fit every table it feeds."""
    return skewed_bags(configs, torch.Generator().manual_seed(1_000 * rank + step), BATCH, 3, weighted)


class LossModel(torch.nn.Module):
    """An EBC and a quadratic loss over every pooled key; returns (loss, loss) as the pipeline wants.

    Each key has its own projection, seeded by its name, so the loss does not depend on the
    order of the pooled columns (a feature feeding two tables pools under ``feature@table``).
    """

    def __init__(self, ebc, width: int) -> None:  # noqa: ARG002
        super().__init__()
        self.ebc = ebc

    def forward(self, features: KeyedJaggedTensor):
        loss = pooled_loss(self.ebc(features))
        return loss, loss.detach()


def _projection(key: str, dim: int) -> torch.Tensor:
    return torch.randn(dim, 3, generator=torch.Generator().manual_seed(zlib.crc32(key.encode())))


def pooled_loss(pooled) -> torch.Tensor:
    """The test loss of a pooled KeyedTensor (a leaf for the pipeline's FX tracer)."""
    return sum(((v @ _projection(k, v.size(1))) ** 2).sum() for k, v in sorted(pooled.to_dict().items()))


torch.fx.wrap("pooled_loss")


def _width(configs) -> int:
    return sum(c.embedding_dim * len(c.feature_names) for c in configs)


def het_model(
    kind: str, configs, weighted: bool, optimizer: str, cache: HetCacheConfig | None = None, lr: float | None = None
) -> DistributedModelParallel:
    ebc = ebc_with_optimizer(configs, weighted, optimizer, "meta", lr)
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
    model = DistributedModelParallel(
        LossModel(ebc, _width(configs)),
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],
    )
    set_tables(model, seeded_tables(configs, SEED))
    return model


def sparse_dist_pipeline(model) -> TrainPipelineSparseDist:
    return TrainPipelineSparseDist(model, CombinedOptimizer([model.fused_optimizer]), torch.device("cpu"))


def bounds(rank: int, world_size: int) -> dict:
    """Read bounds of every behaviour case under the pipeline, then gradient mass after a flush."""
    configs, cache = behaviour.bound_configs()
    model = het_model("het", configs, False, "sgd", cache, lr=behaviour.LR)
    sharded = model.module.ebc
    lookups = sharded.het_lookups()
    recorder = behaviour.ServeRecorder.attach(lookups, rank)
    pipeline = sparse_dist_pipeline(model)
    iterator = iter([behaviour.batch(rank, step, configs) for step in range(behaviour.BOUND_STEPS)])
    try:
        for step in range(behaviour.BOUND_STEPS):
            behaviour.apply_pushes(lookups)  # the lookup of this step applies them before it answers
            recorder.truth = behaviour.true_versions(lookups, world_size)
            recorder.step = step
            pipeline.progress(iterator)
    finally:
        recorder.detach()
    stats = sharded.cache_stats()
    sharded.flush_cache()
    mass = behaviour.gradient_mass(sharded)
    tables = {
        name: {**record, "hits_unique": stats[name]["hits_unique"], "max_staleness": stats[name]["max_staleness"]}
        for name, record in recorder.records.items()
    }
    return {"tables": tables, "mass": mass}


# One step of lag fits each bound (het: s_read >= ws * (s_write + 1) on 2 and 3 ranks; lease:
# s_read >= 1). Under the pipeline a fetched-ahead lease is checked two steps after the answer it
# rests on (the answer for batch i+1 comes before batch i's backward, and the requests of i+2
# leave before batch i+1 settles), so leases serve from s_read = 3 on.
AHEAD_CASES = [
    CacheSettings(s_read=3, s_write=0, capacity=1.0),
    CacheSettings(s_read=3, s_write=0, capacity=behaviour.PRESSURE_ROWS),
    CacheSettings(s_read=3, s_write=0, capacity=1.0, protocol="lease"),
    CacheSettings(s_read=4, s_write=2, capacity=behaviour.PRESSURE_ROWS, protocol="lease", policy="lfu"),
]


class _Collectives:
    """Counts the collectives issued while the model's forward runs (input dists run outside it)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.inside, self.calls = False, 0
        module.register_forward_pre_hook(lambda *_: setattr(self, "inside", True))
        module.register_forward_hook(lambda *_: setattr(self, "inside", False))
        self._originals = {name: getattr(dist, name) for name in ("all_to_all_single", "all_gather")}
        for name, original in self._originals.items():
            setattr(dist, name, self._counted(original))

    def _counted(self, original):
        def call(*args, **kwargs):
            self.calls += int(self.inside)
            return original(*args, **kwargs)

        return call

    def close(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)


def ahead(rank: int, world_size: int, pipelined: bool) -> dict:
    """Tables whose bound allows fetching ahead, under the pipeline or in a plain loop: the read
    bound per table, collectives in the forward, and gradient mass after a flush."""
    configs, cache = behaviour.bound_configs(AHEAD_CASES)
    model = het_model("het", configs, False, "sgd", cache, lr=behaviour.LR)
    sharded = model.module.ebc
    lookups = sharded.het_lookups()
    recorder = behaviour.ServeRecorder.attach(lookups, rank)
    counter = _Collectives(model.module)
    batches = [behaviour.batch(rank, step, configs) for step in range(behaviour.BOUND_STEPS)]
    pipeline, iterator = (sparse_dist_pipeline(model), iter(batches)) if pipelined else (None, None)
    try:
        for step in range(behaviour.BOUND_STEPS):
            behaviour.apply_pushes(lookups)  # the lookup of this step applies them before serving
            recorder.truth = behaviour.true_versions(lookups, world_size)
            recorder.step = step
            if pipelined:
                pipeline.progress(iterator)
            else:
                loss, _ = model(batches[step])
                loss.backward()
    finally:
        counter.close()
        recorder.detach()
    stats = sharded.cache_stats()
    sharded.flush_cache()
    tables = {
        name: {**record, "hits_unique": stats[name]["hits_unique"], "rows_fetched": stats[name]["rows_fetched"]}
        for name, record in recorder.records.items()
    }
    return {
        "ahead": all(lookup.ahead for lookup in lookups),
        "tables": tables,
        "mass": behaviour.gradient_mass(sharded),
        "forward_collectives": counter.calls,
    }


def prefetch(rank: int, world_size: int) -> dict:
    """Two cached models (read bound 1) on the same batches, one with ``prefetch()`` called as the
    prefetch pipeline calls it."""
    configs = table_configs(False)
    cache = HetCacheConfig(default=CacheSettings(s_read=1, capacity=0.3))
    models = [het_model("het", configs, False, "rowwise_adagrad", cache) for _ in range(2)]
    batches = [batch(rank, step, False, configs) for step in range(STEPS)]
    prefetched = 0
    for index, model in enumerate(models):
        sharded = model.module.ebc
        for features in batches:
            ctx = sharded.create_context()
            dist_input = sharded.input_dist(ctx, features).wait().wait()
            if index == 1:
                sharded.prefetch(dist_input=dist_input, forward_stream=None, ctx=ctx)
            pooled = sharded.compute_and_output_dist(ctx, dist_input).wait()
            loss = pooled_loss(pooled)
            loss.backward()
        if index == 1:
            prefetched = sum(lookup.prefetched_batches for lookup in sharded.het_lookups())
    states = [m.state_dict() for m in models]
    worst = 0.0
    for key, value in states[0].items():
        if hasattr(value, "local_shards"):
            for a, b in zip(value.local_shards(), states[1][key].local_shards()):
                worst = max(worst, relative_error(b.tensor, a.tensor))
    return {"weights": worst, "prefetched": prefetched}


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: ``bounds``, ``ahead`` (under the pipeline and in a plain loop), ``prefetch``."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {}
        results["bounds"] = bounds(rank, world_size)
        results["ahead/pipeline"] = ahead(rank, world_size, pipelined=True)
        results["ahead/plain"] = ahead(rank, world_size, pipelined=False)
        results["prefetch"] = prefetch(rank, world_size)
    write_rank_result(out_dir, rank, results)

"""Rank bodies of tests/distributed/test_misleading_failures.py: the cases of "Failures that
mislead" (issue 19) that need ranks, each working as TorchRec does or failing with one message.

``shared_batch``
    An EmbeddingBagCollection (``t_user``) and an EmbeddingCollection (``t_item``) read one
    KeyedJaggedTensor, each ignoring the other's key as TorchRec's sharded modules do. With
    ``t_user`` on ``het_cached_row_wise`` (s = 0) and ``t_item`` on ``het_row_replicated``
    (exact) it trains as with both on stock ``row_wise`` under ``TrainPipelineSparseDist``,
    and it trains under the hybrid pipeline (k = 2; there the HET read comes at the input dist,
    a step before stock's lookup: the bounds add, so it is not compared). Also :func:`torchrec_het.stats_by_table` of the
    plugin model.
``variable_batch``
    A VBE batch (a batch size per feature) reaching a plugin table raises one ValueError
    naming the feature, the table and its type; stock ``row_wise`` takes the same batch.
``feature_processor``
    TorchRec's ``FeatureProcessedEmbeddingBagCollection`` with ``PositionWeightedModuleCollection``
    (tables on stock types) under the hybrid pipeline: k = 0 trains as ``TrainPipelineSparseDist``
    (position weights included), the default settings (k = 1) train and keep the position
    weights equal on every rank.
"""

import math

import torch
import torch.distributed as dist
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.feature_processor_ import PositionWeightedModuleCollection
from torchrec.modules.fp_embedding_modules import FeatureProcessedEmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_het
from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.pipeline import HybridTrainPipeline
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import get_het_sharders
from torchrec_het.sharding import het_cached_row_wise, het_row_replicated
from torchrec_het_testing.settings import hot_rows
from torchrec_het_testing.spawn import gloo_rank, write_rank_result
from torchrec_het_testing.weights import full_tables, seeded_tables, set_tables

SEED = 11
BATCH = 8
STEPS = 6
LR = 0.1
USER = EmbeddingBagConfig(name="t_user", feature_names=["user"], embedding_dim=8, num_embeddings=40)
ITEM = EmbeddingConfig(name="t_item", feature_names=["item"], embedding_dim=8, num_embeddings=30)
FP_TABLES = [
    EmbeddingBagConfig(name=f"t_{f}", feature_names=[f], embedding_dim=8, num_embeddings=30) for f in ("user", "item")
]
MAX_LENGTH = 4  # ids per bag, and position weights per feature


def _batch(rank: int, step: int, max_length: int = 2) -> Batch:
    """Both features' bags in one KeyedJaggedTensor, skewed ids, the same for every run of (rank, step)."""
    generator = torch.Generator().manual_seed(1000 * rank + step)
    lengths = torch.randint(1, max_length + 1, (2 * BATCH,), generator=generator)
    ids = (torch.rand(int(lengths.sum()), generator=generator) ** 2 * 30).long()
    features = KeyedJaggedTensor.from_lengths_sync(["user", "item"], ids, lengths)
    dense = torch.rand(BATCH, 8, generator=generator)
    return Batch(dense_features=dense, sparse_features=features, labels=(dense[:, 0] > 0.5).float())


class SharedBatch(nn.Module):
    """An EBC and an EC fed the same KeyedJaggedTensor, and a dense layer: (loss, (loss, logits, labels))."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=[USER], device=device)
        self.ec = EmbeddingCollection(tables=[ITEM], device=device)
        generator = torch.Generator().manual_seed(SEED)
        self.dense = nn.Linear(8, 8)
        with torch.no_grad():
            self.dense.weight.copy_(torch.randn(8, 8, generator=generator) * 0.3)
            self.dense.bias.zero_()

    def forward(self, batch: Batch):
        pooled = self.ebc(batch.sparse_features)
        items = self.ec(batch.sparse_features)["item"]
        per_sample = torch.segment_reduce(items.values(), "sum", lengths=items.lengths())
        logits = (self.dense(batch.dense_features) * (pooled["user"] + per_sample)).sum(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def _optimizer(model: DistributedModelParallel) -> CombinedOptimizer:
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda params: torch.optim.SGD(params, lr=LR)
    )
    return CombinedOptimizer([model.fused_optimizer, dense])


def _shared_model(plugin: bool) -> DistributedModelParallel:
    """``t_user`` het_cached_row_wise and ``t_item`` het_row_replicated (``plugin``), else both row_wise."""
    model = SharedBatch(torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, [*model.ebc.parameters(), *model.ec.parameters()], {"lr": LR})
    cache = HetCacheConfig(default=CacheSettings(s_read=0, s_write=0, capacity=0.3))
    hot = hot_rows([ITEM], 6)  # the whole model's tiers, as a profile's: each module takes its own tables
    sharders = get_het_sharders(cache=cache, replication=ReplicationConfig(tiers=hot))
    by_module = {s.module_type: s for s in sharders}
    world_size = dist.get_world_size()
    plan = ShardingPlan({
        "ebc": construct_module_sharding_plan(
            model.ebc, per_param_sharding={"t_user": het_cached_row_wise() if plugin else row_wise()},
            world_size=world_size, device_type="cpu", sharder=by_module[EmbeddingBagCollection]),
        "ec": construct_module_sharding_plan(
            model.ec, per_param_sharding={"t_item": het_row_replicated() if plugin else row_wise()},
            world_size=world_size, device_type="cpu", sharder=by_module[EmbeddingCollection]),
    })  # fmt: skip
    sharded = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)
    set_tables(sharded, seeded_tables([USER, ITEM], SEED))
    return sharded


def _train(model: DistributedModelParallel, pipeline_of, batches: list[Batch]) -> tuple[object, list[float]]:
    pipeline = pipeline_of(model, _optimizer(model))
    data, losses = iter(batches), []
    for _ in batches:
        losses.append(float(pipeline.progress(data)[0]))
    return pipeline, losses


def _plain(value) -> bool:
    """Whether ``value`` holds only plain Python numbers, strings, lists and dicts."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return isinstance(value, (bool, int, float, str))


def shared_batch() -> dict:
    rank = dist.get_rank()
    batches = [_batch(rank, step) for step in range(STEPS)]
    pipelines = {
        "sparse_dist": lambda m, o: TrainPipelineSparseDist(m, o, torch.device("cpu")),
        "hybrid_k2": lambda m, o: HybridTrainPipeline(m, o, torch.device("cpu"), embedding_staleness=2),
    }
    out = {}
    for name, pipeline_of in pipelines.items():
        runs, gauges = {}, {}
        for plugin in (False, True):
            model = _shared_model(plugin)
            pipeline, losses = _train(model, pipeline_of, batches)
            runs[plugin] = (full_tables(model, [USER, ITEM]), losses)
            gauges[plugin] = pipeline.gauge.max if isinstance(pipeline, HybridTrainPipeline) else None
            if plugin and name == "sparse_dist":
                stats = torchrec_het.stats_by_table(model)
                out["stats"] = stats if _plain(stats) else repr(stats)
        (stock_tables, stock_losses), (plugin_tables, plugin_losses) = runs[False], runs[True]
        out[name] = {
            "losses": max(abs(a - b) for a, b in zip(plugin_losses, stock_losses)),
            "weights": max(float((plugin_tables[t] - stock_tables[t]).abs().max()) for t in stock_tables),
            "finite": all(math.isfinite(x) for x in plugin_losses),
            "trained": max(float((stock_tables[t] - _tables_at_init(t)).abs().max()) for t in stock_tables),
            "plugin_trained": min(float((plugin_tables[t] - _tables_at_init(t)).abs().max()) for t in plugin_tables),
            "gauge_max": gauges[True],
        }
    return out


def _tables_at_init(name: str) -> torch.Tensor:
    return seeded_tables([USER, ITEM], SEED)[name]


def _vbe_batch(rank: int) -> KeyedJaggedTensor:
    """``user`` with 8 bags, ``item`` with 4 (VBE), one id per bag; inverse indices back to 8 samples."""
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 30, (12,), generator=generator)
    inverse = torch.stack([torch.arange(8), torch.arange(8) % 4])
    return KeyedJaggedTensor(
        keys=["user", "item"], values=ids, lengths=torch.ones(12, dtype=torch.int64),
        stride_per_key_per_rank=[[8], [4]], inverse_indices=(["user", "item"], inverse),
    )  # fmt: skip


def variable_batch() -> dict:
    out = {}
    for kind in ("row_wise", "het_cached_row_wise"):
        ebc = EmbeddingBagCollection(tables=FP_TABLES, device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": LR})
        sharder = next(s for s in get_het_sharders() if s.module_type is EmbeddingBagCollection)
        item = het_cached_row_wise() if kind == "het_cached_row_wise" else row_wise()
        plan = construct_module_sharding_plan(
            ebc, per_param_sharding={"t_user": row_wise(), "t_item": item}, world_size=dist.get_world_size(),
            device_type="cpu", sharder=sharder,
        )  # fmt: skip
        model = DistributedModelParallel(
            ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
        )
        try:
            pooled = model(_vbe_batch(dist.get_rank()))
            pooled.values().sum().backward()
            out[kind] = {"trained": list(pooled.values().shape)}
        except ValueError as error:
            out[kind] = {"error": str(error)}
    return out


class PositionWeighted(nn.Module):
    """A FeatureProcessedEmbeddingBagCollection (position weights) under a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        ebc = EmbeddingBagCollection(tables=FP_TABLES, is_weighted=True, device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": LR})  # the tables, not the processors
        processors = PositionWeightedModuleCollection({c.feature_names[0]: MAX_LENGTH for c in FP_TABLES})
        self.fp_ebc = FeatureProcessedEmbeddingBagCollection(ebc, processors)
        generator = torch.Generator().manual_seed(SEED)
        self.dense = nn.Linear(8, 16)
        with torch.no_grad():
            self.dense.weight.copy_(torch.randn(16, 8, generator=generator) * 0.3)
            self.dense.bias.zero_()

    def forward(self, batch: Batch):
        logits = (self.dense(batch.dense_features) * self.fp_ebc(batch.sparse_features).values()).sum(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels)


def _position_weighted() -> DistributedModelParallel:
    model = PositionWeighted()
    sharders = get_het_sharders()
    sharder = next(s for s in sharders if s.module_type is FeatureProcessedEmbeddingBagCollection)
    plan = construct_module_sharding_plan(
        model.fp_ebc, per_param_sharding={"t_user": table_wise(rank=0), "t_item": row_wise()},
        world_size=dist.get_world_size(), device_type="cpu", sharder=sharder,
    )  # fmt: skip
    sharded = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({"fp_ebc": plan}), sharders=sharders
    )
    set_tables(sharded, seeded_tables(FP_TABLES, SEED))
    return sharded


def _position_weights(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    return {k.split(".")[-1]: v.detach().clone() for k, v in model.state_dict().items() if "position_weights" in k}


def feature_processor() -> dict:
    rank = dist.get_rank()
    batches = [_batch(rank, step, MAX_LENGTH) for step in range(STEPS)]
    runs, out = {}, {}
    for name, pipeline_of in (
        ("sparse_dist", lambda m, o: TrainPipelineSparseDist(m, o, torch.device("cpu"))),
        ("hybrid_k0", lambda m, o: HybridTrainPipeline(m, o, torch.device("cpu"), embedding_staleness=0)),
        ("hybrid_default", lambda m, o: HybridTrainPipeline(m, o, torch.device("cpu"))),
    ):
        model = _position_weighted()
        pipeline, losses = _train(model, pipeline_of, batches)
        runs[name] = (_position_weights(model), full_tables(model, FP_TABLES), losses)
        if name == "hybrid_default":
            out["default_k"] = pipeline.embedding_staleness
            out["default_on_worker"] = pipeline.backward_on_worker_chosen
    want_positions, want_tables, want_losses = runs["sparse_dist"]
    for name, (positions, tables, losses) in runs.items():
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {k: v.tolist() for k, v in positions.items()})
        out[name] = {
            "positions_vs_sparse_dist": max(float((positions[k] - want_positions[k]).abs().max()) for k in positions),
            "tables_vs_sparse_dist": max(float((tables[t] - want_tables[t]).abs().max()) for t in tables),
            "losses_vs_sparse_dist": max(abs(a - b) for a, b in zip(losses, want_losses)),
            "positions_moved": max(float((v - 1.0).abs().max()) for v in positions.values()),
            "positions_equal_on_ranks": all(g == gathered[0] for g in gathered),
            "finite": all(math.isfinite(x) for x in losses),
        }
    return out


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: every body above, one process group."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        result = {
            "shared_batch": shared_batch(),
            "variable_batch": variable_batch(),
            "feature_processor": feature_processor(),
        }
    write_rank_result(out_dir, rank, result)

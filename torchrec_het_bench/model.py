"""Builds the benchmark's DLRM and shards it (or the sequence model) as a configuration says.

This follows TorchRec's DLRM example trainer: tables on the meta device, embedding
optimizer fused into backward, the stock planner (constrained per table by the
configuration), ``DistributedModelParallel`` and a combined optimizer. Every
configuration starts from the same weights (dense by seed, tables row by row), so
configurations differ in how they train, not where they start.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torchrec.optim
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_het_bench.config_types import BenchConfig, ShardingContext
from torchrec_het_bench.presets import BenchPreset
from torchrec_het_bench.table_init import init_tables_by_row
from torchrec_het_bench.topology import cpu_topology

EMBEDDING_OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "rowwise_adagrad": torchrec.optim.RowWiseAdagrad,
}


@dataclass
class ShardedModel:
    """A configuration's trained model (DLRM or sequence) and everything that steps it."""

    config: BenchConfig
    model: DistributedModelParallel
    optimizer: CombinedOptimizer
    plan: ShardingPlan
    sharding_types: list[str]


ShardedDLRM = ShardedModel  # the name earlier versions used

EMBEDDING_MODULE_PATH = "model.sparse_arch.embedding_bag_collection"
BENCH_DEVICE = torch.device("cpu")  # where every configuration trains (gloo)


def table_configs(preset: BenchPreset, feature_names: list[str]) -> list[EmbeddingBagConfig]:
    """One table per sparse feature, named ``t_<feature>``."""
    if len(feature_names) != len(preset.table_sizes):
        raise ValueError(
            f"preset {preset.name!r} has {len(preset.table_sizes)} tables but the data has "
            f"{len(feature_names)} sparse features"
        )
    return [
        EmbeddingBagConfig(
            name=f"t_{feature}",
            embedding_dim=preset.embedding_dim,
            num_embeddings=rows,
            feature_names=[feature],
        )
        for feature, rows in zip(feature_names, preset.table_sizes)
    ]


def build_dlrm(preset: BenchPreset, feature_names: list[str], num_dense: int, seed: int) -> DLRMTrain:
    """The unsharded DLRM, embedding tables on the meta device (DMP materializes shards)."""
    torch.manual_seed(seed)  # same dense initialization on every rank and configuration
    ebc = EmbeddingBagCollection(tables=table_configs(preset, feature_names), device=torch.device("meta"))
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=num_dense,
            dense_arch_layer_sizes=list(preset.dense_arch),
            over_arch_layer_sizes=list(preset.over_arch),
            dense_device=torch.device("cpu"),
        )
    )


def shard_dlrm(
    config: BenchConfig,
    preset: BenchPreset,
    feature_names: list[str],
    num_dense: int,
    embedding_optimizer: str,
    local_world_size: int,
    seed: int = 0,
    sample=None,
    link_bytes_per_s: float | None = None,
) -> ShardedModel:
    """Plans and shards a fresh DLRM for ``config`` on the default process group
    (``sample``: returns this rank's sampled training batches, for configurations that profile;
    ``link_bytes_per_s``: the run's network, for configurations that plan for it)."""
    check_embedding_optimizer(embedding_optimizer)
    train_model = build_dlrm(preset, feature_names, num_dense, seed)
    return shard_module(
        config,
        preset,
        train_model,
        EMBEDDING_MODULE_PATH,
        train_model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs(),
        batch_size=preset.batch_size,
        learning_rate=preset.learning_rate,
        embedding_optimizer=embedding_optimizer,
        local_world_size=local_world_size,
        seed=seed,
        sample=sample,
        link_bytes_per_s=link_bytes_per_s,
    )


def check_embedding_optimizer(name: str) -> None:
    if name not in EMBEDDING_OPTIMIZERS:
        raise ValueError(f"unknown embedding optimizer {name!r}; choose from {sorted(EMBEDDING_OPTIMIZERS)}")


def shard_module(
    config: BenchConfig,
    preset: BenchPreset,
    train_model: nn.Module,
    embedding_path: str,
    tables: list[BaseEmbeddingConfig],
    *,
    batch_size: int,
    learning_rate: float,
    embedding_optimizer: str,
    local_world_size: int,
    seed: int = 0,
    sample=None,
    workload: str = "dlrm",
    link_bytes_per_s: float | None = None,
) -> ShardedModel:
    """Shards ``train_model`` (tables on the meta device) as ``config`` says, the DLRM's way.

    The embedding module at ``embedding_path`` gets the fused ``embedding_optimizer``,
    the rest Adagrad, both at ``learning_rate``; the planner (constrained per table by
    the configuration) or the configuration's own ``make_plan`` places the tables; every
    table then starts from the weights ``init_tables_by_row`` gives it.
    ``link_bytes_per_s``: the network the run uses, for configurations that plan for it.
    """
    check_embedding_optimizer(embedding_optimizer)
    embedding_module = train_model.get_submodule(embedding_path)
    apply_optimizer_in_backward(
        EMBEDDING_OPTIMIZERS[embedding_optimizer],
        embedding_module.parameters(),
        optimizer_kwargs={"lr": learning_rate},
    )
    context = ShardingContext(
        workload=workload,
        train_model=train_model,
        embedding_path=embedding_path,
        tables=list(tables),
        world_size=dist.get_world_size(),
        local_world_size=local_world_size,
        batch_size=batch_size,
        embedding_optimizer=embedding_optimizer,
        sample=sample,
        link_bytes_per_s=link_bytes_per_s,
    )
    sharders = config.make_sharders_for(context) if config.make_sharders_for is not None else config.make_sharders()
    planner_args = dict(
        topology=cpu_topology(dist.get_world_size(), local_world_size),
        batch_size=batch_size,
        # TorchRec deprecates HeuristicalStorageReservation (FutureWarning); on CPU the 128 GB of DDR
        # per rank it plans against are never the binding constraint, so the plans are the same.
        storage_reservation=FixedPercentageStorageReservation(percentage=0.05),
        constraints=config.make_constraints(tables, preset),
    )
    if config.make_planner_for is not None:
        planner = config.make_planner_for(context, **planner_args)
    else:
        planner = EmbeddingShardingPlanner(**planner_args)
    if config.make_plan is not None:
        module_plan = config.make_plan(embedding_module, tables, sharders[0], dist.get_world_size())
        plan = ShardingPlan({embedding_path: module_plan})
    else:
        plan = planner.collective_plan(train_model, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(module=train_model, device=BENCH_DEVICE, plan=plan, sharders=sharders)
    init_tables_by_row(model, tables, seed)  # identical starting weights whatever the plan
    dense_params = dict(in_backward_optimizer_filter(model.named_parameters()))
    optimizers = [model.fused_optimizer]
    if dense_params:  # a model of embeddings alone (the micro benchmark's) has none
        optimizers.append(
            KeyedOptimizerWrapper(dense_params, lambda params: torch.optim.Adagrad(params, lr=learning_rate))
        )
    optimizer = CombinedOptimizer(optimizers)
    return ShardedModel(config, model, optimizer, plan, plan_sharding_types(plan))


def plan_sharding_types(plan: ShardingPlan) -> list[str]:
    """The distinct sharding types a plan uses, sorted."""
    found = {
        param.sharding_type
        for module_plan in plan.plan.values()
        for param in module_plan.values()  # type: ignore[union-attr]
    }
    return sorted(found)


def train_step(sharded: ShardedDLRM, batch) -> float:
    """One synchronous training step; returns the local loss."""
    loss, _ = sharded.model(batch)
    loss.backward()
    sharded.optimizer.step()
    sharded.optimizer.zero_grad()
    return float(loss.detach())


@torch.no_grad()
def predict(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Click probabilities and labels of a batch, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        _, (_, logits, labels) = model(batch)
    finally:
        model.train(was_training)
    return torch.sigmoid(logits.float()), labels.float()

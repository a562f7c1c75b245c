"""Rank bodies of tests/distributed/test_replicated_pipeline.py.

``het_row_replicated`` (bags) trained under TorchRec's ``TrainPipelineSparseDist`` against
the unsharded EmbeddingBagCollection trained on the global batches, with stock row_wise
under the same pipeline beside it; and host syncs per pipelined step.
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.optim.keyed import CombinedOptimizer

from torchrec_het_bench.table_init import init_tables_by_row
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_row_replicated
from torchrec_het_testing.het_ranks import SEED, _ebc, _LossModel, _rel_error, batch, loss_of, projections, table_configs, unsharded
from torchrec_het_testing.host_syncs import count_host_syncs
from torchrec_het_testing.replicated_ranks import replica_disagreement, tiers
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

STEPS = 8
SYNC_STEPS = 3  # the last pipelined steps whose host syncs are counted


def pipeline_model(kind: str, configs, weighted: bool, optimizer: str, replication: ReplicationConfig | None):
    ebc = _ebc(configs, weighted, optimizer, "meta")
    sharder = HetEmbeddingBagCollectionSharder(replication=replication)
    generator = het_row_replicated if kind == "replicated" else row_wise
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding={c.name: generator() for c in configs}, world_size=dist.get_world_size(),
        device_type="cpu", sharder=sharder,
    )
    model = DistributedModelParallel(
        _LossModel(ebc, configs), device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )
    init_tables_by_row(model, configs, SEED)
    return model


def _weight_error(model, reference, configs) -> float:
    """Largest relative difference of the local shards from the unsharded tables' rows."""
    full = {c.name: reference.embedding_bags[c.name].weight.detach() for c in configs}
    worst = 0.0
    for key, value in model.state_dict().items():
        if not hasattr(value, "local_shards"):
            continue
        table = key.split(".")[-2]
        for shard in value.local_shards():
            rows, cols = shard.metadata.shard_offsets
            size_rows, size_cols = shard.metadata.shard_sizes
            want = full[table][rows : rows + size_rows, cols : cols + size_cols]
            worst = max(worst, _rel_error(shard.tensor, want))
    return worst


def under_pipeline(rank: int, world_size: int, optimizer: str, weighted: bool, replication: ReplicationConfig | None) -> dict:
    """Losses and weights of ``replicated`` and stock ``row_wise`` under the pipeline, against unsharded."""
    configs = table_configs(weighted)
    proj = projections(configs)
    reference = unsharded(configs, weighted, optimizer)
    models = {
        "replicated": pipeline_model("replicated", configs, weighted, optimizer, replication),
        "row_wise": pipeline_model("row_wise", configs, weighted, optimizer, None),
    }
    batches = [[batch(r, step, weighted, configs) for r in range(world_size)] for step in range(STEPS)]
    want_losses = []
    for step_batches in batches:
        losses = [loss_of(reference(b), proj) for b in step_batches]
        want_losses.append(float(losses[rank]))
        (sum(losses) / world_size).backward()
    result: dict = {}
    for name, model in models.items():
        pipeline = TrainPipelineSparseDist(model, CombinedOptimizer([model.fused_optimizer]), torch.device("cpu"))
        iterator = iter([b[rank] for b in batches])
        losses = []
        for step in range(STEPS):
            if step < STEPS - SYNC_STEPS:
                losses.append(float(pipeline.progress(iterator)))
                continue
            with count_host_syncs(where=False) as counts:
                loss = pipeline.progress(iterator)
            losses.append(float(loss))
            result[f"host_syncs/{name}"] = max(result.get(f"host_syncs/{name}", 0), counts.total())
        result[f"loss/{name}"] = max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(losses, want_losses))
        result[f"weights/{name}"] = _weight_error(model, reference, configs)
    result["replica_disagreement"] = replica_disagreement(SimpleNamespace(module=models["replicated"].module.ebc))
    result["stats"] = models["replicated"].module.ebc.replication_stats()
    return result


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: hot rows synced every step (row-wise Adagrad, weighted and not; SGD), and an online profile."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {}
        for optimizer, weighted in (("rowwise_adagrad", False), ("rowwise_adagrad", True), ("sgd", False)):
            plan = tiers(table_configs(weighted), hot=8)
            results[f"{optimizer}/{'weighted' if weighted else 'unweighted'}"] = under_pipeline(
                rank, world_size, optimizer, weighted, ReplicationConfig(tiers=plan)
            )
        results["online"] = under_pipeline(rank, world_size, "rowwise_adagrad", False, ReplicationConfig(online_profile_steps=3))
    write_rank_result(out_dir, rank, results)

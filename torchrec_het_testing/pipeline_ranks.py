"""Rank bodies of tests/distributed/test_replicated_pipeline.py: the host syncs one pipelined step
of ``het_row_replicated`` (bags) adds to stock row_wise's under TorchRec's ``TrainPipelineSparseDist``
(that it trains there as the unsharded model is checked by the generic tests,
:mod:`~torchrec_het_testing.equivalence`).
"""

import torch
from torchrec.distributed.sharding_plan import row_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.keyed import CombinedOptimizer

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_row_replicated
from torchrec_het_testing.bag_models import LossModel, batch, ebc_with_optimizer, shard_module, table_configs
from torchrec_het_testing.host_syncs import count_host_syncs
from torchrec_het_testing.settings import hot_rows
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

STEPS = 8
SYNC_STEPS = 3  # the last pipelined steps whose host syncs are counted


def host_syncs(rank: int, optimizer: str, weighted: bool, replication: ReplicationConfig) -> dict[str, int]:
    """Most host syncs of one of the last SYNC_STEPS pipelined steps, ``replicated`` and stock ``row_wise``."""
    configs = table_configs(weighted)
    out = {}
    for name, generator in (("replicated", het_row_replicated), ("row_wise", row_wise)):
        ebc = ebc_with_optimizer(configs, weighted, optimizer, "meta")
        sharder = HetEmbeddingBagCollectionSharder(replication=replication)
        model = shard_module(LossModel(ebc, configs), "ebc", configs, sharder, generator)
        pipeline = TrainPipelineSparseDist(model, CombinedOptimizer([model.fused_optimizer]), torch.device("cpu"))
        feed = iter([batch(rank, step, weighted, configs) for step in range(STEPS)])
        most = 0
        for step in range(STEPS):
            if step < STEPS - SYNC_STEPS:
                pipeline.progress(feed)
                continue
            with count_host_syncs(where=False) as counts:
                pipeline.progress(feed)
            most = max(most, counts.total())
        out[name] = most
        if name == "replicated":
            out["stats"] = model.module.ebc.replication_stats()
    return out


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: hot rows synced every step (row-wise Adagrad, weighted and not; SGD), an online
    profile, and cold ids that fetch their rows."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {}
        for optimizer, weighted in (("rowwise_adagrad", False), ("rowwise_adagrad", True), ("sgd", False)):
            replication = ReplicationConfig(tiers=hot_rows(table_configs(weighted), 8))
            results[f"{optimizer}/{'weighted' if weighted else 'unweighted'}"] = host_syncs(
                rank, optimizer, weighted, replication
            )
        results["online"] = host_syncs(rank, "rowwise_adagrad", False, ReplicationConfig(online_profile_steps=3))
        tables = table_configs(False)  # every table's cold ids fetching rows: no host sync more
        rows = ReplicationConfig(tiers=hot_rows(tables, 8), cold_rows=frozenset(t.name for t in tables))
        results["cold_rows"] = host_syncs(rank, "rowwise_adagrad", False, rows)
    write_rank_result(out_dir, rank, results)

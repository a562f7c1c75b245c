"""Rank bodies of tests/distributed/test_lookahead.py: ``het_row_replicated`` bags of one width under
TorchRec's ``TrainPipelineSparseDist`` with lookahead off, on, and on with the model's state dict
loaded back mid-run (between a batch's arrival on its owners and its lookup)."""

import torch
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.optim.keyed import CombinedOptimizer

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_row_replicated
from torchrec_het_testing.bag_models import LossModel, batch, ebc_with_optimizer, shard_module
from torchrec_het_testing.settings import hot_rows
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

STEPS, RELOAD_AFTER = 8, 3
CONFIGS = [
    EmbeddingBagConfig(name="a", feature_names=["f0"], embedding_dim=8, num_embeddings=50),
    EmbeddingBagConfig(name="b", feature_names=["f1", "f2"], embedding_dim=8, num_embeddings=37),
    EmbeddingBagConfig(name="c", feature_names=["f3"], embedding_dim=8, num_embeddings=101, pooling=PoolingType.MEAN),
]


def train(rank: int, lookahead: bool, reload: bool) -> dict:
    """Per-step losses, the tables' pooled output on one more batch after training, and the counters."""
    replication = ReplicationConfig(tiers=hot_rows(CONFIGS, 4), lookahead=lookahead)
    ebc = ebc_with_optimizer(CONFIGS, False, "rowwise_adagrad", "meta")
    sharder = HetEmbeddingBagCollectionSharder(replication=replication)
    model = shard_module(LossModel(ebc, CONFIGS), "ebc", CONFIGS, sharder, het_row_replicated)
    pipeline = TrainPipelineSparseDist(model, CombinedOptimizer([model.fused_optimizer]), torch.device("cpu"))
    feed = iter([batch(rank, step, False, CONFIGS) for step in range(STEPS)])
    losses = []
    for step in range(STEPS):
        losses.append(float(pipeline.progress(feed)))
        if reload and step == RELOAD_AFTER:  # the next batch's partials are in flight: voided
            model.load_state_dict(model.state_dict())
    while True:
        try:
            losses.append(float(pipeline.progress(feed)))
        except StopIteration:
            break
    model = pipeline.detach()  # the model's own forward again
    with torch.no_grad():
        pooled = model.module.ebc(batch(rank, STEPS, False, CONFIGS)).values()
    return {"losses": losses, "pooled": pooled.tolist(), "stats": model.module.ebc.replication_stats()}


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {name: train(rank, lookahead, reload) for name, lookahead, reload in
                   (("off", False, False), ("on", True, False), ("reloaded", True, True))}  # fmt: skip
    write_rank_result(out_dir, rank, results)

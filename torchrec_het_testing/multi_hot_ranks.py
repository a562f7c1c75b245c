"""Rank bodies of the multi-hot training test: TorchRec benchmark-shaped batches (power-law ids,
about 20 per bag), tables of 10^5 rows, a large batch and fused row-wise Adagrad, trained tens of
steps under ``TrainPipelineSparseDist`` by stock table_wise, the plugin's CPU row_wise and
``het_row_replicated`` from the same weights on the same batches.

The model reads the pooled embeddings through a fixed linear map into a logistic loss: smooth, so
the order in which a sharding sums a bag's rows changes the outputs by rounding only (a ReLU would
turn such a rounding into a different gradient at its kink, and then every sharding's training
takes its own path, as two runs of TorchRec's own row_wise and table_wise do).
"""

import itertools
import json
from pathlib import Path

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.planner.access import ProfileTiers
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfiler
from torchrec_het.sharders import CpuRowWiseEmbeddingBagCollectionSharder, HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_row_replicated
from torchrec_het_testing.bag_models import ebc_with_optimizer, shard_module
from torchrec_het_testing.spawn import gloo_rank

ROWS, DIM, TABLES, BATCH, ALPHA, STEPS = 100_000, 16, 2, 1024, 1.1, 24
LR = 0.02  # row-wise Adagrad
KINDS = ("table_wise", "row_wise", "het_row_replicated")


def table_configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[f"f{i}"])
        for i in range(TABLES)
    ]


def power_law_ids(n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` ids in [0, ROWS) with P(id) ~ (id + 1)^-ALPHA (inverse CDF of the continuous law, as
    TorchRec's benchmark inputs draw them)."""
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    top = (ROWS + 1.0) ** (1.0 - ALPHA)
    x = (1.0 + u * (top - 1.0)) ** (1.0 / (1.0 - ALPHA))
    return (x.floor().long() - 1).clamp_(0, ROWS - 1)


def batch(rank: int, step: int) -> Batch:
    """Rank ``rank``'s batch ``step``: every feature's bags 10..30 ids long (20 on average), a label per sample."""
    generator = torch.Generator().manual_seed(1_000 * step + rank)
    lengths = torch.randint(10, 31, (TABLES * BATCH,), generator=generator)
    ids = power_law_ids(int(lengths.sum()), generator)
    features = KeyedJaggedTensor.from_lengths_sync([f"f{i}" for i in range(TABLES)], ids, lengths)
    labels = (torch.rand(BATCH, generator=generator) < 0.3).float()
    return Batch(dense_features=torch.zeros(BATCH, 1), sparse_features=features, labels=labels)


class LogisticReadout(nn.Module):
    """Pooled embeddings -> one logit per sample (a fixed linear map) -> mean logistic loss."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        weights = torch.randn(TABLES * DIM, generator=torch.Generator().manual_seed(7))
        self.register_buffer("readout", weights)

    def forward(self, batch: Batch):
        pooled = self.ebc(batch.sparse_features)
        logits = torch.cat([pooled[f"f{i}"] for i in range(TABLES)], dim=1) @ self.readout
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def sharder_and_plan(kind: str, configs: list[EmbeddingBagConfig], world_size: int, profile_rank: int = 0) -> tuple:
    """``kind``'s sharder and plan generator (table_wise: the tables round-robin over the ranks;
    het_row_replicated: the hot rows of a profile of rank ``profile_rank``'s batches of the same generator)."""
    if kind == "table_wise":
        ranks = itertools.cycle(range(world_size))
        return EmbeddingBagCollectionSharder(), lambda: table_wise(rank=next(ranks))
    if kind == "row_wise":
        return CpuRowWiseEmbeddingBagCollectionSharder(), row_wise
    profiler = AccessProfiler(configs)
    for step in range(4):
        profiler.observe(batch(profile_rank, 10_000 + step).sparse_features)
    tiers = ProfileTiers(profiler.profile(), world_size=world_size)
    return HetEmbeddingBagCollectionSharder(replication=ReplicationConfig(tiers=tiers)), het_row_replicated


def train(kind: str, configs, world_size: int, rank: int) -> dict:
    """``kind``'s logits and losses of every step, trained under ``TrainPipelineSparseDist``."""
    sharder, generator = sharder_and_plan(kind, configs, world_size)
    ebc = ebc_with_optimizer(configs, False, "rowwise_adagrad", "meta", lr=LR)
    model = shard_module(LogisticReadout(ebc), "ebc", configs, sharder, generator, seed=5)
    no_dense = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)  # the model has no dense weights
    pipeline = TrainPipelineSparseDist(model, no_dense, torch.device("cpu"))
    batches = iter([batch(rank, step) for step in range(STEPS)])
    logits, losses = [], []
    for _ in range(STEPS):
        loss, out = pipeline.progress(batches)
        logits.append(out.tolist())
        losses.append(float(loss))
    return {"logits": logits, "losses": losses}


def own_profile_error(configs, world_size: int, rank: int) -> str | None:
    """The error of sharding ``het_row_replicated`` with every rank's hot rows from its own batches (None: none)."""
    sharder, generator = sharder_and_plan("het_row_replicated", configs, world_size, profile_rank=rank)
    try:
        shard_module(LogisticReadout(ebc_with_optimizer(configs, False, "rowwise_adagrad", "meta")), "ebc", configs,
                     sharder, generator)  # fmt: skip
    except ValueError as error:
        return str(error)
    return None


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port, timeout_s=300):
        configs = table_configs()
        results = {kind: train(kind, configs, world_size, rank) for kind in KINDS}
        results["own_profile_error"] = own_profile_error(configs, world_size, rank)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))

"""The benchmark's sequence model: an unpooled EmbeddingCollection and a target-attention ranker.

Two tables, ``t_item`` (features ``hist_item``, ``target_item``) and ``t_cat``
(``hist_cat``, ``target_cat``), live in one ``EmbeddingCollection``, which returns one
embedding per id (a ``JaggedTensor`` per feature). The dense part pads the item
history, pools it with attention by the target item (softmax of scaled dot products
over the valid positions) and by a plain mean, mean-pools the category history, and
feeds those, the target's embeddings and their elementwise products with the pooled
history to an MLP that outputs the click logit. Training mirrors the DLRM's: the
embedding optimizer is fused into backward, the dense part has Adagrad, the module is
sharded by ``DistributedModelParallel`` and every configuration starts from the same
weights.
"""

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from torchrec_het_bench.config_types import BenchConfig
from torchrec_het_bench.data.sequence import CATEGORY_TABLE, ITEM_TABLE, TABLE_FEATURES
from torchrec_het_bench.model import ShardedModel, shard_module
from torchrec_het_bench.presets import BenchPreset, SequencePreset

EMBEDDING_MODULE_PATH = "model.embedding_collection"


def sequence_table_configs(preset: SequencePreset) -> list[EmbeddingConfig]:
    """``t_item`` and ``t_cat``, each shared by its history and target feature."""
    rows = {ITEM_TABLE: preset.item_rows, CATEGORY_TABLE: preset.category_rows}
    return [
        EmbeddingConfig(
            name=f"t_{'cat' if table == CATEGORY_TABLE else table}",
            embedding_dim=preset.embedding_dim,
            num_embeddings=rows[table],
            feature_names=list(features),
        )
        for table, features in TABLE_FEATURES.items()
    ]


def _padded(history: JaggedTensor, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """History embeddings as [B, max_length, D] (zeros past each length) and the [B, max_length] mask."""
    values, lengths = history.values(), history.lengths().to(torch.int64)
    batch_size, dim = lengths.numel(), values.shape[-1]
    if values.shape[0] == batch_size * max_length:  # every history is full: no copy
        return values.view(batch_size, max_length, dim), torch.ones(batch_size, max_length, dtype=torch.bool)
    sample_of = torch.repeat_interleave(torch.arange(batch_size), lengths)
    starts = torch.cumsum(lengths, 0) - lengths
    position = torch.arange(values.shape[0]) - starts.index_select(0, sample_of)
    padded = values.new_zeros(batch_size, max_length, dim).index_put((sample_of, position), values)
    mask = torch.arange(max_length).unsqueeze(0) < lengths.unsqueeze(1)
    return padded, mask


class HistoryPooling(nn.Module):
    """The ranker's features from the looked-up embeddings: the target's, the item history
    pooled by attention and by mean, the mean category, and two products (7 x D per sample).

    It has no parameters. It is a module of its own so that TorchRec's train pipelines,
    which fx-trace the model around its sharded modules, treat it as a leaf: its shape-
    dependent branches (``_padded``) stay out of the traced graph.

    Args:
        max_history: longest history.
        embedding_dim: width D of every table.
    """

    def __init__(self, max_history: int, embedding_dim: int) -> None:
        super().__init__()
        self.max_history = max_history
        self.scale = embedding_dim**-0.5

    def forward(self, embedded: dict[str, JaggedTensor]) -> torch.Tensor:
        """[B, 7 x D] features."""
        target_item = embedded["target_item"].values()
        target_cat = embedded["target_cat"].values()
        history, mask = _padded(embedded["hist_item"], self.max_history)
        counts = mask.sum(1, keepdim=True).clamp_min(1).to(history.dtype)
        mean_item = history.sum(1) / counts
        scores = torch.einsum("bld,bd->bl", history, target_item) * self.scale
        weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=1).nan_to_num(0.0)
        attended = torch.einsum("bl,bld->bd", weights, history)
        categories = embedded["hist_cat"]
        cat_sum = torch.zeros_like(target_cat).index_add(
            0,
            torch.repeat_interleave(torch.arange(target_cat.shape[0]), categories.lengths().to(torch.int64)),
            categories.values(),
        )
        mean_cat = cat_sum / counts
        return torch.cat(
            [target_item, target_cat, attended, mean_item, mean_cat, target_item * attended, target_cat * mean_cat],
            dim=1,
        )


class SequenceRanker(nn.Module):
    """Scores a target item against a user's history.

    Args:
        embedding_collection: the unpooled tables (features of ``TABLE_FEATURES``).
        embedding_dim: width D of every table.
        max_history: longest history.
        over_arch: MLP widths after the 7 * D input features (the last is 1).
    """

    def __init__(
        self,
        embedding_collection: EmbeddingCollection,
        embedding_dim: int,
        max_history: int,
        over_arch: tuple[int, ...],
    ) -> None:
        super().__init__()
        if over_arch[-1] != 1:
            raise ValueError(f"over_arch must end with 1, got {over_arch}")
        self.embedding_collection = embedding_collection
        self.pooling = HistoryPooling(max_history, embedding_dim)
        layers: list[nn.Module] = []
        width = 7 * embedding_dim
        for i, out in enumerate(over_arch):
            layers.append(nn.Linear(width, out))
            if i < len(over_arch) - 1:
                layers.append(nn.ReLU())
            width = out
        self.over_arch = nn.Sequential(*layers)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """Click logits, shape [B]."""
        return self.over_arch(self.pooling(self.embedding_collection(features))).squeeze(-1)


class SequenceTrain(nn.Module):
    """The ranker with its loss; returns ``(loss, (loss, logits, labels))`` like ``DLRMTrain``."""

    def __init__(self, model: SequenceRanker) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = nn.BCEWithLogitsLoss()

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        logits = self.model(batch.sparse_features)
        loss = self.loss_fn(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def build_sequence_model(preset: SequencePreset, seed: int, device: torch.device | None = None) -> SequenceTrain:
    """The unsharded model; tables on ``device`` (default meta: DMP materializes the shards)."""
    torch.manual_seed(seed)  # same dense initialization on every rank and configuration
    ec = EmbeddingCollection(tables=sequence_table_configs(preset), device=device or torch.device("meta"))
    return SequenceTrain(SequenceRanker(ec, preset.embedding_dim, preset.history_length, preset.over_arch))


def shard_sequence(
    config: BenchConfig,
    preset: BenchPreset,
    embedding_optimizer: str,
    local_world_size: int,
    seed: int = 0,
    sample=None,
    link_bytes_per_s: float | None = None,
) -> ShardedModel:
    """Plans and shards a fresh sequence model for ``config`` on the default process group
    (``sample``: returns this rank's sampled training batches, for configurations that profile)."""
    if preset.sequence is None:
        raise ValueError(f"preset {preset.name!r} has no sequence workload")
    sequence = preset.sequence
    train_model = build_sequence_model(sequence, seed)
    return shard_module(
        config,
        preset,
        train_model,
        EMBEDDING_MODULE_PATH,
        train_model.model.embedding_collection.embedding_configs(),
        batch_size=sequence.batch_size,
        learning_rate=sequence.learning_rate,
        embedding_optimizer=embedding_optimizer,
        local_world_size=local_world_size,
        seed=seed,
        sample=sample,
        workload="sequence",
        link_bytes_per_s=link_bytes_per_s,
    )

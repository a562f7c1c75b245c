"""The model and batches the sharded-vs-unsharded tests train: TorchRec's awkward cases in a few table sets.

A :class:`TableSet` names pooled tables (one EmbeddingBagCollection, ``ebc``), weighted pooled
tables (a second one, ``wbc``) and sequence tables (one EmbeddingCollection per width, ``ec<dim>``).
:class:`SparseDenseModel` puts a dense layer over all of them, as TorchRec's test models do: the
pooled embeddings and the per-sample sums of the sequence embeddings (each position weighted
by where it sits, so an order mix-up shows) go through one ``nn.Linear`` to a prediction per
sample, and the loss is its mean squared distance to the label. :class:`ModelBatch` is the batch
TorchRec's pipelines move: one KeyedJaggedTensor for the unweighted features (every module reads
its own keys of it), one for the weighted ones, and the labels.
"""

from dataclasses import dataclass

import torch
from torch import nn
from torchrec.distributed.types import LazyAwaitable
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from torchrec.streamable import Pipelineable

from torchrec_het_testing.weights import seeded_tables, set_tables

BATCH_SIZE = 6
MAX_BAG = 3  # ids per bag: 0..3 (empty bags included)
MAX_SEQUENCE = 6  # ids per sequence: 0..6


@dataclass(frozen=True)
class TableSet:
    """The tables of one model: pooled (``ebc``), weighted pooled (``wbc``) and sequence (``ec<dim>``) ones."""

    name: str
    bags: tuple[EmbeddingBagConfig, ...] = ()
    weighted: tuple[EmbeddingBagConfig, ...] = ()
    sequences: tuple[EmbeddingConfig, ...] = ()

    @property
    def tables(self) -> list:
        return [*self.bags, *self.weighted, *self.sequences]

    def bag_modules(self) -> dict[str, list[EmbeddingBagConfig]]:
        """``ebc`` and ``wbc`` -> their tables (the modules this set has)."""
        return {name: list(tables) for name, tables in (("ebc", self.bags), ("wbc", self.weighted)) if tables}

    def sequence_modules(self) -> dict[str, list[EmbeddingConfig]]:
        """``ec<dim>`` -> its tables (an EmbeddingCollection holds tables of one width)."""
        out: dict[str, list[EmbeddingConfig]] = {}
        for config in self.sequences:
            out.setdefault(f"ec{config.embedding_dim}", []).append(config)
        return out

    def width(self) -> int:
        """Columns of the dense layer's input: one block per (feature, table) read."""
        return sum(c.embedding_dim * len(c.feature_names) for c in self.tables)


def _bag(name: str, features: list[str], dim: int, rows: int, mean: bool = False) -> EmbeddingBagConfig:
    pooling = PoolingType.MEAN if mean else PoolingType.SUM
    return EmbeddingBagConfig(
        name=name, feature_names=features, embedding_dim=dim, num_embeddings=rows, pooling=pooling
    )


def _torchrec_shared(mean: bool) -> TableSet:
    """The tables of TorchRec's ``ModelParallelTestShared`` (test_model_parallel.py): widths 16-40,
    10-40 rows, two more tables reading features 0 and 1 again, two weighted tables."""
    plain = [_bag(f"table_{i}", [f"feature_{i}"], (i + 2) * 8, (i + 1) * 10, mean) for i in range(4)]
    plain += [_bag(f"table_{i + 4}", [f"feature_{i}"], (i + 2) * 8, (i + 1) * 10, mean) for i in range(2)]
    weighted = [_bag(f"weighted_table_{i}", [f"weighted_feature_{i}"], (i + 2) * 4, (i + 1) * 10) for i in range(2)]
    return TableSet("torchrec_mean" if mean else "torchrec", bags=tuple(plain), weighted=tuple(weighted))


TABLE_SETS: dict[str, TableSet] = {
    # widths 8 and 4; t1 is read by two features; f0 feeds t0 and t3; t2 is mean-pooled
    "bags": TableSet(
        "bags",
        bags=(
            _bag("t0", ["f0"], 8, 50),
            _bag("t1", ["f1", "f2"], 4, 37),
            _bag("t2", ["f3"], 8, 61, mean=True),
            _bag("t3", ["f0"], 4, 29),
        ),
        weighted=(_bag("w0", ["wf0"], 8, 43), _bag("w1", ["wf1", "wf2"], 4, 31)),
    ),  # fmt: skip
    # two widths (two EmbeddingCollections); s1 is read by two features
    "sequences": TableSet(
        "sequences",
        sequences=(
            EmbeddingConfig(name="s0", feature_names=["sf0"], embedding_dim=8, num_embeddings=50),
            EmbeddingConfig(name="s2", feature_names=["sf3"], embedding_dim=8, num_embeddings=101),
            EmbeddingConfig(name="s1", feature_names=["sf1", "sf2"], embedding_dim=4, num_embeddings=37),
        ),
    ),
    # "bags" in one width: het_row_replicated owners then pool and step their rows themselves
    "bags_one_width": TableSet(
        "bags_one_width",
        bags=(
            _bag("o0", ["g0"], 8, 50),
            _bag("o1", ["g1", "g2"], 8, 37),
            _bag("o2", ["g3"], 8, 61, mean=True),
            _bag("o3", ["g0"], 8, 29),
        ),
        weighted=(_bag("ow0", ["wg0"], 8, 43), _bag("ow1", ["wg1", "wg2"], 8, 31)),
    ),  # fmt: skip
    "torchrec": _torchrec_shared(mean=False),
    "torchrec_mean": _torchrec_shared(mean=True),
}


@dataclass
class ModelBatch(Pipelineable):
    """What :class:`SparseDenseModel` trains on; TorchRec's pipelines move it between devices."""

    features: KeyedJaggedTensor
    weighted: KeyedJaggedTensor
    labels: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> "ModelBatch":
        return ModelBatch(
            self.features.to(device=device, non_blocking=non_blocking),
            self.weighted.to(device=device, non_blocking=non_blocking),
            self.labels.to(device=device, non_blocking=non_blocking),
        )

    def record_stream(self, stream: torch.Stream) -> None:
        self.features.record_stream(stream)
        self.weighted.record_stream(stream)
        self.labels.record_stream(stream)


def sequence_sums(embeddings: dict[str, JaggedTensor]) -> dict[str, torch.Tensor]:
    """Per feature, each sample's sum of its sequence's embeddings, position ``p`` of the batch's
    flattened ids weighted ``1 + p / 16`` (so ids served in the wrong order change the sum)."""
    out = {}
    for feature, jagged in embeddings.items():
        values = jagged.values()
        scale = 1.0 + torch.arange(values.size(0), device=values.device, dtype=values.dtype).unsqueeze(1) / 16
        out[feature] = torch.segment_reduce(values * scale, "sum", lengths=jagged.lengths())
    return out


def dense_input(outputs: list) -> torch.Tensor:
    """The pooled embeddings of every module, in the order of their sorted keys, as one ``[B, width]`` tensor.

    ``outputs`` holds KeyedTensors (pooled) and dicts of JaggedTensors (sequences), or the
    awaitables of them a sharded module returns. Keys are sorted because a sharded
    module may order its outputs otherwise than the unsharded one.
    """
    columns: dict[str, torch.Tensor] = {}
    for out in outputs:
        out = out.wait() if isinstance(out, LazyAwaitable) else out
        columns.update(out.to_dict() if isinstance(out, KeyedTensor) else sequence_sums(dict(out)))
    return torch.cat([columns[key] for key in sorted(columns)], dim=1)


torch.fx.wrap("dense_input")  # a leaf for the train pipelines' tracer


class SparseDenseModel(nn.Module):
    """The table set's embedding modules under one dense layer; ``forward`` returns ``(loss, predictions)``.

    Args:
        tables: the table set.
        sparse_device: where the embedding modules are created (``meta`` for a model to shard).
        seed: seeds the dense layer's weights and, with ``sparse_device`` real, the tables'
            (:func:`~torchrec_het_testing.weights.seeded_tables`).
        dense_device: where the dense layer lives (default: ``sparse_device``, the CPU for ``meta``).
    """

    def __init__(
        self, tables: TableSet, sparse_device: torch.device, seed: int, dense_device: torch.device | None = None
    ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.ebc = EmbeddingBagCollection(list(tables.bags), device=sparse_device) if tables.bags else None
        self.wbc = (
            EmbeddingBagCollection(list(tables.weighted), is_weighted=True, device=sparse_device)
            if tables.weighted else None
        )  # fmt: skip
        self.ecs = nn.ModuleDict(
            {
                name: EmbeddingCollection(configs, device=sparse_device)
                for name, configs in tables.sequence_modules().items()
            }
        )
        if dense_device is None:
            dense_device = torch.device("cpu") if sparse_device.type == "meta" else sparse_device
        self.over = nn.Linear(tables.width(), 1, device=dense_device)
        with torch.no_grad():
            self.over.weight.copy_(torch.randn(1, tables.width(), generator=generator) / tables.width() ** 0.5)
            self.over.bias.fill_(0.1)
        if sparse_device.type != "meta":
            set_tables(self, seeded_tables(tables.tables, seed))

    def table_parameters(self) -> list[nn.Parameter]:
        """The tables' weights (what the fused optimizer trains), not the dense layer's."""
        return [p for name, p in self.named_parameters() if not name.startswith("over.")]

    def table_weight(self, name: str) -> torch.Tensor:
        """The unsharded weight of table ``name``."""
        for key, value in self.state_dict(keep_vars=True).items():
            if key.endswith(f".{name}.weight"):
                return value
        raise KeyError(f"no table {name!r} in the model")

    def forward(self, batch: ModelBatch) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = []
        if self.ebc is not None:
            outputs.append(self.ebc(batch.features))
        if self.wbc is not None:
            outputs.append(self.wbc(batch.weighted))
        for ec in self.ecs.values():
            outputs.append(ec(batch.features))
        predictions = self.over(dense_input(outputs)).squeeze(1)
        loss = ((predictions - batch.labels) ** 2).mean()
        return loss, predictions.detach()


@dataclass(frozen=True)
class BatchSpec:
    """How batches are drawn: ``hot`` > 0 folds every id into rows ``[0, hot)`` (batches that read hot rows only)."""

    size: int = BATCH_SIZE
    hot: int = 0
    seed: int = 0


def _rows_of_features(configs) -> dict[str, int]:
    """Each feature's id range: the smallest table it feeds (a feature feeding two tables fits both)."""
    rows: dict[str, int] = {}
    for config in configs:
        for feature in config.feature_names:
            rows[feature] = min(rows.get(feature, config.num_embeddings), config.num_embeddings)
    return rows


def _kjt(rows: dict[str, int], max_length: dict[str, int], generator: torch.Generator, size: int, hot: int,
         weighted: bool) -> KeyedJaggedTensor:  # fmt: skip
    keys, lengths, values = list(rows), [], []
    for key in keys:
        n = torch.randint(0, max_length[key] + 1, (size,), generator=generator)
        ids = (torch.rand(int(n.sum()), generator=generator) ** 3 * rows[key]).long()  # skewed to the first rows
        lengths.append(n)
        values.append(ids % min(hot, rows[key]) if hot else ids)
    ids = torch.cat(values) if values else torch.zeros(0, dtype=torch.int64)
    lengths_tensor = torch.cat(lengths) if lengths else torch.zeros(0, dtype=torch.int64)
    weights = torch.rand(ids.numel(), generator=generator) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=ids, lengths=lengths_tensor, weights=weights, stride=size
    )


def train_batch(tables: TableSet, rank: int, step: int, spec: BatchSpec = BatchSpec()) -> ModelBatch:
    """Rank ``rank``'s batch of step ``step``: the same on every rank and in every run (any rank can build any rank's)."""
    generator = torch.Generator().manual_seed(100_003 * spec.seed + 1_009 * rank + step)
    plain = _rows_of_features([*tables.bags, *tables.sequences])
    longest = {f: MAX_BAG for c in tables.bags for f in c.feature_names}
    longest.update({f: MAX_SEQUENCE for c in tables.sequences for f in c.feature_names})
    weighted = _rows_of_features(tables.weighted)
    return ModelBatch(
        features=_kjt(plain, longest, generator, spec.size, spec.hot, weighted=False),
        weighted=_kjt(weighted, dict.fromkeys(weighted, MAX_BAG), generator, spec.size, spec.hot, weighted=True),
        labels=torch.rand(spec.size, generator=generator),
    )


def every_row_batch(tables: TableSet) -> ModelBatch:
    """One batch that reads every row a feature can read, once: sample ``i`` reads row ``i`` of
    each feature (an empty bag past the smallest table the feature feeds), weight 1."""

    def kjt(rows: dict[str, int], size: int, weighted: bool) -> KeyedJaggedTensor:
        lengths = (
            torch.cat([(torch.arange(size) < rows[k]).long() for k in rows])
            if rows
            else torch.zeros(0, dtype=torch.int64)
        )
        ids = torch.cat([torch.arange(rows[k]) for k in rows]) if rows else torch.zeros(0, dtype=torch.int64)
        weights = torch.ones(ids.numel()) if weighted else None
        return KeyedJaggedTensor.from_lengths_sync(
            keys=list(rows), values=ids, lengths=lengths, weights=weights, stride=size
        )

    plain, weighted = _rows_of_features([*tables.bags, *tables.sequences]), _rows_of_features(tables.weighted)
    size = max(c.num_embeddings for c in tables.tables)
    return ModelBatch(kjt(plain, size, False), kjt(weighted, size, True), torch.zeros(size))

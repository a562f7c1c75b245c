"""Tables of one lookup laid end to end in one id space, with their row-wise ownership.

Fusing tables that share a dimension (table t's row r is id ``offsets[t] + r``) lets a
lookup run one unique, one bucketing and one exchange per step for all of them.
Both plugin lookups (the HET cache and the row-replicated type) build on this, and
their input dists turn a batch into (bag, fused id) per value with :func:`flatten_batch`.
"""

from dataclasses import dataclass

import torch
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.output_layout import bag_offsets


@dataclass(frozen=True)
class TableInfo:
    """One table as this rank's lookup holds it.

    Attributes:
        name: table name.
        features: the table's features, in the lookup's input order.
        num_rows: rows of the whole table.
        row_starts: int64 ``[world_size + 1]``: rank r owns rows ``row_starts[r]:row_starts[r+1]``.
        module_index: the lookup's embedding kernel that holds the local shard.
        table_index: the table's index inside that kernel.
        mean: mean pooling (else sum).
        learning_rate: the fused optimizer's step size for the table.
    """

    name: str
    features: tuple[str, ...]
    num_rows: int
    row_starts: torch.Tensor
    module_index: int
    table_index: int
    mean: bool
    learning_rate: float

    @classmethod
    def of(
        cls, table, module_index: int, table_index: int, shards, world_size: int, learning_rate: float = 0.0
    ) -> "TableInfo":
        """The info of table ``table_index`` of a lookup's grouped config ``module_index``.

        Args:
            table: the grouped config's table (a ``ShardedEmbeddingTable``: name, features,
                rows, pooling).
            module_index: the grouped config's index (its kernel's, in the lookup).
            table_index: the table's index in that config.
            shards: the table's shard metadata (a row-wise plan's).
            world_size: ranks in the sharding's process group.
            learning_rate: the fused optimizer's step size (for lookups that read it here).
        """
        return cls(
            name=table.name,
            features=tuple(table.feature_names),
            num_rows=table.num_embeddings,
            row_starts=row_starts_from_shards(shards, world_size, table.name),
            module_index=module_index,
            table_index=table_index,
            mean=table.pooling == PoolingType.MEAN,
            learning_rate=learning_rate,
        )


class FusedIdSpace:
    """Fused ids, owners and local shard positions of tables that share a dimension.

    Args:
        tables: the tables, in the lookup's order.
        dim: their embedding dimension.
        rank: this rank.
        world_size: ranks in the sharding's process group.
    """

    def __init__(self, tables: list[TableInfo], dim: int, rank: int, world_size: int) -> None:
        self.tables, self.dim, self.rank, self.world_size = tables, dim, rank, world_size
        sizes = torch.tensor([t.num_rows for t in tables], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
        starts = torch.stack([t.row_starts for t in tables])  # [T, ws + 1]
        self.owner_ends = (self.offsets[:-1, None] + starts[:, 1:]).reshape(-1)  # [T * ws]
        self.local_starts = starts[:, rank]
        local_rows = starts[:, rank + 1] - starts[:, rank]
        self.local_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(local_rows, 0)])
        self.features = [f for t in tables for f in t.features]
        self.feature_table = torch.tensor([i for i, t in enumerate(tables) for _ in t.features], dtype=torch.int64)
        self.feature_is_mean = torch.tensor([t.mean for t in tables for _ in t.features])
        self.learning_rates = torch.tensor([t.learning_rate for t in tables])

    def to(self, device: torch.device | str) -> "FusedIdSpace":
        """Moves every index tensor to ``device`` (where the lookup's ids arrive); returns self."""
        return tensors_to(self, device)

    def bag_divisors(self, lengths: torch.Tensor, batch: int) -> torch.Tensor:
        """Per bag (the features one after the other, ``batch`` bags each): its length for mean
        pooling, else 1; ``[bags, 1]``."""
        return bag_divisors(lengths.view(self.feature_is_mean.numel(), batch), self.feature_is_mean).view(-1, 1)

    def table_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(ids, self.offsets[1:], right=True)

    def owner_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(ids, self.owner_ends, right=True) % self.world_size

    def local_rows(self, ids: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """Row of each owned id within its table's local shard."""
        tables = self.table_of(ids) if tables is None else tables
        return ids - self.offsets[tables] - self.local_starts[tables]

    def read_owned(self, ids: torch.Tensor, shards: list[torch.Tensor]) -> torch.Tensor:
        """Rows of owned ids from the local shards (``shards[i]``: table i's local weights or state), table by table."""
        tables = self.table_of(ids)
        rows = self.local_rows(ids, tables)
        out = torch.empty(ids.numel(), shards[0].size(1) if shards else 0, device=ids.device)
        for i in torch.unique(tables).tolist():
            mine = tables == i
            out[mine] = shards[i][rows[mine]].float()
        return out


def flatten_batch(
    features: KeyedJaggedTensor, position_base: torch.Tensor, type_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bag of every value, as ``position * batch + sample``; its id, the value plus
    ``position_base[position]``) of a batch with one batch size; positions are the KJT's keys
    in order. NotImplementedError naming ``type_name`` for variable batch sizes per feature."""
    if features.variable_stride_per_key():
        raise NotImplementedError(f"{type_name} does not support variable batch sizes per feature")
    lengths, values, n = features.lengths(), features.values(), features.values().numel()
    bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=n)
    per_position = lengths.view(len(features.keys()), features.stride()).sum(
        1
    )  # cheaper than indexing by bags // batch
    return bags, values.long() + torch.repeat_interleave(position_base, per_position, output_size=n)


def sample_major(feature_bags: torch.Tensor, features: int, batch: int):
    """Entries in feature-major bag order (``feature_bags``: ``position * batch + sample``, never
    decreasing) put in the output's sample-major order (``sample * features + position``), with no
    sort: (each entry's sample-major bag, the entries in that order, the ``[features * batch + 1]``
    offsets of the sample-major bags)."""
    n, device = feature_bags.numel(), feature_bags.device
    bags = feature_bags % batch * features + feature_bags // batch
    counts = torch.bincount(bags, minlength=features * batch)
    offsets = bag_offsets(counts)
    by_feature = counts.view(batch, features).t().reshape(-1)
    feature_starts = torch.cumsum(by_feature, 0) - by_feature
    at = offsets.index_select(0, bags) + torch.arange(n, device=device) - feature_starts.index_select(0, feature_bags)
    return bags, torch.empty_like(at).index_copy_(0, at, torch.arange(n, device=device)), offsets


def bag_divisors(lengths: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """float ``[positions, batch]``: each bag's length where its position pools by mean, else 1."""
    return torch.where(mean.unsqueeze(1), lengths.clamp(min=1), 1).float()


def tensors_to(obj, device: torch.device | str):
    """Moves every tensor attribute of ``obj`` to ``device`` (static indexes built on the host); returns ``obj``."""
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(device))
    return obj


def row_starts_from_shards(shards, world_size: int, table: str) -> torch.Tensor:
    """Ownership boundaries from a row-wise plan's shard metadata (one contiguous range per rank)."""
    sizes = [0] * world_size
    offsets = [0] * world_size
    for shard in shards:
        if shard.shard_offsets[1] != 0:
            raise ValueError(f"table {table!r}: row-wise plugin types split rows only, not columns")
        rank = shard.placement.rank()
        sizes[rank] += shard.shard_sizes[0]
        offsets[rank] = shard.shard_offsets[0]
    starts = [0]
    for rank in range(world_size):
        if sizes[rank] and offsets[rank] != starts[-1]:
            raise ValueError(f"table {table!r}: row-wise shards must be placed on ranks in row order")
        starts.append(starts[-1] + sizes[rank])
    return torch.tensor(starts, dtype=torch.int64)

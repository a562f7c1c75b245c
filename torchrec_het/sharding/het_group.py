"""Tables of one ``het_cached_row_wise`` lookup that share a dimension and cache settings, laid end to end.

Fusing the tables into one id space (table t's row r is id ``offsets[t] + r``) lets
every step run one unique, one cache probe and one exchange for all of them instead
of one per table. Capacity stays per table: the cache is partitioned by table.
"""

from dataclasses import dataclass

import torch

from torchrec_het.cache import RowCache
from torchrec_het.config import CacheSettings

STALENESS_BUCKETS = 65  # observed staleness 0..63, and 64 for "64 or more"
COUNTERS = (
    "lookups", "unique_lookups", "remote_unique", "remote_lookups", "hits_unique", "hits_lookups",
    "requests", "rows_fetched", "rows_pushed", "evictions", "dirty_evictions",
)


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
        learning_rate: step size of the local SGD update applied to cached copies.
    """

    name: str
    features: tuple[str, ...]
    num_rows: int
    row_starts: torch.Tensor
    module_index: int
    table_index: int
    mean: bool
    learning_rate: float


class GroupStats:
    """Per-table counters of a group (see ``HetCachedEmbeddingLookup.cache_stats``)."""

    def __init__(self, num_tables: int, dim: int) -> None:
        self.counters = {name: torch.zeros(num_tables, dtype=torch.int64) for name in COUNTERS}
        self.staleness = torch.zeros(num_tables, STALENESS_BUCKETS, dtype=torch.int64)
        self.grad_produced = torch.zeros(num_tables, dim, dtype=torch.float64)
        self.grad_applied = torch.zeros(num_tables, dim, dtype=torch.float64)

    def add(self, name: str, tables: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        n = self.counters[name].numel()
        self.counters[name] += torch.bincount(tables, weights, minlength=n).to(torch.int64)

    def add_staleness(self, tables: torch.Tensor, lags: torch.Tensor) -> None:
        cells = tables * STALENESS_BUCKETS + lags.clamp(0, STALENESS_BUCKETS - 1)
        self.staleness += torch.bincount(cells, minlength=self.staleness.numel()).view_as(self.staleness)

    def add_mass(self, name: str, tables: torch.Tensor, grads: torch.Tensor) -> None:
        getattr(self, name).index_add_(0, tables, grads.double())

    def table(self, index: int) -> dict:
        out = {name: int(values[index]) for name, values in self.counters.items()}
        remote, remote_lookups = out["remote_unique"], out["remote_lookups"]
        out["hit_rate_unique"] = out["hits_unique"] / remote if remote else 0.0
        out["hit_rate_lookups"] = out["hits_lookups"] / remote_lookups if remote_lookups else 0.0
        hist = self.staleness[index]
        out["staleness"] = hist.tolist()
        out["max_staleness"] = int(hist.nonzero().max()) if hist.any() else 0
        out["grad_produced"] = self.grad_produced[index].clone()
        out["grad_applied"] = self.grad_applied[index].clone()
        return out


class HetGroup:
    """Fused id space, ownership, versions, cache and counters of tables that share dim and settings.

    Args:
        tables: the tables, in the lookup's order.
        dim: their embedding dimension.
        settings: their cache settings.
        rank: this rank.
        world_size: ranks in the sharding's process group.
    """

    def __init__(self, tables: list[TableInfo], dim: int, settings: CacheSettings, rank: int, world_size: int):
        self.tables, self.dim, self.settings, self.rank, self.world_size = tables, dim, settings, rank, world_size
        sizes = torch.tensor([t.num_rows for t in tables], dtype=torch.int64)
        self.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)])
        starts = torch.stack([t.row_starts for t in tables])  # [T, ws + 1]
        self.owner_ends = (self.offsets[:-1, None] + starts[:, 1:]).reshape(-1)  # [T * ws]
        self.local_starts = starts[:, rank]
        local_rows = starts[:, rank + 1] - starts[:, rank]
        self.local_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(local_rows, 0)])
        capacities = [
            min(settings.capacity_rows(t.num_rows), t.num_rows - int(n)) for t, n in zip(tables, local_rows)
        ]
        self.cache = RowCache(
            int(self.offsets[-1]), dim, capacities, policy=settings.policy, partition_ends=self.offsets[1:].tolist()
        )
        self.versions = torch.zeros(int(self.local_offsets[-1]), dtype=torch.int64)
        self.learning_rates = torch.tensor([t.learning_rate for t in tables])
        self.features = [f for t in tables for f in t.features]
        self.feature_table = torch.tensor([i for i, t in enumerate(tables) for _ in t.features], dtype=torch.int64)
        self.feature_is_mean = torch.tensor([t.mean for t in tables for _ in t.features])
        self.stats = GroupStats(len(tables), dim)

    def table_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(ids, self.offsets[1:], right=True)

    def owner_of(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(ids, self.owner_ends, right=True) % self.world_size

    def local_rows(self, ids: torch.Tensor, tables: torch.Tensor | None = None) -> torch.Tensor:
        """Row of each owned id within its table's local shard."""
        tables = self.table_of(ids) if tables is None else tables
        return ids - self.offsets[tables] - self.local_starts[tables]

    def local_index(self, ids: torch.Tensor) -> torch.Tensor:
        """Index of each owned id in :attr:`versions`; RuntimeError if one is not owned here."""
        tables = self.table_of(ids)
        rows = self.local_rows(ids, tables)
        shard = self.local_offsets[tables + 1] - self.local_offsets[tables]
        if ids.numel() and bool(((rows < 0) | (rows >= shard)).any()):
            raise RuntimeError(f"rank {self.rank} was sent rows it does not own")
        return rows + self.local_offsets[tables]

    def fused_local_view(self, weights: list[torch.Tensor]) -> torch.Tensor | None:
        """One ``[local rows, dim]`` view over the tables' local shards when they lie end to end
        in one buffer (as in one fused kernel), else None."""
        first = weights[0]
        storage = first.untyped_storage().data_ptr()
        for i, w in enumerate(weights):
            expected = first.storage_offset() + int(self.local_offsets[i]) * self.dim
            if not w.is_contiguous() or w.untyped_storage().data_ptr() != storage or w.storage_offset() != expected:
                return None
        return torch.as_strided(first, (int(self.local_offsets[-1]), self.dim), (self.dim, 1), first.storage_offset())

    def read_owned(self, ids: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """Rows of owned ids from the local shards (``weights[i]``: table i's local shard)."""
        fused = self.fused_local_view(weights)
        if fused is not None:
            return fused[self.local_index(ids)].float()
        tables = self.table_of(ids)
        rows = self.local_rows(ids, tables)
        out = torch.empty(ids.numel(), self.dim)
        for i in torch.unique(tables).tolist():
            mine = tables == i
            out[mine] = weights[i][rows[mine]].float()
        return out

    def reset(self) -> None:
        """Forgets the cache and the versions (after a load: every rank does the same)."""
        self.cache.clear()
        self.versions.zero_()


def row_starts_from_shards(shards, world_size: int, table: str) -> torch.Tensor:
    """Ownership boundaries from a row-wise plan's shard metadata (one contiguous range per rank)."""
    sizes = [0] * world_size
    offsets = [0] * world_size
    for shard in shards:
        if shard.shard_offsets[1] != 0:
            raise ValueError(f"table {table!r}: het_cached_row_wise shards split rows only, not columns")
        rank = shard.placement.rank()
        sizes[rank] += shard.shard_sizes[0]
        offsets[rank] = shard.shard_offsets[0]
    starts = [0]
    for rank in range(world_size):
        if sizes[rank] and offsets[rank] != starts[-1]:
            raise ValueError(f"table {table!r}: row-wise shards must be placed on ranks in row order")
        starts.append(starts[-1] + sizes[rank])
    return torch.tensor(starts, dtype=torch.int64)

"""Tables of one ``het_cached_row_wise`` lookup that share a dimension and cache settings.

They share one fused id space (:mod:`torchrec_het.sharding.id_space`), so every step
runs one unique, one cache probe and one exchange for all of them. Capacity stays
per table: the cache is partitioned by table.
"""

import torch

from torchrec_het.cache import RowCache
from torchrec_het.config import CacheSettings
from torchrec_het.sharding.id_space import FusedIdSpace, TableInfo

STALENESS_BUCKETS = 65  # observed staleness 0..63, and 64 for "64 or more"
COUNTERS = (
    "lookups", "unique_lookups", "remote_unique", "remote_lookups", "hits_unique", "hits_lookups",
    "requests", "rows_fetched", "rows_pushed", "evictions", "dirty_evictions",
)


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


class HetGroup(FusedIdSpace):
    """Fused id space plus the versions, cache and counters of tables that share dim and cache settings.

    Args:
        tables: the tables, in the lookup's order.
        dim: their embedding dimension.
        settings: their cache settings.
        rank: this rank.
        world_size: ranks in the sharding's process group.
    """

    def __init__(self, tables: list[TableInfo], dim: int, settings: CacheSettings, rank: int, world_size: int):
        super().__init__(tables, dim, rank, world_size)
        self.settings = settings
        local_rows = self.local_offsets[1:] - self.local_offsets[:-1]
        capacities = [
            min(settings.capacity_rows(t.num_rows), t.num_rows - int(n)) for t, n in zip(tables, local_rows)
        ]
        self.cache = RowCache(
            int(self.offsets[-1]), dim, capacities, policy=settings.policy, partition_ends=self.offsets[1:].tolist()
        )
        self.versions = torch.zeros(int(self.local_offsets[-1]), dtype=torch.int64)
        self.stats = GroupStats(len(tables), dim)

    def reset(self) -> None:
        """Forgets the cache and the versions (after a load: every rank does the same)."""
        self.cache.clear()
        self.versions.zero_()

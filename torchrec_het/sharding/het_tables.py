"""Per-table state of a ``het_cached_row_wise`` lookup on one rank: ownership, versions, cache, counters."""

from dataclasses import dataclass, field

import torch

from torchrec_het.cache import RowCache
from torchrec_het.config import CacheSettings

STALENESS_BUCKETS = 65  # observed staleness 0..63, and 64 for "64 or more"


@dataclass
class CacheStats:
    """What one table's cache did on this rank since the last reset.

    Attributes:
        lookups: ids looked up (with repeats).
        unique_lookups: distinct ids looked up, summed over steps.
        remote_unique: distinct ids owned by another rank, summed over steps.
        remote_lookups: ids owned by another rank (with repeats).
        hits_unique: remote distinct ids served from the cache without fetching the row.
        hits_lookups: remote ids (with repeats) served from the cache without fetching.
        requests: ids sent to owners (HET: every remote id; lease: misses and expired leases).
        rows_fetched: rows received from owners.
        rows_pushed: accumulated row gradients sent to owners.
        evictions: rows evicted from the cache.
        dirty_evictions: evicted rows that still held unpushed gradients (pushed at once).
        staleness: histogram of how many owner updates a served cached copy was behind
            (HET: at every read; lease: when the lease was renewed).
        grad_produced: sum of every row gradient this rank produced (float64, per column).
        grad_applied: sum of every row gradient this rank applied as owner; summed over
            ranks after a flush it equals the sum of ``grad_produced`` (nothing lost).
    """

    lookups: int = 0
    unique_lookups: int = 0
    remote_unique: int = 0
    remote_lookups: int = 0
    hits_unique: int = 0
    hits_lookups: int = 0
    requests: int = 0
    rows_fetched: int = 0
    rows_pushed: int = 0
    evictions: int = 0
    dirty_evictions: int = 0
    staleness: torch.Tensor = field(default_factory=lambda: torch.zeros(STALENESS_BUCKETS, dtype=torch.int64))
    grad_produced: torch.Tensor | None = None  # [dim] float64: sum of every row gradient produced here
    grad_applied: torch.Tensor | None = None  # [dim] float64: sum of every row gradient applied here as owner

    def add_mass(self, name: str, grads: torch.Tensor) -> None:
        total = grads.double().sum(0)
        current = getattr(self, name)
        setattr(self, name, total if current is None else current + total)

    def add_staleness(self, lags: torch.Tensor) -> None:
        if lags.numel():
            self.staleness += torch.bincount(lags.clamp(0, STALENESS_BUCKETS - 1), minlength=STALENESS_BUCKETS)

    def as_dict(self) -> dict:
        """Plain numbers, with hit rates and the staleness histogram as a list."""
        out = {k: v for k, v in vars(self).items() if not isinstance(v, torch.Tensor) and v is not None}
        out["hit_rate_unique"] = self.hits_unique / self.remote_unique if self.remote_unique else 0.0
        out["hit_rate_lookups"] = self.hits_lookups / self.remote_lookups if self.remote_lookups else 0.0
        out["staleness"] = self.staleness.tolist()
        out["max_staleness"] = int(self.staleness.nonzero().max()) if self.staleness.any() else 0
        return out


@dataclass
class HetTable:
    """One table as this rank sees it.

    Attributes:
        name: table name.
        features: the table's feature names, in the lookup's input order.
        dim: embedding dimension.
        mean: mean pooling (else sum).
        num_rows: rows of the whole table.
        row_starts: int64 ``[world_size + 1]``: rank r owns rows ``row_starts[r]:row_starts[r+1]``.
        rank: this rank.
        module_index: which embedding kernel of the lookup holds the local shard.
        table_index: the table's index inside that kernel.
        learning_rate: step size of the local SGD update applied to cached copies.
        settings: the cache settings.
        cache: cached rows owned by other ranks.
        versions: int64 ``[local_rows]``: updates applied to each owned row so far.
        stats: counters.
    """

    name: str
    features: list[str]
    dim: int
    mean: bool
    num_rows: int
    row_starts: torch.Tensor
    rank: int
    module_index: int
    table_index: int
    learning_rate: float
    settings: CacheSettings
    cache: RowCache = field(init=False)
    versions: torch.Tensor = field(init=False)
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        remote_rows = self.num_rows - self.local_rows
        capacity = min(self.settings.capacity_rows(self.num_rows), remote_rows)
        self.cache = RowCache(self.num_rows, self.dim, capacity, policy=self.settings.policy)
        self.versions = torch.zeros(self.local_rows, dtype=torch.int64)

    @property
    def local_start(self) -> int:
        return int(self.row_starts[self.rank])

    @property
    def local_rows(self) -> int:
        return int(self.row_starts[self.rank + 1] - self.row_starts[self.rank])

    def owner_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The owner rank of each id."""
        return torch.bucketize(ids, self.row_starts[1:], right=True)

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

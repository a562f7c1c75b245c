"""Hot-row tiers of the row-replicated sharding: which rows each rank holds a replica of.

Each table's rows fall in three tiers: *replicated* (a copy on every rank), *per_host*
(one copy per host) and *sharded* (the rest). Every row also lives in its row-wise
owner's shard, TorchRec's stock ``row_wise`` split. Rank ``r`` (host ``r // L``) holds a
replica of row ``i`` when ``i`` is not in its own shard and ``i`` is replicated, or ``i``
is per_host, its owner ``o`` is on another host and ``o % L == r % L``.
:func:`~torchrec_het.replication.tier_selection.select_tiers` chooses the tiers.
"""

from dataclasses import dataclass

import torch

from torchrec_het.replication.memory import TableMemory, TierTopology, row_owner, row_wise_sizes

SHARDED, PER_HOST, REPLICATED = 0, 1, 2
TO_HOST, TO_ALL, HOST_TO_ALL = 0, 1, 2  # promotions: sharded->per_host, sharded->replicated, per_host->replicated


def _check_ids(name: str, kind: str, ids: torch.Tensor, num_rows: int) -> None:
    if ids.dtype != torch.int64 or ids.dim() != 1:
        raise ValueError(f"table {name!r}: {kind} must be a 1-D int64 tensor")
    if ids.numel() and (int(ids[0]) < 0 or int(ids[-1]) >= num_rows or not bool((ids[1:] > ids[:-1]).all())):
        raise ValueError(f"table {name!r}: {kind} row ids must be sorted, distinct and in [0, {num_rows})")


@dataclass(frozen=True, eq=False)
class TableTiers:
    """Hot rows of one table: sorted unique int64 ids of the replicated and the per-host tier."""

    name: str
    num_rows: int
    replicated: torch.Tensor
    per_host: torch.Tensor

    def __post_init__(self) -> None:
        _check_ids(self.name, "replicated", self.replicated, self.num_rows)
        _check_ids(self.name, "per_host", self.per_host, self.num_rows)
        if bool(torch.isin(self.replicated, self.per_host).any()):
            raise ValueError(f"table {self.name!r}: a row is in both the replicated and the per-host tier")

    @property
    def hot_fraction(self) -> float:
        return (self.replicated.numel() + self.per_host.numel()) / self.num_rows


@dataclass(frozen=True, eq=False)
class TierPlan:
    """Tiers of every table, the budget they were chosen for and the layout's per-rank peak (bytes)."""

    tables: dict[str, TableTiers]
    budget_bytes: int
    peak_bytes: int

    def for_table(self, name: str) -> TableTiers:
        if name not in self.tables:
            raise KeyError(f"table {name!r} is not in the tier plan; it has {sorted(self.tables)}")
        return self.tables[name]

    @classmethod
    def empty(cls, tables: list[TableMemory], topology: TierTopology) -> "TierPlan":
        """No hot rows: plain row-wise (budget = peak = row-wise peak)."""
        tiers = {t.name: TableTiers(t.name, t.num_rows, *[torch.zeros(0, dtype=torch.int64)] * 2) for t in tables}
        peak = max(layout_bytes_per_rank(tables, tiers, topology))
        return cls(tiers, peak, peak)


def holder_masks(topology: TierTopology) -> torch.Tensor:
    """bool [3, owner, rank]: ranks that gain a copy in each promotion kind of a row owned by ``owner``."""
    ranks = torch.arange(topology.world_size)
    local, host = ranks % topology.local_world_size, ranks // topology.local_world_size
    to_all = ranks[:, None] != ranks[None, :]
    to_host = (local[:, None] == local[None, :]) & (host[:, None] != host[None, :])
    return torch.stack([to_host, to_all, to_all & ~to_host])


def layout_bytes_per_rank(tables: list[TableMemory], tiers: dict[str, TableTiers], topology: TierTopology) -> list[int]:
    """Exact bytes on each rank: its row-wise shards plus the replicas it holds (tables missing in ``tiers``: none)."""
    unknown = sorted(set(tiers) - {t.name for t in tables})
    if unknown:
        raise ValueError(f"tiers name table(s) {unknown} that are not among the tables")
    ws, masks = topology.world_size, holder_masks(topology)
    total = torch.zeros(ws, dtype=torch.int64)
    for table in tables:
        total += torch.tensor(row_wise_sizes(table.num_rows, ws), dtype=torch.int64) * table.bytes_per_row
        tt = tiers.get(table.name)
        if tt is None:
            continue
        if tt.num_rows != table.num_rows:
            raise ValueError(f"table {table.name!r}: tiers made for {tt.num_rows} rows, the table has {table.num_rows}")
        for ids, mask in ((tt.replicated, masks[TO_ALL]), (tt.per_host, masks[TO_HOST])):
            per_owner = torch.bincount(row_owner(ids, table.num_rows, ws), minlength=ws)
            total += (per_owner[:, None] * mask).sum(0) * table.replica_bytes_per_row
    return total.tolist()

"""Hot-row tiers of the row-replicated sharding: which rows to replicate, within a per-rank memory budget.

Each table's rows fall in three tiers: *replicated* (a copy on every rank), *per_host*
(one copy per host) and *sharded* (the rest). Every row also lives in its row-wise
owner's shard, TorchRec's stock ``row_wise`` split. Rank ``r`` (host ``r // L``) holds a
replica of row ``i`` when ``i`` is not in its own shard and ``i`` is replicated, or ``i``
is per_host, its owner ``o`` is on another host and ``o % L == r % L``.

:func:`select_tiers` promotes rows greedily, best saved seconds per added byte first, within a per-rank budget.
"""

import math
from dataclasses import dataclass

import torch

from torchrec_het import _compat
from torchrec_het._tbe import EmbOptimType
from torchrec_het.replication.profile import AccessProfile

SHARDED, PER_HOST, REPLICATED = 0, 1, 2
_TO_HOST, _TO_ALL, _HOST_TO_ALL = 0, 1, 2  # promotions: sharded->per_host, sharded->replicated, per_host->replicated
_NEW_TIER = torch.tensor([PER_HOST, REPLICATED, REPLICATED], dtype=torch.int8)
_OLD_TIER = torch.tensor([SHARDED, SHARDED, PER_HOST], dtype=torch.int8)
_ALIASES = {  # common spellings -> fbgemm's names
    "adagrad": "exact_adagrad", "rowwise_adagrad": "row_wise_adagrad", "partial_rowwise_adam": "partial_row_wise_adam",
    "exact_rowwise_adagrad": "exact_row_wise_adagrad", "partial_rowwise_lamb": "partial_row_wise_lamb",
}
_UNSUPPORTED = {"shampoo", "shampoo_v2", "madgrad", "exact_row_wise_weighted_adagrad"}  # no TBE training kernel
_BLOCK_ROWS = 1 << 16  # rows per table turned into candidates at a time
_CHUNK_CELLS = 1 << 20  # candidates x ranks admitted at a time


@dataclass(frozen=True)
class TierTopology:
    """Ranks, hosts and bandwidths (bytes/s); a host's ranks are consecutive."""

    world_size: int
    local_world_size: int
    intra_host_bandwidth: float
    inter_host_bandwidth: float

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(f"world_size {self.world_size} is not a positive multiple of {self.local_world_size}")
        if not (self.intra_host_bandwidth > 0 and self.inter_host_bandwidth > 0):
            raise ValueError("bandwidths must be positive")

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    def host_of(self, rank: int) -> int:
        return rank // self.local_world_size

    @classmethod
    def from_torchrec(cls, topology) -> "TierTopology":
        """From a planner ``Topology`` (whose bandwidths are in bytes/ms)."""
        per_s = 1000.0  # ms per s
        intra, inter = topology.intra_host_bw * per_s, topology.inter_host_bw * per_s
        return cls(topology.world_size, topology.local_world_size, intra, inter)


@dataclass(frozen=True)
class TableMemory:
    """One table as the memory model sees it (``bytes_per_row``: weights plus optimizer state).

    ``replica_copies``: copies a rank holds of each row replicated to it (2 for replicas synced
    every s > 1 steps: the agreed rows and the rank's own steps since the last sync).
    """

    name: str
    num_rows: int
    dim: int
    bytes_per_row: int
    replica_copies: int = 1

    @property
    def replica_bytes_per_row(self) -> int:
        return self.bytes_per_row * self.replica_copies


def replica_copies(sync_every: int) -> int:
    """Copies a rank holds of a row replicated to it: 2 when replicas sync every s > 1 steps (the
    agreed rows, and the rank's own steps since the last sync: ``ReplicaBlock.steps_locally``), else 1."""
    return 2 if sync_every > 1 else 1

    def __post_init__(self) -> None:
        if self.num_rows < 1 or self.dim < 1 or self.bytes_per_row < 1:
            raise ValueError(f"table {self.name!r}: num_rows, dim and bytes_per_row must be positive")


def bytes_per_row(dim: int, optimizer: "EmbOptimType | str", weight_bytes: int = 4) -> int:
    """Weights plus fused-optimizer state of one row, as fbgemm's TBE keeps it (fp32 state)."""
    value = optimizer.value if isinstance(optimizer, EmbOptimType) else str(optimizer).lower()
    try:
        opt = EmbOptimType(_ALIASES.get(value, value))
    except ValueError:
        raise ValueError(f"unknown optimizer {optimizer!r}") from None
    if opt.value in _UNSUPPORTED:
        raise ValueError(f"optimizer {opt.value!r} is not supported by fbgemm's training kernel")
    full, rowwise = 4 * dim, 4  # fp32 momentum per element, or one per row
    state = {  # sgd, exact_sgd, none: no state
        "exact_adagrad": full, "lars_sgd": full, "adam": 2 * full, "lamb": 2 * full,
        "exact_row_wise_adagrad": rowwise, "row_wise_adagrad": rowwise, "ema_in_place_row_wise_adagrad": rowwise,
        "ensemble_row_wise_adagrad": full + rowwise, "partial_row_wise_adam": full + rowwise,
        "partial_row_wise_lamb": full + rowwise,
    }.get(opt.value, 0)
    return dim * weight_bytes + state


def row_wise_sizes(num_rows: int, world_size: int) -> list[int]:
    """Rows of each rank's shard under TorchRec's ``row_wise`` (its own helper)."""
    return _compat.row_wise_shard_rows(num_rows, world_size)


def row_owner(ids: torch.Tensor, num_rows: int, world_size: int) -> torch.Tensor:
    """Row-wise owner rank of each row id."""
    ends = torch.tensor(row_wise_sizes(num_rows, world_size), dtype=torch.int64).cumsum(0)
    return torch.searchsorted(ends, ids.to(torch.int64), right=True)


def plan_peak_bytes(tables: list[TableMemory], plan: dict, world_size: int) -> int:
    """Per-rank peak bytes of a TorchRec module plan (name -> ``ParameterSharding``).

    Shards count on their placement rank, column shards as ``ceil(bytes_per_row * cols / dim)``
    per row; data-parallel tables (no sharding spec) count whole on every rank.
    """
    per_rank = [0] * world_size
    for table in tables:
        if table.name not in plan:
            raise ValueError(f"the plan has no table {table.name!r}")
        spec = plan[table.name].sharding_spec
        if spec is None:
            per_rank = [b + table.num_rows * table.bytes_per_row for b in per_rank]
            continue
        for shard in spec.shards:
            rows, cols = shard.shard_sizes
            per_rank[shard.placement.rank()] += -(-rows * table.bytes_per_row * cols // table.dim)
    return max(per_rank)


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

    def tier_of(self, ids: torch.Tensor) -> torch.Tensor:
        """int8 tier of each id: 0 sharded, 1 per_host, 2 replicated."""
        out = torch.full(ids.shape, SHARDED, dtype=torch.int8)
        out[torch.isin(ids, self.per_host)] = PER_HOST
        out[torch.isin(ids, self.replicated)] = REPLICATED
        return out

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


def _holder_masks(topology: TierTopology) -> torch.Tensor:
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
    ws, masks = topology.world_size, _holder_masks(topology)
    total = torch.zeros(ws, dtype=torch.int64)
    for table in tables:
        total += torch.tensor(row_wise_sizes(table.num_rows, ws), dtype=torch.int64) * table.bytes_per_row
        tt = tiers.get(table.name)
        if tt is None:
            continue
        if tt.num_rows != table.num_rows:
            raise ValueError(f"table {table.name!r}: tiers made for {tt.num_rows} rows, the table has {table.num_rows}")
        for ids, mask in ((tt.replicated, masks[_TO_ALL]), (tt.per_host, masks[_TO_HOST])):
            per_owner = torch.bincount(row_owner(ids, table.num_rows, ws), minlength=ws)
            total += (per_owner[:, None] * mask).sum(0) * table.replica_bytes_per_row
    return total.tolist()


def _check_profile(tables: list[TableMemory], profile: AccessProfile) -> None:
    for table in tables:
        if sum(t.name == table.name for t in tables) > 1:
            raise ValueError(f"table {table.name!r} appears more than once")
        if table.name not in profile.tables:
            raise ValueError(f"the profile has no table {table.name!r} (it has {list(profile.tables)})")
        rows = profile.num_rows[profile.tables.index(table.name)]
        if rows != table.num_rows:
            raise ValueError(f"table {table.name!r} has {rows} rows in the profile but {table.num_rows} in the model")


class _Scorer:
    """Saved seconds per step per added byte of each promotion kind (-inf where it saves nothing)."""

    def __init__(self, table: TableMemory, topology: TierTopology, sync_every: int = 1) -> None:
        self.sync_every = sync_every
        ws, local, hosts = topology.world_size, topology.local_world_size, topology.num_hosts
        wire = 2 * table.dim * 4  # forward partial + backward gradient, fp32
        intra, inter = topology.intra_host_bandwidth, topology.inter_host_bandwidth
        self.spread = wire * ((local - 1) / ws / intra + (ws - local) / ws / inter)  # s per read over all ranks
        self.host_read = wire * (local - 1) / local / intra
        self.host_combine = wire * (hosts - 1) / hosts / inter
        self.use_host = hosts > 1 and local > 1  # with one rank per host, per_host is replicated
        self.cost = torch.tensor([hosts - 1, ws - 1, ws - hosts], dtype=torch.float64) * table.replica_bytes_per_row

    def scores(self, rps: torch.Tensor) -> torch.Tensor:
        """float64 [n, 3]: score of each kind (_TO_HOST, _TO_ALL, _HOST_TO_ALL) at each reads-per-step."""
        once = rps.clamp(max=1.0)
        # replicated rows combine their gradients once per sync_every steps if touched in between
        synced = (rps * self.sync_every).clamp(max=1.0) / self.sync_every
        sharded, replicated = rps * self.spread, synced * self.spread
        per_host = rps * self.host_read + once * self.host_combine
        saved = torch.stack([sharded - per_host, sharded - replicated, per_host - replicated], dim=1)
        if not self.use_host:
            saved[:, [_TO_HOST, _HOST_TO_ALL]] = 0.0
        return torch.where(saved > 0, saved / self.cost.clamp(min=1.0), -math.inf)


class _Stream:
    """A table's promotable rows, hottest first, turned into candidate promotions block by block."""

    def __init__(self, table: TableMemory, counts, batches: int, base: int, topology, min_reads: float, max_fraction,
                 sync_every: int = 1):  # fmt: skip
        self.base, self.scorer = base, _Scorer(table, topology, sync_every)
        rps = counts.double() / batches if batches else torch.zeros_like(counts, dtype=torch.float64)
        rows = torch.nonzero((rps >= min_reads) & (counts > 0)).flatten()
        order = torch.sort(counts[rows], descending=True, stable=True).indices
        self.rows = rows[order][: int(max_fraction * table.num_rows)]
        self.rps, self.pos = rps[self.rows], 0

    def bound(self) -> float:
        """Upper bound of the scores of candidates not yet emitted (scores grow with reads)."""
        rps = self.rps[self.pos : self.pos + 1]
        return float(self.scorer.scores(rps).max()) if rps.numel() else -math.inf

    def next_block(self) -> "_Block":
        """Up to two candidates per row: the better first step and, where worthwhile, the other one."""
        rows, rps = self.rows[self.pos : self.pos + _BLOCK_ROWS], self.rps[self.pos : self.pos + _BLOCK_ROWS]
        self.pos += rows.numel()
        s = self.scorer.scores(rps)
        host_first = (s[:, _TO_HOST] > -math.inf) & (s[:, _TO_HOST] >= s[:, _HOST_TO_ALL])
        # host first: (to_host, then host_to_all); otherwise (to_all, then to_host as fallback if to_all is refused)
        first = torch.where(host_first, _TO_HOST, _TO_ALL)
        kind = torch.stack([first, torch.where(host_first, _HOST_TO_ALL, _TO_HOST)], dim=1).flatten()
        score = s.repeat_interleave(2, dim=0).gather(1, kind[:, None]).flatten()
        tie = (self.base + rows.repeat_interleave(2)) * 2 + torch.tensor([0, 1]).repeat(rows.numel())
        keep = score > -math.inf
        return _Block(-score[keep], tie[keep], kind[keep].to(torch.int8))


class _Block:
    """Candidates best first: ``neg`` = -score ascending, ``tie`` = (table row offset + row) * 2 + step."""

    def __init__(self, neg: torch.Tensor, tie: torch.Tensor, kind: torch.Tensor, ordered: bool = False) -> None:
        if not ordered:
            order = torch.sort(tie).indices  # tie keys are unique
            order = order[torch.sort(neg[order], stable=True).indices]
            neg, tie, kind = neg[order], tie[order], kind[order]
        self.neg, self.tie, self.kind = neg, tie, kind

    def split(self, threshold: float) -> tuple["_Block", "_Block"]:
        """(candidates scoring above ``threshold``, the rest)."""
        n = int(torch.searchsorted(self.neg, -threshold))
        return self._part(slice(n)), self._part(slice(n, None))

    def _part(self, rows: slice) -> "_Block":
        return _Block(self.neg[rows], self.tie[rows], self.kind[rows], ordered=True)


class _Admission:
    """Per-rank bytes and the tier of every row; applies candidates as a sequential first-fit greedy would.

    A candidate is taken when its row is in the tier it promotes from and every rank that gains a
    copy stays within the budget; a refused one never fits later (loads only grow).
    """

    def __init__(self, tables: list[TableMemory], offsets: list[int], topology: TierTopology, load, budget: int):
        ws = topology.world_size
        shard_ends = [base + torch.tensor(row_wise_sizes(t.num_rows, ws)).cumsum(0) for t, base in zip(tables, offsets)]
        self.ends = torch.cat(shard_ends)  # of all tables' rows in a row: owner and table of a row at once
        self.bpr = torch.tensor([t.replica_bytes_per_row for t in tables], dtype=torch.int64)
        self.state = torch.zeros(offsets[-1], dtype=torch.int8)
        self.masks, self.load, self.budget, self.ws = _holder_masks(topology), load, budget, ws
        self.chunk = max(1, _CHUNK_CELLS // ws)  # candidates per pass

    def admit(self, blocks: list[_Block]) -> None:
        """Applies the candidates of ``blocks`` (all scoring above those not yet seen), best first."""
        if not blocks:
            return
        merged = _Block(*(torch.cat([getattr(b, field) for b in blocks]) for field in ("neg", "tie", "kind")))
        for start in range(0, merged.tie.numel(), self.chunk):
            self._prefixes(merged.tie[start : start + self.chunk], merged.kind[start : start + self.chunk].long())

    def _prefixes(self, tie: torch.Tensor, kind: torch.Tensor) -> None:
        """Applies candidates in order, vectorized: each pass takes the prefix up to the first that no longer fits."""
        state, load, budget = self.state, self.load, self.budget
        while tie.numel():
            n, key = tie.numel(), tie // 2
            where = torch.searchsorted(self.ends, key, right=True)
            owner, bpr = where % self.ws, self.bpr[where // self.ws]
            # a row has at most two candidates; the later one depends on the earlier one's fate
            order = torch.sort(key, stable=True).indices
            same = key[order[1:]] == key[order[:-1]]
            prev = torch.full((n,), -1, dtype=torch.int64)
            prev[order[1:][same]] = order[:-1][same]
            fullest = torch.where(self.masks, load, -1).amax(2)  # [kind, owner]: fullest rank that gains a copy
            state_now = state[key]
            fits = fullest[kind, owner] + bpr <= budget
            ok = (state_now == _OLD_TIER[kind]) & fits & (prev < 0)
            later = prev >= 0
            prev_taken = ok[prev.clamp(min=0)] & later
            # to_host after a refused to_all; host_to_all after a taken to_host
            ok |= later & fits & torch.where(kind == _HOST_TO_ALL, prev_taken, ~prev_taken & (state_now == SHARDED))
            tried = torch.nonzero(ok).flatten()
            running = load + (self.masks[kind[tried], owner[tried]] * bpr[tried, None]).cumsum(0)  # [tried, ws]
            over = torch.nonzero((running > budget).any(1)).flatten()
            first_over = int(over[0]) if over.numel() else tried.numel()
            stop = int(tried[first_over]) if over.numel() else n  # the first one that no longer fits is refused
            for step in (prev[:stop] < 0, prev[:stop] >= 0):  # a row's earlier step first
                taken = ok[:stop] & step
                state[key[:stop][taken]] = _NEW_TIER[kind[:stop][taken]]
            if first_over:
                load.copy_(running[first_over - 1])
            tie, kind = tie[stop + 1 :], kind[stop + 1 :]


def hot_row_count(reads: torch.Tensor, min_reads_per_step: float, max_hot_fraction: float) -> int:
    """Rows (``reads`` per step, hottest first) read at least ``min_reads_per_step`` times a step,
    at most ``max_hot_fraction`` of the table: the hot rows of a profile or of online counts
    (the rule the planner prices too)."""
    count = int((reads >= min_reads_per_step).sum()) if reads.numel() else 0
    return min(count, math.floor(max_hot_fraction * reads.numel()))


def hottest_rows(reads: torch.Tensor, min_reads_per_step: float, max_hot_fraction: float) -> torch.Tensor:
    """Sorted int64 ids of the rows :func:`hot_row_count` admits, ``reads``: per step of every row
    of a table (ties: lower id first). The rule of a profile's and of online counts' hot rows."""
    order = torch.sort(reads, descending=True, stable=True).indices
    return torch.sort(order[: hot_row_count(reads[order], min_reads_per_step, max_hot_fraction)]).values


def host_tier_saving(reads: torch.Tensor, topology: TierTopology) -> torch.Tensor:
    """Seconds per step (per byte of a row) saved by holding each row once per host instead of
    sharding it, ``reads``: its reads per step over all ranks (float64). Negative: sharding is cheaper.

    Sharded, a read from another rank moves the row's partial forward and its gradient back
    (2 rows), over the slow link when the owner is on another host. Held once per host (the
    *per-host* tier), a read goes to its host's holder (2 rows, within the host), and every
    host whose ranks read the row in a step (probability ``1 - exp(-reads / hosts)``) sends its
    summed gradient to the other hosts' holders (1 row each, between hosts). So the tier pays
    off for rows that each host reads about once a step or more: hot enough for one host,
    by the ratio of the intra-host to the inter-host bandwidth. Zero on one host or with one
    rank per host (where the per-host tier is the replicated one).
    """
    ws, local, hosts = topology.world_size, topology.local_world_size, topology.num_hosts
    reads = reads.double()
    if hosts == 1 or local == 1:
        return torch.zeros_like(reads)
    intra, inter = 1.0 / topology.intra_host_bandwidth, 1.0 / topology.inter_host_bandwidth
    sharded = reads * 2 * ((local - 1) / ws * intra + (ws - local) / ws * inter)
    touched = 1.0 - torch.exp(-reads / hosts)  # per host and step
    per_host = reads * 2 * (local - 1) / local * intra + hosts * touched * (hosts - 1) * inter
    return sharded - per_host


def per_host_rows(reads: torch.Tensor, replicated: torch.Tensor, topology: TierTopology, max_rows: int) -> torch.Tensor:
    """Sorted int64 ids of the per-host tier: the rows not in ``replicated`` that
    :func:`host_tier_saving` finds cheaper held once per host than sharded, hottest first, at
    most ``max_rows`` (ties: lower id first). ``reads``: per step of every row of a table.

    The rule of :class:`~torchrec_het.planner.ProfileTiers` and of the planner's price of
    ``het_row_replicated`` on several hosts (the rows read at least once per replica sync are
    replicated on every rank; the next, hot enough for one host but not for all, get one copy
    per host)."""
    if max_rows <= 0 or not reads.numel():
        return torch.zeros(0, dtype=torch.int64)
    candidate = (host_tier_saving(reads, topology) > 0) & (reads > 0)
    candidate[replicated] = False
    rows = torch.nonzero(candidate).flatten()
    order = torch.sort(reads[rows], descending=True, stable=True).indices
    return torch.sort(rows[order][:max_rows]).values


def host_row_count(reads: torch.Tensor, replicated: int, topology: TierTopology, max_rows: int) -> int:
    """How many rows :func:`per_host_rows` puts in the per-host tier, ``reads``: per step of a
    table's rows hottest first, of which the first ``replicated`` are replicated (the planner's count)."""
    if max_rows <= 0:
        return 0
    rest = reads[replicated:]
    return min(int(((host_tier_saving(rest, topology) > 0) & (rest > 0)).sum()), max_rows)


def select_tiers(tables: list[TableMemory], profile: AccessProfile, topology: TierTopology, budget_bytes: int,
                 min_reads_per_step: float = 1.0, max_hot_fraction: float = 0.5, sync_every: int = 1) -> TierPlan:
    """Chooses each table's replicated and per-host rows so that the per-rank peak stays within ``budget_bytes``.

    Rows read fewer than ``min_reads_per_step`` times per step stay sharded, and at most
    ``max_hot_fraction`` of a table's rows are promoted. Promotions (sharded->per_host,
    per_host->replicated, sharded->replicated) are taken by saved seconds per step per
    added byte (summed over ranks), best first, skipping those that would exceed the budget.
    ``sync_every``: replicated rows combine their gradients every this many steps
    (``ReplicationConfig.replica_sync_every``), which makes replicating cheaper.

    Raises:
        ValueError: the profile lacks a table or has other row counts (naming it), or the
            budget is below the plain row-wise peak.
    """
    _check_profile(tables, profile)
    if not 0.0 <= max_hot_fraction <= 1.0:
        raise ValueError(f"max_hot_fraction must lie in [0, 1], got {max_hot_fraction}")
    load = torch.tensor(layout_bytes_per_rank(tables, {}, topology), dtype=torch.int64)
    row_wise_peak = int(load.max())
    if budget_bytes < row_wise_peak:
        raise ValueError(f"budget {budget_bytes} bytes is below the plain row-wise peak of {row_wise_peak} bytes")
    offsets = torch.tensor([0] + [t.num_rows for t in tables]).cumsum(0).tolist()  # of each table in all rows
    admission = _Admission(tables, offsets, topology, load, budget_bytes)
    streams = [
        _Stream(t, profile.table_counts(t.name), profile.batches, base, topology, min_reads_per_step, max_hot_fraction,
                sync_every)
        for t, base in zip(tables, offsets)
    ]
    pool: list[_Block] = []  # emitted, not yet admitted
    smallest_row, bounds = min((t.replica_bytes_per_row for t in tables), default=0), [s.bound() for s in streams]
    while streams and int(load.min()) + smallest_row <= budget_bytes:  # else no rank has room for any row
        best = max(range(len(streams)), key=lambda i: (bounds[i], -i))
        if bounds[best] == -math.inf:
            admission.admit(pool)
            break
        pool.append(streams[best].next_block())
        bounds[best] = streams[best].bound()
        parts = [block.split(max(bounds)) for block in pool]  # nothing emitted later scores above max(bounds)
        admission.admit([ready for ready, _ in parts if ready.tie.numel()])
        pool = [rest for _, rest in parts if rest.tie.numel()]
    tiers = {}
    for table, tier in zip(tables, admission.state.split([t.num_rows for t in tables])):
        ids = (torch.nonzero(tier == level).flatten() for level in (REPLICATED, PER_HOST))
        tiers[table.name] = TableTiers(table.name, table.num_rows, *ids)
    exact = layout_bytes_per_rank(tables, tiers, topology)
    assert exact == load.tolist(), "incremental per-rank bytes disagree with the layout"
    return TierPlan(tiers, budget_bytes, max(exact))

"""Chooses the hot-row tiers greedily: best saved seconds per added byte first, within a per-rank budget."""

import math

import torch

from torchrec_het.replication.memory import TableMemory, TierTopology, row_wise_sizes
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.replication.tiers import (
    HOST_TO_ALL,
    PER_HOST,
    REPLICATED,
    SHARDED,
    TO_ALL,
    TO_HOST,
    TableTiers,
    TierPlan,
    holder_masks,
    layout_bytes_per_rank,
)

_NEW_TIER = torch.tensor([PER_HOST, REPLICATED, REPLICATED], dtype=torch.int8)
_OLD_TIER = torch.tensor([SHARDED, SHARDED, PER_HOST], dtype=torch.int8)
_BLOCK_ROWS = 1 << 16  # rows per table turned into candidates at a time
_CHUNK_CELLS = 1 << 20  # candidates x ranks admitted at a time


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

    def __init__(
        self, table: TableMemory, topology: TierTopology, sync_every: int = 1, price_sync: bool = True
    ) -> None:
        self.sync_every = sync_every
        ws, local, hosts = topology.world_size, topology.local_world_size, topology.num_hosts
        wire = 2 * table.dim * 4  # forward partial + backward gradient, fp32
        intra, inter = topology.intra_host_bandwidth, topology.inter_host_bandwidth
        self.spread = wire * ((local - 1) / ws / intra + (ws - local) / ws / inter)  # s per read over all ranks
        # a replicated row touched between syncs is summed by one all-reduce: 2 (ws - 1) copies of it
        # over all ranks, within the hosts and then (hierarchical) between them
        self.all_reduce = wire * ((ws - hosts) / intra + (hosts - 1) / inter)
        if not price_sync:  # FAE's choice: a synced row is priced as one read of it
            self.all_reduce = self.spread
        self.host_read = wire * (local - 1) / local / intra
        self.host_combine = wire * (hosts - 1) / hosts / inter
        self.use_host = hosts > 1 and local > 1  # with one rank per host, per_host is replicated
        self.cost = torch.tensor([hosts - 1, ws - 1, ws - hosts], dtype=torch.float64) * table.replica_bytes_per_row

    def scores(self, rps: torch.Tensor) -> torch.Tensor:
        """float64 [n, 3]: score of each kind (TO_HOST, TO_ALL, HOST_TO_ALL) at each reads-per-step."""
        once = rps.clamp(max=1.0)
        # replicated rows combine their gradients once per sync_every steps if touched in between
        synced = (rps * self.sync_every).clamp(max=1.0) / self.sync_every
        sharded, replicated = rps * self.spread, synced * self.all_reduce
        per_host = rps * self.host_read + once * self.host_combine
        saved = torch.stack([sharded - per_host, sharded - replicated, per_host - replicated], dim=1)
        if not self.use_host:
            saved[:, [TO_HOST, HOST_TO_ALL]] = 0.0
        return torch.where(saved > 0, saved / self.cost.clamp(min=1.0), -math.inf)


class _Stream:
    """A table's promotable rows, hottest first, turned into candidate promotions block by block."""

    def __init__(self, table: TableMemory, counts, batches: int, base: int, topology, min_reads: float, max_fraction,
                 sync_every: int = 1, price_sync: bool = True):  # fmt: skip
        self.base, self.scorer = base, _Scorer(table, topology, sync_every, price_sync)
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
        host_first = (s[:, TO_HOST] > -math.inf) & (s[:, TO_HOST] >= s[:, HOST_TO_ALL])
        # host first: (to_host, then host_to_all); otherwise (to_all, then to_host as fallback if to_all is refused)
        first = torch.where(host_first, TO_HOST, TO_ALL)
        kind = torch.stack([first, torch.where(host_first, HOST_TO_ALL, TO_HOST)], dim=1).flatten()
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
        self.masks, self.load, self.budget, self.ws = holder_masks(topology), load, budget, ws
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
            ok |= later & fits & torch.where(kind == HOST_TO_ALL, prev_taken, ~prev_taken & (state_now == SHARDED))
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


def select_tiers(
    tables: list[TableMemory],
    profile: AccessProfile,
    topology: TierTopology,
    budget_bytes: int,
    min_reads_per_step: float = 1.0,
    max_hot_fraction: float = 0.5,
    sync_every: int = 1,
    price_sync: bool = True,
) -> TierPlan:
    """Chooses each table's replicated and per-host rows so that the per-rank peak stays within ``budget_bytes``.

    Rows read fewer than ``min_reads_per_step`` times per step stay sharded, and at most
    ``max_hot_fraction`` of a table's rows are promoted. Promotions (sharded->per_host,
    per_host->replicated, sharded->replicated) are taken by saved seconds per step per
    added byte (summed over ranks), best first, skipping those that would exceed the budget.
    ``sync_every``: replicated rows combine their gradients every this many steps
    (``ReplicationConfig.replica_sync_every``), which makes replicating cheaper. A replicated
    row's sync is priced as the all-reduce it is; ``price_sync`` False prices it as one read of
    the row (FAE's choice of hot rows, where whole batches of hot samples skip their exchanges).

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
        _Stream(
            t,
            profile.table_counts(t.name),
            profile.batches,
            base,
            topology,
            min_reads_per_step,
            max_hot_fraction,
            sync_every,
            price_sync,
        )
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

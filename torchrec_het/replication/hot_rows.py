"""Which rows of a table are hot: the rule a profile's, online counts' and the planner's tiers share."""

import math

import torch

from torchrec_het.replication.memory import TierTopology


def replication_threshold(world_size: int, sync_every: int = 1) -> float:
    """Reads per step over all ranks from which a row replicated on every rank moves no more
    bytes than the same row sharded: the rule's ``min_reads_per_step``.

    Sharded, each read from another rank moves the row's partial forward and its gradient back:
    ``reads * 2 * (ws - 1) / ws`` rows a step. Replicated, a row touched between syncs is summed
    once per sync by an all-reduce, ``2 * (ws - 1)`` rows over all ranks (each rank sends
    ``2 (ws - 1) / ws`` of it): ``2 * (ws - 1) / s`` rows a step. They are equal at
    ``reads = ws / s``: about one read per rank per sync. So the bar rises with the world size
    (with one rank nothing moves either way: ``1 / s``)."""
    return max(world_size, 1) / sync_every


def hot_row_count(reads: torch.Tensor, min_reads_per_step: float, max_hot_fraction: float) -> int:
    """Rows (``reads`` per step, hottest first) read at least ``min_reads_per_step`` times a step,
    at most ``max_hot_fraction`` of the table: the hot rows of a profile or of online counts
    (the rule the planner prices too)."""
    count = int((reads >= min_reads_per_step).sum()) if reads.numel() else 0
    return min(count, math.floor(max_hot_fraction * reads.numel()))


def hottest_rows(reads: torch.Tensor, min_reads_per_step: float, max_hot_fraction: float) -> torch.Tensor:
    """Sorted int64 ids of the rows :func:`hot_row_count` admits, ``reads``: per step of every row
    of a table (ties: lower id first). The rule of a profile's and of online counts' hot rows."""
    rows = torch.nonzero(reads >= min_reads_per_step).flatten()  # those read often enough, by id
    count = hot_row_count(reads, min_reads_per_step, max_hot_fraction)
    if rows.numel() > count:  # the hottest of them (a table's sort only where the cap binds)
        order = torch.sort(reads[rows], descending=True, stable=True).indices[:count]
        rows = torch.sort(rows[order]).values
    return rows.to(torch.int64)


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

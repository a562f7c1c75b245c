"""Expected embedding bytes per step of the plugin's sharding types (pure).

Every figure is bytes per training step summed over ranks (what the benchmark counts), for
one table, from its rows' reads per step (:mod:`torchrec_het.planner.access`), for
``het_row_replicated`` (bags and sequences), ``het_cached_row_wise``, and ``row_wise`` /
``table_wise`` for comparison. Embeddings (pooled bags, partial sums, rows) and their gradients
travel at the wire bytes per element of the quantized-comms codecs they take
(:class:`WirePrecision`, :mod:`torchrec_het.planner.qcomms`; fp32 by default), and replicated
rows' gradients sum in the replica syncs' dtype; ids, lengths, versions and touch counts stay as
they are.

Model: docs/internals.md#planner-traffic
"""

import math
from dataclasses import dataclass, field

import torch

from torchrec_het.replication.memory import TierTopology

FLOAT, ID, LENGTH = 4, 8, 4  # bytes of an fp32 value, an int64 id, an int32 length or id pair half


@dataclass(frozen=True)
class WirePrecision:
    """Wire bytes per fp32 element of a collective's embeddings: ``forward`` (pooled bags, partial
    sums, rows) and ``backward`` (their gradients), as their quantized-comms codecs send them;
    ``sync``: of the gradients ``het_row_replicated``'s replica syncs sum (their summing dtype);
    ``forward_cpu``, ``backward_cpu``: seconds per fp32 element to encode and decode them (0: no
    codec; measured on this machine, :meth:`~torchrec_het.sharding.common.wire_codec.WireCodec.seconds_per_element`).
    Precisions compare by their bytes."""

    forward: float = float(FLOAT)
    backward: float = float(FLOAT)
    sync: float = float(FLOAT)
    forward_cpu: float = field(default=0.0, compare=False)
    backward_cpu: float = field(default=0.0, compare=False)


FP32 = WirePrecision()  # no codec


@dataclass(frozen=True)
class TableLoad:
    """One table's traffic inputs.

    Attributes:
        reads: float64 reads per step of its rows, hottest first (all rows, or the read ones).
        bags: bags per step over all ranks (batch size x world size x features of the table).
        dim: embedding dimension.
        world_size: ranks.
        topology: hosts and bandwidths (None: one host): several hosts take the per-host
            tier and sync replicated rows hierarchically.
        weighted: its ids carry fp32 weights (sent beside them).
    """

    reads: torch.Tensor
    bags: float
    dim: int
    world_size: int
    topology: TierTopology | None = None
    weighted: bool = False

    @property
    def ids(self) -> float:
        return float(self.reads.sum())

    @property
    def hosts(self) -> int:
        """Hosts whose ranks sync hierarchically (1: one host, or one rank per host: flat)."""
        t = self.topology
        return t.num_hosts if t is not None and t.num_hosts > 1 and t.local_world_size > 1 else 1

    @property
    def other_hosts(self) -> float:
        """Share of a rank's peers on another host."""
        t = self.topology
        return 0.0 if t is None else other_hosts_share(self.world_size, t.local_world_size)

    @property
    def remote(self) -> float:
        """Share of a row-wise table's reads that another rank owns."""
        return (self.world_size - 1) / self.world_size


def other_hosts_share(world_size: int, local_world_size: int) -> float:
    """Share of a rank's peers on another host (traffic spread evenly over the peers crosses hosts this often)."""
    return (world_size - local_world_size) / (world_size - 1) if world_size > 1 else 0.0


@dataclass(frozen=True)
class Bytes:
    """Bytes per step summed over ranks, by phase."""

    forward: float
    backward: float
    sync: float = 0.0
    intra_forward: float = 0.0  # of ``forward``, the bytes that stay within a host (several hosts only)
    intra_backward: float = 0.0  # of ``backward + sync``, likewise
    ids: float = 0.0  # of ``forward``, the input dist's (ids, lengths, counts)
    inter_host: float | None = None  # of ``total``, the bytes between hosts (None: not modelled apart)

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.sync


def row_replicated_bytes(
    load: TableLoad, hot_rows: int, sync_every: int = 1, host_rows: int = 0, wire: WirePrecision = FP32
) -> Bytes:
    """``het_row_replicated`` with the ``hot_rows`` hottest rows on every rank and the next
    ``host_rows`` once per host (several hosts); partial sums, their gradients and the synced
    gradients at ``wire``."""
    ws, dim = load.world_size, load.dim
    hot = load.reads[:hot_rows]
    host = load.reads[hot_rows : hot_rows + host_rows]
    cold_ids = max(load.ids - float(hot.sum()) - float(host.sum()), 0.0)
    remote_cold = cold_ids * load.remote
    partials = _distinct_servers(load, remote_cold)
    # a (bag, row) int32 pair per cold id (after the group's counts: :func:`counts_bytes`)
    ids = remote_cold * (2 * LENGTH + (FLOAT if load.weighted else 0))
    forward = ids + partials * dim * wire.forward
    backward = partials * dim * wire.backward
    intra_forward = intra_backward = combine = 0.0
    if host_rows and load.hosts > 1:  # read within the host; each host's summed gradient to the others' holders
        local, hosts = ws // load.hosts, load.hosts
        reads_here = float(host.sum()) * (local - 1) / local
        intra_forward = reads_here * (2 * LENGTH + dim * wire.forward)
        intra_backward = reads_here * dim * wire.backward
        touched = float((1.0 - torch.exp(-host / hosts)).sum())  # per host and step
        combine = hosts * touched * (hosts - 1) * (dim * wire.sync + ID)
        ids += reads_here * 2 * LENGTH
        forward += intra_forward
        backward += intra_backward + combine
    sync, sync_intra = (
        (0.0, 0.0) if hot_rows == 0 or ws == 1 else replica_sync_bytes(hot, dim, ws, load.hosts, sync_every, wire.sync)
    )
    # between hosts: the cold traffic's share to owners on other hosts, the per-host combine, the leaders' sync
    spread = forward - intra_forward + backward - intra_backward - combine
    inter = spread * load.other_hosts + combine + (sync - sync_intra if load.other_hosts else 0.0)
    return Bytes(forward, backward, sync, intra_forward, intra_backward + sync_intra, ids, inter)


DENSE_SYNC_SHARE = 0.75  # a sync follows one that touched at least this share of the rows: every row is summed


def replica_sync_bytes(
    hot: torch.Tensor, dim: int, ws: int, hosts: int = 1, sync_every: int = 1, grad_bytes: float = FLOAT
) -> tuple[float, float]:
    """(bytes per step over all ranks, of which within hosts) of summing replicated rows' gradients,
    ``hot``: reads per step of each replicated row.

    Once per ``sync_every`` steps. When most rows were touched since the last sync (at least
    ``DENSE_SYNC_SHARE``), one all-reduce of every row's gradient and touch count (``dim + 1``
    values a row, all in the summing dtype: ``grad_bytes`` each); else an all-reduce of every row's
    touch count (fp32), then one of the touched rows' gradients. An all-reduce of n bytes over k
    ranks moves ``2 (k - 1) n`` bytes in all. On several hosts of several ranks it runs within each
    host, then the host leaders gather each other's touched rows (a bit mask and the rows, padded to
    the most any leader has), then each leader broadcasts the sum to its host."""
    rows, window = hot.numel(), float(sync_every)
    touched = float((1.0 - torch.exp(-hot * window)).sum())  # rows some rank touched since the last sync
    if touched >= DENSE_SYNC_SHARE * rows:
        reductions = [(rows, rows * (dim + 1), grad_bytes)]  # (rows, values, bytes a value) of each all-reduce
    else:
        reductions = [(rows, rows, FLOAT), (touched, touched * dim, grad_bytes)]
    if hosts == 1:
        total = sum(2 * (ws - 1) * n * size for _, n, size in reductions)
        return total / window, 0.0
    local = ws // hosts
    touched_by_host = float((1.0 - torch.exp(-hot * window / hosts)).sum())
    intra = inter = 0.0
    for kept, n, size in reductions:
        width = n / max(kept, 1.0)  # values a row
        intra += hosts * (2 * (local - 1) + (local - 1)) * n * size  # within each host, then the broadcast
        host_rows = min(touched_by_host, kept)
        inter += hosts * (hosts - 1) * (math.ceil(rows / 8) + host_rows * width * size + ID)
    return (intra + inter) / window, intra / window


def sequence_replicated_bytes(load: TableLoad, hot_rows: int, sync_every: int = 1, wire: WirePrecision = FP32) -> Bytes:
    """``het_row_replicated`` for an EmbeddingCollection, or bags whose cold ids fetch rows: distinct
    cold rows fetched, not partials (rows, their gradients and the synced gradients at ``wire``)."""
    ws, dim = load.world_size, load.dim
    cold = load.reads[hot_rows:]
    fetched = float((1.0 - torch.exp(-cold / ws)).sum()) * ws * load.remote  # distinct rows per rank, summed
    pooled = row_replicated_bytes(load, hot_rows, sync_every, wire=wire)  # for its sync term
    ids = fetched * (2 * LENGTH + (FLOAT if load.weighted else 0))  # a (position, row) int32 pair per distinct cold row
    return Bytes(
        ids + fetched * dim * wire.forward, fetched * dim * wire.backward, pooled.sync, 0.0, pooled.intra_backward, ids
    )


def cached_bytes(
    load: TableLoad, capacity_rows: int, s_read: int, s_write: int, protocol: str = "het", wire: WirePrecision = FP32
) -> Bytes:
    """``het_cached_row_wise`` with ``capacity_rows`` cached rows per rank (the hottest, in steady state).

    Each rank asks the owners about each distinct remote row it reads (``het``: all of them, an
    (id, held version) int64 pair; otherwise the ones not cached) and gets each one's version back
    (int64); rows come for those not cached (one row each); the rows a rank wrote go to their
    owners every ``s_write + 1`` steps (a row and its id, once per row written in that window).
    Rows fetched and pushed at ``wire``, ids and versions as they are."""
    ws, dim = load.world_size, load.dim
    remote = load.remote * ws  # distinct rows read per step, summed over ranks, another rank owns: this share of
    distinct = (1.0 - torch.exp(-load.reads / ws)) * remote
    asked_all = float(distinct.sum())
    cached = float(distinct[:capacity_rows].sum()) if s_read >= 1 else 0.0
    misses = asked_all - cached
    ids = (asked_all if protocol == "het" else misses) * 3 * ID
    window = s_write + 1
    written = float(((1.0 - torch.exp(-load.reads * window / ws)) * remote).sum())  # per window
    backward = written * (dim * wire.backward + ID) / window
    return Bytes(ids + misses * dim * wire.forward, backward, ids=ids)


def row_wise_bytes(load: TableLoad, wire: WirePrecision = FP32) -> Bytes:
    """Stock row_wise: every bag's length to every other rank and each id to its owner (TorchRec's
    KJT all-to-all), every rank's partial of every bag reduce-scattered, gradients all-gathered
    (both at ``wire``)."""
    ids = load.bags * LENGTH * (load.world_size - 1) + load.ids * load.remote * _id_bytes(load)
    outputs = load.bags * load.dim * (load.world_size - 1)
    return Bytes(ids + outputs * wire.forward, outputs * wire.backward, ids=ids)


def table_wise_bytes(load: TableLoad, wire: WirePrecision = FP32) -> Bytes:
    """Stock table_wise: lengths and ids to the table's rank, pooled bags back, their gradients to
    it (both at ``wire``)."""
    ids = (load.bags * LENGTH + load.ids * _id_bytes(load)) * load.remote
    outputs = load.bags * load.dim * load.remote
    return Bytes(ids + outputs * wire.forward, outputs * wire.backward, ids=ids)


def _id_bytes(load: TableLoad) -> int:
    """An id on TorchRec's wire: int64, and its fp32 weight."""
    return ID + (FLOAT if load.weighted else 0)


def counts_bytes(world_size: int) -> float:
    """The plugin's first collective: every rank's send counts and batch size (int64) to every other rank."""
    return world_size * (world_size - 1) * (world_size + 1) * ID


def _distinct_servers(load: TableLoad, remote_cold: float) -> float:
    """Expected (bag, remote server) pairs: partials per step. A bag holds ``ids / bags`` ids, each
    a remote cold one with probability ``remote_cold / ids``, on one of the other ranks alike."""
    if remote_cold <= 0 or load.bags <= 0:
        return 0.0
    servers = load.world_size - 1
    per_bag, share = load.ids / load.bags, min(remote_cold / load.ids, 1.0)
    return load.bags * servers * (1.0 - (1.0 - share / servers) ** per_bag)

"""The step model: a plan's embedding bytes per phase and the parts of its training step, predicted.

One model prices every table of a plan, stock types and the plugin's alike, from what a planner
knows: the tables (rows, width, ids per sample), each one's sharding type, placement and
settings, the reads of its rows (a profile or a stated skew), the batch per rank, the ranks and
hosts, the links' figures and the lookups' compute. The benchmark records its prediction beside
what it measured for every entry (so the model is checked on every run), and
``python -m torchrec_het.plan`` uses it to project plans to clusters this machine is not.

**Bytes** are what the benchmark counts: the bytes of every collective that leave the sender,
summed over ranks (an all-reduce of n bytes over k ranks: ``2 (k - 1) n``). Stock types send
TorchRec's encodings: int32 lengths, one per bag and destination (row_wise: every destination),
int64 ids, fp32 weights; table_wise returns each pooled bag to its rank, row_wise
reduce-scatters every rank's partial of every bag and all-gathers the gradients. The plugin's
types send their own (:mod:`~torchrec_het.planner.traffic`). Phases: ``ids`` (the input dist),
``emb_fwd`` (pooled bags, partial sums or rows), ``emb_bwd`` (their gradients and the replica
sync), as the benchmark's ``fwd_ids`` / ``fwd_emb`` / ``bwd_grad``. Under TorchRec's quantized
comms, embeddings and their gradients travel at their codecs' wire bytes per element
(``PlannedTable.wire``; :func:`with_codecs` takes them from the sharders' ``qcomm_codecs_registry``,
:mod:`~torchrec_het.planner.qcomms`), and replica syncs sum gradients in their summing dtype; ids,
touch counts and data_parallel's all-reduce stay as they are.

**Time** (seconds per step on the slowest rank), the assumptions:

- compute: a sharded module costs ``module_s_per_step`` per step for each group of tables of one
  type (TorchRec's stages around the kernels) and ``lookup_s_per_id`` per id on the rank that
  pools it (table_wise: the rank holding the most ids; sharded types: an even share), a third in
  the forward and two thirds in the backward (TorchRec's estimator's split); a plugin type adds its calibrated extra
  per id of the reader's batch (``compute_costs.json``); the dense part costs
  ``dense_s_per_sample`` per sample of a rank's batch; a quantized-comms codec costs its measured
  encode-and-decode seconds per element it codes (``PlannedTable.wire``), on the ranks evenly, in the
  phase it codes.
- communication: each phase's bytes per rank over the link they cross (the inter-host share at
  the inter-host bandwidth, the rest within hosts), plus ``latency`` per collective. A rank sends
  and receives at once (full duplex), so a phase takes its bytes sent per rank over the bandwidth.
- the dense all-reduce (DDP) overlaps the dense backward (two thirds of the dense compute); what
  is left over counts in ``dense``.
- overlap, per pipeline (:data:`OVERLAP`): ``plain`` hides nothing; ``sparse_dist`` moves the
  next batch's ids under this step's compute, and waits for the pooled embeddings and their
  gradients; the plugin's deferred owner backward (row replication) also flies under the dense
  forward of the next step; ``hybrid`` (k >= 1) runs every embedding collective on a worker
  thread ahead of the dense part, so only what exceeds the step's compute is waited for.
"""

import math
from dataclasses import dataclass, field, replace

import torch

from torchrec_het.planner.compute_costs import setting_class
from torchrec_het.planner.qcomms import sharder_registry, wire_precision
from torchrec_het.planner.traffic import (
    FLOAT,
    FP32,
    Bytes,
    TableLoad,
    WirePrecision,
    cached_bytes,
    counts_bytes,
    other_hosts_share,
    row_replicated_bytes,
    row_wise_bytes,
    sequence_replicated_bytes,
    table_wise_bytes,
)
from torchrec_het.replication.memory import TierTopology
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED

PIPELINES = ("plain", "sparse_dist", "hybrid")
OVERLAP = {
    "plain": "nothing overlaps: every collective is waited for where it is issued",
    "sparse_dist": "the next batch's ids move under this step's compute; pooled embeddings and gradients are waited for; "
    "row replication's owner backward is deferred and flies under the next dense forward",
    "hybrid": "embedding collectives run on a worker thread ahead of the dense part: only their time beyond the step's "
    "compute is waited for",
}
BACKWARD_SHARE = 2.0 / 3.0  # of a lookup's or the dense part's compute, the backward's (TorchRec's split)
# collectives per step of one group of tables of a type: (ids, forward, backward)
COLLECTIVES = {
    "table_wise": (2, 1, 1),  # splits, then one all-to-all of lengths and ids (TorchRec fuses them)
    "column_wise": (2, 1, 1),
    "table_column_wise": (2, 1, 1),
    "row_wise": (2, 1, 1),  # ... then a reduce-scatter of the bags, an all-gather of their gradients
    "data_parallel": (0, 0, 1),
    HET_ROW_REPLICATED: (2, 1, 2),  # counts, ids; partial sums; their gradients and the replica sync
    HET_CACHED_ROW_WISE: (3, 2, 2),
}
FETCHED_ROWS_COLLECTIVES = (2, 1, 1)  # exact caches: counts, ids; the rows; their gradients (no replicas to sync)


@dataclass(frozen=True)
class Links:
    """What the model assumes of the network.

    Attributes:
        intra: bytes/s between ranks of one host.
        inter: bytes/s between hosts.
        latency: seconds per collective.
        source: where the figures came from ("measured: ...", "stated").
    """

    intra: float
    inter: float
    latency: float = 0.0
    source: str = "stated"


@dataclass(frozen=True)
class Compute:
    """What the model assumes of the compute.

    Attributes:
        lookup_s_per_id: a stock TBE lookup's forward, backward and fused update, per id.
        module_s_per_step: a sharded embedding module's own work per step around its kernels
            (TorchRec's dist stages, permutes, awaitables), per group of tables of one type.
        dense_s_per_sample: the dense part's forward, backward and optimizer step, per sample.
        dense_s_per_step: the dense part's fixed work per step.
        extra_s_per_id: plugin type -> setting class ("exact", "stale") -> extra seconds per id
            (:class:`~torchrec_het.planner.compute_costs.ComputeCosts`).
        source: where the figures came from.
    """

    lookup_s_per_id: float
    dense_s_per_sample: float
    extra_s_per_id: dict = field(default_factory=dict)
    source: str = "stated"
    module_s_per_step: float = 0.0
    dense_s_per_step: float = 0.0

    def extra(self, sharding_type: str, setting: str) -> float:
        """The extra seconds per id of ``sharding_type`` under ``setting`` ("rows" where not given: "exact")."""
        figures = self.extra_s_per_id.get(sharding_type, {})
        return figures.get(setting, figures.get("exact", 0.0) if setting == "rows" else 0.0)


@dataclass(frozen=True)
class PlannedTable:
    """One table as planned.

    Attributes:
        name: the table.
        rows: its rows.
        dim: its width.
        features: bags per sample (the features that read it).
        ids_per_sample: ids per sample over those features.
        sharding_type: its sharding type.
        reads: float64 reads per step over all ranks of its rows (any order, all rows or the read ones).
        owners: table_wise / column_wise: the rank of each shard (the model's placement); else empty.
        shard_dims: column_wise: each shard's width; else empty.
        hot: het_row_replicated: reads per step of its replicated rows; het_cached_row_wise: of its
            cached ones (the hottest ``capacity`` rows).
        per_host: het_row_replicated: reads per step of its per-host rows.
        sync_every: het_row_replicated's replica sync interval.
        s_read, s_write: het_cached_row_wise's bounds.
        pooled: an EmbeddingBagCollection's table (False: sequences).
        weighted: its features carry per-id weights.
        wire: wire bytes per element of its embeddings, their gradients and its synced gradients
            (its sharder's codecs; :func:`with_codecs`).
        lookahead: het_row_replicated bags: the next batch's partial sums leave their owners during
            this step, but those of rows this step updates (:func:`lookahead_fresh_share`).
        cold_rows: het_row_replicated bags: its cold ids fetch their rows (each distinct one once a step).
    """

    name: str
    rows: int
    dim: int
    features: int
    ids_per_sample: float
    sharding_type: str
    reads: torch.Tensor | None = None
    owners: tuple[int, ...] = ()
    shard_dims: tuple[int, ...] = ()
    hot: torch.Tensor | None = None
    per_host: torch.Tensor | None = None
    sync_every: int = 1
    s_read: int = 0
    s_write: int = 0
    pooled: bool = True
    weighted: bool = False
    wire: WirePrecision = FP32
    lookahead: bool = False
    cold_rows: bool = False

    @property
    def fetched_rows_tier(self) -> bool:
        """An exact ``het_cached_row_wise`` table: it runs as ``het_row_replicated``'s fetched-rows tier."""
        return self.sharding_type == HET_CACHED_ROW_WISE and self.s_read == self.s_write == 0

    @property
    def priced_type(self) -> str:
        """The type whose compute figures price this table (the fetched-rows tier's: ``het_row_replicated``)."""
        return HET_ROW_REPLICATED if self.fetched_rows_tier else self.sharding_type

    @property
    def setting(self) -> str:
        rows = self.cold_rows or self.fetched_rows_tier
        return setting_class(self.priced_type, self.sync_every, self.s_read, self.s_write, rows)


def with_codecs(table: PlannedTable, sharders: list | None) -> PlannedTable:
    """``table`` priced under the codecs of its sharder among ``sharders`` (its module's kind: bags
    or sequences; no sharder or no registry: fp32)."""
    registry = sharder_registry(sharders, table.pooled)
    return replace(table, wire=wire_precision(registry, table.sharding_type, table.pooled))


@dataclass(frozen=True)
class Cluster:
    """Ranks, hosts and batch: ``world_size`` ranks, ``local_world_size`` per host, ``batch`` samples each."""

    world_size: int
    local_world_size: int
    batch: int


@dataclass
class PhaseBytes:
    """Bytes per step summed over ranks, by phase; ``inter_host``: of their sum, those between hosts;
    ``collectives``: per step, by phase; ``sync``: of ``emb_bwd``, the replica syncs' (not coded as
    the embeddings' gradients are)."""

    ids: float = 0.0
    emb_fwd: float = 0.0
    emb_bwd: float = 0.0
    inter_host: float = 0.0
    collectives: list[int] = field(default_factory=lambda: [0, 0, 0])
    sync: float = 0.0

    @property
    def total(self) -> float:
        return self.ids + self.emb_fwd + self.emb_bwd

    def add(self, other: "PhaseBytes") -> "PhaseBytes":
        return PhaseBytes(
            self.ids + other.ids,
            self.emb_fwd + other.emb_fwd,
            self.emb_bwd + other.emb_bwd,
            self.inter_host + other.inter_host,
            [a + b for a, b in zip(self.collectives, other.collectives)],
            self.sync + other.sync,
        )

    def as_dict(self) -> dict:
        return {
            "fwd_ids": round(self.ids),
            "fwd_emb": round(self.emb_fwd),
            "bwd_grad": round(self.emb_bwd),
            "embedding_cross_rank": round(self.total),
            "inter_host_embedding": round(self.inter_host),
        }


@dataclass(frozen=True)
class StepPrediction:
    """A plan's predicted step: its bytes and the parts of its time, in seconds."""

    bytes: PhaseBytes
    emb_fwd: float
    emb_bwd: float
    dense: float
    comm_wait: float
    pipeline: str

    @property
    def total(self) -> float:
        return self.emb_fwd + self.emb_bwd + self.dense + self.comm_wait

    def samples_per_s(self, cluster: Cluster) -> float:
        return cluster.batch * cluster.world_size / self.total if self.total > 0 else math.inf

    def step_ms(self) -> dict:
        parts = {"emb_fwd": self.emb_fwd, "emb_bwd": self.emb_bwd, "dense": self.dense, "comm_wait": self.comm_wait}
        return {k: v * 1e3 for k, v in dict(parts, total=self.total).items()}


def _inter_share(cluster: Cluster) -> float:
    return other_hosts_share(cluster.world_size, cluster.local_world_size)


def table_bytes(table: PlannedTable, cluster: Cluster) -> PhaseBytes:
    """One table's bytes per step over all ranks, by phase."""
    ws, batch = cluster.world_size, cluster.batch
    if ws == 1:
        return PhaseBytes()
    if table.sharding_type == "data_parallel":  # every rank's gradient of the whole table, all-reduced
        grads = 2 * (ws - 1) * table.rows * table.dim * FLOAT
        return PhaseBytes(0.0, 0.0, grads, grads * _inter_share(cluster))
    bags = float(batch * ws * table.features)
    kind = table.sharding_type
    if kind in ("table_wise", "column_wise", "table_column_wise", "row_wise"):
        ids = torch.tensor([float(batch * ws * table.ids_per_sample)], dtype=torch.float64)
        if kind == "row_wise":
            load = TableLoad(ids, bags, table.dim, ws, weighted=table.weighted)
            phases = _as_phases(row_wise_bytes(load, table.wire))
        else:  # each column shard is a table of its width: its lengths and ids go to its owner
            phases = PhaseBytes()
            for width in table.shard_dims or (table.dim,):
                load = TableLoad(ids, bags, width, ws, weighted=table.weighted)
                phases = phases.add(_as_phases(table_wise_bytes(load, table.wire)))
    elif kind in (HET_ROW_REPLICATED, HET_CACHED_ROW_WISE):
        phases = _plugin_phases(table, cluster, bags)
    else:
        raise ValueError(f"table {table.name!r}: the step model has no bytes for sharding type {kind!r}")
    if phases.inter_host < 0 or kind not in (HET_ROW_REPLICATED,):
        phases.inter_host = phases.total * _inter_share(cluster)
    return phases


def _plugin_phases(table: PlannedTable, cluster: Cluster, bags: float) -> PhaseBytes:
    ws, local = cluster.world_size, cluster.local_world_size
    topology = TierTopology(ws, local, 1.0, 1.0) if ws > local else None
    hot = table.hot if table.hot is not None else torch.zeros(0, dtype=torch.float64)
    host = table.per_host if table.per_host is not None else torch.zeros(0, dtype=torch.float64)
    reads = table.reads if table.reads is not None else torch.zeros(0, dtype=torch.float64)
    # hot rows first, then the per-host ones, then the rest: the traffic model's order
    rest = max(float(reads.sum()) - float(hot.sum()) - float(host.sum()), 0.0)
    ordered = torch.cat([hot.double(), host.double(), torch.tensor([rest], dtype=torch.float64)])
    load = TableLoad(ordered, bags, table.dim, ws, topology, weighted=table.weighted)
    if table.sharding_type == HET_ROW_REPLICATED and table.pooled and not table.cold_rows:
        phases = _as_phases(row_replicated_bytes(load, hot.numel(), table.sync_every, host.numel(), table.wire))
        if table.lookahead:  # every partial sum goes early; the stale ones go again at the lookup
            again = phases.emb_fwd * (1.0 - lookahead_fresh_share(table))
            phases.emb_fwd += again
            phases.inter_host += again * _inter_share(cluster) if phases.inter_host >= 0 else 0.0
        return phases
    # the cache and the sequences' fetches count distinct rows: every row's reads, hottest first
    descending = bool((reads[:-1] >= reads[1:]).all()) if reads.numel() > 1 else True
    by_row = replace(load, reads=reads.double() if descending else torch.sort(reads.double(), descending=True).values)
    if table.fetched_rows_tier:  # every remote row a rank reads is fetched, once a step
        traffic = sequence_replicated_bytes(by_row, 0, 1, table.wire)
    elif table.sharding_type == HET_ROW_REPLICATED:  # sequences, and bags whose cold ids fetch rows
        traffic = sequence_replicated_bytes(by_row, hot.numel(), table.sync_every, table.wire)
    else:
        traffic = cached_bytes(by_row, hot.numel(), table.s_read, table.s_write, wire=table.wire)
    return _as_phases(traffic)


def _as_phases(traffic: Bytes) -> PhaseBytes:
    inter = -1.0 if traffic.inter_host is None else traffic.inter_host  # -1: the table's even spread
    return PhaseBytes(
        traffic.ids, traffic.forward - traffic.ids, traffic.backward + traffic.sync, inter, sync=traffic.sync
    )


def lookahead_fresh_share(table: PlannedTable) -> float:
    """Of a lookahead table's cold partial sums, the share its owners send a step early: those whose
    row the previous step did not read (a row read ``r`` times a step was read in the previous one
    with probability ``1 - exp(-r)``), weighted by reads."""
    if table.reads is None or not table.reads.numel():
        return 1.0
    held = (table.hot.numel() if table.hot is not None else 0) + (
        table.per_host.numel() if table.per_host is not None else 0
    )
    reads = table.reads.double()
    if not bool((reads[:-1] >= reads[1:]).all()):  # hottest first: the held rows are the first
        reads = torch.sort(reads, descending=True).values
    cold = reads[held:]
    total = float(cold.sum())
    return float((cold * torch.exp(-cold)).sum()) / total if total > 0 else 1.0


def plan_bytes(tables: list[PlannedTable], cluster: Cluster, per_table: list[PhaseBytes] | None = None) -> PhaseBytes:
    """Every table's bytes (``per_table``, when already known), summed, and the collectives of each
    sharding type's group."""
    total = PhaseBytes()
    for phases in per_table if per_table is not None else [table_bytes(t, cluster) for t in tables]:
        total = total.add(phases)
    if cluster.world_size > 1:
        for kind in {t.sharding_type for t in tables}:
            counts = COLLECTIVES.get(kind, (1, 1, 1))
            if kind == HET_CACHED_ROW_WISE and all(t.fetched_rows_tier for t in tables if t.sharding_type == kind):
                counts = FETCHED_ROWS_COLLECTIVES
            total.collectives = [a + b for a, b in zip(total.collectives, counts)]
            if kind in (HET_ROW_REPLICATED, HET_CACHED_ROW_WISE):  # the group's first collective
                total.ids += counts_bytes(cluster.world_size)
    return total


def _lookup_ids(tables: list[PlannedTable], cluster: Cluster) -> list[float]:
    """Ids each rank pools per step (table_wise / column_wise: on the shards' owners)."""
    ws, even = cluster.world_size, 0.0  # ``even``: a rank's own batch's ids of the tables every rank pools
    placed = [0.0] * ws
    for table in tables:
        ids = cluster.batch * table.ids_per_sample
        if table.owners and table.sharding_type not in ("row_wise", "data_parallel"):
            for owner, width in zip(table.owners, table.shard_dims or (table.dim,) * len(table.owners)):
                placed[owner % ws] += ids * ws * width / table.dim
        else:
            even += ids
    return [even + p for p in placed]


def _codec_seconds(tables: list[PlannedTable], per_table: list[PhaseBytes], cluster: Cluster) -> tuple[float, float]:
    """A rank's codec CPU per step, forward and backward: every coded element is encoded by its sender
    and decoded by its receiver (the ranks share the elements evenly)."""
    forward = backward = 0.0
    for table, phases in zip(tables, per_table):
        wire = table.wire
        forward += phases.emb_fwd / wire.forward * wire.forward_cpu
        backward += (phases.emb_bwd - phases.sync) / wire.backward * wire.backward_cpu
    return forward / cluster.world_size, backward / cluster.world_size


def _seconds(phase_bytes: float, collectives: int, cluster: Cluster, links: Links, inter: float | None = None) -> float:
    """One phase's time on a rank: its bytes per rank over the links they cross (``inter``: the share
    between hosts; default the even spread over peers), plus latency."""
    ws = cluster.world_size
    if ws == 1 or phase_bytes <= 0:
        return 0.0
    per_rank = phase_bytes / ws
    inter = _inter_share(cluster) if inter is None else inter
    return per_rank * (inter / links.inter + (1 - inter) / links.intra) + collectives * links.latency


def predict_step(
    tables: list[PlannedTable],
    cluster: Cluster,
    links: Links,
    compute: Compute,
    pipeline: str = "sparse_dist",
    dense_params: int = 0,
) -> StepPrediction:
    """The plan's predicted step under ``pipeline`` (``plain``, ``sparse_dist``, ``hybrid``);
    ``dense_params``: parameters the dense all-reduce sums (DDP)."""
    if pipeline not in PIPELINES:
        raise ValueError(f"unknown pipeline {pipeline!r}; the step model knows {PIPELINES}")
    per_table = [table_bytes(t, cluster) for t in tables]
    traffic = plan_bytes(tables, cluster, per_table)
    lookup = max(_lookup_ids(tables, cluster)) * compute.lookup_s_per_id
    extra = sum(
        cluster.batch * t.ids_per_sample * compute.extra(t.priced_type, t.setting)
        for t in tables
        if t.sharding_type in (HET_ROW_REPLICATED, HET_CACHED_ROW_WISE)
    )
    emb = max(lookup + extra, 0.0)
    module = len({t.sharding_type for t in tables}) * compute.module_s_per_step  # the stages: in the forward
    codec_fwd, codec_bwd = _codec_seconds(tables, per_table, cluster)
    emb_fwd, emb_bwd = module + emb * (1 - BACKWARD_SHARE) + codec_fwd, emb * BACKWARD_SHARE + codec_bwd
    emb += module + codec_fwd + codec_bwd
    dense_compute = compute.dense_s_per_step + cluster.batch * compute.dense_s_per_sample
    ws = cluster.world_size
    allreduce = 0.0
    if ws > 1 and dense_params:
        allreduce = _seconds(2 * (ws - 1) * dense_params * FLOAT, 1, cluster, links)
    dense = dense_compute + max(0.0, allreduce - dense_compute * BACKWARD_SHARE)
    calls = traffic.collectives
    inter = traffic.inter_host / traffic.total if traffic.total > 0 else None  # the per-host tier keeps bytes in a host
    t_ids = _seconds(traffic.ids, calls[0], cluster, links, inter)
    t_fwd = _seconds(traffic.emb_fwd, calls[1], cluster, links, inter)
    t_bwd = _seconds(traffic.emb_bwd, calls[2], cluster, links, inter)
    if pipeline == "plain":
        wait = t_ids + t_fwd + t_bwd
    elif pipeline == "sparse_dist":
        compute_time = emb + dense
        wait = max(0.0, t_ids - compute_time) + t_fwd + t_bwd
        if any(t.sharding_type == HET_ROW_REPLICATED for t in tables):  # the deferred owner backward
            deferred = sum(p.emb_bwd for t, p in zip(tables, per_table) if t.sharding_type == HET_ROW_REPLICATED)
            hidden = min(_seconds(deferred, 0, cluster, links), dense_compute * (1 - BACKWARD_SHARE))
            wait -= hidden
        ahead = [(t, p) for t, p in zip(tables, per_table) if t.lookahead and t.sharding_type == HET_ROW_REPLICATED]
        if ahead:  # lookahead: the next batch's partials fly under this step's backward; the stale ones go again
            # emb_fwd counted the stale partial sums twice (table_bytes): what went early is the rest
            early = _seconds(
                sum(p.emb_fwd / (2.0 - lookahead_fresh_share(t)) for t, p in ahead), 0, cluster, links, inter
            )
            fits = min(1.0, (emb_bwd + dense_compute * BACKWARD_SHARE) / early) if early > 0 else 1.0
            # t_fwd counted every byte sent forward: the early ones that fit under the backward are not waited for
            wait -= early * fits
            wait += links.latency  # the ids' round trip moved into the step
    else:
        wait = max(0.0, t_ids + t_fwd + t_bwd - (emb + dense))
    return StepPrediction(traffic, emb_fwd, emb_bwd, dense, max(wait, 0.0), pipeline)

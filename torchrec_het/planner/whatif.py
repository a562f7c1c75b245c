"""What-if plans: stock's best plan and the plugin's, predicted on a cluster you describe.

The choice and the prediction are the step model's (:mod:`torchrec_het.planner.step_model`),
the one the benchmark checks against every run. Each table takes the cheapest of its options
(its bytes over the links plus its compute): stock's plan chooses among table_wise (tables
placed on the least loaded rank) and row_wise; the plugin's among those and
``het_row_replicated`` (hot rows: :func:`~torchrec_het.replication.hot_rows.replication_threshold`)
and ``het_cached_row_wise``, exact and at each staleness; every option under the quantized-comms
codecs of the ``sharders`` given (their ``qcomm_codecs_registry``; none: fp32). Pure: no process
group, no GPU.
"""

import math
from dataclasses import dataclass, field, replace

import torch

from torchrec_het.config import CacheSettings
from torchrec_het.plan_options import ReplicaOptions
from torchrec_het.planner.access import zipf_shares
from torchrec_het.planner.plan_tables import planned_table
from torchrec_het.planner.step_model import (
    Cluster,
    Compute,
    Links,
    PlannedTable,
    StepPrediction,
    predict_step,
    with_codecs,
)
from torchrec_het.replication.hot_rows import hot_row_count, replication_threshold
from torchrec_het.replication.memory import bytes_per_row, replica_copies
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED

STOCK = ("table_wise", "row_wise")
GBIT = 1e9 / 8  # bytes/s per Gbit/s
CACHE_SHARE = 0.1  # het_cached_row_wise's default capacity: 10% of a table's rows
TAIL_READS = 1e-3  # reads per step below which a long table's rows are summed in blocks (:func:`coarse_tail`)


@dataclass(frozen=True)
class TableShape:
    """A table the what-if plans: ``reads`` per step of one rank's batch, hottest first."""

    name: str
    rows: int
    dim: int
    features: int
    ids_per_sample: float
    reads_per_rank: torch.Tensor

    def entries(self, rows: int) -> int:
        """Entries of ``reads_per_rank`` that hold its hottest ``rows`` rows (its tail may be summed in blocks)."""
        n = self.reads_per_rank.numel()
        if n >= self.rows:
            return rows
        head = int((self.reads_per_rank >= TAIL_READS).sum())
        block = math.ceil((self.rows - head) / max(n - head, 1))
        return rows if rows <= head else min(n, head + math.ceil((rows - head) / block))


@dataclass(frozen=True)
class Setting:
    """A plugin setting the what-if prices: ``staleness`` 0 is exact (replicas synced every step, cache bounds 0)."""

    staleness: int = 0

    @property
    def label(self) -> str:
        return "exact" if self.staleness == 0 else f"s{self.staleness}"


@dataclass
class PlanChoice:
    """A plan the what-if chose and its prediction."""

    label: str
    tables: list[PlannedTable]
    prediction: StepPrediction
    memory_per_rank: float  # bytes, the most loaded rank
    types: dict[str, int] = field(default_factory=dict)


def tables_from_configs(configs, batch: int, alpha: float | None = None, profile=None) -> list[TableShape]:
    """The what-if's tables from ``EmbeddingBagConfig``s: reads from ``profile`` (an
    :class:`~torchrec_het.replication.profile.AccessProfile` of one rank's batches), else a Zipf
    skew ``alpha`` (None: uniform), one id per feature per sample."""
    shapes, skewed = [], {}  # Zipf reads per (rows, ids per sample), computed once
    for config in configs:
        features = len(config.feature_names)
        if profile is not None and config.name in profile.tables:
            counts = profile.table_counts(config.name).double() / max(profile.batches, 1)
            reads = coarse_tail(torch.sort(counts, descending=True).values)
            ids = float(reads.sum()) / batch
        else:
            ids = float(features)
            key = (config.num_embeddings, ids)
            if key not in skewed:
                skewed[key] = coarse_tail(zipf_shares(config.num_embeddings, alpha or 0.0) * batch * ids)
            reads = skewed[key]
        shapes.append(TableShape(config.name, config.num_embeddings, config.embedding_dim, features, ids, reads))
    return shapes


def coarse_tail(reads: torch.Tensor, limit: int = 1 << 18, small: float = TAIL_READS) -> torch.Tensor:
    """``reads`` (hottest first) in at most about ``limit`` entries: past the rows read at least
    ``small`` times a step, rows are summed in blocks whose sum stays near ``small``. Every formula of
    the model sees such a block as one row read its sum of times: exact for sums, and for the
    chance a row is read (``1 - exp(-reads)``) while blocks are read far less than once a step."""
    if reads.numel() <= limit:
        return reads
    head = int((reads >= small).sum())
    tail = reads[head:]
    block = max(1, math.ceil(tail.numel() / max(limit - head, 1)))
    pad = (-tail.numel()) % block
    summed = torch.cat([tail, tail.new_zeros(pad)]).view(-1, block).sum(1)
    return torch.cat([reads[:head], summed])


def _planned(
    shape: TableShape, kind: str, cluster: Cluster, staleness: int = 0, sharders: list | None = None
) -> PlannedTable:
    reads = shape.reads_per_rank * cluster.world_size  # per step over all ranks
    options, hot = None, None
    if kind == HET_ROW_REPLICATED:
        options = ReplicaOptions(replica_sync_every=max(staleness, 1))
        hot = reads[: hot_row_count(reads, replication_threshold(cluster.world_size, options.replica_sync_every), 0.5)]
    elif kind == HET_CACHED_ROW_WISE:
        options = CacheSettings(s_read=staleness, s_write=staleness)
        hot = reads[: shape.entries(math.ceil(CACHE_SHARE * shape.rows))]
    table = planned_table(
        shape.name, shape.rows, shape.dim, shape.features, shape.ids_per_sample, kind, options, reads=reads, hot=hot
    )
    return with_codecs(table, sharders)


def _memory(tables: list[PlannedTable], world_size: int, optimizer: str) -> float:
    """Bytes of the most loaded rank: table_wise tables on their owners, sharded ones evenly, plus replicas or caches."""
    even, owned = 0.0, [0.0] * world_size  # ``even``: what every rank holds alike
    for t in tables:
        row = bytes_per_row(t.dim, optimizer)
        if t.owners:
            owned[t.owners[0]] += t.rows * row
            continue
        extra = 0.0 if t.hot is None else t.hot.numel() * replica_copies(t.sync_every)
        even += (t.rows / world_size + extra) * row
    return even + max(owned)


def _place(tables: list[PlannedTable], cluster: Cluster) -> list[PlannedTable]:
    """table_wise tables on the rank with the fewest ids so far, biggest first (TorchRec's greedy)."""
    load = [0.0] * cluster.world_size
    placed = list(tables)
    order = sorted(range(len(tables)), key=lambda i: -tables[i].ids_per_sample)
    for i in order:
        t = tables[i]
        if t.sharding_type == "table_wise":
            rank = min(range(cluster.world_size), key=lambda r: (load[r], r))
            load[rank] += t.ids_per_sample
            placed[i] = replace(t, owners=(rank,))
    return placed


def choose_plan(
    shapes: list[TableShape], cluster: Cluster, links: Links, compute: Compute, kinds: tuple, staleness: int = 0,
    pipeline: str = "sparse_dist", dense_params: int = 0, optimizer: str = "exact_row_wise_adagrad", label: str = "",
    sharders: list | None = None,
) -> PlanChoice:  # fmt: skip
    """The cheapest plan by the whole-plan prediction among: each table's cheapest option among
    ``kinds`` (its own bytes and its share of the lookups), and every table of one kind; each
    priced under the codecs of ``sharders``."""
    candidates = [_per_table(shapes, cluster, links, compute, kinds, staleness, pipeline, sharders)]
    candidates += [[_planned(s, kind, cluster, staleness, sharders) for s in shapes] for kind in kinds]
    best = None
    for tables in candidates:
        placed = _place(tables, cluster)
        prediction = predict_step(placed, cluster, links, compute, pipeline, dense_params)
        if best is None or prediction.total < best[1].total:
            best = (placed, prediction)
    placed, prediction = best
    types: dict[str, int] = {}
    for t in placed:
        types[t.sharding_type] = types.get(t.sharding_type, 0) + 1
    return PlanChoice(label, placed, prediction, _memory(placed, cluster.world_size, optimizer), types)


def _per_table(shapes, cluster, links, compute, kinds, staleness, pipeline, sharders=None) -> list[PlannedTable]:
    """Each table's cheapest option among ``kinds`` by its own bytes and its share of the lookups."""
    chosen, best = [], {}  # tables of one shape and skew choose alike: once per shape
    for shape in shapes:
        key = (shape.rows, shape.dim, shape.features, shape.ids_per_sample, float(shape.reads_per_rank.sum()))
        if key not in best:
            options = [_planned(shape, kind, cluster, staleness, sharders) for kind in kinds]
            costs = [_table_cost(option, cluster, links, compute, pipeline, len(shapes)) for option in options]
            best[key] = options[min(range(len(options)), key=lambda i: costs[i])]
        chosen.append(replace(best[key], name=shape.name))
    return chosen


def _table_cost(
    table: PlannedTable, cluster: Cluster, links: Links, compute: Compute, pipeline: str, tables: int
) -> float:
    """One table's share of the step: its communication alone, and its lookup's share of the most
    loaded rank's (table_wise: every rank's ids of it on one rank, the ranks' lookups in parallel
    only as far as there are tables to spread)."""
    ws = cluster.world_size
    alone = replace(table, owners=(0,)) if table.sharding_type == "table_wise" else table
    step = predict_step([alone], cluster, links, replace(compute, dense_s_per_sample=0.0), pipeline)
    if table.sharding_type == "table_wise":
        lookup = cluster.batch * table.ids_per_sample * compute.lookup_s_per_id
        return step.total - lookup * ws + lookup * ws / min(ws, tables)
    return step.total


def compare(
    shapes: list[TableShape], cluster: Cluster, links: Links, compute: Compute, staleness: tuple[int, ...] = (0, 10),
    pipeline: str = "sparse_dist", dense_params: int = 0, optimizer: str = "exact_row_wise_adagrad",
    sharders: list | None = None,
) -> list[PlanChoice]:  # fmt: skip
    """Stock's best plan, then the plugin's at each staleness (0: exact); all under the codecs of ``sharders``."""
    common = dict(pipeline=pipeline, dense_params=dense_params, optimizer=optimizer, sharders=sharders)
    plans = [choose_plan(shapes, cluster, links, compute, STOCK, 0, label="stock", **common)]
    for s in staleness:
        kinds = STOCK + (HET_ROW_REPLICATED, HET_CACHED_ROW_WISE)
        plans.append(
            choose_plan(shapes, cluster, links, compute, kinds, s, label=f"plugin {Setting(s).label}", **common)
        )
    return plans


def sweep(
    shapes: list[TableShape], batch: int, compute: Compute, world_sizes: tuple[int, ...], inter_gbits: tuple[float, ...],
    ranks_per_host: int, intra_gbit: float | None = None, latency_s: float = 0.0, staleness: tuple[int, ...] = (10,),
    pipeline: str = "sparse_dist", dense_params: int = 0,
) -> list[dict]:  # fmt: skip
    """:func:`compare` at each world size (whole hosts of ``ranks_per_host``, or one smaller host) and
    each speed between hosts (``intra_gbit`` within them; None: the same): one row each."""
    rows = []
    for gbit in inter_gbits:
        links = Links((intra_gbit or gbit) * GBIT, gbit * GBIT, latency_s, "stated")
        for ws in world_sizes:
            local = min(ranks_per_host, ws)
            if ws % local:
                continue
            plans = compare(shapes, Cluster(ws, local, batch), links, compute, (0, *staleness),
                            pipeline, dense_params)  # fmt: skip
            base = plans[0].prediction.total
            rows.append({
                "world_size": ws, "inter_gbit": gbit,
                "plans": {p.label: {"types": p.types, "step_ms": p.prediction.total * 1e3,
                                    "mib_per_rank": p.prediction.bytes.total / ws / 2**20,
                                    "memory_per_rank": p.memory_per_rank,
                                    "speedup": base / p.prediction.total} for p in plans},
            })  # fmt: skip
    return rows


def speedup_series(rows: list[dict]) -> dict[str, list[tuple[float, float]]]:
    """The sweep's speed-ups over stock, one series per plugin setting and link speed (for a plot)."""
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        for label, plan in row["plans"].items():
            if label != "stock":
                series.setdefault(f"{label}, {row['inter_gbit']:g} Gbit/s", []).append(
                    (row["world_size"], plan["speedup"])
                )
    return series

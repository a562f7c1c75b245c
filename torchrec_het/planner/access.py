"""How often each row of a table is read per training step: from a profile, or a skew the user states.

The planner prices the plugin's types from these reads, and the row-replicated sharder takes
its hot rows from the same rule (:class:`ProfileTiers`), so what the planner sized is what gets
built. Plugin types are offered for a table only when its reads are known
(:meth:`AccessModel.has_evidence`).

Design: docs/internals.md#planner-access
"""

import math
from dataclasses import dataclass

import torch

from torchrec_het.errors import ConfigurationError
from torchrec_het.planner.network import cpu_network
from torchrec_het.replication.hot_rows import hottest_rows, per_host_rows, replication_threshold
from torchrec_het.replication.memory import TierTopology
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.replication.tiers import TableTiers


@dataclass(frozen=True)
class TableReads:
    """Reads per step of one table's rows, hottest first.

    Attributes:
        rows: row ids, hottest first (None under the skew model, where row identities are unknown).
        reads: float64 reads per step of each of those rows.
    """

    rows: torch.Tensor | None
    reads: torch.Tensor

    @property
    def total(self) -> float:
        return float(self.reads.sum())


@dataclass(frozen=True)
class AccessModel:
    """Where the planner's reads come from.

    Attributes:
        profile: measured counts, or None.
        alpha: a Zipf exponent the user states for tables the profile lacks, or None (the
            default): no skew is assumed, and those tables get TorchRec's types only (unless
            their constraints name a plugin type; they are then priced as uniform reads).
        source: where ``profile`` was read from (named in errors), if known.
        origin: the setting that named ``source`` (e.g. ``TORCHREC_HET_PROFILE``), named in errors.
    """

    profile: AccessProfile | None = None
    alpha: float | None = None
    source: str | None = None
    origin: str | None = None

    def __post_init__(self) -> None:
        if self.alpha is not None and not self.alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")

    def measured(self, table: str) -> bool:
        return self.profile is not None and table in self.profile.tables

    def has_evidence(self, table: str) -> bool:
        """Whether ``table``'s reads are known (measured, or a stated skew): the planner offers the
        plugin's types only then."""
        return self.measured(table) or self.alpha is not None

    def check_matches(self, rows_by_table: dict[str, int]) -> None:
        """Raises :class:`~torchrec_het.errors.ConfigurationError` naming the profile (and the setting
        it came from) when it does not fit the model's tables (name -> rows): empty, naming none of
        them, or counting another number of rows for one of them. A profile may leave tables out
        (they get TorchRec's types). A no-op without a profile."""
        if self.profile is None or not rows_by_table:
            return
        tables = sorted(rows_by_table)
        named = bool(self.origin and self.source)  # "$TORCHREC_HET_PROFILE='path': the access profile ..."
        prefix, source = (f"${self.origin}={self.source!r}: ", None) if named else ("", self.source)
        try:
            check_not_empty(self.profile, source, tables)
        except ValueError as error:
            raise ConfigurationError(prefix + str(error)) from None
        if not set(tables) & set(self.profile.tables):
            raise ConfigurationError(
                f"{prefix}{_where(source)} names none of the model's tables: it has {_few(self.profile.tables)}, "
                f"the model has {_few(tables)}; profile this model's batches"
            )
        other = [
            f"{name!r} has {rows} rows in the profile, {rows_by_table[name]} in the model"
            for name, rows in zip(self.profile.tables, self.profile.num_rows)
            if name in rows_by_table and rows != rows_by_table[name]
        ]
        if other:
            raise ConfigurationError(
                f"{prefix}{_where(source)} counts other row numbers than the model's tables: {_few(other, 2)}; "
                "profile this model's batches"
            )

    def reads(self, table: str, num_rows: int, reads_per_step: float, world_size: int) -> TableReads:
        """Reads per step of ``table``'s rows, hottest first.

        Args:
            num_rows: the table's rows.
            reads_per_step: ids of the table in one step over all ranks (the skew model's
                total; a profile brings its own).
            world_size: ranks whose batches make one step.

        Raises:
            ValueError: the profile's row count of the table differs from ``num_rows``.
        """
        if self.measured(table):
            rows = self.profile.num_rows[self.profile.tables.index(table)]
            if rows != num_rows:
                raise ValueError(f"table {table!r} has {rows} rows in the profile but {num_rows} in the model")
            counts = self.profile.table_counts(table)
            order = torch.sort(counts, descending=True, stable=True).indices
            scale = world_size / max(self.profile.batches, 1)
            return TableReads(order, counts[order].double() * scale)
        alpha = self.alpha if self.alpha is not None else 0.0  # no skew assumed: uniform
        return TableReads(None, zipf_shares(num_rows, alpha) * reads_per_step)


def check_not_empty(profile: AccessProfile, source: str | None = None, tables: list[str] | None = None) -> None:
    """Raises a ValueError naming ``source`` (and the model's ``tables``, if given) when ``profile``
    counted no batch, names no table or holds no read."""
    reads = sum(int(c.sum()) for c in profile.counts)
    if profile.batches >= 1 and profile.tables and reads:
        return
    model = f"; the model's tables are {sorted(tables)}" if tables else ""
    raise ValueError(
        f"{_where(source)} is empty ({profile.batches} batches, {len(profile.tables)} tables, {reads} reads)"
        f"{model}; profile at least one batch (python -m torchrec_het_bench.profile --steps N, or "
        "torchrec_het.replication.AccessProfiler)"
    )


def _few(items: list, shown: int = 8) -> str:
    """``items`` for a one-line message: the first ``shown`` and how many in all."""
    items = list(items)
    if len(items) <= shown:
        return str(items)
    return f"{items[:shown]} and {len(items) - shown} more"


def _where(source: str | None) -> str:
    return f"access profile {source!r}" if source else "the access profile"


def zipf_shares(num_rows: int, alpha: float) -> torch.Tensor:
    """P(rank k) proportional to (k + 1) ** -alpha, float64 ``[num_rows]``, summing to 1."""
    weights = torch.arange(1, num_rows + 1, dtype=torch.float64).pow(-alpha)
    return weights / weights.sum()


class ProfileTiers:
    """Hot rows of every profiled table (a ``ReplicationConfig.tiers``): the rule the planner prices.

    Rows read about once per rank per replica sync or more (:func:`~torchrec_het.replication.hot_rows.replication_threshold`)
    are replicated on every rank; on several hosts of
    several ranks, the next rows get the per-host tier where the topology makes that cheaper;
    both tiers stay within ``max_hot_fraction`` of a table. Names the tables of a whole model
    (``spans_modules``): each sharded module takes its own.

    Args:
        profile: the measured counts.
        world_size: ranks of the training job (None: torch.distributed's world size when first read).
        replica_sync_every: the replicas' sync interval s: rows read at least ``world_size / s`` times a step are hot.
        max_hot_fraction: at most this share of a table's rows is hot.
        topology: the planner's ``Topology`` (or a :class:`~torchrec_het.replication.memory.TierTopology`):
            hosts and bandwidths. Give the planner's, so that the tiers built are the ones it
            priced. None: ``world_size`` ranks on one host (no per-host tier).
    """

    def __init__(
        self, profile: AccessProfile, world_size: int | None = None, replica_sync_every: int = 1,
        max_hot_fraction: float = 0.5, topology=None,
    ) -> None:  # fmt: skip
        self.profile, self.world_size = profile, world_size
        self.spans_modules = True
        self.replica_sync_every, self.max_hot_fraction = replica_sync_every, max_hot_fraction
        self.topology = tier_topology(topology) if topology is not None else None
        if self.topology is not None:
            if world_size is not None and world_size != self.topology.world_size:
                raise ValueError(f"world_size {world_size} differs from the topology's {self.topology.world_size}")
            self.world_size = self.topology.world_size
        self._tables: dict[str, TableTiers] | None = None

    @property
    def tables(self) -> dict[str, TableTiers]:
        if self.world_size is None:
            import torch.distributed as dist

            self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        if self._tables is None:
            self._tables = self.tables_for(self.world_size)
        return self._tables

    @property
    def fingerprint(self) -> str:
        """The profile's fingerprint (:meth:`AccessProfile.fingerprint`): the plan names it."""
        return self.profile.fingerprint()

    def tables_for(self, world_size: int) -> dict[str, TableTiers]:
        """The tiers of every profiled table when ``world_size`` ranks read (the planner's view)."""
        if world_size == self.world_size and self._tables is not None:
            return self._tables
        scale = world_size / max(self.profile.batches, 1)  # reads per step, as AccessModel.reads
        tables = {}
        for name, rows, counts in zip(self.profile.tables, self.profile.num_rows, self.profile.counts):
            reads = counts.double() * scale
            hot = hottest_rows(reads, replication_threshold(world_size, self.replica_sync_every), self.max_hot_fraction)
            host = torch.zeros(0, dtype=torch.int64)
            if self.topology is not None:
                room = math.floor(self.max_hot_fraction * rows) - hot.numel()
                host = per_host_rows(reads, hot, self.topology, room)
            tables[name] = TableTiers(name, rows, hot, host)
        return tables


def tier_topology(topology) -> TierTopology:
    """A :class:`TierTopology` from a planner ``Topology`` (on a CPU topology with TorchRec's
    default GPU bandwidths, the gloo-over-TCP ones the planner prices with,
    :func:`~torchrec_het.planner.network.cpu_network`), or ``topology`` itself."""
    if isinstance(topology, TierTopology):
        return topology
    return TierTopology.from_torchrec(cpu_network(topology))

"""What the planner assumes about the plugin's types: the reads behind them and their lookups'
compute (:mod:`torchrec_het.planner.compute_costs`). Their settings are each option's plan options
(:mod:`torchrec_het.plan_options`), which the enumerator takes from the sharders
(:func:`attach_options`): the planner prices what the plan carries and the sharded module builds.
Their embeddings and gradients are priced at the wire bytes of the codecs the sharder's
``qcomm_codecs_registry`` gives them (:func:`attach_wire`, :mod:`torchrec_het.planner.qcomms`)."""

import math
from dataclasses import dataclass, field

from torchrec.distributed.planner.types import ShardingOption

from torchrec_het.config import CacheSettings
from torchrec_het.plan_options import PlanOptions, ReplicaOptions, check_options
from torchrec_het.planner.access import AccessModel
from torchrec_het.planner.compute_costs import ComputeCosts, default_compute_costs
from torchrec_het.planner.traffic import (
    FP32,
    TableLoad,
    WirePrecision,
)
from torchrec_het.replication.hot_rows import host_row_count, hot_row_count, replication_threshold
from torchrec_het.replication.memory import TierTopology, replica_copies
from torchrec_het.types import HET_ROW_REPLICATED, HET_SHARDING_TYPES

PLUGIN_TYPES = HET_SHARDING_TYPES  # the one tuple of torchrec_het.types, under the planner's name

OPTIONS_ATTR = "het_options"  # where an enumerated ShardingOption keeps its plan options
WIRE_ATTR = "het_wire"  # ... and the wire bytes per element of its embeddings (its sharder's codecs)


def attach_options(option: ShardingOption, options: PlanOptions) -> None:
    """Gives a plugin-typed ``option`` its plan options (kept through the planner's deep copies)."""
    check_options(option.sharding_type, options, option.name)
    setattr(option, OPTIONS_ATTR, options)


def attach_wire(option: ShardingOption, wire: WirePrecision) -> None:
    """Gives a plugin-typed ``option`` the wire bytes per element its sharder's codecs send its embeddings at."""
    setattr(option, WIRE_ATTR, wire)


def priced_wire(option: ShardingOption) -> WirePrecision:
    """The wire bytes per element ``option`` is priced with: those attached, else fp32."""
    return getattr(option, WIRE_ATTR, FP32)


def priced_options(option: ShardingOption) -> PlanOptions:
    """The plan options ``option`` is priced with: those attached, else the type's defaults."""
    options = getattr(option, OPTIONS_ATTR, None)
    if options is not None:
        return options
    return ReplicaOptions() if option.sharding_type == HET_ROW_REPLICATED else CacheSettings()


@dataclass(frozen=True)
class PluginPricing:
    """Where reads per row come from, and the lookups' compute; the settings the types run with are
    each option's plan options (:func:`priced_options`).

    Attributes:
        access: a profile (it names ``het_row_replicated``'s hot rows, unless they are counted
            online) and the skew assumed where nothing was measured.
        max_hot_fraction: at most this share of a table's rows is replicated, where the options
            name no tier sizes (the planner estimates them).
        online_profile_steps: > 0 when the sharders choose hot rows from reads counted during
            training (``ReplicationConfig.online_profile_steps``). Online counts come after
            planning, so they are no evidence: they only let row replication be built for a
            table that no profile names but the evidence rule admits (a stated skew) or whose
            constraints name ``het_row_replicated``; it is priced from the stated skew, or as
            uniform reads without one.
        compute: the lookups' extra compute per id beyond a stock TBE lookup (default:
            ``$TORCHREC_HET_COMPUTE_COSTS`` when set, else the table shipped with the package,
            ``compute_costs.json``, measured on CPU; on other devices no extra is priced). ``ComputeCosts.bytes_only()`` prices bytes alone.
        per_host_tier: on a topology of several hosts with several ranks each, price the
            per-host tier of profiled ``het_row_replicated`` tables whose options name no tier sizes
            (the rows :class:`~torchrec_het.planner.ProfileTiers` given the same topology puts there).
            False when the sharders' tiers know no topology (hot rows counted online are always
            replicated on every rank).
    """

    access: AccessModel = field(default_factory=AccessModel)
    max_hot_fraction: float = 0.5
    online_profile_steps: int = 0
    compute: ComputeCosts = field(default_factory=default_compute_costs)
    per_host_tier: bool = True

    def offers(self, sharding_type: str, table: str) -> bool:
        """Whether the sharders can build ``sharding_type`` for ``table``: row replication needs
        its hot rows named (a profile of the table, or online counting); the cache needs nothing.

        This is not the evidence rule: the enumerator offers a plugin type only for a table
        whose reads are known or whose constraints name the type, and only if this holds.
        """
        if sharding_type == HET_ROW_REPLICATED:
            return self.access.measured(table) or self.online_profile_steps > 0
        return sharding_type in PLUGIN_TYPES

    def needs(self, sharding_type: str) -> str:
        """What :meth:`offers` needs for ``sharding_type`` (for error messages)."""
        if sharding_type == HET_ROW_REPLICATED:
            return (
                "measured reads of the table (a profile naming it) or online counting (online_profile_steps) "
                "to choose its hot rows"
            )
        return "nothing"

    def load(self, option: ShardingOption, world_size: int, topology: TierTopology | None = None) -> TableLoad:
        """The table's traffic inputs; ``topology``: hosts and bandwidths (None: one host)."""
        rows, dim = option.tensor.shape
        bags = option.batch_size * world_size * len(option.input_lengths)
        reads_per_step = option.batch_size * world_size * float(sum(option.input_lengths))
        reads = self.access.reads(option.name, rows, reads_per_step, world_size)
        return TableLoad(reads.reads, float(bags), int(dim), world_size, topology)

    def hot_rows(self, load: TableLoad, options: ReplicaOptions) -> int:
        """Rows replicated on every rank: the options' tier size, else those whose replica sync moves
        fewer bytes than their reads would sharded (the planner's estimate, :func:`replication_threshold`)."""
        if options.replicated_rows is not None:
            return options.replicated_rows
        threshold = replication_threshold(load.world_size, options.replica_sync_every)
        return hot_row_count(load.reads, threshold, self.max_hot_fraction)

    def host_rows(self, load: TableLoad, options: ReplicaOptions, table: str | None = None) -> int:
        """Rows of the per-host tier: the options' tier size, else (several hosts, ``load.topology``)
        the next hottest that are cheaper held once per host than sharded, within ``max_hot_fraction``
        with the replicated ones (:class:`~torchrec_het.planner.ProfileTiers`' rule). None unless
        ``per_host_tier``, or for a ``table`` the profile does not name (its hot rows are counted online)."""
        if options.per_host_rows is not None:
            return options.per_host_rows if load.hosts > 1 else 0
        if load.hosts == 1 or not self.per_host_tier or (table is not None and not self.access.measured(table)):
            return 0
        hot = self.hot_rows(load, options)
        return host_row_count(
            load.reads, hot, load.topology, math.floor(self.max_hot_fraction * load.reads.numel()) - hot
        )

    def extra_rows(self, option: ShardingOption, load: TableLoad) -> int:
        """Rows each rank holds beyond its row-wise shard (replicas, or cache slots); a per-host
        row is held by ``hosts - 1`` ranks besides its owner, counted as that share of a row per rank.
        Replicas synced every s > 1 steps are held twice (the agreed rows, and the rank's copy with its
        own steps since the last sync)."""
        options = priced_options(option)
        if option.sharding_type == HET_ROW_REPLICATED:
            per_host = self.host_rows(load, options, option.name) * (load.hosts - 1) / load.world_size
            return replica_copies(options.replica_sync_every) * self.hot_rows(load, options) + math.ceil(per_host)
        return 0 if options.exact else options.capacity_rows(option.tensor.shape[0])  # an exact cache holds none

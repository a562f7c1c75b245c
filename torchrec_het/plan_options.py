"""The settings of a plugin-sharded table, as they travel in the sharding plan.

One frozen options object per table planned with a plugin type: :class:`~torchrec_het.config.CacheSettings`
for ``het_cached_row_wise`` (bounds, capacity, policy, protocol), :class:`ReplicaOptions` for
``het_row_replicated`` (sync interval, skip-all-hot, tier sizes and the profile the hot
rows come from). The planner builds it from the sharder's settings, prices from it and emits it in a
:class:`HetParameterSharding` (TorchRec's ``ParameterSharding`` plus ``options``, as TorchRec's own
``cache_params`` ride there); the sharded module builds each table from it. A hand-written plan
carries it through the generators of :mod:`torchrec_het.sharding`.
"""

import dataclasses
import os
from dataclasses import dataclass

from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding, ShardingPlan

from torchrec_het.config import CacheSettings
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED


@dataclass(frozen=True)
class ReplicaOptions:
    """How one ``het_row_replicated`` table keeps its hot rows.

    Attributes:
        replica_sync_every: replicated rows' gradients are combined every this many steps.
        skip_all_hot: skip the cold exchanges on steps where every rank reads only rows it holds.
        local_world_size: ranks per host (None: ``$LOCAL_WORLD_SIZE``, else one host).
        replicated_rows: rows replicated on every rank; None: not known when planning (counted online
            with ``online_profile_steps``; else the planner estimates them from its reads and the
            sharder must name the table's hot rows when it shards).
        per_host_rows: rows held once per host (None: as ``replicated_rows``).
        profile: fingerprint of the access profile the hot rows come from (None: ids given directly,
            or counted online). Each rank takes the ids from its own copy of that profile.
        online_profile_steps: > 0: the hot rows are chosen from the reads of the first this many steps.
        online_max_hot_fraction: cap of the online choice.
        lookahead: bags: while a step runs, owners send the next batch's partial sums of rows that
            step's update leaves alone, and at the next lookup only the others
            (:mod:`~torchrec_het.sharding.row_replicated.lookahead`); exact.
        cold_rows: bags: the table's cold ids fetch their rows, each distinct row once a step, and
            the reader pools them (the cached tier's exact form) instead of their owners sending
            partial sums; cheaper where a step reads few distinct rows many times.
    """

    replica_sync_every: int = 1
    skip_all_hot: bool = True
    local_world_size: int | None = None
    replicated_rows: int | None = None
    per_host_rows: int | None = None
    profile: str | None = None
    online_profile_steps: int = 0
    online_max_hot_fraction: float = 0.5
    lookahead: bool = False
    cold_rows: bool = False

    def __post_init__(self) -> None:
        if self.lookahead and self.online_profile_steps > 0 and self.replicated_rows is None:
            raise ValueError(
                "lookahead needs the hot rows known when planning (a profile or given tiers), not counted online "
                f"(online_profile_steps={self.online_profile_steps})"
            )
        if self.replica_sync_every < 1:
            raise ValueError(f"replica_sync_every must be >= 1, got {self.replica_sync_every}")
        for name in ("replicated_rows", "per_host_rows"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None (counted online), got {value}")
        if (self.replicated_rows is None) != (self.per_host_rows is None):
            raise ValueError("replicated_rows and per_host_rows are both known or both None")
        if self.online_profile_steps < 0:
            raise ValueError(f"online_profile_steps must be >= 0, got {self.online_profile_steps}")
        if not 0.0 <= self.online_max_hot_fraction <= 1.0:
            raise ValueError(f"online_max_hot_fraction must lie in [0, 1], got {self.online_max_hot_fraction}")
        if self.local_world_size is not None and self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")

    @property
    def counted_online(self) -> bool:
        """The hot rows are chosen from the reads of the first ``online_profile_steps`` steps."""
        return self.replicated_rows is None and self.online_profile_steps > 0

    def module_settings(self) -> tuple:
        """What every table of one sharding must share (they run one replica holder)."""
        return (self.replica_sync_every, self.skip_all_hot, self.local_world_size, self.counted_online, self.online_profile_steps, self.online_max_hot_fraction, self.lookahead)  # fmt: skip

    def ranks_per_host(self, world_size: int) -> int:
        """Ranks per host on ``world_size`` ranks (``local_world_size``, else ``$LOCAL_WORLD_SIZE``, else one host)."""
        local = self.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        if world_size % local:
            raise ValueError(f"world size {world_size} is not a multiple of {local} ranks per host")
        return local


def shared_options(options_by_table: dict[str, ReplicaOptions]) -> ReplicaOptions:
    """What the ``het_row_replicated`` tables of one sharding share (they run one replica holder): one
    table's options, whose :meth:`ReplicaOptions.module_settings` are every table's (read only those).

    Raises:
        ValueError: naming the tables, when their module-wide settings differ.
    """
    if len({o.module_settings() for o in options_by_table.values()}) > 1:
        raise ValueError(
            f"het_row_replicated tables {sorted(options_by_table)} of one module must share replica_sync_every, "
            "skip_all_hot, local_world_size and online counting; their options differ"
        )
    return next(iter(options_by_table.values()))


PlanOptions = CacheSettings | ReplicaOptions
OPTIONS_CLASS = {HET_CACHED_ROW_WISE: CacheSettings, HET_ROW_REPLICATED: ReplicaOptions}


@dataclass
class HetParameterSharding(ParameterSharding):
    """TorchRec's ``ParameterSharding`` with the table's plugin settings (``options``)."""

    options: PlanOptions | None = None


def with_options(sharding: ParameterSharding, options: PlanOptions) -> HetParameterSharding:
    """``sharding`` (a copy) carrying ``options``; TypeError naming the type if they do not fit it."""
    check_options(sharding.sharding_type, options)
    fields = {f.name: getattr(sharding, f.name) for f in dataclasses.fields(ParameterSharding)}
    return HetParameterSharding(**fields, options=options)


def options_of(sharding: ParameterSharding) -> PlanOptions | None:
    """The plugin settings a plan entry carries (None: a plain ``ParameterSharding``)."""
    return getattr(sharding, "options", None)


def check_options(sharding_type: str, options: object, table: str | None = None) -> None:
    """TypeError when ``options`` are not the settings of ``sharding_type``."""
    expected = OPTIONS_CLASS.get(sharding_type)
    if expected is None or not isinstance(options, expected):
        where = f"table {table!r}: " if table else ""
        wanted = expected.__name__ if expected else "no plugin options"
        raise TypeError(f"{where}{sharding_type} takes {wanted}, got {type(options).__name__}")


def describe(options: PlanOptions | None) -> str:
    """A short line of ``options`` for plan printouts."""
    if options is None:
        return "-"
    if isinstance(options, CacheSettings):
        return (f"s_read={options.s_read} s_write={options.s_write} capacity={options.capacity} "
                f"{options.policy} {options.protocol}")  # fmt: skip
    if options.replicated_rows is not None:
        tiers = f"hot={options.replicated_rows} host={options.per_host_rows}"
    else:
        tiers = "hot=online" if options.counted_online else "hot=unnamed"
    profile = f" profile={options.profile}" if options.profile else ""
    skip = " skip_all_hot" if options.skip_all_hot else ""
    cold = " cold=rows" if options.cold_rows else ""
    return f"sync_every={options.replica_sync_every}{skip} {tiers}{profile}{cold}"


class HetEmbeddingModuleShardingPlan(EmbeddingModuleShardingPlan):
    """TorchRec's module plan, printed with each plugin table's options (``print(plan)``)."""

    def __str__(self) -> str:
        rows = [
            (name, p.sharding_type, describe(options_of(p))) for name, p in self.items() if options_of(p) is not None
        ]
        if not rows:
            return super().__str__()
        width = max(len(name) for name, _, _ in rows)
        lines = [f"{name:<{width}}  {sharding_type}  {text}" for name, sharding_type, text in rows]
        return super().__str__() + "\n\ntorchrec_het options\n" + "\n".join(lines)


def with_plan_options(plan: ShardingPlan, options: dict[tuple[str, str, str], PlanOptions]) -> ShardingPlan:
    """``plan`` (changed in place) with ``options[(module path, table, sharding type)]`` in the
    entries they name, as :class:`HetParameterSharding`, and those modules' plans printing them."""
    for path, module_plan in list(plan.plan.items()):
        if not isinstance(module_plan, EmbeddingModuleShardingPlan):
            continue
        named = {name: options.get((path, name, p.sharding_type)) for name, p in module_plan.items()}
        if not any(o is not None for o in named.values()):
            continue
        plan.plan[path] = HetEmbeddingModuleShardingPlan(
            {name: p if named[name] is None else with_options(p, named[name]) for name, p in module_plan.items()}
        )
    return plan

"""What both plugin sharders add to TorchRec's: the module type they shard, chosen at construction,
the plugin's sharding types on TorchRec's fused row-wise kernel, and the per-table options of the
plan (:mod:`torchrec_het.plan_options`): the planner asks the sharder for them
(:meth:`PluginSharder.table_options`), and ``shard()`` fills them into a hand-written plan that
carries none, so the sharded module reads every table's settings from its plan entry."""

from typing import Any

import torch
from torch import nn
from torchrec.distributed.types import ParameterSharding, ShardingType

from torchrec_het.config import HetCacheConfig
from torchrec_het.plan_options import PlanOptions, check_options, options_of, with_options
from torchrec_het.replication.config import ReplicationConfig, table_tiers
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED


def plan_hot_rows(
    source: object | None, plan: dict[str, ParameterSharding], rows_of: dict[str, int]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The hot row ids, name -> (replicated, per_host), of each ``het_row_replicated`` table of ``plan``
    that is not counted online, from ``source`` (this rank's hot-row source, e.g. ``ProfileTiers`` of
    the profile the plan names).

    Raises:
        ValueError: naming the table, when the source gives no hot rows for a table the plan does not
            count online, or other tier sizes or another profile than the plan's options.
    """
    tables, missing = {}, []
    for name, sharding in plan.items():
        options = options_of(sharding)
        if sharding.sharding_type != HET_ROW_REPLICATED or options.counted_online:
            continue
        if source is None or name not in source.tables:
            missing.append(name)
            continue
        replicated, per_host = table_tiers(source, name, rows_of[name])
        sizes = (int(replicated.numel()), int(per_host.numel()))
        if options.replicated_rows is not None and sizes != (options.replicated_rows, options.per_host_rows):
            raise ValueError(
                f"table {name!r}: the plan prices {options.replicated_rows} replicated and {options.per_host_rows} "
                f"per-host rows, the sharder's hot rows give {sizes[0]} and {sizes[1]} (another profile, world size or topology?)"
            )
        fingerprint = getattr(source, "fingerprint", None)
        if options.profile is not None and fingerprint is not None and fingerprint != options.profile:
            raise ValueError(
                f"table {name!r}: the plan names profile {options.profile}, the sharder's hot rows come from {fingerprint}"
            )
        tables[name] = (replicated, per_host)
    if missing:
        raise ValueError(
            f"table(s) {sorted(missing)} are planned het_row_replicated, but the sharder has no hot rows for them "
            "(ReplicationConfig.tiers does not name them and online_profile_steps is 0): they would train "
            "with zero replicas. Build the sharders from the profile the planner priced, "
            "get_het_sharders(profile=profile) or ReplicationConfig(tiers=ProfileTiers(profile)), "
            "or set ReplicationConfig(online_profile_steps=N)"
        )
    return tables


class PluginSharder:
    """Mixin placed before a TorchRec sharder in the bases.

    Subclasses set ``plugin_types`` (the plugin's sharding types they offer) and
    ``module_base`` (the TorchRec module class every ``module_type`` must derive from), and
    implement :meth:`settings_for`.
    """

    plugin_types: tuple[str, ...] = ()
    module_base: type = object

    def _set_module_type(self, module_type: Any) -> None:
        if not (isinstance(module_type, type) and issubclass(module_type, self.module_base)):
            name = self.module_base.__name__
            raise ValueError(f"module_type must be {name} or a subclass, got {module_type!r}")
        self._module_type = module_type

    @property
    def module_type(self) -> type:
        return self._module_type

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        if sharding_type in self.plugin_types:  # row-wise shards on the fused kernel
            return super().compute_kernels(ShardingType.ROW_WISE.value, compute_device_type)[:1]
        return super().compute_kernels(sharding_type, compute_device_type)

    def settings_for(self, module: nn.Module) -> tuple[HetCacheConfig, ReplicationConfig]:
        """The cache and replication settings of ``module``'s tables (the module's own, else the sharder's)."""
        raise NotImplementedError

    def table_options(self, module: nn.Module, table: str, sharding_type: str, world_size: int) -> PlanOptions:
        """The options of ``table`` of ``module`` planned ``sharding_type`` on ``world_size`` ranks:
        what the planner prices and puts in the plan."""
        cache, replication = self.settings_for(module)
        if sharding_type == HET_CACHED_ROW_WISE:
            return cache.for_table(table)
        if sharding_type == HET_ROW_REPLICATED:
            return replication.table_options(table, world_size)
        raise ValueError(f"table {table!r}: {sharding_type!r} is not a plugin sharding type")

    def planner_chooses_cold_rows(self, module: nn.Module) -> bool:
        """Whether the planner chooses, per ``het_row_replicated`` table of ``module``, partial sums or
        fetched rows for its cold ids (``ReplicationConfig.cold_rows`` None)."""
        return self.settings_for(module)[1].cold_rows is None

    def with_table_options(
        self, module: nn.Module, params: dict[str, ParameterSharding], world_size: int
    ) -> dict[str, ParameterSharding]:
        """``params`` with options on every plugin entry: those the plan carries (checked), else the
        sharder's (a hand-written plan)."""
        out = {}
        for name, sharding in params.items():
            if sharding.sharding_type in self.plugin_types:
                options = options_of(sharding)
                if options is None:
                    sharding = with_options(
                        sharding, self.table_options(module, name, sharding.sharding_type, world_size)
                    )
                else:
                    check_options(sharding.sharding_type, options, name)
            out[name] = sharding
        return out

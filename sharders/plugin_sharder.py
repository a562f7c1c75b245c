"""What both plugin sharders add to TorchRec's: the module type they shard, chosen at construction,
the plugin's sharding types on TorchRec's fused row-wise kernel, the check that a table
planned ``het_row_replicated`` has hot rows to replicate, and the fused-params keys that carry
the plugin's settings to its shardings."""

import dataclasses
from typing import Any

from torchrec.distributed.types import ParameterSharding, ShardingType

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.types import HET_ROW_REPLICATED


# The replication and HET cache settings travel to the shardings in the fused params under
# these keys, which are removed before TorchRec groups tables or FBGEMM sees the dict.
REPLICATION_KEY = "het_replication"
HET_CACHE_KEY = "het_cache"


def without_settings(sharding_infos, key: str = REPLICATION_KEY) -> tuple[list, Any]:
    """The sharding infos minus the plugin's fused-params ``key``, and the settings it carried."""
    config, cleaned = None, []
    for info in sharding_infos:
        params = dict(info.fused_params or {})
        config = params.pop(key, config)
        cleaned.append(dataclasses.replace(info, fused_params=params))
    return cleaned, config


def takes_pipelined_path(config: ReplicationConfig, sharding_infos) -> bool:
    """Whether these tables take the pipelined path: it has no per-host tier yet."""
    if config.tiers is None:
        return True
    for info in sharding_infos:
        table = info.embedding_config
        if config.table_tiers(table.name, table.num_embeddings)[1].numel():
            return False
    return True


def require_hot_rows(replication: ReplicationConfig, plan: dict[str, ParameterSharding]) -> None:
    """Raises a ValueError naming the tables planned ``het_row_replicated`` that ``replication``
    gives no hot rows: its tiers do not name them and online counting is off, so they would
    train as row_wise with zero replicas (the planner priced replicas)."""
    if replication.online_profile_steps > 0:
        return
    named = set(replication.tiers.tables) if replication.tiers is not None else set()
    missing = sorted(name for name, p in plan.items() if p.sharding_type == HET_ROW_REPLICATED and name not in named)
    if missing:
        raise ValueError(
            f"table(s) {missing} are planned het_row_replicated, but the sharder has no hot rows for them "
            "(ReplicationConfig.tiers does not name them and online_profile_steps is 0): they would train "
            "with zero replicas. Build the sharders from the profile the planner priced, "
            "get_het_sharders(profile=profile) or ReplicationConfig(tiers=ProfileTiers(profile)), "
            "or set ReplicationConfig(online_profile_steps=N)"
        )


class PluginSharder:
    """Mixin placed before a TorchRec sharder in the bases.

    Subclasses set ``plugin_types`` (the plugin's sharding types they offer) and
    ``module_base`` (the TorchRec module class every ``module_type`` must derive from).
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

"""What the planner assumes about the plugin's types: their settings and the reads behind them."""

from dataclasses import dataclass, field

from torchrec.distributed.planner.types import ShardingOption

from torchrec_het.config import HetCacheConfig
from torchrec_het.planner.access import AccessModel
from torchrec_het.replication.tiers import hot_row_count
from torchrec_het.planner.traffic import Bytes, TableLoad, cached_bytes, row_replicated_bytes, sequence_replicated_bytes
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED

PLUGIN_TYPES = (HET_CACHED_ROW_WISE, HET_ROW_REPLICATED)


@dataclass(frozen=True)
class PluginPricing:
    """Settings the plugin's types will run with, and where reads per row come from.

    Attributes:
        access: a profile (it names ``het_row_replicated``'s hot rows, unless they are counted
            online) and the skew assumed where nothing was measured.
        cache: settings of ``het_cached_row_wise`` tables.
        replica_sync_every: replica sync interval of ``het_row_replicated`` tables.
        max_hot_fraction: at most this share of a table's rows is replicated.
        online_profile_steps: > 0 when the sharders choose hot rows from reads counted during
            training (``ReplicationConfig.online_profile_steps``): row replication is then offered
            for tables without a profile too, priced from the stated skew.
    """

    access: AccessModel = field(default_factory=AccessModel)
    cache: HetCacheConfig = field(default_factory=HetCacheConfig)
    replica_sync_every: int = 1
    max_hot_fraction: float = 0.5
    online_profile_steps: int = 0

    def offers(self, sharding_type: str, table: str) -> bool:
        """Whether the planner may consider ``sharding_type`` for ``table``: row replication
        needs measured reads or an online profile (they name its hot rows); the cache adapts online."""
        if sharding_type == HET_ROW_REPLICATED:
            return self.access.measured(table) or self.online_profile_steps > 0
        return sharding_type in PLUGIN_TYPES

    def load(self, option: ShardingOption, world_size: int) -> TableLoad:
        rows, dim = option.tensor.shape
        bags = option.batch_size * world_size * len(option.input_lengths)
        reads_per_step = option.batch_size * world_size * float(sum(option.input_lengths))
        reads = self.access.reads(option.name, rows, reads_per_step, world_size)
        return TableLoad(reads.reads, float(bags), int(dim), world_size)

    def hot_rows(self, load: TableLoad) -> int:
        return hot_row_count(load.reads, 1.0 / self.replica_sync_every, self.max_hot_fraction)

    def extra_rows(self, option: ShardingOption, load: TableLoad) -> int:
        """Rows each rank holds beyond its row-wise shard (replicas, or cache slots)."""
        if option.sharding_type == HET_ROW_REPLICATED:
            return self.hot_rows(load)
        return self.cache.for_table(option.name).capacity_rows(option.tensor.shape[0])

    def bytes(self, option: ShardingOption, load: TableLoad) -> Bytes:
        if option.sharding_type == HET_ROW_REPLICATED:
            traffic = row_replicated_bytes if option.is_pooled else sequence_replicated_bytes
            return traffic(load, self.hot_rows(load), self.replica_sync_every)
        settings = self.cache.for_table(option.name)
        capacity = settings.capacity_rows(option.tensor.shape[0])
        return cached_bytes(load, capacity, settings.s_read, settings.s_write, settings.protocol)

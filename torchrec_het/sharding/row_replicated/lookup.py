"""The lookups of ``het_row_replicated`` (local compute), bags and sequences.

The owner's fused kernels read what the input dist brought it (their fused backward steps
those rows, as stock row-wise does); the reader reads its hot rows from its replica blocks at
the same moment (:meth:`~torchrec_het.sharding.row_replicated.holder.ReplicaHolder.read_hot`).
"""

import torch
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharding.common.context import HetShardingContext
from torchrec_het.sharding.row_replicated.batch import ReplicatedBagBatch, ReplicatedSequenceBatch
from torchrec_het.sharding.row_replicated.holder import ReplicaHolder


class ReplicatedBagLookup(ReplicaHolder, GroupedPooledEmbeddingsLookup):
    """The owner pools received ids with its fused kernels; the reader pools hot ids from replicas.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: the sharding's features.
        pg: the sharding's process group.
        config: replication settings (tiers, sync interval, wire dtype).
        shards_by_table: each table's shard metadata.
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names, pg, config: ReplicationConfig, shards_by_table, device=None, env=None):
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env)
        self.init_holder(pg, feature_names, config, shards_by_table, device)

    def forward(self, sparse_features: KeyedJaggedTensor, sharding_ctx: HetShardingContext[ReplicatedBagBatch]) -> torch.Tensor:
        step = sharding_ctx.batch
        self.begin_read(step.hot_version)
        step.hot_read = self.read_hot([slots for slots, _, _ in step.hot])
        positions = self.layout.num_positions
        pooled = super().forward(sparse_features)  # [compact bags, width]: the kernels' fused forward and backward
        rows, position, stride = step.partial_at
        if self.layout.uniform_dim is not None:  # the output dist pools hot rows as it finishes the bags
            partials = pooled.view(stride * positions, self.layout.uniform_dim).index_select(0, rows * positions + position)
            partials = partials.reshape(-1)
        else:
            partials = pooled.reshape(-1).index_select(0, self.layout.elements(rows, position, self.layout.width))
        self.stats["skipped_steps"] += int(step.local_only)
        return partials


class ReplicatedSequenceLookup(ReplicaHolder, GroupedEmbeddingsLookup):
    """The owner's fused kernels read the asked rows (local compute); their backward steps them.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: the sharding's features.
        pg: the sharding's process group.
        config: replication settings.
        shards_by_table: each table's shard metadata.
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names, pg, config: ReplicationConfig, shards_by_table, device=None, env=None):
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, env=env)
        self.init_holder(pg, feature_names, config, shards_by_table, device)
        if self.layout.uniform_dim is None:
            raise ValueError("het_row_replicated sequences need one embedding dimension for all their tables")
        self.stats["rows_fetched"] = 0  # distinct rows this rank read from other ranks

    def forward(self, sparse_features: KeyedJaggedTensor, sharding_ctx: HetShardingContext[ReplicatedSequenceBatch]) -> torch.Tensor:
        step = sharding_ctx.batch
        self.begin_read(step.hot_version)
        step.hot_read = self.read_hot([slots for slots, _ in step.hot])
        # the kernels' own forward and fused backward, the rows put back in arrival order
        by_position = super().forward(sparse_features).view(-1, self.layout.uniform_dim)
        step.rows = torch.empty_like(by_position).index_copy(0, step.kernel_order, by_position)
        self.stats["skipped_steps"] += int(step.local_only)
        self.stats["rows_fetched"] += sum(c for r, c in enumerate(step.send_splits) if r != self._rank)
        return step.rows.reshape(-1)

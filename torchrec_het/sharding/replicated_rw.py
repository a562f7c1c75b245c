"""``het_row_replicated``: row-wise owners, hot rows replicated (FlexShard), partial sums on the wire (DES).

In TorchRec's grammar: the input dist is a no-op (each rank keeps its own batch), the
lookup (:class:`RowReplicatedEmbeddingLookup`) pools hot rows locally and asks owners
for partial sums of the cold ones, and the output dist is a no-op (bags are finished
where the batch lives). Shards, grouping, state dict and fused optimizer are row-wise's
own, so a checkpoint holds every table once and loads into any world size.
"""

from typing import Any

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingDist, DpSparseFeaturesDist
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding_plan import row_wise
from torchrec.distributed.types import ParameterSharding, ShardingEnv

from torchrec_het.sharding.replicated_lookup import RowReplicatedEmbeddingLookup
from torchrec_het.types import HET_ROW_REPLICATED


class RowReplicatedPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """Row-wise shards plus hot-row replicas, read through partial sums."""

    def __init__(self, sharding_infos: list[EmbeddingShardingInfo], env: ShardingEnv, device=None, **kwargs: Any):
        super().__init__(sharding_infos, env, device, **kwargs)
        self.shards_by_table = {
            info.embedding_config.name: list(info.param_sharding.sharding_spec.shards) for info in sharding_infos
        }

    def create_input_dist(self, device: torch.device | None = None) -> DpSparseFeaturesDist:
        return DpSparseFeaturesDist()

    def create_lookup(self, device=None, fused_params=None, feature_processor=None) -> RowReplicatedEmbeddingLookup:
        if feature_processor is not None:
            raise NotImplementedError("het_row_replicated does not support feature processors")
        return RowReplicatedEmbeddingLookup(
            self._grouped_embedding_configs,
            self.feature_names(),
            pg=self._pg,
            device=device if device is not None else self._device,
            env=self._env,
        )

    def create_output_dist(self, device: torch.device | None = None) -> DpPooledEmbeddingDist:
        return DpPooledEmbeddingDist()


def het_row_replicated():
    """A ``per_param_sharding`` generator for TorchRec's ``construct_module_sharding_plan``.

    Shards a table row-wise over all ranks (TorchRec's own sizes and offsets, fused
    kernel) and marks it ``het_row_replicated``; its hot rows come from the module's
    :class:`~torchrec_het.replication.ReplicationConfig`.
    """
    rows = row_wise(compute_kernel="fused")

    def generate(*args: Any, **kwargs: Any) -> ParameterSharding:
        sharding = rows(*args, **kwargs)
        sharding.sharding_type = HET_ROW_REPLICATED
        return sharding

    return generate

"""What the plugin's pooled row-wise types share: stock row-wise shards, each rank keeps its batch.

The input dist and output dist are no-ops (ids are not sent ahead, bags are finished
where the batch lives); the type's own lookup does every exchange. Shards, grouping,
state dict and fused optimizer are row-wise's own.
"""

from typing import Any

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingDist, DpSparseFeaturesDist
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv

from torchrec_het._compat import sharding_lookup_arguments


class LocalBatchRwPooledSharding(RwPooledEmbeddingSharding):
    """Row-wise shards read by ``lookup_class`` (set by subclasses, with ``sharding_type``)."""

    lookup_class: type
    sharding_type: str

    def __init__(self, sharding_infos: list[EmbeddingShardingInfo], env: ShardingEnv, device=None, **kwargs: Any):
        super().__init__(sharding_infos, env, device, **kwargs)
        self.shards_by_table = {
            info.embedding_config.name: list(info.param_sharding.sharding_spec.shards) for info in sharding_infos
        }

    def create_input_dist(self, device: torch.device | None = None) -> DpSparseFeaturesDist:
        return DpSparseFeaturesDist()

    def create_lookup(self, device=None, fused_params=None, feature_processor=None):
        if feature_processor is not None:
            raise NotImplementedError(f"{self.sharding_type} does not support feature processors")
        arguments = sharding_lookup_arguments(self)
        if device is not None:
            arguments["device"] = device
        return self.lookup_class(feature_names=self.feature_names(), **arguments)

    def create_output_dist(self, device: torch.device | None = None) -> DpPooledEmbeddingDist:
        return DpPooledEmbeddingDist()

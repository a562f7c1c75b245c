"""``het_cached_row_wise``: row-wise owners, a stale-tolerant cache of remote rows on every rank.

In TorchRec's grammar: the input dist is a no-op (each rank keeps its own batch),
the lookup (:class:`HetCachedEmbeddingLookup`) reads owned rows locally and remote
rows through the cache, and the output dist is a no-op (bags are pooled where the
batch lives). Shards, grouping, state dict and fused optimizer are row-wise's own.
"""

from typing import Any

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingDist, DpSparseFeaturesDist
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.sharding_plan import row_wise
from torchrec.distributed.types import ParameterSharding, ShardingEnv

from torchrec_het.sharding.het_lookup import HetCachedEmbeddingLookup
from torchrec_het.types import HET_CACHED_ROW_WISE


class HetCachedRwPooledEmbeddingSharding(RwPooledEmbeddingSharding):
    """Row-wise shards, read and written through the HET cache."""

    def __init__(self, sharding_infos: list[EmbeddingShardingInfo], env: ShardingEnv, device=None, **kwargs: Any):
        super().__init__(sharding_infos, env, device, **kwargs)
        self.shards_by_table = {
            info.embedding_config.name: list(info.param_sharding.sharding_spec.shards) for info in sharding_infos
        }

    def create_input_dist(self, device: torch.device | None = None) -> DpSparseFeaturesDist:
        return DpSparseFeaturesDist()

    def create_lookup(self, device=None, fused_params=None, feature_processor=None) -> HetCachedEmbeddingLookup:
        if feature_processor is not None:
            raise NotImplementedError("het_cached_row_wise does not support feature processors")
        return HetCachedEmbeddingLookup(
            self._grouped_embedding_configs,
            self.feature_names(),
            pg=self._pg,
            device=device if device is not None else self._device,
            env=self._env,
        )

    def create_output_dist(self, device: torch.device | None = None) -> DpPooledEmbeddingDist:
        return DpPooledEmbeddingDist()


def het_cached_row_wise():
    """A ``per_param_sharding`` generator for TorchRec's ``construct_module_sharding_plan``.

    Shards a table row-wise over all ranks (TorchRec's own row-wise sizes and offsets)
    and marks it ``het_cached_row_wise``. The sharder must offer row_wise and the
    het type (:class:`torchrec_het.sharders.HetEmbeddingBagCollectionSharder` does).
    """
    rows = row_wise()

    def generate(*args: Any, **kwargs: Any) -> ParameterSharding:
        sharding = rows(*args, **kwargs)
        sharding.sharding_type = HET_CACHED_ROW_WISE
        return sharding

    return generate

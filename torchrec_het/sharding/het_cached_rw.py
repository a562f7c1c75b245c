"""``het_cached_row_wise``: row-wise owners, a stale-tolerant cache of remote rows on every rank.

In TorchRec's grammar: the input dist is a no-op (each rank keeps its own batch),
the lookup (:class:`HetCachedEmbeddingLookup`) reads owned rows locally and remote
rows through the cache, and the output dist is a no-op (bags are pooled where the
batch lives). Shards, grouping, state dict and fused optimizer are row-wise's own.
"""

from torchrec_het.sharding.het_lookup import HetCachedEmbeddingLookup
from torchrec_het.sharding.local_rw import LocalBatchRwPooledSharding, row_wise_as
from torchrec_het.types import HET_CACHED_ROW_WISE


class HetCachedRwPooledEmbeddingSharding(LocalBatchRwPooledSharding):
    """Row-wise shards, read and written through the HET cache."""

    lookup_class = HetCachedEmbeddingLookup
    sharding_type = HET_CACHED_ROW_WISE


def het_cached_row_wise():
    """A ``per_param_sharding`` generator for TorchRec's ``construct_module_sharding_plan``.

    Shards a table row-wise over all ranks (TorchRec's own row-wise sizes and offsets)
    and marks it ``het_cached_row_wise``. The sharder must offer row_wise and the
    het type (:class:`torchrec_het.sharders.HetEmbeddingBagCollectionSharder` does).
    """
    return row_wise_as(HET_CACHED_ROW_WISE)

"""The plugin's sharding types, one module each, in TorchRec's grammar (input dist, lookup, output dist)."""

from torchrec_het.sharding.het_cached_rw import HetCachedRwPooledEmbeddingSharding, het_cached_row_wise
from torchrec_het.sharding.het_lookup import HetCachedEmbeddingLookup

__all__ = ["HetCachedEmbeddingLookup", "HetCachedRwPooledEmbeddingSharding", "het_cached_row_wise"]

"""The plugin's sharding types, one module each, in TorchRec's grammar (input dist, lookup, output dist)."""

from torchrec_het.sharding.het_cached_rw import HetCachedRwPooledEmbeddingSharding, het_cached_row_wise
from torchrec_het.sharding.het_lookup import HetCachedEmbeddingLookup
from torchrec_het.sharding.replicated_lookup import RowReplicatedEmbeddingLookup
from torchrec_het.sharding.replicated_rw import RowReplicatedPooledEmbeddingSharding, het_row_replicated
from torchrec_het.sharding.replicated_sequence import RowReplicatedSequenceEmbeddingSharding, RowReplicatedSequenceLookup

__all__ = [
    "HetCachedEmbeddingLookup",
    "HetCachedRwPooledEmbeddingSharding",
    "RowReplicatedEmbeddingLookup",
    "RowReplicatedPooledEmbeddingSharding",
    "RowReplicatedSequenceEmbeddingSharding",
    "RowReplicatedSequenceLookup",
    "het_cached_row_wise",
    "het_row_replicated",
]

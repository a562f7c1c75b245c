"""The plugin's sharding types, one sub-package each, in TorchRec's grammar (input dist, lookup, output dist).

``het_cache``: ``het_cached_row_wise``; ``row_replicated``: ``het_row_replicated``; ``common``:
what both share (the per-batch context, exchanges, id space, output layout, batch checks).
"""

from torchrec_het.sharding.het_cache.lookup import HetCachedEmbeddingLookup
from torchrec_het.sharding.het_cache.sharding import HetCachedRwPooledEmbeddingSharding, het_cached_row_wise
from torchrec_het.sharding.row_replicated.lookup import ReplicatedBagLookup, ReplicatedSequenceLookup
from torchrec_het.sharding.row_replicated.sharding import (
    PipelinedRowReplicatedSequenceSharding,
    PipelinedRowReplicatedSharding,
    het_row_replicated,
)

__all__ = [
    "HetCachedEmbeddingLookup",
    "HetCachedRwPooledEmbeddingSharding",
    "PipelinedRowReplicatedSequenceSharding",
    "PipelinedRowReplicatedSharding",
    "ReplicatedBagLookup",
    "ReplicatedSequenceLookup",
    "het_cached_row_wise",
    "het_row_replicated",
]

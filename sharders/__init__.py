"""Sharders users swap in for TorchRec's (``torchrec_het.sharders``)."""

if __name__ == "sharders":  # imported from the repo root by mistake
    raise ImportError("import this package as `torchrec_het.sharders`, not `sharders`")

from torchrec_het.sharders.defaults import get_het_sharders
from torchrec_het.sharders.het import (
    HetEmbeddingBagCollection,
    HetEmbeddingBagCollectionSharder,
    HetShardedEmbeddingBagCollection,
)
from torchrec_het.sharders.het_ec import (
    HetEmbeddingCollection,
    HetEmbeddingCollectionSharder,
    HetShardedEmbeddingCollection,
)
from torchrec_het.sharders.row_wise import CpuRowWiseEmbeddingBagCollectionSharder

__all__ = [
    "CpuRowWiseEmbeddingBagCollectionSharder",
    "HetEmbeddingBagCollection",
    "HetEmbeddingBagCollectionSharder",
    "HetEmbeddingCollection",
    "HetEmbeddingCollectionSharder",
    "HetShardedEmbeddingBagCollection",
    "HetShardedEmbeddingCollection",
    "get_het_sharders",
]

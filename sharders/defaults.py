"""``get_het_sharders()``: TorchRec's default sharders with the plugin's in place of the stock
EmbeddingBagCollection and EmbeddingCollection sharders (the one-line swap for
``get_default_sharders()``)."""

from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import get_default_sharders

from torchrec_het.config import HetCacheConfig
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders.het import HetEmbeddingBagCollectionSharder
from torchrec_het.sharders.het_ec import HetEmbeddingCollectionSharder


def get_het_sharders(
    cache: HetCacheConfig | None = None, replication: ReplicationConfig | None = None, stock=get_default_sharders
) -> list:
    """``stock()`` (TorchRec's ``get_default_sharders``), with its ``EmbeddingBagCollectionSharder``
    and ``EmbeddingCollectionSharder`` replaced by the plugin's, built with ``cache`` and ``replication``."""
    out = []
    for sharder in stock():
        if type(sharder) is EmbeddingBagCollectionSharder:
            sharder = HetEmbeddingBagCollectionSharder(cache=cache, replication=replication)
        elif type(sharder) is EmbeddingCollectionSharder:
            sharder = HetEmbeddingCollectionSharder(replication=replication)
        out.append(sharder)
    return out

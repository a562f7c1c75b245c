"""The old, unpipelined ``het_row_replicated`` bags (the per-host tier's path until the pipelined one has it): row-wise owners, hot rows replicated (FlexShard), partial sums on the wire (DES).

In TorchRec's grammar: the input dist is a no-op (each rank keeps its own batch), the
lookup (:class:`RowReplicatedEmbeddingLookup`) pools hot rows locally and asks owners
for partial sums of the cold ones, and the output dist is a no-op (bags are finished
where the batch lives). Shards, grouping, state dict and fused optimizer are row-wise's
own, so a checkpoint holds every table once and loads into any world size.
"""

from torchrec_het.sharding.row_replicated.legacy.local_rw import LocalBatchRwPooledSharding
from torchrec_het.sharding.row_replicated.legacy.replicated_lookup import RowReplicatedEmbeddingLookup
from torchrec_het.types import HET_ROW_REPLICATED


class RowReplicatedPooledEmbeddingSharding(LocalBatchRwPooledSharding):
    """Row-wise shards plus hot-row replicas, read through partial sums."""

    lookup_class = RowReplicatedEmbeddingLookup
    sharding_type = HET_ROW_REPLICATED

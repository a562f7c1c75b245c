"""``het_row_replicated``: row-wise owners, hot rows replicated (FlexShard), partial sums on the wire (DES).

In TorchRec's grammar: the input dist is a no-op (each rank keeps its own batch), the
lookup (:class:`RowReplicatedEmbeddingLookup`) pools hot rows locally and asks owners
for partial sums of the cold ones, and the output dist is a no-op (bags are finished
where the batch lives). Shards, grouping, state dict and fused optimizer are row-wise's
own, so a checkpoint holds every table once and loads into any world size.
"""

from torchrec_het.sharding.local_rw import LocalBatchRwPooledSharding, row_wise_as
from torchrec_het.sharding.replicated_lookup import RowReplicatedEmbeddingLookup
from torchrec_het.types import HET_ROW_REPLICATED


class RowReplicatedPooledEmbeddingSharding(LocalBatchRwPooledSharding):
    """Row-wise shards plus hot-row replicas, read through partial sums."""

    lookup_class = RowReplicatedEmbeddingLookup
    sharding_type = HET_ROW_REPLICATED


def het_row_replicated():
    """A ``per_param_sharding`` generator for TorchRec's ``construct_module_sharding_plan``.

    Shards a table row-wise over all ranks (TorchRec's own sizes and offsets, fused
    kernel) and marks it ``het_row_replicated``; its hot rows come from the module's
    :class:`~torchrec_het.replication.ReplicationConfig`.
    """
    return row_wise_as(HET_ROW_REPLICATED, compute_kernel="fused")

"""``het_row_replicated``: row-wise owners, hot rows replicated (FlexShard), partial sums on the wire (DES).

Row-wise shards (TorchRec's own, with their fused FBGEMM kernels; grouping, state dict and
fused optimizer are row-wise's own) plus the hot rows of every table replicated on every rank
(:mod:`~torchrec_het.sharding.row_replicated.replicas`), in TorchRec's three stages
(:mod:`~torchrec_het.sharding.row_replicated.dists`, :mod:`~torchrec_het.sharding.row_replicated.lookup`).

Bags (:class:`PipelinedRowReplicatedSharding`, EmbeddingBagCollections):

input dist (:class:`~torchrec_het.sharding.row_replicated.dists.ColdIdsDist`, two awaitables as TorchRec's row-wise dist)
  hot ids stay on the reader; every other id goes to its owner as (bag, row[, weight]).
  First awaitable: every rank's send counts (and batch size), one all-gather. Second: the
  ids, one all-to-all (none when no rank reads a row owned elsewhere: FAE's all-hot step).
lookup (:class:`~torchrec_het.sharding.row_replicated.lookup.ReplicatedBagLookup`, local compute)
  the owner pools what it received with its fused kernel, as stock row-wise does, and
  keeps only the partial sums of bags that had ids (DES).
output dist (:class:`~torchrec_het.sharding.row_replicated.dists.PartialSumsDist`)
  partial sums back to their readers (one all-to-all, sparse: no empty bags), added to
  the reader's hot rows (read from its replica blocks at the lookup), mean pooling applied (the shared
  :mod:`~torchrec_het.sharding.common.output_layout`). Backward: partial gradients go back the same
  way into the owners' fused kernels (their optimizer steps as in stock row-wise); hot
  gradients are summed over ranks by one asynchronous all-reduce (every
  ``replica_sync_every`` steps) applied before the next read.

With no hot rows this is row-wise sharding with sparse partial sums in place of the
reduce-scatter, and trains exactly as stock row-wise does.

Sequences (:class:`PipelinedRowReplicatedSequenceSharding`, EmbeddingCollections):

input dist (:class:`~torchrec_het.sharding.row_replicated.dists.SequenceIdsDist`)
  hot ids stay on the reader; every other **distinct** id goes to its owner once per
  reader, as (position, row): one all-gather of counts, then one all-to-all.
lookup (:class:`~torchrec_het.sharding.row_replicated.lookup.ReplicatedSequenceLookup`, local compute)
  the owner's fused kernels read the rows it was asked for (their fused backward steps them).
output dist (:class:`~torchrec_het.sharding.row_replicated.dists.SequenceRowsDist`)
  the rows go back (one all-to-all) and the reader lays every position's row out in its
  batch's order: hot ones from its replica blocks, cold ones from the rows received (one
  gather, :mod:`~torchrec_het.sharding.common.output_layout`).
  Backward: per distinct cold id the gradient summed over its positions goes back to the
  owner, whose fused kernel steps the row as stock row-wise does; hot gradients are
  summed over ranks by the replica blocks' syncs.

With no hot rows this is row-wise sharding that moves each distinct row once per reader,
and trains as stock row-wise does.
"""

from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding

from torchrec_het.sharding.common.row_wise import StagedSharding, row_wise_as
from torchrec_het.sharding.row_replicated.dists import ColdIdsDist, PartialSumsDist, SequenceIdsDist, SequenceRowsDist
from torchrec_het.sharding.row_replicated.lookup import ReplicatedBagLookup, ReplicatedSequenceLookup
from torchrec_het.types import HET_ROW_REPLICATED


class RowReplicatedStages(StagedSharding):
    """What both variants' shardings share: the lookup hands its layout and online profile to the
    input dist (``input_dist_class(layout, feature_names, pg)``) and itself to the output dist
    (``output_dist_class(lookup, pg)``); both run on the lookup's exchange group."""

    input_dist_class: type
    output_dist_class: type
    sharding_type = HET_ROW_REPLICATED

    def create_input_dist(self, device=None):
        lookup = self.create_lookup()
        dist_ = self.input_dist_class(lookup.layout, self.feature_names(), lookup.exchange_pg)
        dist_.observe = lookup.observe
        return dist_

    def create_output_dist(self, device=None):
        lookup = self.create_lookup()
        return self.output_dist_class(lookup, lookup.exchange_pg)


class PipelinedRowReplicatedSharding(RowReplicatedStages, RwPooledEmbeddingSharding):
    """``het_row_replicated`` bags: row-wise shards, hot replicas, partial sums, in TorchRec's stages.

    Args:
        sharding_infos: TorchRec's per-table sharding infos.
        env: sharding environment.
        config: replication settings for these tables.
        device: compute device.
    """

    lookup_class = ReplicatedBagLookup
    input_dist_class = ColdIdsDist
    output_dist_class = PartialSumsDist


class PipelinedRowReplicatedSequenceSharding(RowReplicatedStages, RwSequenceEmbeddingSharding):
    """``het_row_replicated`` sequences: row-wise shards, hot replicas, distinct rows, in TorchRec's stages.

    Args:
        sharding_infos: TorchRec's per-table sharding infos.
        env: sharding environment.
        config: replication settings for these tables.
        device: compute device.
    """

    lookup_class = ReplicatedSequenceLookup
    input_dist_class = SequenceIdsDist
    output_dist_class = SequenceRowsDist


def het_row_replicated():
    """A ``per_param_sharding`` generator for TorchRec's ``construct_module_sharding_plan``.

    Shards a table row-wise over all ranks (TorchRec's own sizes and offsets, fused
    kernel) and marks it ``het_row_replicated``; its hot rows come from the module's
    :class:`~torchrec_het.replication.ReplicationConfig`.
    """
    return row_wise_as(HET_ROW_REPLICATED, compute_kernel="fused")

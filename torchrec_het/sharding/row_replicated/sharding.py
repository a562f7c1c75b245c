"""``het_row_replicated``: row-wise owners, hot rows replicated (FlexShard), partial sums on the wire (DES).

Row-wise shards (TorchRec's own, with their fused FBGEMM kernels; grouping, state dict and
fused optimizer are row-wise's own) plus the hot rows of every table replicated on every rank
or, on several hosts, held once per host
(:mod:`~torchrec_het.sharding.row_replicated.replicas`), in TorchRec's three stages
(:mod:`~torchrec_het.sharding.row_replicated.dists`, :mod:`~torchrec_het.sharding.row_replicated.lookup`).

Bags (:class:`RowReplicatedPooledEmbeddingSharding`, EmbeddingBagCollections):

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

Sequences (:class:`RowReplicatedSequenceEmbeddingSharding`, EmbeddingCollections):

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

The per-host tier (several hosts) is data in the same stages: a per-host row is held by one rank
per host (:mod:`~torchrec_het.sharding.row_replicated.routing`); the input dists send its ids
to the holder on the reader's host instead of its owner, the holder's lookup pools (bags) or
reads (sequences) them from its per-host blocks beside its kernels' work, the output dists
bring them back as any partial or row, and the blocks sum their gradients over the row's
holders every step (:mod:`~torchrec_het.sharding.row_replicated.sync`), the owner's shard
written through.
"""

from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding

from torchrec_het.plan_options import ReplicaOptions
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharding.common.row_wise import StagedSharding, row_wise_as
from torchrec_het.sharding.row_replicated.dists import ColdIdsDist, PartialSumsDist, SequenceIdsDist, SequenceRowsDist
from torchrec_het.sharding.row_replicated.lookup import ReplicatedBagLookup, ReplicatedSequenceLookup
from torchrec_het.types import HET_ROW_REPLICATED


class RowReplicatedStages(StagedSharding):
    """What both variants' shardings share: the dists are built on the sharding's one lookup
    (``input_dist_class(lookup, feature_names)``, ``output_dist_class(lookup)``) and run on its
    replicas' layout and exchange group.

    Args:
        sharding_infos: TorchRec's per-table sharding infos.
        env: sharding environment.
        hot_rows: this rank's hot row ids (``.tables``: name -> tiers) of the tables the plan does not count online.
        device: compute device.
    """

    input_dist_class: type
    output_dist_class: type
    sharding_type = HET_ROW_REPLICATED

    def lookup_config(self, options_by_table: dict, hot_rows) -> ReplicationConfig:
        """The replica holder's settings: those every table's options share, and this rank's hot row
        ids of these tables (``hot_rows.tables``)."""
        return replica_config(options_by_table, hot_rows)

    def create_input_dist(self, device=None):
        return self.input_dist_class(self.create_lookup(), self.feature_names())

    def create_output_dist(self, device=None):
        return self.output_dist_class(self.create_lookup())


class RowReplicatedPooledEmbeddingSharding(RowReplicatedStages, RwPooledEmbeddingSharding):
    """``het_row_replicated`` bags: row-wise shards, hot replicas, partial sums, in TorchRec's stages
    (arguments: :class:`RowReplicatedStages`)."""

    lookup_class = ReplicatedBagLookup
    input_dist_class = ColdIdsDist
    output_dist_class = PartialSumsDist


class RowReplicatedSequenceEmbeddingSharding(RowReplicatedStages, RwSequenceEmbeddingSharding):
    """``het_row_replicated`` sequences: row-wise shards, hot replicas, distinct rows, in TorchRec's stages
    (arguments: :class:`RowReplicatedStages`)."""

    lookup_class = ReplicatedSequenceLookup
    input_dist_class = SequenceIdsDist
    output_dist_class = SequenceRowsDist


def het_row_replicated(options: ReplicaOptions | None = None):
    """A ``per_param_sharding`` generator for TorchRec's ``construct_module_sharding_plan``.

    Shards a table row-wise over all ranks (TorchRec's own sizes and offsets, fused
    kernel) and marks it ``het_row_replicated`` with ``options`` (None: the sharder's, from its
    :class:`~torchrec_het.replication.ReplicationConfig`, filled in when it shards); the hot row
    ids come from the sharder's hot-row source and must have the options' tier sizes.
    """
    return row_wise_as(HET_ROW_REPLICATED, compute_kernel="fused", options=options)


def replica_config(options_by_table: dict[str, ReplicaOptions], hot_rows) -> ReplicationConfig:
    """One sharding's :class:`ReplicationConfig` from its tables' options (ValueError naming the
    tables when their sharding-wide settings differ) and the hot row ids ``hot_rows``."""
    distinct = {o.module_settings() for o in options_by_table.values()}
    if len(distinct) > 1:
        raise ValueError(
            f"het_row_replicated tables {sorted(options_by_table)} of one module must share replica_sync_every, "
            "wire_dtype, skip_all_hot, local_world_size and online counting; their options differ"
        )
    first = next(iter(options_by_table.values()))
    tiers = None
    if not first.counted_online:
        named = dict(hot_rows.tables) if hot_rows is not None else {}
        tiers = ChosenTiers({name: named[name] for name in options_by_table if name in named})
    return ReplicationConfig(
        tiers=tiers, replica_sync_every=first.replica_sync_every, skip_all_hot=first.skip_all_hot,
        local_world_size=first.local_world_size, wire_dtype=first.wire_dtype,
        online_profile_steps=first.online_profile_steps if first.counted_online else 0,
        online_max_hot_fraction=first.online_max_hot_fraction,
    )  # fmt: skip


class ChosenTiers:
    """Hot row ids per table (``tables``), as a :class:`ReplicationConfig` reads them."""

    def __init__(self, tables: dict) -> None:
        self.tables = tables

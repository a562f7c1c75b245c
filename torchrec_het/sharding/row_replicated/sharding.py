"""``het_row_replicated``: row-wise owners, hot rows replicated (FlexShard), partial sums on the wire (DES).

TorchRec's row-wise shards (fused FBGEMM kernels, row-wise grouping, state dict and fused
optimizer) plus the hot rows of every table replicated on every rank, or held once per host
on several hosts (:mod:`~torchrec_het.sharding.row_replicated.replicas`), in TorchRec's three
stages (:mod:`~torchrec_het.sharding.row_replicated.dists`,
:mod:`~torchrec_het.sharding.row_replicated.lookup`). Bags: :class:`RowReplicatedPooledEmbeddingSharding`;
sequences: :class:`RowReplicatedSequenceEmbeddingSharding`. With no hot rows each trains
exactly as stock row-wise does.

Design (stages and collectives per step, per-host tier): docs/internals.md#row-replicated-sharding
"""

from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import CommOp

from torchrec_het._compat import sharding_lookup_arguments
from torchrec_het.plan_options import ReplicaOptions
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharding.common.row_wise import StagedSharding, row_wise_as
from torchrec_het.sharding.common.wire_codec import BAGS, SEQUENCES, codecs_of, summing_dtype
from torchrec_het.sharding.row_replicated.dists import ColdIdsDist, PartialSumsDist, SequenceIdsDist, SequenceRowsDist
from torchrec_het.sharding.row_replicated.lookup import ReplicatedBagLookup, ReplicatedSequenceLookup
from torchrec_het.sharding.row_replicated.placement import ReplicaPlacement
from torchrec_het.types import HET_ROW_REPLICATED


class RowReplicatedStages(StagedSharding):
    """What both variants' shardings share: one :class:`ReplicaPlacement` (tables, tiers, layout,
    exchange group), built before the stages and handed to each (``lookup_class(..., placement)``,
    ``input_dist_class(placement, feature_names)``, ``output_dist_class(placement)``); per batch the
    stages share only the batch in the sharding context.

    Args:
        sharding_infos: TorchRec's per-table sharding infos.
        env: sharding environment.
        hot_rows: this rank's hot row ids (``.tables``: name -> tiers) of the tables the plan does not count online.
        device: compute device.
    """

    input_dist_class: type
    output_dist_class: type
    comm_op: CommOp  # whose codecs of the sharder's ``qcomm_codecs_registry`` its payloads take
    sharding_type = HET_ROW_REPLICATED

    def lookup_config(self, options_by_table: dict, hot_rows) -> ReplicationConfig:
        """The replica holder's settings: those every table's options share, and this rank's hot row
        ids of these tables (``hot_rows.tables``)."""
        return replica_config(options_by_table, hot_rows)

    _placement: ReplicaPlacement | None = None

    def placement(self) -> ReplicaPlacement:
        """The sharding's one placement (built at the first stage TorchRec asks for: a collective)."""
        if self._placement is None:
            arguments = sharding_lookup_arguments(self)
            self._placement = ReplicaPlacement(
                arguments["grouped_configs"],
                arguments["pg"],
                self._config,
                self.shards_by_table,
                arguments["device"],
                codecs_of(self.qcomm_codecs_registry, self.comm_op),
                summing_dtype(self.qcomm_codecs_registry),
            )
        return self._placement

    def lookup_settings(self) -> dict:
        return {"placement": self.placement()}

    def set_training(self, training: bool) -> None:
        self.placement().training = training  # the online profile counts training batches only

    def create_input_dist(self, device=None):
        return self.input_dist_class(self.placement(), self.feature_names())

    def create_output_dist(self, device=None):
        return self.output_dist_class(self.placement())


class RowReplicatedPooledEmbeddingSharding(RowReplicatedStages, RwPooledEmbeddingSharding):
    """``het_row_replicated`` bags: row-wise shards, hot replicas, partial sums, in TorchRec's stages
    (arguments: :class:`RowReplicatedStages`)."""

    lookup_class = ReplicatedBagLookup
    input_dist_class = ColdIdsDist
    output_dist_class = PartialSumsDist
    comm_op = BAGS


class RowReplicatedSequenceEmbeddingSharding(RowReplicatedStages, RwSequenceEmbeddingSharding):
    """``het_row_replicated`` sequences: row-wise shards, hot replicas, distinct rows, in TorchRec's stages
    (arguments: :class:`RowReplicatedStages`)."""

    lookup_class = ReplicatedSequenceLookup
    input_dist_class = SequenceIdsDist
    output_dist_class = SequenceRowsDist
    comm_op = SEQUENCES


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
            "skip_all_hot, local_world_size and online counting; their options differ"
        )
    first = next(iter(options_by_table.values()))
    tiers = None
    if not first.counted_online:
        named = dict(hot_rows.tables) if hot_rows is not None else {}
        tiers = ChosenTiers({name: named[name] for name in options_by_table if name in named})
    return ReplicationConfig(
        tiers=tiers, replica_sync_every=first.replica_sync_every, skip_all_hot=first.skip_all_hot,
        local_world_size=first.local_world_size,
        online_profile_steps=first.online_profile_steps if first.counted_online else 0,
        online_max_hot_fraction=first.online_max_hot_fraction,
    )  # fmt: skip


class ChosenTiers:
    """Hot row ids per table (``tables``), as a :class:`ReplicationConfig` reads them."""

    def __init__(self, tables: dict) -> None:
        self.tables = tables

"""``het_row_replicated``: row-wise owners, hot rows replicated (FlexShard), partial sums on the wire (DES).

TorchRec's row-wise shards (fused FBGEMM kernels, row-wise grouping, state dict and fused
optimizer) plus the hot rows of every table replicated on every rank, or held once per host
on several hosts (:mod:`~torchrec_het.sharding.row_replicated.replicas`), in TorchRec's three
stages (:mod:`~torchrec_het.sharding.row_replicated.dists`,
:mod:`~torchrec_het.sharding.row_replicated.lookup`). Bags: :class:`RowReplicatedPooledEmbeddingSharding`;
sequences: :class:`RowReplicatedSequenceEmbeddingSharding`. With no hot rows each trains
exactly as stock row-wise does. Each table's settings are the ``ReplicaOptions`` of its plan entry
(:class:`~torchrec_het.plan_options.HetParameterSharding` ``options``); its hot row ids come from
the sharder's hot-row source, checked against them by the sharded module.

Design (stages and collectives per step, per-host tier): docs/internals.md#row-replicated-sharding
"""

from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import CommOp

from torchrec_het._compat import sharding_lookup_arguments
from torchrec_het.plan_options import ReplicaOptions, shared_options
from torchrec_het.sharding.common.row_wise import StagedSharding, row_wise_as
from torchrec_het.sharding.common.wire_codec import BAGS, SEQUENCES, codecs_of, summing_dtype
from torchrec_het.sharding.row_replicated.dists import ColdIdsDist, PartialSumsDist, SequenceIdsDist, SequenceRowsDist
from torchrec_het.sharding.row_replicated.lookup import ReplicatedBagLookup, ReplicatedSequenceLookup
from torchrec_het.sharding.row_replicated.placement import ReplicaPlacement
from torchrec_het.types import HET_ROW_REPLICATED


class RowReplicatedStages(StagedSharding):
    """What both variants' shardings share: one :class:`ReplicaPlacement` (tables, tiers, layout,
    exchange group), built before the stages from the tables' plan options and handed to each
    (``lookup_class(..., placement)``, ``input_dist_class(placement, feature_names)``,
    ``output_dist_class(placement)``); per batch the stages share only the batch in the sharding context.

    Args:
        sharding_infos: TorchRec's per-table sharding infos (each plan entry carries its ``ReplicaOptions``).
        env: sharding environment.
        hot_rows: this rank's hot row ids, name -> (replicated, per_host) sorted int64 ids, of the tables
            the plan does not count online (checked against the plan by the sharded module).
        device: compute device.
    """

    input_dist_class: type
    output_dist_class: type
    comm_op: CommOp  # whose codecs of the sharder's ``qcomm_codecs_registry`` its payloads take
    sharding_type = HET_ROW_REPLICATED

    def lookup_config(self, options_by_table: dict[str, ReplicaOptions], hot_rows) -> dict:
        """The placement's settings: the options the tables share (:func:`shared_options`, a ValueError
        naming them when they differ) and the hot row ids of those tables (none when counted online)."""
        settings = shared_options(options_by_table)
        named = {} if settings.counted_online or hot_rows is None else hot_rows
        return {
            "settings": settings,
            "hot_rows": {name: named[name] for name in options_by_table if name in named},
            "cold_rows": {name for name, options in options_by_table.items() if options.cold_rows},
        }

    _placement: ReplicaPlacement | None = None

    def placement(self) -> ReplicaPlacement:
        """The sharding's one placement (built at the first stage TorchRec asks for: a collective)."""
        if self._placement is None:
            arguments = sharding_lookup_arguments(self)
            self._placement = ReplicaPlacement(
                arguments["grouped_configs"],
                arguments["pg"],
                self._config["settings"],
                self._config["hot_rows"],
                self.shards_by_table,
                arguments["device"],
                codecs_of(self.qcomm_codecs_registry, self.comm_op),
                summing_dtype(self.qcomm_codecs_registry),
                self._config["cold_rows"] if self.comm_op == BAGS else set(),
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

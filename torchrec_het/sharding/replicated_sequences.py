"""``het_row_replicated`` for EmbeddingCollections (sequences), in TorchRec's three stages.

input dist (:class:`SequenceIdsDist`)
  hot ids stay on the reader; every other **distinct** id goes to its owner once per
  reader, as (position, row): one all-gather of counts, then one all-to-all.
lookup (:class:`ReplicatedSequenceLookup`, local compute)
  the owner's fused kernels read the rows it was asked for (their fused backward steps them).
output dist (:class:`SequenceRowsDist`)
  the rows go back (one all-to-all) and the reader lays every position's row out in its
  batch's order: hot ones from its replica blocks, cold ones from the rows received (one
  gather, :mod:`~torchrec_het.sharding.output_layout`).
  Backward: per distinct cold id the gradient summed over its positions goes back to the
  owner, whose fused kernel steps the row as stock row-wise does; hot gradients are
  summed over ranks by the replica blocks' syncs (:mod:`~torchrec_het.sharding.replica_store`).

With no hot rows this is row-wise sharding that moves each distinct row once per reader,
and trains as stock row-wise does.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, BaseSparseFeaturesDist
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharding.exchange_async import Exchange, start_exchange
from torchrec_het.sharding.output_layout import OutputPlan, Part, Source, output_layout
from torchrec_het.sharding.replica_holder import IdLayout, ReplicaHolder, StagedSharding, gather_counts
from torchrec_het.sharding.replicated_bags import STEP_ATTR, _Splits

__all__ = ["PipelinedRowReplicatedSequenceSharding", "ReplicatedSequenceLookup"]


@dataclass
class _Rows:
    """One batch's bookkeeping, from the input dist to the output dist."""

    hot_version: int
    num_values: int
    hot: list  # per block: (slots, value indexes) of the reader's hot values
    cold: torch.Tensor  # value indexes of the cold values
    need_of: torch.Tensor  # distinct cold id (in the order sent) of every cold value
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    local_only: bool = False
    received: torch.Tensor | None = None  # owner: int32 [ids, 2] (position, row), by source
    kernel_order: torch.Tensor | None = None  # owner: arrival index of each id in the KJT's order
    rows: torch.Tensor | None = None  # owner: the rows asked for, in arrival order
    hot_read: list | None = None  # reader: per block, the hot rows read at the lookup (HotRead)


class SequenceIdsDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Keeps hot ids on the reader and asks each owner once for every distinct cold id."""

    def __init__(self, layout: IdLayout, feature_names: list[str], pg):
        super().__init__()
        self.layout, self.feature_names, self.pg = layout, feature_names, pg
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.observe = None  # the lookup's replica syncs and online profile

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        layout = self.layout
        bags, ids = layout.flatten(sparse_features)
        positions = bags // sparse_features.stride()
        if self.observe is not None:
            self.observe(ids)
        hot_pos, owner, row = layout.route(ids)
        hot = [(slots, mine) for mine, slots in layout.hot_of(hot_pos)]
        cold = (hot_pos < 0).nonzero().flatten()
        key = owner.index_select(0, cold) * layout.total_rows + ids.index_select(0, cold)  # by owner, then id
        need, need_of = torch.unique(key, return_inverse=True)
        first = torch.empty_like(need).scatter_(0, need_of, torch.arange(cold.numel(), device=cold.device))
        first = cold.index_select(0, first)
        payload = torch.stack([positions.index_select(0, first).to(torch.int32), row.index_select(0, first).to(torch.int32)], 1)
        step = _Rows(layout.hot_version, ids.numel(), hot, cold, need_of)
        work, gathered = gather_counts(need // layout.total_rows, sparse_features.stride(), self.pg)
        return _Splits(self, step, payload, 2, work, gathered)

    def owner_features(self, step: _Rows, received: torch.Tensor) -> KeyedJaggedTensor:
        """The (position, row) pairs received, as a KJT of one bag per position."""
        step.received = received
        position = received[:, 0].long()
        _, step.kernel_order = torch.sort(position, stable=True)
        return KeyedJaggedTensor(
            keys=self.feature_names,
            values=received[:, 1].index_select(0, step.kernel_order).long(),
            lengths=torch.bincount(position, minlength=self.layout.num_positions).int(),
            stride=1,
        )


class ReplicatedSequenceLookup(ReplicaHolder, GroupedEmbeddingsLookup):
    """The owner's fused kernels read the asked rows (local compute); their backward steps them.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: the sharding's features.
        pg: the sharding's process group.
        config: replication settings.
        shards_by_table: each table's shard metadata.
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names, pg, config: ReplicationConfig, shards_by_table, device=None, env=None):
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, env=env)
        self.init_holder(pg, feature_names, config, shards_by_table, device)
        if self.layout.uniform_dim is None:
            raise ValueError("het_row_replicated sequences need one embedding dimension for all their tables")
        self.stats["rows_fetched"] = 0  # distinct rows this rank read from other ranks
        self.last_batch: _Rows | None = None

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        step: _Rows = getattr(sparse_features, STEP_ATTR)
        self.begin_read(step.hot_version)
        step.hot_read = self.read_hot([slots for slots, _ in step.hot])
        # the kernels' own forward and fused backward, the rows put back in arrival order
        by_position = super().forward(sparse_features).view(-1, self.layout.uniform_dim)
        step.rows = torch.empty_like(by_position).index_copy(0, step.kernel_order, by_position)
        self.stats["skipped_steps"] += int(step.local_only)
        self.stats["rows_fetched"] += sum(c for r, c in enumerate(step.send_splits) if r != self._rank)
        self.last_batch = step
        return step.rows.reshape(-1)


class _SequenceRows(Awaitable[torch.Tensor]):
    def __init__(self, dist_: "SequenceRowsDist", step: _Rows, exchange: Exchange):
        super().__init__()
        self.dist, self.step, self.exchange = dist_, step, exchange

    def _wait_impl(self) -> torch.Tensor:
        lookup = self.dist._lookup[0]
        scale = 1.0 / lookup._ws if get_gradient_division() else 1.0
        received = self.exchange.wait().float()
        step, dim = self.step, self.dist.layout.uniform_dim
        # every position's row: one gather from the blocks' rows read and the rows received
        sources = [Source(read.rows, at, sink=read.add_grads) for read, (_, at) in zip(step.hot_read, step.hot)]
        sources.append(Source(received.view(-1, dim), step.cold, step.need_of))
        plan = OutputPlan([Part(sources, step.num_values, dim, one_per_bag=True)], (step.num_values, dim), scale)
        return output_layout(plan, lookup._anchor)


class SequenceRowsDist(BaseEmbeddingDist):
    """Sends the asked rows back and lays every position's row out in the reader's order."""

    def __init__(self, lookup: ReplicatedSequenceLookup, pg):
        super().__init__()
        self._lookup = [lookup]  # not a submodule: the lookup is the sharded module's own
        self.pg, self.layout = pg, lookup.layout

    def forward(self, local_embs: torch.Tensor, sharding_ctx=None) -> Awaitable[torch.Tensor]:
        lookup = self._lookup[0]
        step, dim = lookup.last_batch, self.layout.uniform_dim
        send, recv = [c * dim for c in step.recv_splits], [c * dim for c in step.send_splits]
        return _SequenceRows(self, step, start_exchange(local_embs, send, recv, self.pg, lookup._wire, step.local_only))


class PipelinedRowReplicatedSequenceSharding(StagedSharding, RwSequenceEmbeddingSharding):
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

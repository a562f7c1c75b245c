"""``het_row_replicated`` for EmbeddingCollection (sequence, unpooled): hot rows local, cold rows fetched once.

Each rank keeps its own batch (no input dist, no output dist). Per step, for the tables
of one dimension (:class:`~torchrec_het.sharding.row_replicated.routing.ReplicaGroup`):

forward
  the embedding of every position. Positions whose id this rank owns or holds
  (:meth:`ReplicaGroup.server_of` is this rank: owned rows, replicated rows, per-host
  rows of its host slot) are read locally. For the rest this rank sends every server
  the **distinct** ids it needs from it; the server returns those rows (each distinct
  row once per reader, only cold positions' rows cross the wire) and the reader
  scatters them to their positions. One small all-gather per step tells every rank how
  many ids each rank fetches and how many replicated rows each touched: when nobody
  fetches, the cold exchange is skipped (FAE's all-hot step).
backward
  per distinct id, the gradient summed over its positions (divided by the world size,
  as TorchRec's row-wise backward); cold ids' gradients go back to their servers, and
  :meth:`~torchrec_het.sharding.row_replicated.legacy.replica_writes.ReplicaWrites.settle` combines
  replicated rows' gradients over all ranks and per-host rows' over the holder group,
  so every copy takes the same fused-optimizer step as its owner's shard.

With no hot rows this is row-wise sharding that moves distinct rows instead of one row
per position, and trains as stock row-wise does. Shards, grouping, state dict and fused
optimizer are row-wise's own.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup
from torchrec.distributed.embedding_sharding import EmbeddingShardingInfo
from torchrec.distributed.sharding.dp_sequence_sharding import DpSequenceEmbeddingDist
from torchrec.distributed.sharding.dp_sharding import DpSparseFeaturesDist
from torchrec.distributed.sharding.rw_sequence_sharding import RwSequenceEmbeddingSharding
from torchrec.distributed.types import ShardingEnv
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import sharding_lookup_arguments
from torchrec_het.sharding.common.exchange import exchange_counts, exchange_flat
from torchrec_het.sharding.row_replicated.legacy.replica_writes import ReplicaWrites, sum_by_id
from torchrec_het.sharding.row_replicated.legacy.replicated_lookup import feature_positions
from torchrec_het.sharding.row_replicated.routing import ReplicaGroup


@dataclass
class _SequenceStep:
    """One group's positions in one step, kept for the backward."""

    ids: torch.Tensor  # fused id of every position, the group's features one after the other
    here: torch.Tensor  # positions read on this rank
    away: torch.Tensor  # positions read from other ranks
    need: torch.Tensor  # distinct ids read from other ranks, grouped by server
    need_of: torch.Tensor  # index into ``need`` of every away position
    send_counts: torch.Tensor  # distinct ids asked of each server
    exchanged: bool = False  # whether the cold exchange ran
    recv_counts: torch.Tensor | None = None  # distinct ids each reader asked of this rank
    served_ids: torch.Tensor | None = None  # those ids, by reader
    hot_counts: list[int] | None = None  # replicated rows each rank touched


class RowReplicatedSequenceLookup(ReplicaWrites, GroupedEmbeddingsLookup):
    """TorchRec's row-wise sequence lookup (fused kernels) plus hot-row replicas and distinct-row fetches.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: input feature order (the sharding's ``feature_names()``).
        pg: the process group of the sharding.
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names: list[str], pg, device=None, env=None) -> None:
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, env=env)
        self.init_replicas(pg, feature_names, device)
        self.stats["rows_fetched"] = 0  # distinct rows this rank read from other ranks

    # --- forward -------------------------------------------------------------------------

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        steps, rows = self.read_groups(sparse_features)
        counts = sparse_features.length_per_key()  # by input position (a shared feature has two)
        return _SequenceRows.apply(self._anchor, self, steps, rows, counts)

    def _facts(self, g: ReplicaGroup, step: _SequenceStep) -> tuple[int, int]:
        return step.need.numel(), int(g.is_hot(torch.unique(step.ids[step.here])).sum())

    def _plan(self, g: ReplicaGroup, by_feature) -> _SequenceStep:
        values = [by_feature[f].values() for f in g.features]
        per_feature = torch.tensor([v.numel() for v in values], dtype=torch.int64, device=g.feature_table.device)
        ids = torch.cat(values).long() + g.offsets[torch.repeat_interleave(g.feature_table, per_feature)]
        server = g.server_of(ids)
        local = server == self._rank
        here, away = local.nonzero().flatten(), (~local).nonzero().flatten()
        need, need_of = torch.unique(ids[away], return_inverse=True)
        need_server = g.server_of(need)
        order = torch.sort(need_server, stable=True).indices  # by server, then id
        slot = torch.empty_like(order)
        slot[order] = torch.arange(order.numel(), device=order.device)
        send_counts = torch.bincount(need_server, minlength=self._ws)
        return _SequenceStep(ids, here, away, need[order], slot[need_of], send_counts)

    def _read(self, g: ReplicaGroup, step: _SequenceStep) -> torch.Tensor:
        """``[positions, dim]``: local rows here, distinct rows of the rest from their servers."""
        shards, replicas = self._shard_weights(g), self._replica_weights(g)
        rows = torch.empty(step.ids.numel(), g.dim, device=step.ids.device)
        rows[step.here] = g.read(step.ids[step.here], shards, replicas)
        if not step.exchanged:
            return rows
        ws, dim = self._ws, g.dim
        step.recv_counts = exchange_counts(step.send_counts.view(ws, 1), self._pg).view(ws)
        send, recv = step.send_counts.tolist(), step.recv_counts.tolist()
        step.served_ids = exchange_flat(step.need, send, recv, self._pg)
        served = g.read(step.served_ids, shards, replicas)  # server side: each asked row once per reader
        received = self.exchange_rows(served.view(-1), [c * dim for c in recv], [c * dim for c in send])
        rows[step.away] = received.view(-1, dim)[step.need_of]
        self.stats["rows_fetched"] += step.need.numel()
        return rows

    # --- backward --------------------------------------------------------------------------

    def _served_grads(self, g: ReplicaGroup, step: _SequenceStep, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct ids this rank serves, the gradient summed over every position that read each);
        ``grad``: ``[positions, dim]`` of the group's rows (:meth:`ReplicaWrites.write_back`)."""
        ids, per_position = [step.ids[step.here]], [grad[step.here]]
        if step.exchanged:
            dim = g.dim
            need_grads = torch.zeros(step.need.numel(), dim, device=grad.device).index_add_(0, step.need_of, grad[step.away])
            served = self.exchange_rows(
                need_grads.view(-1), (step.send_counts * dim).tolist(), (step.recv_counts * dim).tolist()
            ).view(-1, dim)
            ids.append(step.served_ids)
            per_position.append(served)
        return sum_by_id(ids, per_position)


class _SequenceRows(torch.autograd.Function):
    """Lays the groups' rows out in the input's key order (the lookup's output); its backward runs the write path.

    Blocks are placed by input position, not by feature name: a feature that feeds two
    tables appears twice in the lookup's input and output.
    """

    @staticmethod
    def forward(ctx, anchor, lookup, steps, rows, counts):  # noqa: ARG004
        ctx.lookup, ctx.steps, ctx.counts = lookup, steps, counts
        blocks = [None] * len(counts)
        for g, group_rows, at in zip(lookup.groups, rows, feature_positions(lookup)):
            for position, block in zip(at, group_rows.split([counts[p] for p in at])):
                blocks[position] = block
        if not blocks:
            return torch.empty(0, device=anchor.device)
        return torch.cat([block.reshape(-1) for block in blocks])

    @staticmethod
    def backward(ctx, grad_output):
        lookup, steps, counts = ctx.lookup, ctx.steps, ctx.counts
        positions = feature_positions(lookup)
        dims = [0] * len(counts)
        for g, at in zip(lookup.groups, positions):
            for position in at:
                dims[position] = g.dim
        parts = [part.view(-1, dim) for part, dim in zip(grad_output.split([c * d for c, d in zip(counts, dims)]), dims)]
        position_grads = [torch.cat([parts[p] for p in at]).float() for at in positions]
        lookup.write_back(steps, position_grads)
        return None, None, None, None, None


class RowReplicatedSequenceEmbeddingSharding(RwSequenceEmbeddingSharding):
    """Row-wise sequence shards plus hot-row replicas; each rank keeps its batch and its embeddings.

    Input and output dists are data-parallel's no-ops: the lookup reads every position's
    row for this rank's own batch, so the ``SequenceShardingContext`` TorchRec fills
    (the batch before the input dist, no unbucketize permute) already describes the
    output, and ``construct_jagged_tensors`` splits it by the batch's own lengths.
    """

    def __init__(self, sharding_infos: list[EmbeddingShardingInfo], env: ShardingEnv, device=None, **kwargs: Any):
        super().__init__(sharding_infos, env, device, **kwargs)
        self.shards_by_table = {
            info.embedding_config.name: list(info.param_sharding.sharding_spec.shards) for info in sharding_infos
        }

    def create_input_dist(self, device: torch.device | None = None) -> DpSparseFeaturesDist:
        return DpSparseFeaturesDist()

    def create_lookup(self, device=None, fused_params=None, feature_processor=None) -> RowReplicatedSequenceLookup:
        if feature_processor is not None:
            raise NotImplementedError("het_row_replicated does not support feature processors")
        arguments = sharding_lookup_arguments(self)
        if device is not None:
            arguments["device"] = device
        return RowReplicatedSequenceLookup(feature_names=self.feature_names(), **arguments)

    def create_output_dist(self, device: torch.device | None = None) -> DpSequenceEmbeddingDist:
        return DpSequenceEmbeddingDist()

    def create_write_dist(self, device: torch.device | None = None):
        raise NotImplementedError("het_row_replicated does not support embedding updates (enable_embedding_update)")


__all__ = ["RowReplicatedSequenceEmbeddingSharding", "RowReplicatedSequenceLookup"]

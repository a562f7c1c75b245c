"""The lookup of ``het_row_replicated``: hot rows local, cold rows pooled at their owners (DES).

Each rank keeps its own batch (no input dist). Per step, for the tables of one dimension
(:class:`~torchrec_het.sharding.row_replicated.routing.ReplicaGroup`):

forward
  every id is read from its nearest holder (:meth:`ReplicaGroup.server_of`). Ids this
  rank owns or holds are pooled here. The others go, as (id, bag) pairs, to their
  server, which pools them into **one partial sum per bag** and sends the partials back
  (never raw rows); the receiver adds them to its local partial. One small all-gather
  per step tells every rank how many ids each rank sends and how many replicated rows
  each touched: when nobody sends anything the cold exchange is skipped (FAE's all-hot
  step).
backward
  partial-sum gradients go back to the servers that pooled them; every holder then has
  the gradients its reads produced. Gradients of replicated rows are summed over all
  ranks (sparse or dense, whichever moves fewer bytes) and of per-host rows over the
  holder group (one rank per host), so every copy of a row takes the same fused
  optimizer step as its owner's shard: exactly synchronous. With
  ``replica_sync_every = s > 1`` gradients of replicated rows are held and combined
  every s steps instead.

With no hot rows this is row-wise sharding with partial sums in place of the
reduce-scatter, and trains as stock row-wise does.
"""

from dataclasses import dataclass

import torch
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.exchange import exchange_counts, exchange_flat
from torchrec_het.sharding.row_replicated.legacy.replica_writes import ReplicaWrites, sum_by_id
from torchrec_het.sharding.row_replicated.routing import ReplicaGroup


@dataclass
class _BagStep:
    """One group's batch in one step, kept for the backward."""

    lengths: torch.Tensor  # [F * B] bag lengths, the group's features one after the other
    weights: torch.Tensor | None  # per-id weights
    ids: torch.Tensor  # fused id of every value
    bags: torch.Tensor  # bag of every value
    here: torch.Tensor  # positions of values read on this rank
    exchanged: bool = False  # whether the cold exchange ran
    send_counts: torch.Tensor | None = None  # ids sent to each server
    recv_counts: torch.Tensor | None = None  # ids received from each reader
    partial_bags: torch.Tensor | None = None  # bag of each partial received, grouped by server
    partials_in: torch.Tensor | None = None  # partials received from each server
    partials_out: torch.Tensor | None = None  # partials sent to each reader
    served_ids: torch.Tensor | None = None  # ids received, by reader
    served_weights: torch.Tensor | None = None
    served_partial: torch.Tensor | None = None  # partial of each received id
    hot_counts: list[int] | None = None  # replicated rows each rank touched


class RowReplicatedEmbeddingLookup(ReplicaWrites, GroupedPooledEmbeddingsLookup):
    """TorchRec's row-wise fused lookup plus hot-row replicas and partial-sum exchanges.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: input feature order (the sharding's ``feature_names()``).
        pg: the process group of the sharding.
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names: list[str], pg, device=None, env=None) -> None:
        super().__init__(
            grouped_configs=grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env
        )
        self.init_replicas(pg, feature_names, device)

    # --- forward -------------------------------------------------------------------------

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        steps, pooled = self.read_groups(sparse_features)
        return _ReplicatedPooling.apply(self._anchor, self, steps, pooled, sparse_features.stride())

    def _facts(self, g: ReplicaGroup, step: _BagStep) -> tuple[int, int]:
        return step.ids.numel() - step.here.numel(), int(g.is_hot(torch.unique(step.ids)).sum())

    def _plan(self, g: ReplicaGroup, by_feature) -> _BagStep:
        jts = [by_feature[f] for f in g.features]
        lengths = torch.cat([jt.lengths() for jt in jts]).long()
        weights = [jt.weights_or_none() for jt in jts]
        per_feature = torch.tensor([jt.values().numel() for jt in jts], dtype=torch.int64, device=lengths.device)
        ids = torch.cat([jt.values() for jt in jts]).long() + g.offsets[torch.repeat_interleave(g.feature_table, per_feature)]
        bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        here = (g.server_of(ids) == self._rank).nonzero().flatten()
        return _BagStep(lengths, torch.cat(weights) if weights[0] is not None else None, ids, bags, here)

    def _read(self, g: ReplicaGroup, step: _BagStep) -> torch.Tensor:
        """[F * B, dim] bag sums: local rows here, partial sums of the rest from their servers."""
        shards, replicas = self._shard_weights(g), self._replica_weights(g)
        values = g.read(step.ids[step.here], shards, replicas)
        if step.weights is not None:
            values = values * step.weights[step.here].unsqueeze(1)
        pooled = torch.zeros(step.lengths.numel(), g.dim, device=values.device).index_add_(0, step.bags[step.here], values)
        if not step.exchanged:
            return pooled
        ws, dim = self._ws, g.dim
        away = torch.ones(step.ids.numel(), dtype=torch.bool, device=step.ids.device)
        away[step.here] = False
        away = away.nonzero().flatten()
        server = g.server_of(step.ids[away])
        order = torch.sort(server, stable=True).indices
        away, server = away[order], server[order]
        step.send_counts = torch.bincount(server, minlength=ws)
        step.recv_counts = exchange_counts(step.send_counts.view(ws, 1), self._pg).view(ws)
        send, recv = step.send_counts.tolist(), step.recv_counts.tolist()
        pairs = torch.stack([step.ids[away], step.bags[away]], 1).view(-1)
        requests = exchange_flat(pairs, [2 * c for c in send], [2 * c for c in recv], self._pg).view(-1, 2)
        step.served_ids = requests[:, 0]
        if step.weights is not None:
            step.served_weights = exchange_flat(step.weights[away], send, recv, self._pg)
        # server side: one partial per (reader, bag)
        reader = torch.repeat_interleave(torch.arange(ws, device=step.recv_counts.device), step.recv_counts)
        width = int(requests[:, 1].max()) + 1 if requests.numel() else 1
        keys, step.served_partial = torch.unique(reader * width + requests[:, 1], return_inverse=True)
        rows = g.read(step.served_ids, shards, replicas)
        if step.served_weights is not None:
            rows = rows * step.served_weights.unsqueeze(1)
        partials = torch.zeros(keys.numel(), dim, device=rows.device).index_add_(0, step.served_partial, rows)
        step.partials_out = torch.bincount(keys // width, minlength=ws)
        # reader side: the partials to expect, in the servers' order (by bag)
        mine = torch.unique(server * step.lengths.numel() + step.bags[away])
        step.partial_bags = mine % step.lengths.numel()
        step.partials_in = torch.bincount(mine // step.lengths.numel(), minlength=ws)
        received = self.exchange_rows(
            partials.view(-1), (step.partials_out * dim).tolist(), (step.partials_in * dim).tolist()
        ).view(-1, dim)
        return pooled.index_add_(0, step.partial_bags, received)

    # --- backward --------------------------------------------------------------------------

    def _served_grads(self, g: ReplicaGroup, step: _BagStep, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct ids this rank serves, the gradient its readers' bags give each); ``grad``: ``[F * B, dim]``
        of the group's bag sums (:meth:`ReplicaWrites.write_back`)."""
        values = grad[step.bags[step.here]]
        if step.weights is not None:
            values = values * step.weights[step.here].unsqueeze(1)
        ids, per_value = [step.ids[step.here]], [values]
        if step.exchanged:
            dim = g.dim
            partial_grads = self.exchange_rows(
                grad[step.partial_bags].reshape(-1), (step.partials_in * dim).tolist(), (step.partials_out * dim).tolist()
            ).view(-1, dim)
            served = partial_grads[step.served_partial]
            if step.served_weights is not None:
                served = served * step.served_weights.unsqueeze(1)
            ids.append(step.served_ids)
            per_value.append(served)
        return sum_by_id(ids, per_value)


class _ReplicatedPooling(torch.autograd.Function):
    """Finishes the bags (weights, mean) into the lookup's output; its backward runs the write path.

    Blocks are placed by input position, not by feature name: a feature that feeds two
    tables appears twice in the lookup's input and output.
    """

    @staticmethod
    def forward(ctx, anchor, lookup, steps, pooled, batch):  # noqa: ARG004
        ctx.lookup, ctx.steps, ctx.batch = lookup, steps, batch
        blocks = [None] * len(lookup._features)
        for g, step, sums, at in zip(lookup.groups, steps, pooled, feature_positions(lookup)):
            out = (sums / g.bag_divisors(step.lengths, batch)).view(len(g.features), batch, g.dim)
            for position, block in zip(at, out.unbind(0)):
                blocks[position] = block
        if not blocks:
            return torch.empty(batch, 0, device=anchor.device)
        return torch.cat(blocks, dim=1)

    @staticmethod
    def backward(ctx, grad_output):
        lookup, steps, batch = ctx.lookup, ctx.steps, ctx.batch
        positions = feature_positions(lookup)
        dims = [0] * len(lookup._features)
        for g, at in zip(lookup.groups, positions):
            for position in at:
                dims[position] = g.dim
        columns = grad_output.split(dims, dim=1)
        bag_grads = [
            torch.stack([columns[p] for p in at]).reshape(-1, g.dim) / g.bag_divisors(step.lengths, batch)
            for g, step, at in zip(lookup.groups, steps, positions)
        ]
        lookup.write_back(steps, bag_grads)
        return None, None, None, None, None


def feature_positions(lookup) -> list[list[int]]:
    """Per group of ``lookup``, the input position of each of its features (in the group's order).

    The input lists the features of the lookup's grouped configs' tables one after the
    other (the sharding's ``feature_names()``), so a feature shared by two tables has
    two positions.
    """
    cached = getattr(lookup, "_feature_positions", None)
    if cached is None:
        at, position = {}, 0
        for config in lookup.grouped_configs:
            for table in config.embedding_tables:
                at[table.name] = list(range(position, position + len(table.feature_names)))
                position += len(table.feature_names)
        cached = [[p for t in g.tables for p in at[t.name]] for g in lookup.groups]
        lookup._feature_positions = cached
    return cached

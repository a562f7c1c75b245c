"""``het_row_replicated`` for EmbeddingBagCollections, in TorchRec's three stages.

Row-wise shards (TorchRec's own, with their fused FBGEMM kernels) plus the hot rows of
every table replicated on every rank (:mod:`~torchrec_het.sharding.replica_store`).

input dist (:class:`ColdIdsDist`, two awaitables as TorchRec's row-wise dist)
  hot ids stay on the reader; every other id goes to its owner as (bag, row[, weight]).
  First awaitable: every rank's send counts (and batch size), one all-gather. Second: the
  ids, one all-to-all (none when no rank reads a row owned elsewhere: FAE's all-hot step).
lookup (:class:`ReplicatedBagLookup`, local compute)
  the owner pools what it received with its fused kernel, as stock row-wise does, and
  keeps only the partial sums of bags that had ids (DES).
output dist (:class:`PartialSumsDist`)
  partial sums back to their readers (one all-to-all, sparse: no empty bags), added to
  the reader's hot rows (read from its replica blocks at the lookup), mean pooling applied (the shared
  :mod:`~torchrec_het.sharding.output_layout`). Backward: partial gradients go back the same
  way into the owners' fused kernels (their optimizer steps as in stock row-wise); hot
  gradients are summed over ranks by one asynchronous all-reduce (every
  ``replica_sync_every`` steps) applied before the next read.

With no hot rows this is row-wise sharding with sparse partial sums in place of the
reduce-scatter, and trains exactly as stock row-wise does.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, BaseSparseFeaturesDist
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharding.exchange_async import Exchange, start_exchange
from torchrec_het.sharding.id_space import bag_divisors
from torchrec_het.sharding.output_layout import OutputPlan, Part, Source, output_layout
from torchrec_het.sharding.replica_holder import IdLayout, ReplicaHolder, StagedSharding, gather_counts

STEP_ATTR = "_het_replicated_step"  # where the input dist leaves a batch's bookkeeping on its KJT


@dataclass
class _Batch:
    """One batch's bookkeeping, from the input dist to the output dist."""

    batch: int
    hot_version: int  # the layout's hot rows this batch was routed with
    lengths: torch.Tensor  # [F * B] reader's bag lengths (mean pooling)
    hot: list  # per block: (slots, bags of its output part, weights) of the reader's hot values
    sent_entries: torch.Tensor  # reader: distinct (dest, position, sample) keys of cold values sent
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    local_only: bool = False
    served_entries: torch.Tensor | None = None  # owner: (source, position, sample) of bags received
    partial_at: tuple | None = None  # owner: (row, position, rows) of each partial in the kernels' compact output
    hot_read: list | None = None  # reader: per block, the hot rows read at the lookup (HotRead)


class _Splits(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """First stage: every rank's send counts known; starts the ids' all-to-all."""

    def __init__(self, dist_: "ColdIdsDist", step: _Batch, payload: torch.Tensor, width: int, work, gathered):
        super().__init__()
        self.dist, self.step, self.payload, self.width, self.work, self.gathered = dist_, step, payload, width, work, gathered

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        self.work.wait()
        ws, rank = self.dist.world_size, self.dist.rank
        table = torch.stack(self.gathered).tolist()  # [source][dest counts..., batch size]
        batches = {row[ws] for row in table}
        if len(batches) != 1:
            raise ValueError(f"het_row_replicated needs one batch size on every rank, got {sorted(batches)}")
        step = self.step
        step.send_splits = [table[rank][d] for d in range(ws)]
        step.recv_splits = [table[s][rank] for s in range(ws)]
        step.local_only = all(table[s][d] == 0 for s in range(ws) for d in range(ws) if s != d)
        exchange = start_exchange(
            self.payload.view(-1),
            [c * self.width for c in step.send_splits],
            [c * self.width for c in step.recv_splits],
            self.dist.pg,
            torch.int32,
            step.local_only,
        )
        return _Ids(self.dist, step, exchange, self.width)


class _Ids(Awaitable[KeyedJaggedTensor]):
    """Second stage: the ids received, as the KJT the owner's kernels pool."""

    def __init__(self, dist_: "ColdIdsDist", step: _Batch, exchange: Exchange, width: int):
        super().__init__()
        self.dist, self.step, self.exchange, self.width = dist_, step, exchange, width

    def _wait_impl(self) -> KeyedJaggedTensor:
        received = self.exchange.wait().view(-1, self.width)
        kjt = self.dist.owner_features(self.step, received)
        setattr(kjt, STEP_ATTR, self.step)
        return kjt


class ColdIdsDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Keeps hot ids on the reader and sends every other id to its owner."""

    def __init__(self, layout: IdLayout, feature_names: list[str], pg):
        super().__init__()
        self.layout, self.feature_names, self.pg = layout, feature_names, pg
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.observe = None  # the lookup's replica syncs and online profile

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        layout, batch = self.layout, sparse_features.stride()
        bags, ids = layout.flatten(sparse_features)
        weights = sparse_features.weights_or_none()
        if self.observe is not None:
            self.observe(ids)  # replica syncs move on; online profile: counts, at its end new hot rows
        hot_pos, owner, row = layout.route(ids)
        hot = []
        for index, (mine, slots) in enumerate(layout.hot_of(hot_pos)):
            bag = layout.group_bags(bags.index_select(0, mine), batch, index)  # output rows are (sample, position)
            hot.append((slots, bag, None if weights is None else weights.index_select(0, mine)))
        cold = (hot_pos < 0).nonzero().flatten()
        dest, by_owner = torch.sort(owner.index_select(0, cold), stable=True)  # by owner, each owner's in bag order
        cold = cold.index_select(0, by_owner)
        cold_bags = bags.index_select(0, cold)
        columns = [cold_bags.to(torch.int32), row.index_select(0, cold).to(torch.int32)]
        if weights is not None:
            columns.append(weights.index_select(0, cold).float().view(torch.int32))
        num_bags = batch * layout.num_positions
        step = _Batch(batch, layout.hot_version, sparse_features.lengths().long(), hot, torch.unique(dest * num_bags + cold_bags))
        work, gathered = gather_counts(dest, batch, self.pg)
        return _Splits(self, step, torch.stack(columns, 1), len(columns), work, gathered)

    def owner_features(self, step: _Batch, received: torch.Tensor) -> KeyedJaggedTensor:
        """The (bag, row) pairs received, as a compact KJT: per position, one bag per
        (source, sample) that sent ids, in that order, padded with empty bags to the position
        with the most. The owner's kernels pool it in one call per group."""
        ws, batch, positions = self.world_size, step.batch, self.layout.num_positions
        device = received.device
        source = torch.repeat_interleave(torch.arange(ws, device=device), torch.tensor(step.recv_splits, device=device))
        bag = received[:, 0].long()
        position = bag // batch
        # ids arrive by source, each source's in bag order: (source, position, sample) never decreases
        step.served_entries = torch.unique_consecutive(source * (positions * batch) + bag)
        key, order = torch.sort(position * (ws * batch) + source * batch + bag % batch, stable=True)
        entries, counts = torch.unique_consecutive(key, return_counts=True)  # by (position, source, sample)
        entry_position = entries // (ws * batch)
        per_position = torch.bincount(entry_position, minlength=positions)
        first = torch.cumsum(per_position, 0) - per_position
        slot = torch.arange(entries.numel(), device=device) - first.index_select(0, entry_position)
        stride = max(int(per_position.max()), 1) if entries.numel() else 1  # the owner's one extra host sync
        lengths = torch.zeros(positions * stride, dtype=torch.int64, device=device)
        lengths[entry_position * stride + slot] = counts
        # where each entry's partial is, in the order the readers expect: (source, position, sample)
        rest = entries % (ws * batch)
        by_source = torch.argsort((rest // batch) * (positions * batch) + entry_position * batch + rest % batch)
        step.partial_at = (slot.index_select(0, by_source), entry_position.index_select(0, by_source), stride)
        received = received.index_select(0, order)
        weights = received[:, 2].view(torch.float32) if received.size(1) > 2 else None
        return KeyedJaggedTensor(
            keys=self.feature_names, values=received[:, 1].long(), lengths=lengths.int(), weights=weights, stride=stride
        )


class ReplicatedBagLookup(ReplicaHolder, GroupedPooledEmbeddingsLookup):
    """The owner pools received ids with its fused kernels; the reader pools hot ids from replicas.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: the sharding's features.
        pg: the sharding's process group.
        config: replication settings (tiers, sync interval, wire dtype).
        shards_by_table: each table's shard metadata.
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names, pg, config: ReplicationConfig, shards_by_table, device=None, env=None):
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env)
        self.init_holder(pg, feature_names, config, shards_by_table, device)
        self.last_batch: _Batch | None = None

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        step: _Batch = getattr(sparse_features, STEP_ATTR)
        self.begin_read(step.hot_version)
        step.hot_read = self.read_hot([slots for slots, _, _ in step.hot])
        positions = self.layout.num_positions
        pooled = super().forward(sparse_features)  # [compact bags, width]: the kernels' fused forward and backward
        rows, position, stride = step.partial_at
        if self.layout.uniform_dim is not None:  # the output dist pools hot rows as it finishes the bags
            partials = pooled.view(stride * positions, self.layout.uniform_dim).index_select(0, rows * positions + position)
            partials = partials.reshape(-1)
        else:
            partials = pooled.reshape(-1).index_select(0, self.layout.elements(rows, position, self.layout.width))
        self.stats["skipped_steps"] += int(step.local_only)
        self.last_batch = step
        return partials


class _Bags(Awaitable[torch.Tensor]):
    def __init__(self, dist_: "PartialSumsDist", step: _Batch, exchange: Exchange):
        super().__init__()
        self.dist, self.step, self.exchange = dist_, step, exchange

    def _wait_impl(self) -> torch.Tensor:
        return self.dist.finish(self.step, self.exchange.wait().float())


class PartialSumsDist(BaseEmbeddingDist):
    """Sends the owners' partial sums back to their readers and finishes the bags."""

    def __init__(self, lookup: ReplicatedBagLookup, pg):
        super().__init__()
        self._lookup = [lookup]  # not a submodule: the lookup is the sharded module's own
        self.pg, self.layout = pg, lookup.layout

    def forward(self, local_embs: torch.Tensor, sharding_ctx=None) -> Awaitable[torch.Tensor]:
        lookup = self._lookup[0]
        step = lookup.last_batch
        layout = self.layout
        ws, bags = lookup._ws, step.batch * layout.num_positions
        served_source, sent_dest = step.served_entries // bags, step.sent_entries // bags
        if layout.uniform_dim is not None:
            splits = torch.cat([torch.bincount(served_source, minlength=ws), torch.bincount(sent_dest, minlength=ws)])
            splits = splits * layout.uniform_dim
        else:  # elements: each entry is as wide as its position's table
            served_width = layout.dims[(step.served_entries % bags) // step.batch].double()
            sent_width = layout.dims[(step.sent_entries % bags) // step.batch].double()
            splits = torch.cat([
                torch.bincount(served_source, served_width, minlength=ws), torch.bincount(sent_dest, sent_width, minlength=ws)
            ]).long()
        splits = splits.tolist()  # the output dist's one host sync
        send, recv = splits[:ws], splits[ws:]
        exchange = start_exchange(local_embs, send, recv, self.pg, lookup._wire, step.local_only)
        return _Bags(self, step, exchange)

    def finish(self, step: _Batch, received: torch.Tensor) -> torch.Tensor:
        """``[batch, width]`` bags, one part per width (:mod:`~torchrec_het.sharding.output_layout`):
        the hot rows from the replica block (their gradients go to it) plus the partials received
        (theirs go back to the owners), mean applied, gradients scaled as TorchRec's row-wise
        backward scales them."""
        layout, batch, lookup = self.layout, step.batch, self._lookup[0]
        entries = step.sent_entries % (layout.num_positions * batch)  # position * batch + sample of each partial
        scale = 1.0 / lookup._ws if get_gradient_division() else 1.0
        lengths = step.lengths.view(layout.num_positions, batch)
        one_width = layout.uniform_dim is not None
        if not one_width:  # the partials of every width, one after the other
            position = entries // batch
            group = layout.position_group.index_select(0, position)
            widths = layout.dims.index_select(0, position)
            starts = torch.cumsum(widths, 0) - widths
        parts = []
        for index, (read, (_, bags, weights)) in enumerate(zip(step.hot_read, step.hot)):
            block = read.block
            at, columns = layout.group_part(index)
            if one_width:
                mine, partials = entries, received.view(-1, block.dim)
            else:
                chosen = (group == index).nonzero().flatten()
                mine = entries.index_select(0, chosen)
                elements = starts.index_select(0, chosen).unsqueeze(1) + torch.arange(block.dim, device=received.device)
                partials = received.index_select(0, elements.view(-1)).view(-1, block.dim)
            sources = [
                Source(read.rows, bags, None, weights, sink=read.add_grads),
                Source(partials, layout.group_bags(mine, batch, index)),
            ]
            divisors = None
            if layout.has_mean:
                divisors = bag_divisors(lengths.index_select(0, at), layout.mean.index_select(0, at)).t().reshape(-1, 1)
            parts.append(Part(sources, batch * at.numel(), block.dim, divisors, columns))
        return output_layout(OutputPlan(parts, (batch, layout.width), scale), lookup._anchor)


class PipelinedRowReplicatedSharding(StagedSharding, RwPooledEmbeddingSharding):
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

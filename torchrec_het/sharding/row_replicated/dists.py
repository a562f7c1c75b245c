"""The input and output dists of ``het_row_replicated``, bags and sequences (every collective of a step
but the replica syncs; the stages are described in :mod:`~torchrec_het.sharding.row_replicated.sharding`).

Both input dists keep hot ids on the reader and send the rest to their owners in two
awaitables, as TorchRec's row-wise dist: every rank's send counts (and batch size) by one
all-gather, then one all-to-all; the first awaitable's ``batch`` is the batch planned, which
the sharded module puts in the batch's sharding context for the lookup and the output dist. The output dists bring the owners' partial sums (bags) or rows
(sequences) back and finish the output with :mod:`~torchrec_het.sharding.common.output_layout`.
"""

import torch
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, BaseSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.context import HetShardingContext
from torchrec_het.sharding.common.exchange import Exchange, GatheredCounts, start_exchange
from torchrec_het.sharding.common.id_space import bag_divisors, sample_major
from torchrec_het.sharding.common.output_layout import OutputPlan, Part, Source, gradient_scale, output_layout
from torchrec_het.sharding.row_replicated.batch import (
    FetchedRows,
    HotValues,
    ReplicatedBagBatch,
    ReplicatedSequenceBatch,
)
from torchrec_het.sharding.row_replicated.lookahead import arrived_partials, late_partials
from torchrec_het.sharding.row_replicated.owner import OwnerValues
from torchrec_het.sharding.row_replicated.placement import IdLayout, ReplicaPlacement


class _CountsGathered(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """First stage: every rank's send counts known; starts the ids' all-to-all. ``batch``: the batch planned."""

    def __init__(
        self, dist_: "_ReplicaIdsDist", batch: ReplicatedBagBatch | ReplicatedSequenceBatch, payload: torch.Tensor,
        width: int, counts: GatheredCounts,
    ):  # fmt: skip
        super().__init__()
        self.dist, self.batch, self.payload, self.width, self.counts = dist_, batch, payload, width, counts

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        splits = self.counts.wait()
        if len(splits.batch_sizes) != 1:
            raise ValueError(f"het_row_replicated needs one batch size on every rank, got {sorted(splits.batch_sizes)}")
        step = self.batch
        step.send_splits, step.recv_splits = splits.send, splits.recv
        # FAE's all-hot step (skip_all_hot): no rank sends to another, nothing is exchanged
        step.local_only = self.dist.placement.settings.skip_all_hot and not splits.crosses_ranks()
        exchange = start_exchange(
            self.payload.view(-1),
            [c * self.width for c in step.send_splits],
            [c * self.width for c in step.recv_splits],
            self.dist.pg,
            step.local_only,
        )
        ids = _Ids(self.dist, step, exchange, self.width)
        if self.dist.placement.early_partials is not None:
            # lookahead: TorchRec's pipeline waits this stage during the previous step (after its forward)
            # and the ids' one only at this batch's forward; the owners take the ids now, to send early
            return _Arrived(ids.wait())
        return ids


class _Ids(Awaitable[KeyedJaggedTensor]):
    """Second stage: the ids received, as the KJT the owner's kernels pool."""

    def __init__(self, dist_: "_ReplicaIdsDist", step: ReplicatedBagBatch, exchange: Exchange, width: int):
        super().__init__()
        self.dist, self.step, self.exchange, self.width = dist_, step, exchange, width

    def _wait_impl(self) -> KeyedJaggedTensor:
        received = self.exchange.wait().view(-1, self.width)
        return self.dist.owner_features(self.step, received)


class _Arrived(Awaitable[KeyedJaggedTensor]):
    """Second stage when the ids were taken at the first (lookahead): what they came to."""

    def __init__(self, features: KeyedJaggedTensor):
        super().__init__()
        self.features = features

    def _wait_impl(self) -> KeyedJaggedTensor:
        return self.features


class _ReplicaIdsDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """What both input dists share: the placement (its layout routes every id) and the exchange group."""

    def __init__(self, placement: ReplicaPlacement, feature_names: list[str]):
        super().__init__()
        self.placement, self.feature_names = placement, feature_names
        self.pg, self.rank, self.world_size = placement.exchange_pg, placement.rank, placement.world_size

    @property
    def layout(self) -> IdLayout:
        return self.placement.layout

    def _route(self, sparse_features: KeyedJaggedTensor):
        """(bag and id of every value, then :meth:`IdLayout.split`: hot ones, cold ones to their owners,
        per-host ones to the host's holder); replica syncs move on, and the online profile counts
        training batches (at its end: new hot rows)."""
        bags, ids = self.layout.flatten(sparse_features)
        self.placement.observe(ids, self.placement.training)  # the online profile counts; at its end, new hot rows
        return (bags, ids, *self.layout.split(ids))


class ColdIdsDist(_ReplicaIdsDist):
    """Keeps hot ids on the reader and sends every other id to its owner."""

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        layout, batch = self.layout, sparse_features.stride()
        bags, ids, hot_at, hot_pos, cold, dest, row = self._route(sparse_features)
        weights = sparse_features.weights_or_none()
        hot = []
        for index, (mine, slots) in enumerate(layout.hot_of(hot_at, hot_pos)):
            # the output's bags are (sample, position): the lookup pools the values in that order
            group_bags, by_bag, offsets = sample_major(
                layout.group_feature_bags(bags.index_select(0, mine), batch, index), layout.group_sizes[index], batch
            )
            rows = layout.groups[index].hot.numel()
            hot.append(HotValues.of(slots, rows, group_bags, None if weights is None else weights.index_select(0, mine),
                                    by_bag, offsets))  # fmt: skip
        dest, by_dest = torch.sort(dest, stable=True)  # by destination, each one's in bag order
        cold, row = cold.index_select(0, by_dest), row.index_select(0, by_dest)
        cold_bags = bags.index_select(0, cold)
        cold_weights = None if weights is None else weights.index_select(0, cold).float()
        fetch = None
        if layout.fetches_rows:  # the rows of ``cold_rows`` tables are fetched: those values leave the bags
            fetch = self._row_entries(ids.index_select(0, cold), cold_bags, dest, row, cold_weights, batch)
            keep = fetch[0]
            dest, cold_bags, row = (
                dest.index_select(0, keep),
                cold_bags.index_select(0, keep),
                row.index_select(0, keep),
            )
            cold_weights = None if weights is None else cold_weights.index_select(0, keep)
        columns = [cold_bags.to(torch.int32), row.to(torch.int32)]
        if weights is not None:
            columns.append(cold_weights.view(torch.int32))
        payload = torch.stack(columns, 1)
        num_bags = batch * layout.num_positions
        sent = torch.unique_consecutive(dest * num_bags + cold_bags)  # never decreasing: no sort
        sent_dest, sent_position = sent // num_bags, sent % num_bags // batch
        fetched = None
        if fetch is not None:  # each owner's segment: its bags' values, then the rows asked of it
            _, entry_payload, entry_dest, fetched = fetch
            order = _by_owner(dest, entry_dest)
            payload = torch.cat([payload, entry_payload]).index_select(0, order)
            dest = torch.cat([dest, entry_dest]).index_select(0, order)
            wire = _by_owner(sent_dest, entry_dest)
            fetched.wire_at = torch.empty_like(wire).index_copy_(
                0, wire, torch.arange(wire.numel(), device=wire.device)
            )
            sent_dest = torch.cat([sent_dest, entry_dest]).index_select(0, wire)
            sent_position = torch.cat([sent_position, fetched.position]).index_select(0, wire)
        step = ReplicatedBagBatch(
            batch, layout.hot_version, sparse_features.lengths().long(), hot, sent, sent_dest, sent_position, fetched
        )
        return _CountsGathered(self, step, payload, len(columns), GatheredCounts(dest, batch, self.pg))

    def _row_entries(self, ids, cold_bags, dest, row, weights, batch: int):
        """The cold values of ``cold_rows`` tables (not per-host ones) as row entries: each distinct
        (owner, id) asked once, as ``(-1 - position, row[, weight 1])``. Returns (indexes of the values
        that stay bags, the entries' payload, their owners, :class:`FetchedRows`)."""
        layout = self.layout
        fetch = layout.cold_rows.index_select(0, cold_bags // batch) & (row >= 0)
        keep, take = (~fetch).nonzero().flatten(), fetch.nonzero().flatten()
        owners, entry_of, first = layout.distinct(dest.index_select(0, take), ids.index_select(0, take))
        first = take.index_select(0, first)
        position = cold_bags.index_select(0, first) // batch
        columns = [(-1 - position).to(torch.int32), row.index_select(0, first).to(torch.int32)]
        if weights is not None:  # the owner sends the row itself: the reader weighs each read
            columns.append(torch.ones(owners.numel(), device=owners.device).view(torch.int32))
        fetched = FetchedRows(
            cold_bags.index_select(0, take), entry_of, None if weights is None else weights.index_select(0, take),
            position, owners, wire_at=None,
        )  # fmt: skip
        return keep, torch.stack(columns, 1), owners, fetched

    def owner_features(self, step: ReplicatedBagBatch, received: torch.Tensor) -> KeyedJaggedTensor:
        """The (bag, row) pairs received, for the owner's lookup, in ``step.received`` (arrival order: the
        lookup pools them itself or builds its kernels' input, ``owner.py``); the KJT handed on is
        empty. Ids of the per-host tier (row ``-1 - slot``) stay out, for the lookup to pool from this
        holder's blocks (``step.host_values``)."""
        ws, batch, positions = self.world_size, step.batch, self.layout.num_positions
        device = received.device
        source = torch.repeat_interleave(torch.arange(ws, device=device), torch.tensor(step.recv_splits, device=device))
        # ids arrive by source, each source's in bag order: (source, position, sample) never decreases,
        # so the entries (bags sent) are runs, already in the order the readers expect their partials
        # a row entry (code ``-1 - position``, fetched rows) is an entry of its own
        code, bags = received[:, 0].long(), positions * batch
        key, row_entry = source * bags + code, code < 0
        new = torch.ones_like(row_entry)
        new[1:] = (key[1:] != key[:-1]) | row_entry[1:] | row_entry[:-1]
        entry_of = torch.cumsum(new, 0) - 1
        first = new.nonzero().flatten()
        step.served_source, code = source.index_select(0, first), code.index_select(0, first)
        entry_position = torch.where(code < 0, -1 - code, code % bags // batch)
        rows = received[:, 1].long()
        weights = received[:, 2].view(torch.float32) if received.size(1) > 2 else None
        if self.layout.host_ids.numel():  # this rank holds per-host rows: those values are pooled from its blocks
            held = rows < 0
            kernel, held = (~held).nonzero().flatten(), held.nonzero().flatten()
            widths = self.layout.dims.index_select(0, entry_position)
            starts = torch.cumsum(widths, 0) - widths  # each entry's first element in the partials
            step.host_entries = entry_of.index_select(0, held)
            step.host_values = (
                -1 - rows.index_select(0, held),
                starts.index_select(0, step.host_entries),
                None if weights is None else weights.index_select(0, held),
            )
            rows, entry_of = rows.index_select(0, kernel), entry_of.index_select(0, kernel)
            weights = None if weights is None else weights.index_select(0, kernel)
        step.received = OwnerValues(rows, entry_of, weights, entry_position)
        if self.placement.early_partials is not None:  # lookahead: the owner pools now, sends what is final
            step.early = self.placement.early_partials(step)
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return KeyedJaggedTensor(
            keys=self.feature_names, values=empty, lengths=torch.zeros(len(self.feature_names), dtype=torch.int32,
                                                                       device=device), stride=1
        )  # fmt: skip


def _by_owner(bag_owners: torch.Tensor, row_owners: torch.Tensor) -> torch.Tensor:
    """The order that merges bag items and row entries (each already by owner) by owner, each
    owner's bag items first: indexes into their concatenation."""
    return torch.sort(torch.cat([bag_owners * 2, row_owners * 2 + 1]), stable=True).indices


class _Bags(Awaitable[torch.Tensor]):
    def __init__(self, dist_: "PartialSumsDist", step: ReplicatedBagBatch, exchange: Exchange, late=None):
        super().__init__()
        self.dist, self.step, self.exchange, self.late = dist_, step, exchange, late

    def _wait_impl(self) -> torch.Tensor:
        if self.late is not None:  # lookahead: the partials came by the early and the late exchange
            late, stale_sent = self.late
            self.exchange.arrive(arrived_partials(self.step.early, late, stale_sent, self.dist.layout.uniform_dim))
        return self.dist.finish(self.step, self.exchange.wait().float())


class _ReplicaOutputDist(BaseEmbeddingDist):
    """What both output dists share: the placement (its layout, exchange group and codecs)."""

    def __init__(self, placement: ReplicaPlacement):
        super().__init__()
        self.placement, self.pg, self.world_size = placement, placement.exchange_pg, placement.world_size

    @property
    def layout(self) -> IdLayout:
        return self.placement.layout


class PartialSumsDist(_ReplicaOutputDist):
    """Sends the owners' partial sums back to their readers and finishes the bags."""

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: HetShardingContext[ReplicatedBagBatch]
    ) -> Awaitable[torch.Tensor]:
        step, layout = sharding_ctx.batch, self.layout
        early = step.early
        if early is not None and early.valid:  # lookahead: only the stale entries travel now
            late = late_partials(early, local_embs, self.pg, self.placement.codecs)
            exchange = start_exchange(
                local_embs, early.served, early.sent, self.pg, False, self.placement.codecs, step.owed,
                step.owner_step, grad_scale=gradient_scale(self.world_size), forward_elsewhere=True,
            )  # fmt: skip
            return _Bags(self, step, exchange, late)
        if early is not None:  # sent before the owner's rows were reloaded: void, all travel now
            early.exchange.wait()
            early.flags_work.wait()
        ws, served_source, sent_dest = self.world_size, step.served_source, step.sent_dest
        if layout.uniform_dim is not None:
            splits = torch.cat([torch.bincount(served_source, minlength=ws), torch.bincount(sent_dest, minlength=ws)])
            splits = splits * layout.uniform_dim
        else:  # elements: each entry is as wide as its position's table
            served_width = layout.dims.index_select(0, step.received.entry_position).double()
            sent_width = layout.dims.index_select(0, step.sent_position).double()
            splits = torch.cat(
                [
                    torch.bincount(served_source, served_width, minlength=ws),
                    torch.bincount(sent_dest, sent_width, minlength=ws),
                ]
            ).long()
        splits = splits.tolist()  # the output dist's one host sync
        send, recv = splits[:ws], splits[ws:]
        # the owners step when their rows are next read: the gradients fly under the optimizer step and
        # the next input dist (the lookup's ``owed``, ``owner_step``)
        exchange = start_exchange(
            local_embs, send, recv, self.pg, step.local_only, self.placement.codecs, step.owed, step.owner_step,
            grad_scale=gradient_scale(self.world_size),
        )  # fmt: skip
        return _Bags(self, step, exchange)

    def finish(self, step: ReplicatedBagBatch, received: torch.Tensor) -> torch.Tensor:
        """``[batch, width]`` bags, one part per width (:mod:`~torchrec_het.sharding.common.output_layout`):
        the hot rows from the replica block (their gradients go to it) plus the partials received
        (theirs go back to the owners), mean applied, gradients scaled as TorchRec's row-wise
        backward scales them."""
        layout, batch, fetched = self.layout, step.batch, step.fetched
        entries = step.sent_entries % (layout.num_positions * batch)  # position * batch + sample of each partial
        scale = gradient_scale(self.world_size)
        lengths = step.lengths.view(layout.num_positions, batch)
        one_width = layout.uniform_dim is not None  # then one group
        bags_at = None if fetched is None else fetched.wire_at[: entries.numel()]  # the bags' place in the reply
        starts = None
        if one_width:  # every entry received is a row
            partials = received.view(-1, layout.uniform_dim)
            partials = partials if bags_at is None else partials.index_select(0, bags_at)
        else:  # the entries of every width one after the other: where each starts
            widths = layout.dims.index_select(0, step.sent_position)
            starts = torch.cumsum(widths, 0) - widths
            bag_starts = starts if bags_at is None else starts.index_select(0, bags_at)
            group = layout.position_group.index_select(0, entries // batch)
        fetched_sources = None if fetched is None else _fetched_sources(layout, fetched, received, starts, batch)
        parts = []
        for index, read in enumerate(step.hot_read):
            block = read.block
            at, columns = layout.group_part(index)
            mine = entries
            if not one_width:
                chosen = (group == index).nonzero().flatten()
                mine = entries.index_select(0, chosen)
                partials = _rows_at(received, bag_starts.index_select(0, chosen), block.dim)
            sources = [
                Source(read.pooled, None, sink=read.add_grads),  # pooled at the lookup
                Source(partials, layout.group_bags(mine, batch, index)),
            ]
            if fetched_sources is not None:  # pooled here; their gradients go back to their owners
                sources.append(fetched_sources[index])
            divisors = None
            if layout.has_mean:
                divisors = bag_divisors(lengths.index_select(0, at), layout.mean.index_select(0, at)).t().reshape(-1, 1)
            parts.append(Part(sources, batch * at.numel(), block.dim, divisors, columns))
        return output_layout(OutputPlan(parts, (batch, layout.width), scale), step.anchor)


def _rows_at(received: torch.Tensor, starts: torch.Tensor, dim: int) -> torch.Tensor:
    """``[len(starts), dim]``: the rows of ``dim`` elements at ``starts`` of the flat ``received``."""
    elements = starts.unsqueeze(1) + torch.arange(dim, device=received.device)
    return received.index_select(0, elements.view(-1)).view(-1, dim)


def _fetched_sources(layout: IdLayout, fetched: FetchedRows, received, starts, batch: int) -> list[Source]:
    """Per group, the rows fetched of its tables as a source of its part (each value reads its
    entry's row); ``starts``: several widths, where each entry sent starts in ``received``."""
    rows_at = fetched.wire_at[fetched.wire_at.numel() - fetched.position.numel() :]  # the rows' place in the reply
    if layout.uniform_dim is not None:  # one group, every entry a row
        rows = _watched(received.view(-1, layout.uniform_dim).index_select(0, rows_at), fetched)
        return [Source(rows, layout.group_bags(fetched.bags, batch, 0), fetched.entry_of, fetched.weights)]
    entry_group = layout.position_group.index_select(0, fetched.position)
    value_group = entry_group.index_select(0, fetched.entry_of)
    out = []
    for index, g in enumerate(layout.groups):
        chosen = (entry_group == index).nonzero().flatten()
        local = torch.full_like(entry_group, -1).index_copy_(
            0, chosen, torch.arange(chosen.numel(), device=chosen.device)
        )
        values = (value_group == index).nonzero().flatten()
        out.append(Source(
            _watched(_rows_at(received, starts.index_select(0, rows_at.index_select(0, chosen)), g.dim), fetched, chosen),
            layout.group_bags(fetched.bags.index_select(0, values), batch, index),
            local.index_select(0, fetched.entry_of.index_select(0, values)),
            None if fetched.weights is None else fetched.weights.index_select(0, values),
        ))  # fmt: skip
    return out


def _watched(rows: torch.Tensor, fetched: FetchedRows, chosen: torch.Tensor | None = None) -> torch.Tensor:
    """``rows`` (the fetched entries ``chosen``, None: all), their gradients handed to ``fetched.on_grad``."""
    if fetched.on_grad is not None and rows.requires_grad:
        positions, owners = fetched.position, fetched.owners
        if chosen is not None:
            positions, owners = positions.index_select(0, chosen), owners.index_select(0, chosen)
        rows.register_hook(lambda grads: fetched.on_grad(grads, positions, owners))
    return rows


class SequenceIdsDist(_ReplicaIdsDist):
    """Keeps hot ids on the reader and asks each owner once for every distinct cold id."""

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        layout = self.layout
        bags, ids, hot_at, hot_pos, cold, dest, row = self._route(sparse_features)
        positions = bags // sparse_features.stride()
        hot = [(slots, mine) for mine, slots in layout.hot_of(hot_at, hot_pos)]
        owners, need_of, first = layout.distinct(dest, ids.index_select(0, cold))
        payload = torch.stack(
            [positions.index_select(0, cold.index_select(0, first)).to(torch.int32),
             row.index_select(0, first).to(torch.int32)], 1
        )  # fmt: skip
        step = ReplicatedSequenceBatch(layout.hot_version, ids.numel(), hot, cold, need_of)
        counts = GatheredCounts(owners, sparse_features.stride(), self.pg)
        return _CountsGathered(self, step, payload, 2, counts)

    def owner_features(self, step: ReplicatedSequenceBatch, received: torch.Tensor) -> KeyedJaggedTensor:
        """The (position, row) pairs received, as a KJT of one bag per position; ids of the
        per-host tier (row ``-1 - slot``) stay out of it, for the lookup to read from this
        holder's blocks (``step.host_values``)."""
        step.received = received
        position, rows = received[:, 0].long(), received[:, 1].long()
        if self.layout.host_ids.numel():
            held = rows < 0
            step.kernel_at, held = (~held).nonzero().flatten(), held.nonzero().flatten()
            step.host_values = (held, -1 - rows.index_select(0, held))
            position, rows = position.index_select(0, step.kernel_at), rows.index_select(0, step.kernel_at)
        _, step.kernel_order = torch.sort(position, stable=True)
        return KeyedJaggedTensor(
            keys=self.feature_names,
            values=rows.index_select(0, step.kernel_order),
            lengths=torch.bincount(position, minlength=self.layout.num_positions).int(),
            stride=1,
        )


class _SequenceOutput(Awaitable[torch.Tensor]):
    def __init__(self, dist_: "SequenceRowsDist", step: ReplicatedSequenceBatch, exchange: Exchange):
        super().__init__()
        self.dist, self.step, self.exchange = dist_, step, exchange

    def _wait_impl(self) -> torch.Tensor:
        scale = gradient_scale(self.dist.world_size)
        received = self.exchange.wait().float()
        step, dim = self.step, self.dist.layout.uniform_dim
        # every position's row: one gather from the blocks' rows read and the rows received
        sources = [Source(read.rows, at, sink=read.add_grads) for read, (_, at) in zip(step.hot_read, step.hot)]
        sources.append(Source(received.view(-1, dim), step.cold, step.need_of))
        plan = OutputPlan([Part(sources, step.num_values, dim, one_per_bag=True)], (step.num_values, dim), scale)
        return output_layout(plan, step.anchor)


class SequenceRowsDist(_ReplicaOutputDist):
    """Sends the asked rows back and lays every position's row out in the reader's order."""

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: HetShardingContext[ReplicatedSequenceBatch]
    ) -> Awaitable[torch.Tensor]:
        step, dim = sharding_ctx.batch, self.layout.uniform_dim
        send, recv = [c * dim for c in step.recv_splits], [c * dim for c in step.send_splits]
        return _SequenceOutput(
            self,
            step,
            start_exchange(
                local_embs,
                send,
                recv,
                self.pg,
                step.local_only,
                self.placement.codecs,
                grad_scale=gradient_scale(self.world_size),
            ),  # fmt: skip
        )

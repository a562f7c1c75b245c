"""The lookup of ``het_cached_row_wise``: owned rows locally, remote rows from a stale-tolerant cache.

Each rank owns a row range of every table (held by the stock fused FBGEMM kernel this class
extends) and caches rows of the other ranges. The lookup is local compute: its dists
(:mod:`~torchrec_het.sharding.het_cache.dists`) carry every exchange and call its stages
(:meth:`~HetCachedEmbeddingLookup.plan_requests`, :meth:`~HetCachedEmbeddingLookup.forward`,
:meth:`~HetCachedEmbeddingLookup.rows_request`, :meth:`~HetCachedEmbeddingLookup.settle_fetched`);
the rules are in :mod:`~torchrec_het.sharding.het_cache.protocol`.

Design: docs/internals.md#het-cache-lookup
"""

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het import _tbe
from torchrec_het._compat import lookup_kernels
from torchrec_het.config import CacheSettings
from torchrec_het.sharding.common.context import HetShardingContext
from torchrec_het.sharding.common.groups import dedicated_group
from torchrec_het.sharding.common.id_space import TableInfo
from torchrec_het.sharding.common.owned_rows import OwnedRows
from torchrec_het.sharding.common.wire_codec import WireCodecs
from torchrec_het.sharding.het_cache import protocol
from torchrec_het.sharding.het_cache.batch import CachedBatch
from torchrec_het.sharding.het_cache.coded_rows import CodedPayload, PayloadRows, ValueCodec
from torchrec_het.sharding.het_cache.dists import HetPushDist
from torchrec_het.sharding.het_cache.groups import HetGroup
from torchrec_het.sharding.het_cache.layout import GroupLayout
from torchrec_het.sharding.het_cache.owned_rows import fetched_rows, read_rows
from torchrec_het.sharding.het_cache.pushes import HetPushes, flatten_rows


class HetCachedEmbeddingLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's row-wise fused lookup plus the HET read and write protocol.

    Built complete by the sharding's ``create_lookup`` (settings from the plan).

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: input feature order (the sharding's ``feature_names()``; a
            feature that feeds two tables appears twice).
        pg: the process group of the sharding.
        config: each table's cache settings (from the plan).
        shards_by_table: each table's shard metadata (row ranges per rank).
        device: compute device.
        env: sharding environment.
        codecs: the quantized-comms codecs of the rows fetched (forward) and the gradients pushed
            (backward), from the sharder's ``qcomm_codecs_registry``; None: fp32 both ways.
    """

    def __init__(
        self,
        grouped_configs,
        feature_names: list[str],
        pg,
        config: dict[str, CacheSettings],
        shards_by_table,
        device=None,
        env=None,
        codecs: WireCodecs | None = None,
    ) -> None:
        super().__init__(
            grouped_configs=grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env
        )
        self._rank = dist.get_rank(pg)
        self._ws = dist.get_world_size(pg)
        self._compute_device = torch.device(device) if device is not None else torch.device("cpu")
        self.exchange_pg = dedicated_group(pg)  # the cache's exchanges and pushes (its dists')
        self._features = list(feature_names)
        self.codecs = codecs if codecs is not None else WireCodecs()
        self.row_codec = ValueCodec(self.codecs.forward)  # on the rows' values, not the state sent along
        self._step = 0
        self.prefetched_batches = 0  # batches ``prefetch`` prepared
        self._anchor = torch.zeros(
            1, device=self._compute_device, requires_grad=True
        )  # lets backward reach the write path
        self.owned_rows = OwnedRows([k.emb_module for k in lookup_kernels(self)], self._compute_device)
        self._build_groups(config, shards_by_table)

    # --- set-up and inspection --------------------------------------------------------

    def _build_groups(self, config: dict[str, CacheSettings], shards_by_table: dict[str, list]) -> None:
        """Creates the per-group state and the static indexes (once, at construction)."""
        by_key: dict[tuple, list[TableInfo]] = {}
        positions: dict[str, list[int]] = {}
        position = 0
        for module_index, group in enumerate(self.grouped_configs):
            lr = float((group.fused_params or {}).get("learning_rate", 0.01))
            for table_index, table in enumerate(group.embedding_tables):
                info = TableInfo.of(table, module_index, table_index, shards_by_table[table.name], self._ws, lr)
                by_key.setdefault((table.embedding_dim, config[table.name]), []).append(info)
                positions[table.name] = list(range(position, position + len(table.feature_names)))
                for feature, at in zip(table.feature_names, positions[table.name]):
                    if at >= len(self._features) or self._features[at] != feature:
                        raise ValueError(f"table {table.name!r}: feature {feature!r} is not input {at} of the lookup")
                position += len(table.feature_names)
        if position != len(self._features):
            raise ValueError(f"the lookup's tables read {position} features, its input has {len(self._features)}")
        self._groups = [
            HetGroup(tables, dim, settings, self._rank, self._ws, self._compute_device)
            for (dim, settings), tables in by_key.items()
        ]
        device = self._compute_device
        self.layout = GroupLayout(self._groups, self._features, positions, device)
        self._bounds, self._bounds_ahead, self.ahead = protocol.read_bounds(self._groups, self._ws, device)
        self.holds_nothing = all(not g.cache.capacity for g in self._groups)  # every request brings its row
        for m in lookup_kernels(self):
            _tbe.optimizer_kind(m.emb_module)  # a clear error now for an optimizer the write path cannot step
        self.pushes = HetPushes(
            self._groups,
            lookup_kernels(self),
            self._rank,
            self._ws,
            device,
            HetPushDist(self.exchange_pg),
            self.codecs.backward,
        )
        self._fetch_widths = torch.tensor([g.fetch_width for g in self._groups], dtype=torch.int64, device=device)
        self._dims = torch.tensor([g.dim for g in self._groups], dtype=torch.int64, device=device)

    @property
    def groups(self) -> list[HetGroup]:
        return self._groups

    @property
    def clock(self) -> int:
        """The step the next training batch reads at (training batches planned so far)."""
        return self._step

    def cache_stats(self) -> dict[str, dict]:
        """Per table: lookups, hits (distinct ids and all lookups), requests, rows fetched and
        pushed, evictions, dirty evictions, staleness histogram, gradient mass produced/applied."""
        return {t.name: g.stats.table(i) for g in self._groups for i, t in enumerate(g.tables)}

    def reset_cache_stats(self) -> None:
        for g in self._groups:
            g.stats = type(g.stats)(len(g.tables), g.dim, self._compute_device)

    def allow_batches_ahead(self) -> None:
        """Lets later batches run their forward before this batch's backward (:class:`~torchrec_het.pipeline.HybridTrainPipeline`).

        A settled batch's slots stay pinned until its backward; push counts travel just before each
        backward (one small all-to-all more per step). Every rank must call it (a collective protocol).
        """
        self.pushes.batches_ahead = True

    # --- input dist: what to ask the owners ---------------------------------------------

    def plan_requests(self, sparse_features: KeyedJaggedTensor, training: bool) -> CachedBatch:
        """Requester side of the input dist: the batch's reads, the requests, slots pinned. A
        training batch takes the next step of the clock; an evaluation batch reads at it."""
        by_group = list(self.layout.split(sparse_features))  # checks the batch before anything changes
        step = self._step
        if training:
            self._step += 1
        reads, ids, held, dest, group, at = [], [], [], [], [], []
        for index, g, gids, gbags, weights, lengths, counts in by_group:
            read = protocol.plan_read(g, gids, gbags, weights, lengths, counts, step, self._rank)
            slots = g.cache.slots_of(read.uniq.index_select(0, read.remote), check=False)
            read.asked = protocol.asked_ids(g, slots, step)
            asked_slots = slots.index_select(0, read.asked)
            read.pinned = slots[slots >= 0]
            g.pins.index_add_(0, read.pinned, torch.ones_like(read.pinned, dtype=g.pins.dtype))
            asked_ids = read.uniq.index_select(0, read.remote.index_select(0, read.asked))
            g.stats.add("requests", read.tables.index_select(0, read.remote.index_select(0, read.asked)))
            ids.append(asked_ids + self.layout.group_base[index])
            held.append(g.cache.held_versions(asked_slots))
            dest.append(g.owner_of(asked_ids))
            group.append(torch.full_like(asked_ids, index))
            at.append(torch.arange(asked_ids.numel(), device=self._compute_device))
            reads.append(read)
        empty = torch.zeros(0, dtype=torch.int64, device=self._compute_device)
        dest_all = torch.cat([empty] + dest)
        order = torch.sort(dest_all, stable=True).indices  # by owner, then group, then id
        pick = lambda parts: torch.cat([empty] + parts).index_select(0, order)  # noqa: E731
        return CachedBatch(
            step,
            sparse_features.stride(),
            reads,
            pick(ids),
            pick(held),
            dest_all.index_select(0, order),
            pick(group),
            pick(at),
        )

    # --- prefetch and lookup: local compute -------------------------------------------------

    def prefetch(
        self,
        sparse_features: KeyedJaggedTensor,
        forward_stream=None,
        sharding_ctx: HetShardingContext[CachedBatch] | None = None,
    ) -> None:  # noqa: ARG002
        """Called by ``PrefetchTrainPipelineSparseDist`` for batch i+1 between batch i's forward and backward.

        Builds the bag orders the pooling needs (a pure function of the batch), off the forward's
        path; reads nothing batch i's backward changes. Without a sharding context it does nothing.
        """
        if sharding_ctx is None:
            return
        for read in sharding_ctx.batch.reads:
            if read.bags is None:
                protocol.sample_major(read)
        self.prefetched_batches += 1

    def forward(
        self, sparse_features: KeyedJaggedTensor, sharding_ctx: HetShardingContext[CachedBatch]
    ) -> torch.Tensor:  # noqa: ARG002
        """Owner side: each requested row's current version and the rows the rule sends (flat, in request order).

        Fetching ahead, the input dist did all of it and only the previous backward's pushes are
        applied here. ``sharding_ctx.batch``: what the input dist planned and received."""
        batch = sharding_ctx.batch
        self.pushes.apply_arrived()  # the previous backward's pushes: versions and rows below include them
        self.pushes.skip_unanswered()
        if not self.ahead:
            self.answer(batch, self._bounds)
        return batch.payload

    def answer(self, batch: CachedBatch, bounds: torch.Tensor) -> None:
        """Owner side: ``batch.current`` (version of each request), ``batch.payload`` (the rows the
        rule sends, flat, in request order) and ``batch.rows_out`` (their elements per requester)."""
        received = batch.received
        gid, held = received[:, 0].contiguous(), received[:, 1]  # bucketize wants contiguous ids
        group = torch.bucketize(gid, self.layout.group_ends, right=True)
        source = torch.repeat_interleave(
            torch.arange(self._ws, device=self._compute_device),
            torch.tensor(batch.recv_splits, device=self._compute_device),
            output_size=gid.numel(),
        )
        current = torch.empty_like(held)
        parts = []
        for index, g in enumerate(self._groups):
            mine = (group == index).nonzero().flatten()
            fused = gid.index_select(0, mine) - self.layout.group_base[index]
            current.index_copy_(0, mine, g.versions.index_select(0, g.local_index_of(fused)))
            parts.append((mine, fused))
        sends = protocol.sends(held, current, bounds.index_select(0, group))
        widths = self._fetch_widths.index_select(0, group)
        batch.current = current
        batch.rows_out = torch.bincount(source[sends], widths[sends], minlength=self._ws).long()
        if self.row_codec.active:  # where the values the codec takes sit among the rows sent
            batch.sent_rows = self._payload_rows(source, group, sends)
        if len(self._groups) == 1:
            batch.payload = fetched_rows(self.owned_rows, self._groups[0], parts[0][1][sends]).reshape(-1)
        else:  # rows of every group, read group by group, then placed in request order
            sent = sends.nonzero().flatten()
            sent_group = group.index_select(0, sent)
            by_group = torch.sort(sent_group, stable=True).indices  # group-major position -> request order
            rows = [
                fetched_rows(
                    self.owned_rows, g, gid.index_select(0, sent[sent_group == index]) - self.layout.group_base[index]
                )
                for index, g in enumerate(self._groups)
            ]
            place = torch.empty_like(by_group).index_copy_(
                0, by_group, torch.arange(by_group.numel(), device=self._compute_device)
            )
            batch.payload = flatten_rows(rows, place, widths.index_select(0, sent).index_select(0, by_group))

    # --- fetching ahead: the owners' side in the input dist ---------------------------------

    def answer_ahead(self, batch: CachedBatch) -> None:
        """Owners answer with the margin rule (:data:`ahead`) once the requests arrived (input dist's first awaitable).

        The values served miss the previous backward's pushes; the margin covers one step of them."""
        self.pushes.apply_arrived()  # a plain loop: the previous backward's pushes (pipelined: already applied)
        self.answer(batch, self._bounds_ahead)

    def expect_rows_ahead(self, batch: CachedBatch, replies: torch.Tensor) -> tuple[list[int], list[int]]:
        """Requester side of a batch fetched ahead, once the owners' versions came: which requests
        bring a row; returns the rows' (send, receive) sizes per rank (the fetch's second host sync)."""
        widths = self._fetch_widths.index_select(0, batch.group)
        brings = protocol.sends(batch.held, replies, self._bounds_ahead.index_select(0, batch.group))
        rows_in = torch.bincount(batch.dest[brings], widths[brings], minlength=self._ws).long()
        batch.replies, batch.brings = replies, brings
        per_rank = [batch.rows_out, rows_in]
        if self.row_codec.active:
            brought = self._payload_rows(batch.dest, batch.group, brings)
            per_rank += [batch.sent_rows.values_per_rank(self._ws), brought.values_per_rank(self._ws)]
        send, recv, *values = torch.stack(per_rank).tolist()
        if self.row_codec.active:
            self._code_rows(batch, brought, values, send, recv, heads=0)
        return send, recv

    def settle_ahead(self, batch: CachedBatch, training: bool) -> torch.Tensor:
        """Requester side of a batch fetched ahead (``batch.rows_received``): slots for the rows it
        lacks, the settle, the pooled bags (no exchange; the backward's push counts go out with the
        pushes)."""
        batch.writes = training and torch.is_grad_enabled()
        rescans = self._plan_slots(batch, batch.brings, training)  # the settle's host sync
        batch.push_counts = self._reserve(batch, rescans, training)
        widths = torch.where(batch.brings, self._fetch_widths.index_select(0, batch.group), 0)
        starts = torch.cumsum(widths, 0) - widths
        self._settle(
            batch, batch.rows_received, starts, batch.step - 1, training
        )  # answered before the previous pushes
        batch.pull_counts = None  # exchanged with the pushes
        batch.rows_received = None
        return self._pooled(batch)

    # --- output dist: the requester's side ---------------------------------------------------

    def rows_request(
        self, batch: CachedBatch, replies: torch.Tensor, training: bool
    ) -> tuple[torch.Tensor, list[int], list[int]]:
        """Requester side, once the owners' versions came: which rows come, their slots, and what to send.

        Each rank gets a header (the gradients this rank will push to it in the backward, per group),
        then the rows it asked for. Returns (what to send, send sizes, receive sizes); one host sync."""
        ws, heads = self._ws, max(len(self._groups), 1)
        widths = self._fetch_widths.index_select(0, batch.group)
        brings = protocol.sends(batch.held, replies, self._bounds.index_select(0, batch.group))
        batch.rows_in = torch.bincount(batch.dest[brings], widths[brings], minlength=ws).long()
        batch.replies, batch.brings = replies, brings
        batch.writes = training and torch.is_grad_enabled()
        read_along = [batch.rows_out, batch.rows_in]
        if self.row_codec.active:
            brought = self._payload_rows(batch.dest, batch.group, brings)
            read_along += [batch.sent_rows.values_per_rank(ws), brought.values_per_rank(ws)]
        rescans = self._plan_slots(batch, brings, training, read_along)  # the output dist's one host sync
        rows_out, rows_in = rescans[:ws], rescans[ws : 2 * ws]
        push_counts = self._reserve(batch, rescans[len(read_along) * ws :], training)
        header = push_counts.to(torch.int32).view(torch.float32)  # [ws, heads]
        # each rank's segment: its header, then the rows it asked for (the payload is by requester)
        segments = batch.payload.split(rows_out)
        send = torch.cat([part for rank in range(ws) for part in (header[rank], segments[rank])])
        send_sizes, recv_sizes = [heads + r for r in rows_out], [heads + r for r in rows_in]
        if self.row_codec.active:
            values = [rescans[2 * ws : 3 * ws], rescans[3 * ws : 4 * ws]]
            self._code_rows(batch, brought, values, send_sizes, recv_sizes, heads)
        return send, send_sizes, recv_sizes

    # --- the forward codec: the rows' values ----------------------------------------------------

    def _payload_rows(self, ranks: torch.Tensor, group: torch.Tensor, chosen: torch.Tensor) -> PayloadRows:
        """The rows of the requests ``chosen`` (bool per request; ``ranks``: the other side of each,
        ``group``: its group), as a payload carries them: the row's values, then its state."""
        widths = torch.where(chosen, self._fetch_widths.index_select(0, group), 0)
        return PayloadRows(widths, torch.where(chosen, self._dims.index_select(0, group), 0), ranks)

    def _code_rows(
        self,
        batch: CachedBatch,
        brought: PayloadRows,
        values: list[list[int]],
        send: list[int],
        recv: list[int],
        heads: int,
    ) -> None:
        """The rows' exchange under the forward codec (``batch.coded_rows``): ``values`` sent and received
        per rank, of ``send`` and ``recv`` floats whose segments start with ``heads`` header words."""
        out = batch.sent_rows.share(send, values[0], heads)
        batch.coded_rows = CodedPayload(self.row_codec, out, brought.share(recv, values[1], heads))
        batch.sent_rows = None

    def settle_fetched(self, batch: CachedBatch, received: torch.Tensor, training: bool) -> torch.Tensor:
        """Requester side, once the rows' exchange arrived: the push counts the other ranks sent,
        the settle, the pooled bags."""
        ws, groups, device = self._ws, len(self._groups), self._compute_device
        heads = max(groups, 1)
        head_in = (torch.cumsum(batch.rows_in + heads, 0) - batch.rows_in - heads).unsqueeze(1) + torch.arange(
            heads, device=device
        )
        pull_counts = received.index_select(0, head_in.reshape(-1)).view(torch.int32).long().view(ws, heads)
        widths = torch.where(batch.brings, self._fetch_widths.index_select(0, batch.group), 0)
        starts = torch.cumsum(widths, 0) - widths + heads * (batch.dest + 1)  # where each brought row starts
        self._settle(batch, received, starts, batch.step, training)
        batch.pull_counts = pull_counts[:, :groups]
        return self._pooled(batch)

    def _plan_slots(
        self, batch: CachedBatch, brings: torch.Tensor, training: bool, read_along: list[torch.Tensor] | None = None
    ) -> list[int]:
        """Per group, the slot plan (:func:`~torchrec_het.sharding.het_cache.protocol.plan_slots`);
        returns ``read_along`` and each group's rescan decision, read in one host sync."""
        batch.slot_plans = [
            protocol.plan_slots(g, read, batch, index, brings, training)
            for index, (g, read) in enumerate(zip(self._groups, batch.reads))
        ]
        parts = (read_along or []) + [plan.shortfall for plan in batch.slot_plans]
        return torch.cat(parts).tolist() if parts else []

    def _reserve(self, batch: CachedBatch, rescans: list[int], training: bool) -> torch.Tensor:
        """Training: slots for the rows each group lacks (evicting by the policy), and the backward's
        plan; returns ``[ws, groups]`` rows this rank will push to each rank. Evaluation reserves
        nothing: every row it lacks is served as fetched."""
        push_counts = torch.zeros(self._ws, max(len(self._groups), 1), dtype=torch.int64, device=self._compute_device)
        for index, (g, read, plan) in enumerate(zip(self._groups, batch.reads, batch.slot_plans)):
            if not training:
                read.uncached = read.remote.index_select(0, plan.asked.index_select(0, plan.missing))
                self.pushes.plan(index, read, False)
                continue
            new_slots, dirty, evicted = g.cache.reserve(
                plan.missing_ids,
                batch.held.index_select(0, plan.mine.index_select(0, plan.missing)),
                batch.step - (1 if self.ahead else 0),
                protect=plan.protect,
                check=False,
                rescan=bool(rescans[index]),
            )
            read.slots.index_copy_(0, plan.asked.index_select(0, plan.missing), new_slots)
            read.uncached = read.remote.index_select(0, plan.asked.index_select(0, plan.missing[new_slots < 0]))
            if len(dirty):
                self.pushes.queue_dirty(index, dirty)
                g.stats.add("dirty_evictions", g.table_of(dirty.ids))
            g.stats.add("evictions", g.table_of(evicted))
            self.pushes.plan(index, read, batch.writes)
            push_counts[:, index] = read.push_counts
        return push_counts

    def _settle(
        self, batch: CachedBatch, received: torch.Tensor, starts: torch.Tensor, validated: int, training: bool
    ) -> None:
        """Each group's settle (:func:`~torchrec_het.sharding.het_cache.protocol.settle`) with the rows
        that came (``received``; each brought row's first float at ``starts``)."""
        keep_pinned = self.pushes.batches_ahead and training and torch.is_grad_enabled()
        for g, read, plan in zip(self._groups, batch.reads, batch.slot_plans):
            at = starts.index_select(0, plan.mine[plan.brings]).unsqueeze(1) + torch.arange(
                g.fetch_width, device=self._compute_device
            )
            rows = received.index_select(0, at.reshape(-1)).view(-1, g.fetch_width)
            owned = read_rows(self.owned_rows, g, read.uniq.index_select(0, read.local))
            protocol.settle(
                g, read, plan, batch.replies.index_select(0, plan.mine), rows, owned, validated, training, keep_pinned
            )
        batch.slot_plans = None

    def _pooled(self, batch: CachedBatch) -> torch.Tensor:
        self.pushes.settled(batch)
        return self.layout.pooled(batch, self._anchor, self.pushes.write_back)

    # --- checkpoints -------------------------------------------------------------------------

    @torch.no_grad()
    def flush(self) -> None:
        """Pushes every pending gradient to its owner (a collective: every rank calls it)."""
        self.pushes.flush()
        super().flush()

    def purge(self) -> None:
        """Forgets cached rows, pending gradients and versions (before a load)."""
        self.pushes.purge()
        self.owned_rows.forget()
        super().purge()

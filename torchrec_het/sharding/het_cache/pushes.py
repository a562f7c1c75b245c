"""The write path of ``het_cached_row_wise``: what each backward pushes to the owners, and the owners' updates.

:class:`HetPushes` is a collaborator of the lookup with its own state (dirty rows waiting, due
backwards, pushes in flight); its exchanges are issued by
:class:`~torchrec_het.sharding.het_cache.dists.HetPushDist`.

Design: docs/internals.md#het-cache-pushes
"""

from collections import deque

import torch
from torch import nn
from torchrec.distributed.types import Awaitable

from torchrec_het import _tbe
from torchrec_het.cache import PendingRows
from torchrec_het.sharding.common.output_layout import gradient_scale
from torchrec_het.sharding.common.wire_codec import WireCodec
from torchrec_het.sharding.het_cache.batch import CachedBatch, GroupRead
from torchrec_het.sharding.het_cache.coded_rows import CodedPayload, PayloadRows, ValueCodec, ValueShare
from torchrec_het.sharding.het_cache.groups import HetGroup

PUSH_HEAD = 4  # a pushed row: id and update count as int64 bit patterns (two float32 words each), then the gradient


class HetPushes:
    """Pushes and owner-side updates of one lookup's groups.

    Args:
        groups: the lookup's groups (shared: their caches, versions and counters).
        kernels: the lookup's TorchRec kernels (the owners' fused optimizers).
        rank: this rank.
        world_size: ranks of the sharding.
        device: compute device.
        wire: the push dist that carries the exchanges (``counts``, ``start``, ``exchange``).
        codec: the backward codec of the gradients pushed (the rest of a pushed row stays exact);
            None: fp32.
    """

    def __init__(
        self,
        groups: list[HetGroup],
        kernels: nn.ModuleList,
        rank: int,
        world_size: int,
        device: torch.device,
        wire,
        codec: WireCodec | None = None,
    ) -> None:
        self.groups, self.kernels, self.rank, self.world_size, self.device = groups, kernels, rank, world_size, device
        self.wire = wire
        self.codec = codec if codec is not None else WireCodec()
        self.outbox: list[list[PendingRows]] = [[] for _ in groups]  # per group: evicted dirty rows not pushed yet
        self.awaiting: deque[CachedBatch] = deque()  # settled batches whose backward is due, oldest first
        self.in_flight: tuple[Awaitable[torch.Tensor], torch.Tensor] | None = (
            None  # (the last backward's pushes, pull counts)
        )
        self.batches_ahead = False  # later batches may settle before a backward (the hybrid pipeline)
        for g in groups:
            found = {_tbe.optimizer_kind(kernels[m].emb_module) for m in g.modules}
            kind = found.pop() if len(found) == 1 else None
            if kind in ("adagrad", "rowwise_adagrad") and g.cache.capacity:  # for its copies' local steps
                eps = torch.tensor([_tbe.optimizer_eps(kernels[t.module_index].emb_module) for t in g.tables])
                g.keep_optimizer_state(kind, eps)
        self.widths = torch.tensor([self.width(g) for g in groups], dtype=torch.int64, device=device)  # per group
        self.dims = torch.tensor([g.dim for g in groups], dtype=torch.int64, device=device)

    @staticmethod
    def width(g: HetGroup) -> int:
        """Floats of one pushed row of the group: the head, the gradient, its held squares (Adagrad family)."""
        return PUSH_HEAD + g.dim + g.state_width

    # --- the settle's side: what the backward will push ------------------------------------

    def queue_dirty(self, index: int, dirty: PendingRows) -> None:
        """Rows of group ``index`` evicted with pending updates: they go out with the next push."""
        self.outbox[index].append(dirty)

    def plan(self, index: int, read: GroupRead, writes: bool) -> None:
        """What this batch's backward will push to each owner (``read.push_counts``): owned and
        uncached rows, cached rows that pass the write bound with this step's update, and dirty
        evicted rows."""
        g = self.groups[index]
        if not writes or self.batches_ahead:  # no backward will come, or its counts go out with it
            read.push_counts = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
            return
        cached = read.slots[read.slots >= 0]
        read.due = cached[g.cache.pending_count.index_select(0, cached) + 1 > g.settings.s_write]
        read.outbox, self.outbox[index] = self.outbox[index], []
        ids = [
            read.uniq.index_select(0, read.local),
            read.uniq.index_select(0, read.uncached),
            g.cache.slot_ids.index_select(0, read.due),
            *[p.ids for p in read.outbox],
        ]
        read.push_counts = torch.bincount(g.owner_of(torch.cat(ids)), minlength=self.world_size)

    def settled(self, batch: CachedBatch) -> None:
        """A batch settled: its backward is due (or, with none to come, its reads keep no dirty rows)."""
        if batch.writes:
            self.awaiting.append(batch)
        else:
            for read in batch.reads:
                read.outbox = []

    def skip_unanswered(self) -> None:
        """Before a lookup: batches that got no backward (a forward without one) give their planned
        pushes back to the queue (unless later batches may run ahead of backwards)."""
        while self.awaiting and not self.batches_ahead:
            self.requeue(self.awaiting.popleft())

    def requeue(self, batch: CachedBatch) -> None:
        """A settled batch got no backward: the dirty rows it was to push wait for the next push."""
        for index, (g, read) in enumerate(zip(self.groups, batch.reads)):
            self.outbox[index] = read.outbox + self.outbox[index]
            read.outbox = []
            if read.pinned is not None and read.pinned.numel():
                g.pins.index_add_(0, read.pinned, torch.full_like(read.pinned, -1, dtype=g.pins.dtype))
                read.pinned = read.pinned[:0]

    # --- the backward ----------------------------------------------------------------------

    def write_back(self, batch: CachedBatch, row_grads: list[torch.Tensor]) -> None:
        """Called by the backward of a batch with the gradient of every distinct row it read:
        starts the pushes (one all-to-all), which the next lookup, ``flush`` or ``purge`` waits for."""
        while self.awaiting and self.awaiting[0] is not batch:  # older batches that got no backward
            self.requeue(self.awaiting.popleft())
        if not self.awaiting:
            raise RuntimeError(
                "het_cached_row_wise: a backward must follow its own forward before the next forward runs"
            )
        self.awaiting.popleft()
        self.apply_arrived()  # a backward with no forward since the last (a pipeline's last batches): apply those first
        scale = self.grad_scale()
        ws, groups = self.world_size, len(self.groups)
        packed, keys, widths = [], [], []
        for index, (g, read, grad) in enumerate(zip(self.groups, batch.reads, row_grads)):
            grad = grad * scale
            g.stats.add_mass("grad_produced", read.tables, grad)
            cached = (read.slots >= 0).nonzero().flatten()
            slots = read.slots.index_select(0, cached)
            cached_grad = grad.index_select(0, read.remote.index_select(0, cached))
            tables = read.tables.index_select(0, read.remote.index_select(0, cached))
            squares = _tbe.squares_of(g.held_kind, cached_grad) if g.held_kind is not None else None
            deltas = self.local_step(g, slots, cached_grad, tables)  # none where the cache has no slots
            if g.settings.s_write == 0:  # every update goes out now (read.due is every cached row)
                due = g.cache.write_through(slots, cached_grad, deltas, squares)
            else:
                g.cache.accumulate(slots, cached_grad, deltas, squares)
                due = g.cache.take_due(g.settings.s_write, slots) if self.batches_ahead else g.cache.take(read.due)
            if self.batches_ahead:  # dirty rows evicted by any batch since the last push go too
                read.outbox, self.outbox[index] = self.outbox[index], []
                g.pins.index_add_(0, read.pinned, torch.full_like(read.pinned, -1, dtype=g.pins.dtype))
                read.pinned = read.pinned[:0]
            pending = PendingRows.concat(
                [
                    PendingRows(
                        read.uniq.index_select(0, read.local),
                        grad.index_select(0, read.local),
                        torch.ones_like(read.local),
                    ),
                    PendingRows(
                        read.uniq.index_select(0, read.uncached),
                        grad.index_select(0, read.uncached),
                        torch.ones_like(read.uncached),
                    ),
                    due,
                    *read.outbox,
                ]
            )
            dest = g.owner_of(pending.ids)
            g.stats.add("rows_pushed", g.table_of(pending.ids[dest != self.rank]))
            packed.append(pack_push(pending, g.held_kind))
            keys.append(dest * groups + index)
            widths.append(torch.full_like(dest, self.width(g)))
        key, width = torch.cat(keys), torch.cat(widths)
        order = torch.sort(key, stable=True).indices  # by owner, then group
        flat = flatten_rows(packed, order, width)
        send = torch.bincount(key // groups, width, minlength=ws).long()
        if self.batches_ahead:  # the counts of what this backward pushes go out now
            batch.pull_counts = self.wire.counts(torch.bincount(key, minlength=ws * groups).view(ws, groups))
        elif batch.pull_counts is None:  # fetched ahead: the push counts go out now
            batch.pull_counts = self.wire.counts(batch.push_counts[:, :groups])
        recv = (batch.pull_counts * self.widths).sum(1)
        if self.codec.active:
            ordered = key.index_select(0, order)
            rows = PayloadRows(
                width.index_select(0, order), self.dims.index_select(0, ordered % groups), ordered // groups
            )
            self.in_flight = (self.start_coded(flat, send, recv, rows, batch.pull_counts), batch.pull_counts)
            return
        send_list, recv_list = torch.stack([send, recv]).tolist()  # the backward's one host sync
        self.in_flight = (self.wire.start(flat, send_list, recv_list), batch.pull_counts)

    # --- the backward codec: the gradients' columns ---------------------------------------------

    def start_coded(
        self, flat: torch.Tensor, send: torch.Tensor, recv: torch.Tensor, rows: PayloadRows, pull_counts: torch.Tensor
    ) -> Awaitable[torch.Tensor]:
        """:meth:`write_back`'s pushes under the backward codec: ``flat`` holds ``rows``, ``send[d]``
        floats of them to rank d; ``pull_counts[s, g]`` rows of group g come from rank s (``recv[s]`` floats)."""
        values_in = (pull_counts * self.dims).sum(1)
        sizes = [send, recv, rows.values_per_rank(self.world_size), values_in, pull_counts.sum(1)]
        send, recv, values_out, values_in, rows_in = torch.stack(sizes).tolist()  # the backward's one host sync
        groups = torch.arange(len(self.groups), device=self.device).repeat(self.world_size)
        group = torch.repeat_interleave(groups, pull_counts.reshape(-1), output_size=sum(rows_in))  # as rows arrive
        arriving = PayloadRows(self.widths.index_select(0, group), self.dims.index_select(0, group))
        out = rows.share(send, values_out, first=PUSH_HEAD)
        return self.wire.start(flat, send, recv, self.coded(out, arriving.share(recv, values_in, first=PUSH_HEAD)))

    def grad_scale(self) -> float:
        """The factor of the gradients pushed: TorchRec's gradient division, as its row-wise backward."""
        return gradient_scale(self.world_size)

    def coded(self, out: ValueShare, into: ValueShare) -> CodedPayload:
        """The pushes' exchange under the backward codec: the gradient columns take it, without the
        gradient division (applied on arrival, as TorchRec's all-to-all applies it after decoding)."""
        return CodedPayload(ValueCodec(self.codec, self.grad_scale()), out, into)

    def group_share(self, g: HetGroup, counts: list[int]) -> ValueShare:
        """Where the gradients sit among ``counts[r]`` pushed rows of group ``g`` for (or from) each rank r."""
        widths = torch.full((sum(counts),), self.width(g), dtype=torch.int64, device=self.device)
        floats, values = [c * self.width(g) for c in counts], [c * g.dim for c in counts]
        return PayloadRows(widths, torch.full_like(widths, g.dim)).share(floats, values, first=PUSH_HEAD)

    def local_step(self, g: HetGroup, slots: torch.Tensor, grad: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The update a cached copy takes now for its gradient ``grad``: the table's optimizer step
        as this rank knows the row (:func:`~torchrec_het._tbe.step_rows` from the cached value and
        the state the owner sent plus this rank's squares not yet pushed). When this rank is the
        row's only writer, k local steps are the k synchronous steps; SGD's is ``-lr * grad``. The
        owner still applies the pushed gradients (this delta only serves this rank's reads until
        the next fetch)."""
        lr = self.learning_rates(g).index_select(0, tables).unsqueeze(1)
        if g.held_kind is None:
            return -lr * grad
        weight = g.cache.values.index_select(0, slots)
        new, _ = _tbe.step_rows(
            g.held_kind, weight, g.cache.known_states(slots), grad, lr, g.eps.index_select(0, tables).unsqueeze(1)
        )
        return new - weight

    def learning_rates(self, g: HetGroup) -> torch.Tensor:
        """Each table's current learning rate (its kernel's, so schedules apply; no host sync)."""
        rates = torch.stack([_tbe.learning_rate(m.emb_module) for m in self.kernels]).to(self.device)
        return rates.index_select(0, g.table_module)

    # --- the owners ------------------------------------------------------------------------

    def apply_arrived(self) -> None:
        """Waits for the last backward's pushes and applies them at their owners (local after the wait)."""
        if self.in_flight is None:
            return
        arriving, pull_counts = self.in_flight
        self.in_flight = None
        received = arriving.wait()
        groups = len(self.groups)
        if groups == 1:
            self.apply_packed(self.groups[0], received.view(-1, self.width(self.groups[0])))
            return
        row_group = torch.repeat_interleave(
            torch.arange(groups, device=self.device).repeat(self.world_size), pull_counts.reshape(-1)
        )
        width = self.widths.index_select(0, row_group)
        start = torch.cumsum(width, 0) - width
        for index, g in enumerate(self.groups):
            mine = (row_group == index).nonzero().flatten()
            at = start.index_select(0, mine).unsqueeze(1) + torch.arange(self.width(g), device=self.device)
            self.apply_packed(g, received.index_select(0, at.reshape(-1)).view(-1, self.width(g)))

    def apply_packed(self, g: HetGroup, rows: torch.Tensor) -> None:
        """Owner side: applies pushed rows (:func:`pack_push`'s layout) of group ``g``."""
        # fresh contiguous copies: a row of odd width (row-wise Adagrad's one square) has an odd stride
        ids = rows[:, :2].clone(memory_format=torch.contiguous_format).view(torch.int64).view(-1)
        updates = rows[:, 2:4].clone(memory_format=torch.contiguous_format).view(torch.int64).view(-1)
        grads, beyond = rows[:, PUSH_HEAD : PUSH_HEAD + g.dim], rows[:, PUSH_HEAD + g.dim :]
        self.apply(g, ids, grads, updates, beyond if beyond.size(1) else None)

    @torch.no_grad()
    def apply(
        self,
        g: HetGroup,
        ids: torch.Tensor,
        grads: torch.Tensor,
        updates: torch.Tensor,
        beyond: torch.Tensor | None = None,
    ) -> None:
        """Owner side: one fused-optimizer step per owned row with the summed gradient; versions move on.

        Adagrad family: a push of k held updates carries their squares beyond the square of
        their sum (``beyond``), so the row's state grows as the k steps would have grown it
        (pushes of one update each, from several ranks in one step, add up to the synchronous
        step): :func:`~torchrec_het._tbe.apply_rows`.
        """
        if ids.numel() == 0:
            return
        tables = g.table_of(ids)
        rows = g.local_rows(ids, tables)
        for module_index in g.modules:
            tbe = self.kernels[module_index].emb_module
            step, mine_rows, mine_tables, mine_beyond, mine_updates = grads, rows, tables, beyond, updates
            if len(g.modules) > 1:
                mine = (g.table_module.index_select(0, tables) == module_index).nonzero().flatten()
                step, mine_rows = grads.index_select(0, mine), rows.index_select(0, mine)
                mine_tables, mine_updates = tables.index_select(0, mine), updates.index_select(0, mine)
                mine_beyond = beyond.index_select(0, mine) if beyond is not None else None
            _tbe.apply_rows(
                tbe, g.kernel_table.index_select(0, mine_tables), mine_rows, step, mine_beyond, mine_updates
            )
        g.versions.index_add_(0, g.local_index_of(ids), updates)
        g.stats.add_mass("grad_applied", tables, grads)

    # --- flush and purge -------------------------------------------------------------------

    @torch.no_grad()
    def flush(self) -> None:
        """Pushes every pending gradient to its owner (collectives: every rank calls it)."""
        self.apply_arrived()
        self.skip_unanswered()  # a forward without backward: its queued evictions go too
        for index, g in enumerate(self.groups):
            pending = PendingRows.concat([g.cache.take_all(), *self.outbox[index]])
            self.outbox[index] = []
            ws, width = self.world_size, self.width(g)
            dest = g.owner_of(pending.ids)
            order = torch.sort(dest, stable=True).indices
            counts = torch.bincount(dest, minlength=ws)
            recv_counts = self.wire.counts(counts.view(ws, 1)).view(ws)
            send, recv = torch.stack([counts, recv_counts]).tolist()
            packed = pack_push(pending, g.held_kind).index_select(0, order)
            coded = self.coded(self.group_share(g, send), self.group_share(g, recv)) if self.codec.active else None
            received = self.wire.exchange(packed.view(-1), [c * width for c in send], [c * width for c in recv], coded)
            g.stats.add("rows_pushed", g.table_of(pending.ids[dest != self.rank]))
            self.apply_packed(g, received.view(-1, width))

    def purge(self) -> None:
        """Forgets cached rows, pending gradients and versions (before a load)."""
        self.apply_arrived()
        for index, g in enumerate(self.groups):
            g.reset()
            self.outbox[index] = []
        self.awaiting.clear()


def pack_push(pending: PendingRows, kind: str | None = None) -> torch.Tensor:
    """``[n, 4 + dim (+ w)]`` float32 rows: id and update count as int64 bit patterns, the gradient,
    and (Adagrad family, ``kind``) its updates' squares beyond the square of their sum (``w`` wide)."""
    parts = [
        pending.ids.view(torch.float32).view(-1, 2),
        pending.counts.view(torch.float32).view(-1, 2),
        pending.grads.float(),
    ]
    if kind is not None:  # a row of one update has none beyond (exactly: the synchronous step stays bit-exact)
        squares = pending.squares if pending.squares is not None else _tbe.squares_of(kind, pending.grads)
        beyond = (squares.double() - _tbe.squares_of(kind, pending.grads).double()).float()
        parts.append(torch.where(pending.counts.unsqueeze(1) > 1, beyond, 0.0))
    return torch.cat(parts, 1)


def flatten_rows(parts: list[torch.Tensor], order: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The rows of ``parts`` (one after the other; row i has ``width[i]`` values) flattened in ``order``."""
    if len(parts) == 1:
        return parts[0].index_select(0, order).reshape(-1)
    flat = torch.cat([p.reshape(-1) for p in parts])
    start = torch.cumsum(width, 0) - width  # of each row in ``flat``
    ordered = width.index_select(0, order)
    first = torch.repeat_interleave(torch.cumsum(ordered, 0) - ordered, ordered)
    base = torch.repeat_interleave(start.index_select(0, order), ordered)
    return flat.index_select(0, base + torch.arange(base.numel(), device=flat.device) - first)

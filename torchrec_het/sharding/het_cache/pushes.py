"""The write path of ``het_cached_row_wise``: pushing gradients to their owners and applying them there.

A mixin of :class:`~torchrec_het.sharding.het_cache.lookup.HetCachedEmbeddingLookup`. The backward
of a batch calls :meth:`HetWrites.write_back` with every distinct row's gradient: cached
rows take a local optimizer step (with the row's state as this rank knows it) and keep their
gradient pending until the write bound is due;
owned rows, rows that found no cache slot, due rows and dirty evictions go to their owners
in one asynchronous all-to-all, which the next lookup, ``flush`` or ``purge`` waits for
(:meth:`HetWrites.wait_pushes`). Owners apply the table's fused optimizer once per row
with the summed gradient and move the row's version on.
"""

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division

from torchrec_het import _tbe
from torchrec_het._compat import lookup_kernels
from torchrec_het.cache import PendingRows
from torchrec_het.sharding.common.exchange import exchange_counts, exchange_flat
from torchrec_het.sharding.het_cache.batch import CachedBatch
from torchrec_het.sharding.het_cache.groups import HetGroup

_PUSH_HEAD = 4  # a pushed row: id and update count as int64 bit patterns (two float32 words each), then the gradient


class HetWrites:
    """Pushes and owner-side updates; uses the lookup's groups, process groups and step state."""

    def write_back(self, step: CachedBatch, row_grads: list[torch.Tensor]) -> None:
        """Called by the backward of a batch with the gradient of every distinct row it read:
        starts the pushes (one all-to-all), which the next lookup, ``flush`` or ``purge`` waits for."""
        while self._awaiting and self._awaiting[0] is not step:  # older batches that got no backward
            self._requeue(self._awaiting.popleft())
        if not self._awaiting:
            raise RuntimeError(
                "het_cached_row_wise: a backward must follow its own forward before the next forward runs"
            )
        self._awaiting.popleft()
        self.wait_pushes()  # a backward with no forward since the last (a pipeline's last batches): apply those first
        scale = 1.0 / self._ws if get_gradient_division() else 1.0  # as TorchRec's row-wise backward
        ws = self._ws
        packed, keys, widths = [], [], []
        for index, (g, read, grad) in enumerate(zip(self._groups, step.reads, row_grads)):
            grad = grad * scale
            g.stats.add_mass("grad_produced", read.tables, grad)
            cached = (read.slots >= 0).nonzero().flatten()
            slots = read.slots.index_select(0, cached)
            cached_grad = grad.index_select(0, read.remote.index_select(0, cached))
            tables = read.tables.index_select(0, read.remote.index_select(0, cached))
            squares = _tbe.squares_of(g.held_kind, cached_grad) if g.held_kind is not None else None
            g.cache.accumulate(slots, cached_grad, self._local_step(g, slots, cached_grad, tables), squares)
            if self.batches_ahead:  # due now; dirty rows evicted by any batch since the last push go too
                due = g.cache.take_due(g.settings.s_write, slots)
                read.outbox, self._outbox[index] = self._outbox[index], []
                g.pins.index_add_(0, read.pinned, torch.full_like(read.pinned, -1, dtype=g.pins.dtype))
                read.pinned = read.pinned[:0]
            else:
                due = g.cache.take(read.due)
            pending = PendingRows.concat([
                PendingRows(read.uniq.index_select(0, read.local), grad.index_select(0, read.local),
                            torch.ones_like(read.local)),
                PendingRows(read.uniq.index_select(0, read.uncached), grad.index_select(0, read.uncached),
                            torch.ones_like(read.uncached)),
                due,
                *read.outbox,
            ])
            dest = g.owner_of(pending.ids)
            g.stats.add("rows_pushed", g.table_of(pending.ids[dest != self._rank]))
            packed.append(_pack_push(pending, g.held_kind))
            keys.append(dest * len(self._groups) + index)
            widths.append(torch.full_like(dest, self._push_width(g)))
        key, width = torch.cat(keys), torch.cat(widths)
        order = torch.sort(key, stable=True).indices  # by owner, then group
        flat = flatten_rows(packed, order, width)
        send = torch.bincount(key // len(self._groups), width, minlength=ws).long()
        if self.batches_ahead:  # the counts of what this backward pushes go out now
            counts = torch.bincount(key, minlength=ws * len(self._groups)).view(ws, len(self._groups))
            step.pull_counts = exchange_counts(counts, self._exchange_pg)
        elif step.pull_counts is None:  # fetched ahead: the push counts go out now
            step.pull_counts = exchange_counts(step.push_counts[:, : len(self._groups)], self._exchange_pg)
        recv = (step.pull_counts * self._push_widths()).sum(1)
        send_list, recv_list = torch.stack([send, recv]).tolist()  # the backward's one host sync
        received = flat.new_empty(sum(recv_list))
        work = dist.all_to_all_single(received, flat, recv_list, send_list, group=self._exchange_pg, async_op=True)
        self._inflight = (work, received, step.pull_counts)

    def wait_pushes(self) -> None:
        """Waits for the last backward's pushes and applies them at their owners (local after the wait)."""
        if self._inflight is None:
            return
        work, received, pull_counts = self._inflight
        self._inflight = None
        work.wait()
        groups = len(self._groups)
        if groups == 1:
            self._apply_packed(self._groups[0], received.view(-1, self._push_width(self._groups[0])))
            return
        row_group = torch.repeat_interleave(
            torch.arange(groups, device=self._compute_device).repeat(self._ws), pull_counts.reshape(-1)
        )
        width = self._push_widths().index_select(0, row_group)
        start = torch.cumsum(width, 0) - width
        for index, g in enumerate(self._groups):
            mine = (row_group == index).nonzero().flatten()
            at = start.index_select(0, mine).unsqueeze(1) + torch.arange(self._push_width(g), device=self._compute_device)
            self._apply_packed(g, received.index_select(0, at.reshape(-1)).view(-1, self._push_width(g)))

    def _apply_packed(self, g: HetGroup, rows: torch.Tensor) -> None:
        # fresh contiguous copies: a row of odd width (row-wise Adagrad's one square) has an odd stride
        ids = rows[:, :2].clone(memory_format=torch.contiguous_format).view(torch.int64).view(-1)
        updates = rows[:, 2:4].clone(memory_format=torch.contiguous_format).view(torch.int64).view(-1)
        grads, beyond = rows[:, _PUSH_HEAD : _PUSH_HEAD + g.dim], rows[:, _PUSH_HEAD + g.dim :]
        self._apply(g, ids, grads, updates, beyond if beyond.size(1) else None)

    def _keep_optimizer_state(self) -> None:
        """At construction: a group whose kernels share one Adagrad-family optimizer keeps each
        cached row's optimizer state (:meth:`~torchrec_het.sharding.het_cache.groups.HetGroup.keep_optimizer_state`)."""
        kernels = lookup_kernels(self)
        for g in self._groups:
            found = {_tbe.optimizer_kind(kernels[m].emb_module) for m in g.modules}
            kind = found.pop() if len(found) == 1 else None
            if kind in ("adagrad", "rowwise_adagrad"):
                eps = torch.tensor([_tbe.optimizer_eps(kernels[t.module_index].emb_module) for t in g.tables])
                g.keep_optimizer_state(kind, eps)

    def _local_step(self, g: HetGroup, slots: torch.Tensor, grad: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The update a cached copy takes now for its gradient ``grad``: the table's optimizer step
        as this rank knows the row (:func:`~torchrec_het._tbe.step_rows` from the
        cached value and the state the owner sent plus this rank's squares not yet pushed). When
        this rank is the row's only writer, k local steps are the k synchronous steps; SGD's is
        ``-lr * grad``. The owner still applies the pushed gradients (this delta only serves this
        rank's reads until the next fetch)."""
        lr = self._learning_rates(g).index_select(0, tables).unsqueeze(1)
        if g.held_kind is None:
            return -lr * grad
        weight = g.cache.values.index_select(0, slots)
        new, _ = _tbe.step_rows(g.held_kind, weight, g.cache.known_states(slots), grad, lr,
                           g.eps.index_select(0, tables).unsqueeze(1))
        return new - weight

    def _push_width(self, g: HetGroup) -> int:
        """Floats of one pushed row of the group: the head, the gradient, its held squares (Adagrad family)."""
        return _PUSH_HEAD + g.dim + g.state_width

    def _push_widths(self) -> torch.Tensor:
        return torch.tensor([self._push_width(g) for g in self._groups], device=self._compute_device)

    def _requeue(self, step: CachedBatch) -> None:
        """A settled batch got no backward: the dirty rows it was to push wait for the next push."""
        for index, (g, read) in enumerate(zip(self._groups, step.reads)):
            self._outbox[index] = read.outbox + self._outbox[index]
            read.outbox = []
            if read.pinned is not None and read.pinned.numel():
                g.pins.index_add_(0, read.pinned, torch.full_like(read.pinned, -1, dtype=g.pins.dtype))
                read.pinned = read.pinned[:0]

    def _learning_rates(self, g: HetGroup) -> torch.Tensor:
        """Each table's current learning rate (its kernel's, so schedules apply; no host sync)."""
        rates = torch.stack([_tbe.learning_rate(m.emb_module) for m in lookup_kernels(self)]).to(self._compute_device)
        return rates.index_select(0, g.table_module)

    @torch.no_grad()
    def flush(self) -> None:
        """Pushes every pending gradient to its owner (a collective: every rank calls it)."""
        self.wait_pushes()
        while self._awaiting and not self.batches_ahead:  # a forward without backward: its queued evictions go too
            self._requeue(self._awaiting.popleft())
        for index, g in enumerate(self._groups):
            pending = PendingRows.concat([g.cache.take_all(), *self._outbox[index]])
            self._outbox[index] = []
            self._push_now(g, pending)
        super().flush()

    def purge(self) -> None:
        """Forgets cached rows, pending gradients and versions (before a load)."""
        self.wait_pushes()
        for index, g in enumerate(self._groups):
            g.reset()
            self._outbox[index] = []
        self._awaiting.clear()
        self._views = {}
        super().purge()

    def _push_now(self, g: HetGroup, pending: PendingRows) -> None:
        """Sends pending gradients to their owners and applies them (a counts exchange, then the rows)."""
        ws, width = self._ws, self._push_width(g)
        dest = g.owner_of(pending.ids)
        order = torch.sort(dest, stable=True).indices
        counts = torch.bincount(dest, minlength=ws)
        recv_counts = exchange_counts(counts.view(ws, 1), self._exchange_pg).view(ws)
        send, recv = torch.stack([counts, recv_counts]).tolist()
        packed = _pack_push(pending, g.held_kind).index_select(0, order)
        received = exchange_flat(packed.view(-1), [c * width for c in send], [c * width for c in recv],
                                 self._exchange_pg)
        g.stats.add("rows_pushed", g.table_of(pending.ids[dest != self._rank]))
        self._apply_packed(g, received.view(-1, width))

    @torch.no_grad()
    def _apply(self, g: HetGroup, ids: torch.Tensor, grads: torch.Tensor, updates: torch.Tensor,
               beyond: torch.Tensor | None = None) -> None:
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
            tbe = lookup_kernels(self)[module_index].emb_module
            step, mine_rows, mine_tables, mine_beyond, mine_updates = grads, rows, tables, beyond, updates
            if len(g.modules) > 1:
                mine = (g.table_module.index_select(0, tables) == module_index).nonzero().flatten()
                step, mine_rows = grads.index_select(0, mine), rows.index_select(0, mine)
                mine_tables, mine_updates = tables.index_select(0, mine), updates.index_select(0, mine)
                mine_beyond = beyond.index_select(0, mine) if beyond is not None else None
            _tbe.apply_rows(tbe, g.kernel_table.index_select(0, mine_tables), mine_rows, step, mine_beyond, mine_updates)
        g.versions.index_add_(0, g.local_index_of(ids), updates)
        g.stats.add_mass("grad_applied", tables, grads)


def _pack_push(pending: PendingRows, kind: str | None = None) -> torch.Tensor:
    """``[n, 4 + dim (+ w)]`` float32 rows: id and update count as int64 bit patterns, the gradient,
    and (Adagrad family, ``kind``) its updates' squares beyond the square of their sum (``w`` wide)."""
    parts = [pending.ids.view(torch.float32).view(-1, 2), pending.counts.view(torch.float32).view(-1, 2),
             pending.grads.float()]
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

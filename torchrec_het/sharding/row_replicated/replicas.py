"""Hot rows replicated on every rank: one dense block per embedding width, kept identical everywhere.

A :class:`ReplicaBlock` holds the hot rows of tables of one width plus the owners' optimizer
state for them. Reads come from the block; gradients are summed over ranks every
``sync_every`` steps and applied with the owners' arithmetic before the next read, written
through to the owners' shards so a state dict always sees current values.

Design: docs/internals.md#row-replicated-replicas
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from torchrec_het import _tbe
from torchrec_het._tbe import square_width, squares_of, step_rows, step_rows_held
from torchrec_het.replication.memory import replica_copies
from torchrec_het.sharding.common.exchange import after_backward_pass
from torchrec_het.sharding.common.owned_rows import OwnedRows
from torchrec_het.sharding.row_replicated.sync import HostGroups


@dataclass
class OwnedSlots:
    """The hot rows this rank owns in one owner kernel: block rows ``slots`` are rows ``rows`` of its
    tables ``tables``, read and written through ``kernel`` (the :class:`OwnedRows` of that one kernel)."""

    kernel: OwnedRows
    slots: torch.Tensor
    tables: torch.Tensor
    rows: torch.Tensor


class ReplicaBlock:
    """The hot rows of tables of one width, replicated on every rank of ``pg``.

    A sync is sparse (touch counts, then the touched rows' gradients) and leaves every copy
    identical. Synced every k > 1 steps, a rank also steps its own copy with its own gradients at
    once; ``agreed_weights`` / ``agreed_state`` are what the next sync steps from.

    Args:
        hot_ids: sorted fused ids of the hot rows (the lookup's id space).
        dim: their width.
        optimizer: the owners' optimizer kind (all tables of the block share it).
        kernels: the owners' kernels (their learning rates are read at every step).
        kernel_of: ``[rows]`` index in ``kernels`` of each row's table.
        eps: float64 ``[rows]`` epsilon of each row's table.
        owned: where this rank's own hot rows live in its kernels.
        sync_every: combine gradients every this many steps (1: exactly synchronous).
        pg: the process group.
        device: where the block lives.
        hosts: ``pg``'s host subgroups: the sums run within each host, then between host
            leaders, then back within the host (:class:`~torchrec_het.sharding.row_replicated.sync.HostGroups`);
            None: flat all-reduces on ``pg``.
        sync_dtype: the dtype the gradient syncs sum in (a quantized-comms codec's; every rank
            still gets the same bits). Refreshes copy rows in fp32.
    """

    def __init__(
        self, hot_ids, dim, optimizer, kernels, kernel_of, eps, owned: list[OwnedSlots], sync_every, pg, device,
        hosts: HostGroups | None = None, sync_dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        rows = hot_ids.numel()
        self.hot_ids, self.dim, self.optimizer, self.pg = hot_ids.to(device), dim, optimizer, pg
        self.hosts, self.sync_dtype = hosts, sync_dtype
        self.weights = torch.zeros(rows, dim, device=device)
        self.state = torch.zeros(rows, square_width(optimizer, dim), device=device)
        self.kernels, self.kernel_of = kernels, kernel_of.to(device)
        self.eps = eps.view(-1, 1).to(device=device, dtype=torch.float64)  # Adagrad adds it in double
        self.owned, self.sync_every = owned, sync_every
        self.pending = torch.zeros(rows, dim, device=device)  # summed gradients held
        # syncing every k > 1 steps with an Adagrad-family optimizer: what each held step adds to the state
        self.holds_squares = optimizer != "sgd" and sync_every > 1
        self.squares = torch.zeros(rows, square_width(optimizer, dim) if self.holds_squares else 0, device=device)
        self.touches = torch.zeros(rows, device=device)  # how many bags read each row since the last sync
        # synced every k > 1 steps: the rows and state every rank agreed on at the last sync
        # (``weights`` and ``state`` are this rank's copy with its own steps since)
        self.steps_locally = replica_copies(sync_every) == 2
        self.agreed_weights = torch.zeros(rows if self.steps_locally else 0, dim, device=device)
        self.agreed_state = torch.zeros(self.agreed_weights.size(0), self.state.size(1), device=device)
        self.steps_held = 0
        self._start_due = False  # a sync is due and starts at the end of the backward pass (add_grads)
        self._touches = None  # the started all-reduce of touch counts, and its buffer
        self._grads = None  # the started all-reduce of the touched rows' gradients
        self._dense = None  # or the started all-reduce of every row's gradient and touch count
        # one all-reduce of every row instead of touch counts then touched rows: chosen from the last
        # sync (the same on every rank), when it touched most rows (Adagrad's held squares: never)
        self.dense_sync = False
        self.last_sync_dense = False  # whether the last sync applied was one all-reduce of every row
        self.syncs = 0

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.weights, self.state, self.agreed_weights, self.agreed_state)
        )

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies every row and its optimizer state from its owner (one all-reduce)."""
        self.wait()
        block = torch.zeros(self.weights.size(0), self.dim + self.state.size(1), device=self.weights.device)
        for part in self.owned:
            block[part.slots, : self.dim] = part.kernel.read(0, self.dim, part.tables, part.rows)
            if self.state.size(1):
                block[part.slots, self.dim :] = part.kernel.read(0, self.dim, part.tables, part.rows, _tbe.STATE)
        self._all_reduce(block)
        self.load(block[:, : self.dim], block[:, self.dim :])

    @torch.no_grad()
    def load(self, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Takes every row and its optimizer state as agreed (what a refresh copies); drops what is held."""
        for copy in (self.weights, self.agreed_weights) if self.steps_locally else (self.weights,):
            copy.copy_(weights)
        for copy in (self.state, self.agreed_state) if self.steps_locally else (self.state,):
            copy.copy_(state)
        self.drop_held()

    def drop_held(self) -> None:
        """Forgets the gradients held since the last sync."""
        self.pending.zero_()
        self.squares.zero_()
        self.touches.zero_()
        self.steps_held = 0

    def add_grads(self, slots: torch.Tensor, grads: torch.Tensor, scale: float = 1.0) -> None:
        """Backward: this rank's gradients of rows ``slots`` (one per value read, repeats summed),
        times ``scale``; starts the sync when due (:meth:`add_row_grads` for gradients already per row).

        A sync started earlier and not yet applied is applied first, so its steps stay separate."""
        if self.weights.size(0) == 0:  # no hot rows: nothing to keep in sync (the same on every rank)
            return
        self._before_adding()
        if self.steps_locally:  # the step's gradient of each row, repeats summed
            rows, inverse = torch.unique(slots, return_inverse=True)
            step = torch.zeros(rows.numel(), self.dim, device=grads.device).index_add_(0, inverse, grads, alpha=scale)
            self._hold_step(rows, step)
        else:
            # contiguous: a strided target takes a 7x slower path
            self.pending.index_add_(0, slots, grads, alpha=scale)
        self.touches.index_add_(0, slots, torch.ones_like(slots, dtype=self.touches.dtype))
        self._added()

    def add_row_grads(self, row_grads: torch.Tensor, reads: torch.Tensor, scale: float = 1.0) -> None:
        """Backward: this rank's gradient of every row of the block (``[rows, dim]``, zero where
        unread; consumed), times ``scale``, and how many values read each row; as :meth:`add_grads`."""
        if self.weights.size(0) == 0:
            return
        self._before_adding()
        if self.steps_locally:
            rows = (reads > 0).nonzero().flatten()
            self._hold_step(rows, row_grads.index_select(0, rows).mul_(scale))
        else:
            self.pending.add_(row_grads, alpha=scale)
        self.touches.add_(reads)
        self._added()

    def _before_adding(self) -> None:
        if self.steps_held >= self.sync_every:
            self.wait()  # (starts a due sync first)

    def _hold_step(self, rows: torch.Tensor, step: torch.Tensor) -> None:
        """Synced every k > 1 steps: the step's gradient of rows ``rows`` is held and stepped locally."""
        self.pending.index_add_(0, rows, step)
        if self.holds_squares:  # squared on its own
            self.squares.index_add_(0, rows, squares_of(self.optimizer, step).float())
        self._step_locally(rows, step)

    def _added(self) -> None:
        self.steps_held += 1
        if self.steps_held >= self.sync_every:  # after the pass's other traffic (DDP's): docs/internals.md
            self._start_due = True
            after_backward_pass(self._start_if_due)

    def _start_if_due(self) -> None:
        """Starts the sync :meth:`add_grads` made due, unless started already (by :meth:`wait`)."""
        if self._start_due:
            self._start_due = False
            self._start()

    @torch.no_grad()
    def _step_locally(self, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """This rank's copy takes its own step at once (the optimizer's, on its local state)."""
        weights, state = step_rows(
            self.optimizer,
            self.weights.index_select(0, rows),
            self.state.index_select(0, rows),
            grads,
            self._rates(rows),
            self.eps.index_select(0, rows),
        )
        self.weights.index_copy_(0, rows, weights)
        if self.state.size(1):
            self.state.index_copy_(0, rows, state)

    def _rates(self, rows: torch.Tensor) -> torch.Tensor:
        """``[rows, 1]``: each row's learning rate, read from its owner kernel now (a scheduler may change it)."""
        rates = torch.stack([_tbe.learning_rate(k) for k in self.kernels]).to(self.weights.device)
        return rates.index_select(0, self.kernel_of.index_select(0, rows)).view(-1, 1)

    def _start(self) -> None:
        if self.dense_sync:  # one all-reduce of every row's gradient and touch count
            summed = torch.cat([self.pending, self.touches.unsqueeze(1)], 1)
            self._dense = (self._sum_gradients(summed), summed)
            return
        touches = self.touches.clone()
        self._touches = (self._all_reduce(touches, async_op=True), touches)

    def advance(self) -> None:
        """Once the touch counts are in, starts the all-reduce of the touched rows' gradients (at the
        end of the backward pass that started the sync, so it flies under the optimizer step and
        the next batch's input dist and dense forward; else from the input dist or the next read)."""
        if self._touches is None:
            return
        work, touches = self._touches
        self._touches = None
        work.wait()
        touched = (touches > 0).nonzero().flatten()
        grads = self.pending.index_select(0, touched)  # only rows some rank touched travel
        if self.holds_squares:  # and this rank's squares beyond its own sum's (see ``_apply``)
            beyond = self.squares.index_select(0, touched) - squares_of(self.optimizer, grads).float()
            grads = torch.cat([grads, beyond], 1)
        self._grads = (self._sum_gradients(grads), touched, grads, touches.index_select(0, touched))

    def _sum_gradients(self, tensor: torch.Tensor):
        """Starts summing ``tensor`` (gradients) over the ranks in ``sync_dtype``; the handle's
        ``wait()`` leaves the sum in ``tensor``."""
        if self.sync_dtype == tensor.dtype:
            return self._all_reduce(tensor, async_op=True)
        sent = tensor.to(self.sync_dtype)
        return _CopiedBack(self._all_reduce(sent, async_op=True), sent, tensor)

    def _all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sums ``tensor`` over the ranks: flat on ``pg``, or hierarchically over ``hosts``."""
        if self.hosts is None:
            return dist.all_reduce(tensor, group=self.pg, async_op=async_op)
        return self.hosts.all_reduce(tensor, async_op=async_op)

    def wait(self) -> bool:
        """Finishes a started sync and applies it (call before reading the rows); whether there was one."""
        with record_function("## het replica sync ##"):
            return self._finish_sync()

    def _finish_sync(self) -> bool:
        self._start_if_due()
        self.advance()
        self.last_sync_dense = self._dense is not None
        if self._dense is not None:
            work, summed = self._dense
            self._dense = None
            work.wait()
            touches = summed[:, self.dim]
            touched = (touches > 0).nonzero().flatten()
            grads = summed.index_select(0, touched)[:, : self.dim]
            self._apply(touched, grads, touches.index_select(0, touched))
        elif self._grads is not None:
            work, touched, grads, touches = self._grads
            self._grads = None
            work.wait()
            self._apply(touched, grads, touches)
        else:
            return False
        self.syncs += 1
        return True

    def flush(self) -> int:
        """Applies a started sync and whatever is held (a collective: every rank calls it); syncs applied."""
        synced = int(self.wait())
        if self.steps_held and self.weights.size(0):
            self._start()
            synced += int(self.wait())
        return synced

    @torch.no_grad()
    def _apply(self, touched: torch.Tensor, summed: torch.Tensor, touches: torch.Tensor) -> None:  # noqa: ARG002
        """Steps the touched rows with the gradients summed over ranks (and the held steps).

        The state grows by ``S**2 + sum (Q_r - S_r**2)`` (at least ``S**2 / k``); the step is
        :func:`~torchrec_het._tbe.step_rows_held`. Why: docs/internals.md#row-replicated-replicas
        """
        lr = self._rates(touched)
        agreed_weights, agreed_state = (
            (self.agreed_weights, self.agreed_state) if self.steps_locally else (self.weights, self.state)
        )
        weight, state = agreed_weights.index_select(0, touched), agreed_state.index_select(0, touched)
        eps = self.eps.index_select(0, touched)
        if self.holds_squares:
            grads, beyond = summed[:, : self.dim], summed[:, self.dim :]
            squares = (squares_of(self.optimizer, grads) + beyond).clamp(min=0)
            weights, state = step_rows_held(
                self.optimizer, weight, state, grads, squares, lr, eps, max(self.steps_held, 1)
            )
        else:
            weights, state = step_rows(self.optimizer, weight, state, summed, lr, eps)
        self.weights.index_copy_(0, touched, weights)  # the sync's step replaces the local ones
        self.state.index_copy_(0, touched, state)
        if self.steps_locally:
            self.agreed_weights.index_copy_(0, touched, weights)
            self.agreed_state.index_copy_(0, touched, state)
        self.drop_held()
        self._write_through(touched)
        self.dense_sync = not self.holds_squares and 4 * touched.numel() >= 3 * self.weights.size(0)

    def _write_through(self, touched: torch.Tensor) -> None:
        """Copies updated rows this rank owns, with their state, into its owner kernels."""
        mask = torch.zeros(self.weights.size(0), dtype=torch.bool, device=self.weights.device)
        mask[touched] = True
        for part in self.owned:
            mine = mask.index_select(0, part.slots).nonzero().flatten()
            slots = part.slots.index_select(0, mine)
            at = (0, self.dim, part.tables.index_select(0, mine), part.rows.index_select(0, mine))
            part.kernel.write(*at, self.weights.index_select(0, slots))
            if self.state.size(1):
                part.kernel.write(*at, self.state.index_select(0, slots), _tbe.STATE)


def owned_rows(kernel, tables: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, dim: int) -> OwnedSlots:
    """Block rows ``slots``: rows ``rows`` of tables ``tables`` in ``kernel`` (rows of width ``dim``);
    ValueError where its rows are not in one flat buffer."""
    device = _tbe.flat_data(kernel, _tbe.WEIGHTS)[0].device  # (the state is where the rows are)
    return OwnedSlots(OwnedRows([kernel], device), slots.to(device), tables.to(device), rows.to(device))


class _BlockRows(torch.autograd.Function):
    """Rows of a block, read now; the backward hands their gradients to the block."""

    @staticmethod
    def forward(ctx, anchor, block: ReplicaBlock, slots):  # noqa: ARG004
        ctx.block, ctx.slots = block, slots
        return block.weights.index_select(0, slots)

    @staticmethod
    def backward(ctx, grad):
        ctx.block.add_grads(ctx.slots, grad)
        return None, None, None


def read_rows(anchor: torch.Tensor, block: ReplicaBlock, slots: torch.Tensor) -> torch.Tensor:
    """``[len(slots), dim]``: the block's rows ``slots`` as they are now, differentiable: their
    gradients go to the block (``anchor``, a tensor that requires grad, puts them in the graph)."""
    return _BlockRows.apply(anchor, block, slots)


class _CopiedBack:
    """A started sum of ``sent`` (another dtype); ``wait()`` copies it into ``into``."""

    def __init__(self, work, sent: torch.Tensor, into: torch.Tensor) -> None:
        self.work, self.sent, self.into = work, sent, into

    def wait(self) -> bool:
        self.work.wait()
        self.into.copy_(self.sent)
        return True

"""An owner's own work in ``het_row_replicated`` bags: pool the cold ids it was sent into partial sums,
and step those rows when their gradients come back, in its fused kernels' buffers.

Where every table of the sharding has one width and every kernel's optimizer has a row update
(:class:`~torchrec_het.sharding.common.owned_rows.KernelRows`), the owner reads and steps the
kernels' rows itself: per kernel, one ``embedding_bag`` over the rows as they arrived (no
reordering into the kernel's input layout, no gather of its output) and, with the gradients, one
sort, one ``embedding_bag`` of the entries' gradients into each distinct row's, and the kernel's
own row arithmetic (:func:`torchrec_het._tbe.step_rows`). Elsewhere the lookup calls the kernels
(TorchRec's grouped lookup) as before.

Design (why not the kernel's call, what is exact): docs/internals.md#row-replicated-owner
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.output_layout import bag_offsets
from torchrec_het.sharding.common.owned_rows import KernelRows, OwnedRows


@dataclass
class OwnerValues:
    """The cold values an owner received for one batch (its kernels' rows; per-host ones set apart),
    in arrival order: by source, each source's in bag order, so each entry's values are one run."""

    rows: torch.Tensor  # int64: row in its table's shard of each value
    entry_of: torch.Tensor  # int64: the entry (a reader's bag, one partial sum) each value belongs to
    weights: torch.Tensor | None  # per-value weights (weighted tables)
    entry_position: torch.Tensor  # int64 [entries]: the position (feature) of each entry

    @property
    def positions(self) -> torch.Tensor:
        """The position of each value."""
        return self.entry_position.index_select(0, self.entry_of)


def kernel_features(values: OwnerValues, feature_names: list[str], num_positions: int):
    """Where the kernels' call serves: the values as a compact KJT (per position, one bag per entry of
    it, in arrival order, padded with empty bags to the position with the most; one call per group),
    and where each entry's pooled bag lands in the kernels' ``[stride, width]`` output:
    ``(slot, position, stride)``."""
    entry_position, entry_of = values.entry_position, values.entry_of
    entries, n, device = entry_position.numel(), entry_of.numel(), entry_of.device
    _, by_position = torch.sort(entry_position, stable=True)  # a few keys: the KJT's bag order
    per_position = torch.bincount(entry_position, minlength=num_positions)
    first = torch.cumsum(per_position, 0) - per_position
    slot = torch.empty_like(entry_position).index_copy_(
        0, by_position,
        torch.arange(entries, device=device) - first.index_select(0, entry_position.index_select(0, by_position)),
    )  # fmt: skip
    stride = max(int(per_position.max()), 1) if entries else 1  # the owner's one extra host sync
    # the values, entry by entry in the KJT's order (each entry's values are one run)
    counts = torch.bincount(entry_of, minlength=entries)
    moved = counts.index_select(0, by_position)
    shift = (torch.cumsum(counts, 0) - counts).index_select(0, by_position) - (torch.cumsum(moved, 0) - moved)
    order = torch.repeat_interleave(shift, moved, output_size=n) + torch.arange(n, device=device)
    weights = None if values.weights is None else values.weights.index_select(0, order)
    lengths = torch.zeros(num_positions * stride, dtype=torch.int64, device=device)
    lengths[entry_position * stride + slot] = counts
    features = KeyedJaggedTensor(
        keys=feature_names, values=values.rows.index_select(0, order), lengths=lengths.int(), weights=weights,
        stride=stride,
    )  # fmt: skip
    return features, (slot, entry_position, stride)


@dataclass
class KernelValues:
    """The values of one batch one kernel serves, in arrival order."""

    rows: torch.Tensor  # int64: view row of each value in the kernel (KernelRows)
    entry_of: torch.Tensor  # int64: the entry (partial sum) each value belongs to
    offsets: torch.Tensor  # [entries + 1] where each entry's values start (entries of other kernels: empty)
    weights: torch.Tensor | None  # per-value weights (weighted tables)


@dataclass
class OwnerBatch:
    """The cold values one batch brought this owner, per kernel (``None`` where a kernel serves none);
    ``seq``: its number among the batches this owner expects to step (-1: not expected, :meth:`DirectOwner.expect`)."""

    entries: int
    kernels: list[KernelValues | None]
    seq: int = -1


class DirectOwner:
    """Pools and steps an owner's rows in its kernels (see the module docstring).

    Args:
        kernels: the lookup's FBGEMM kernels, one per grouped config.
        dim: the width of every table in them.
        position_kernel: int64 ``[positions]`` the kernel of each of the sharding's positions.
        position_table: int64 ``[positions]`` its table's index in that kernel.
        device: where the lookup computes.
    """

    def __init__(self, kernels: list, dim: int, position_kernel, position_table, device: torch.device) -> None:
        self.owned, self.dim, self.device = OwnedRows(kernels, device), dim, device
        self.position_kernel, self.position_table = position_kernel.to(device), position_table.to(device)
        # lookahead: per batch expected to step (by ``seq``, oldest first), its rows in each kernel, and
        # per kernel how many values of those batches read each row (a row is stale while above 0)
        self.unstepped: dict[int, list[torch.Tensor | None]] = {}
        self._pending_reads: list[torch.Tensor | None] = [None] * len(kernels)
        self._next_seq = 0
        self.epoch = 0  # the rows were reloaded this many times (:meth:`reloaded`): earlier reads are void

    @classmethod
    def of(cls, kernels: list, dims: list[int], position_kernel, position_table, device) -> "DirectOwner | None":
        """The direct owner of a lookup's kernels, or None where the kernels' call must serve (tables
        of several widths, an optimizer without a row update, rows not in one view per kernel)."""
        if not kernels or len(set(dims)) != 1:
            return None
        owned = OwnedRows(kernels, device)
        for index in range(len(kernels)):
            view = owned.view(index, dims[0])
            if view is None or view.kind is None:
                return None
            if view.state is not None and not torch.equal(view.first_row, view.state_first_row):
                return None  # a row's state is not at its row's index
        return cls(kernels, dims[0], position_kernel, position_table, device)

    def view(self, index: int) -> KernelRows:
        found = self.owned.view(index, self.dim)
        if found is None:
            raise RuntimeError(
                "het_row_replicated: an owner kernel's rows are no longer one view (its buffers changed)"
            )
        return found

    def plan(self, values: OwnerValues) -> OwnerBatch:
        """The batch of values this owner pools from its kernels."""
        positions, rows, entry_of, weights = values.positions, values.rows, values.entry_of, values.weights
        entries = values.entry_position.numel()
        tables = self.position_table.index_select(0, positions)
        if len(self.owned.kernels) == 1:
            return OwnerBatch(entries, [self._values(0, tables, rows, entry_of, entries, weights)])
        kernel_of = self.position_kernel.index_select(0, positions)
        out = []
        for index in range(len(self.owned.kernels)):  # one per grouped config, as TorchRec's lookup calls them
            mine = (kernel_of == index).nonzero().flatten()
            pick = None if weights is None else weights.index_select(0, mine)
            values = (t.index_select(0, mine) for t in (tables, rows, entry_of))
            out.append(self._values(index, *values, entries, pick) if mine.numel() else None)
        return OwnerBatch(entries, out)

    def _values(self, index: int, tables, rows, entry_of, entries: int, weights) -> KernelValues:
        at = self.view(index).first_row.index_select(0, tables) + rows
        return KernelValues(at, entry_of, bag_offsets(torch.bincount(entry_of, minlength=entries)), weights)

    def expect(self, batch: OwnerBatch) -> None:
        """``batch`` (a training batch's, planned at its arrival) will step its rows: until it has,
        its rows are stale for any other batch's early read (:meth:`stale_entries`)."""
        batch.seq, self._next_seq = self._next_seq, self._next_seq + 1
        rows = [None if v is None else v.rows for v in batch.kernels]
        self.unstepped[batch.seq] = rows
        self._count(rows, 1)

    def _count(self, rows: list[torch.Tensor | None], sign: int) -> None:
        for index, read in enumerate(rows):
            if read is None or read.numel() == 0:
                continue
            if self._pending_reads[index] is None:
                self._pending_reads[index] = torch.zeros(self.view(index).weights.size(0), dtype=torch.int32,
                                                         device=self.device)  # fmt: skip
            self._pending_reads[index].index_add_(0, read, torch.full_like(read, sign, dtype=torch.int32))

    def stale_entries(self, batch: OwnerBatch) -> torch.Tensor:
        """bool ``[entries]``: the entries of ``batch`` with a row an expected batch has not stepped yet."""
        stale = torch.zeros(batch.entries, dtype=torch.bool, device=self.device)
        for index, values in enumerate(batch.kernels):
            pending = self._pending_reads[index]
            if values is None or pending is None or not self.unstepped:
                continue
            hit = pending.index_select(0, values.rows) > 0
            stale[values.entry_of[hit]] = True
        return stale

    def reloaded(self) -> None:
        """The rows were loaded anew (a checkpoint): what was read of them before is void."""
        self.epoch += 1

    def pool_entries(self, batch: OwnerBatch, entries: torch.Tensor) -> torch.Tensor:
        """``[len(entries), dim]``: those entries of ``batch`` pooled from the rows as they are now, each
        as :meth:`pool` pools it (the same values in the same order: the same bits)."""
        out = torch.zeros(entries.numel(), self.dim, device=self.device)
        for index, values in enumerate(batch.kernels):
            if values is None or entries.numel() == 0:
                continue
            starts = values.offsets.index_select(0, entries)
            counts = values.offsets.index_select(0, entries + 1) - starts
            offsets = bag_offsets(counts)
            pick = torch.repeat_interleave(starts - offsets[:-1], counts) + torch.arange(
                int(offsets[-1]), device=self.device
            )
            weights = None if values.weights is None else values.weights.index_select(0, pick)
            out.add_(F.embedding_bag(
                values.rows.index_select(0, pick), self.view(index).weights, offsets, mode="sum",
                include_last_offset=True, per_sample_weights=weights,
            ))  # fmt: skip
        return out

    def pool(self, batch: OwnerBatch) -> torch.Tensor:
        """``[entries, dim]``: each entry's values summed (weighted), from the rows as they are now."""
        out = None
        for index, values in enumerate(batch.kernels):
            if values is None:
                continue
            pooled = F.embedding_bag(
                values.rows, self.view(index).weights, values.offsets, mode="sum", include_last_offset=True,
                per_sample_weights=values.weights,
            )  # fmt: skip
            out = pooled if out is None else out.add_(pooled)  # an entry's values are all of one table
        return out if out is not None else torch.zeros(batch.entries, self.dim, device=self.device)

    @torch.no_grad()
    def step(self, batch: OwnerBatch, grad: torch.Tensor) -> None:
        """The owner's backward: ``grad`` (the entries' gradients, flat) summed per distinct row and
        applied with each kernel's optimizer, once per row, as its fused backward would."""
        grads = grad.view(-1, self.dim).float()
        for index, values in enumerate(batch.kernels):
            if values is None or values.rows.numel() == 0:
                continue
            sorted_rows, order = torch.sort(values.rows)
            rows, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
            weights = None if values.weights is None else values.weights.index_select(0, order)
            row_grads = F.embedding_bag(
                values.entry_of.index_select(0, order), grads, bag_offsets(counts), mode="sum",
                include_last_offset=True, per_sample_weights=weights,
            )  # fmt: skip
            self.view(index).step(rows, rows, row_grads)
        if batch.seq >= 0:  # this batch and any older one never stepped (a forward without backward) are done
            for seq in [s for s in self.unstepped if s <= batch.seq]:
                self._count(self.unstepped.pop(seq), -1)

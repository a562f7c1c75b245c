"""The rows a rank owns, where FBGEMM's fused kernels keep them: read, pooled and stepped in place.

A fused kernel (TBE) keeps every table's rows end to end in one flat buffer, and their optimizer
state in another (:mod:`torchrec_het._tbe`). Where the tables of one width start at a common
phase modulo that width (always so for a kernel of one width), each buffer is one
``[rows, width]`` view, and row ``r`` of the kernel's table ``t`` is view row ``first_row[t] + r``:
:class:`KernelRows`. Both plugin types read owned rows through :class:`OwnedRows` (HET owners
answer requests, replica blocks copy and write back their rows), and ``het_row_replicated`` owners
pool and step their rows in the views directly (:mod:`torchrec_het.sharding.row_replicated.owner`).

Design: docs/internals.md#owned-rows
"""

from dataclasses import dataclass

import torch

from torchrec_het import _tbe


@dataclass(frozen=True)
class KernelRows:
    """One kernel's rows of one width as views of its flat buffers (``.data``: writes are optimizer writes).

    Attributes:
        weights: ``[rows, dim]``.
        state: ``[rows, state width]`` (Adagrad: dim, row-wise Adagrad: 1), or None (SGD, or a state
            kept elsewhere).
        first_row: int64 ``[kernel tables]`` view row of each table's row 0 (meaningful for the
            tables of this width).
        state_first_row: the same in ``state``.
        kind: the optimizer's row update when rows can be stepped here (``sgd``, ``adagrad``,
            ``rowwise_adagrad``: :func:`torchrec_het._tbe.kernel_layout`), else None (read only).
        eps: the optimizer's epsilon.
    """

    kernel: _tbe.TBE
    dim: int
    buffer: str  # the kernel's attribute holding the flat weights
    weights: torch.Tensor
    state: torch.Tensor | None
    first_row: torch.Tensor
    state_first_row: torch.Tensor | None
    kind: str | None
    eps: float

    def current(self) -> bool:
        """Whether the kernel still holds the buffers these views were made of (a load may replace them)."""
        flat = _tbe.buffer(self.kernel, self.buffer)
        return flat.data_ptr() <= self.weights.data_ptr() < flat.data_ptr() + flat.numel() * flat.element_size()

    @torch.no_grad()
    def step(self, rows: torch.Tensor, state_rows: torch.Tensor | None, grads: torch.Tensor) -> None:
        """One optimizer step of view rows ``rows`` (distinct; their state at ``state_rows``) with
        ``grads`` (``[n, dim]``, consumed), with the arithmetic of FBGEMM's CPU kernels
        (:func:`torchrec_het._tbe.step_rows`)."""
        lr = _tbe.learning_rate(self.kernel).to(self.weights.device)
        if self.kind == "rowwise_adagrad":  # additive: the rows are written without being read
            state = self.state.index_select(0, state_rows) + (grads * grads).sum(1, keepdim=True) / grads.size(1)
            self.state.index_copy_(0, state_rows, state)
            # w + (-(g * m)) is w - g * m, bit for bit: step_rows' arithmetic
            self.weights.index_add_(0, rows, grads.mul_(-(lr / (state.sqrt() + self.eps))))
            return
        state = None if self.state is None else self.state.index_select(0, state_rows)
        weights, state = _tbe.step_rows(self.kind, self.weights.index_select(0, rows), state, grads, lr, self.eps)
        self.weights.index_copy_(0, rows, weights)
        if self.state is not None:
            self.state.index_copy_(0, state_rows, state)


def _view(flat: torch.Tensor, offsets: torch.Tensor, tables: list[int], width: int):
    """(``[rows, width]`` view of ``flat``, first view row of every table) when the ``tables`` start at
    one phase modulo ``width``; else None."""
    phases = {int(offsets[t]) % width for t in tables}
    if len(phases) != 1:
        return None
    phase = phases.pop()
    rows = (flat.numel() - phase) // width
    return flat[phase : phase + rows * width].view(rows, width), (offsets - phase) // width


def kernel_rows(kernel: _tbe.TBE, dim: int, device: torch.device) -> KernelRows | None:
    """The views of ``kernel``'s tables of width ``dim``, or None where its buffers do not allow them
    (several placements, rows cached in HBM, tables of that width at several phases)."""
    tables = [t for t, width in enumerate(_tbe.table_dims(kernel)) if width == dim]
    found = _tbe.flat_buffer(kernel, _tbe.WEIGHTS)
    if not tables or found is None:
        return None
    weights = _view(_tbe.buffer(kernel, found[0]).data.view(-1), found[1], tables, dim)
    if weights is None:
        return None
    layout = _tbe.kernel_layout(kernel)
    kind = layout.kind if layout is not None else None
    state = None
    width = _tbe.square_width(_tbe.KINDS.get(_tbe.optimizer_name(kernel)), dim)
    if width:
        state_buffer = _tbe.flat_buffer(kernel, _tbe.STATE)
        state = None if state_buffer is None else _view(
            _tbe.buffer(kernel, state_buffer[0]).data.view(-1), state_buffer[1], tables, width
        )  # fmt: skip
        if state is None:
            kind = None  # no state view: read the weights only
    return KernelRows(
        kernel, dim, found[0], weights[0], None if state is None else state[0], weights[1].to(device),
        None if state is None else state[1].to(device), kind, _tbe.optimizer_eps(kernel),
    )  # fmt: skip


class OwnedRows:
    """The rows of a lookup's kernels, read and written by (kernel, table, row): through the kernel's
    :class:`KernelRows` (made once per (kernel, width), and again after a load) where it has them,
    else element by element in its flat buffers.

    Args:
        kernels: the lookup's FBGEMM kernels (TBEs), one per grouped config.
        device: where row indexes are made.
    """

    def __init__(self, kernels: list, device: torch.device) -> None:
        self.kernels, self.device = kernels, device
        self._views: dict[tuple[int, int], KernelRows | None] = {}
        self._flat: dict[tuple[int, str], tuple[str, torch.Tensor] | None] = {}  # a load keeps the offsets

    def view(self, module_index: int, dim: int) -> KernelRows | None:
        """Kernel ``module_index``'s rows of width ``dim`` (None: not one view; read them element by element)."""
        key = (module_index, dim)
        if key not in self._views or (self._views[key] is not None and not self._views[key].current()):
            self._views[key] = kernel_rows(self.kernels[module_index], dim, self.device)
        return self._views[key]

    def forget(self) -> None:
        """Drops the views (after a load the kernels may hold new buffers)."""
        self._views = {}

    def read(self, module_index: int, dim: int, tables, rows, part: str = _tbe.WEIGHTS) -> torch.Tensor | None:
        """fp32 ``[n, width]``: rows ``rows`` of kernel ``module_index``'s tables ``tables`` (of width ``dim``),
        their weights or (``part=_tbe.STATE``) optimizer state; None where ``part`` is not one flat buffer."""
        source, at = self._at(module_index, dim, tables, rows, part)
        return None if source is None else (source.index_select(0, at) if at.dim() == 1 else source[at]).float()

    def write(self, module_index: int, dim: int, tables, rows, values: torch.Tensor, part: str = _tbe.WEIGHTS) -> None:
        """Writes ``values`` into the rows :meth:`read` reads (an optimizer write)."""
        source, at = self._at(module_index, dim, tables, rows, part)
        source[at] = values.to(source.dtype)

    def _at(self, module_index: int, dim: int, tables: torch.Tensor, rows: torch.Tensor, part: str):
        """(``[rows, width]`` view, view row of each row), or (flat buffer, ``[n, width]`` element positions)."""
        view = self.view(module_index, dim)
        if view is not None and (part == _tbe.WEIGHTS or view.state is not None):
            first = view.first_row if part == _tbe.WEIGHTS else view.state_first_row
            return view.weights if part == _tbe.WEIGHTS else view.state, first.index_select(0, tables) + rows
        kernel, key = self.kernels[module_index], (module_index, part)
        if key not in self._flat:  # (attribute, each table's first element), None where not one flat buffer
            found = _tbe.flat_buffer(kernel, part)
            self._flat[key] = None if found is None else (found[0], found[1].to(self.device))
        if self._flat[key] is None:
            return None, None
        width = dim if part == _tbe.WEIGHTS else _tbe.square_width(_tbe.KINDS.get(_tbe.optimizer_name(kernel)), dim)
        attribute, offsets = self._flat[key]
        at = (offsets.index_select(0, tables) + rows * width).unsqueeze(1) + torch.arange(width, device=self.device)
        return _tbe.buffer(kernel, attribute).data.view(-1), at

"""Every FBGEMM internal the plugin touches, in one place (as ``_compat`` is for TorchRec's).

The optimizer's name, kind, epsilon and learning rate; the TBE kernel's flat buffers and
each table's offset in them; and the row steps: :func:`apply_rows` updates a kernel's
weights and state in place, :func:`step_rows` / :func:`step_rows_held` step dense rows with
the formulas of FBGEMM's CPU kernels, and :func:`apply_row_grads` is the fallback that runs
the kernel's own backward.

Design: docs/internals.md#tbe
"""

import weakref
from dataclasses import dataclass, field

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

TBE = SplitTableBatchedEmbeddingBagsCodegen

KINDS = {  # FBGEMM optimizer names -> the row update they are
    "sgd": "sgd",
    "exact_sgd": "sgd",
    "exact_adagrad": "adagrad",
    "exact_row_wise_adagrad": "rowwise_adagrad",
    "row_wise_adagrad": "rowwise_adagrad",
}
WEIGHTS, STATE = "weights", "momentum1"  # the two flat buffers rows are read from: the rows, their optimizer state
_PLACEMENT_BUFFERS = {
    EmbeddingLocation.DEVICE.value: "dev",
    EmbeddingLocation.HOST.value: "host",
    EmbeddingLocation.MANAGED.value: "uvm",
}
__all__ = [  # EmbOptimType too: the planner's memory model names optimizers by it
    "KINDS",
    "STATE",
    "TBE",
    "WEIGHTS",
    "EmbOptimType",
    "FlatRows",
    "KernelLayout",
    "accumulates_squares",
    "apply_row_grads",
    "apply_rows",
    "buffer",
    "flat_buffer",
    "flat_data",
    "kernel_layout",
    "learning_rate",
    "num_tables",
    "optimizer_eps",
    "optimizer_kind",
    "optimizer_name",
    "replica_kind",
    "row_state",
    "square_width",
    "squares_of",
    "step_rows",
    "step_rows_held",
    "table_dims",
]


# ---- the optimizer --------------------------------------------------------------------------------


def optimizer_name(tbe: TBE) -> str:
    """The kernel's ``optimizer`` (an ``EmbOptimType``) as its lowercase FBGEMM name."""
    return str(getattr(tbe.optimizer, "value", tbe.optimizer)).lower()


def optimizer_kind(tbe: TBE) -> str:
    """``sgd``, ``adagrad`` or ``rowwise_adagrad``: the kernel's fused optimizer; ValueError for others."""
    name = optimizer_name(tbe)
    if name not in KINDS:
        raise ValueError(f"fused optimizer {name!r} is not supported for row updates; use one of {sorted(KINDS)}")
    return KINDS[name]


def replica_kind(tbe: TBE) -> str:
    """:func:`optimizer_kind`; ValueError also with weight decay (a replica block's row step has none)."""
    kind = optimizer_kind(tbe)
    if float(tbe.optimizer_args.weight_decay) != 0.0:
        raise ValueError(f"fused optimizer {kind!r} with weight decay has no replica update")
    return kind


def accumulates_squares(tbe: TBE) -> bool:
    """Whether the kernel's optimizer keeps a running sum of squared gradients (the Adagrad family)."""
    return "adagrad" in optimizer_name(tbe)


def optimizer_eps(tbe: TBE) -> float:
    """The optimizer's epsilon."""
    return float(tbe.optimizer_args.eps)


def learning_rate(tbe: TBE) -> torch.Tensor:
    """The kernel's current learning rate, a one-element tensor (a scheduler may change it; no host sync)."""
    return tbe.learning_rate_tensor


def num_tables(tbe: TBE) -> int:
    return len(tbe.embedding_specs)


def table_dims(tbe: TBE) -> list[int]:
    """The width of each of the kernel's tables."""
    return [spec[1] for spec in tbe.embedding_specs]


# ---- the flat buffers -----------------------------------------------------------------------------


def flat_buffer(tbe: TBE, part: str) -> tuple[str, torch.Tensor] | None:
    """(attribute, first element of each table) of the kernel's flat ``part`` buffer (:data:`WEIGHTS`
    or :data:`STATE`), or None when the tables are not in one (mixed placements, rows cached in HBM)."""
    placements = {int(getattr(p, "value", p)) for p in getattr(tbe, f"{part}_physical_placements")}
    if len(placements) != 1 or next(iter(placements)) not in _PLACEMENT_BUFFERS:
        return None
    offsets = torch.tensor(list(getattr(tbe, f"{part}_physical_offsets")), dtype=torch.int64)
    return f"{part}_{_PLACEMENT_BUFFERS[next(iter(placements))]}", offsets


def buffer(tbe: TBE, attribute: str) -> torch.Tensor:
    """The kernel's buffer ``attribute`` (a name :func:`flat_buffer` gave)."""
    return getattr(tbe, attribute)


def flat_data(tbe: TBE, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the kernel's flat ``part`` buffer, each table's first element in it); ValueError when it has none.

    As ``.data``: a synced row's write must not bump the version a forward in flight saved."""
    found = flat_buffer(tbe, part)
    if found is None:
        raise ValueError(
            f"het_row_replicated: the kernel's {part} are not in one flat buffer (mixed placements or a cache)"
        )
    return getattr(tbe, found[0]).data, found[1]


def row_state(tbe: TBE, table: int) -> list[torch.Tensor]:
    """The table's weights and optimizer states as ``[rows, k]`` views (k = dim or 1)."""
    weights = tbe.split_embedding_weights()[table]
    rows = weights.size(0)
    states = [] if optimizer_name(tbe) in ("sgd", "exact_sgd") else tbe.split_optimizer_states()[table]
    return [weights] + [s.view(rows, -1) for s in states]


@dataclass(frozen=True)
class KernelLayout:
    """Where a kernel keeps each table's rows: a flat buffer name and element offsets per table."""

    kind: str
    weights: str  # attribute of the flat weight buffer
    weight_offsets: torch.Tensor  # [T] first element of each table
    state: str | None  # attribute of the flat momentum buffer (None for sgd)
    state_offsets: torch.Tensor | None  # [T] first state element of each table
    dims: tuple[int, ...] = ()  # width of each table
    aligned: dict = field(default_factory=dict, compare=False)  # dim -> its tables' rows start at multiples of dim

    def rows_aligned(self, dim: int) -> bool:
        """Whether every row of the tables of width ``dim`` starts at a multiple of ``dim`` (weights and state)."""
        if dim not in self.aligned:
            tables = [t for t, d in enumerate(self.dims) if d == dim]
            offsets = [int(self.weight_offsets[t]) for t in tables]
            if self.kind == "adagrad":
                offsets += [int(self.state_offsets[t]) for t in tables]
            self.aligned[dim] = all(o % dim == 0 for o in offsets)
        return self.aligned[dim]


_layouts: "weakref.WeakKeyDictionary[TBE, KernelLayout | None]" = weakref.WeakKeyDictionary()


def kernel_layout(tbe: TBE) -> KernelLayout | None:
    """The kernel's layout when :func:`apply_rows` can update it directly (cached per kernel)."""
    if tbe in _layouts:
        return _layouts[tbe]
    layout = None
    kind = KINDS.get(optimizer_name(tbe))
    decay = float(getattr(tbe.optimizer_args, "weight_decay", 0.0)) and int(tbe.optimizer_args.weight_decay_mode)
    fp32 = str(getattr(tbe.weights_precision, "value", tbe.weights_precision)).lower() in ("fp32", "0")
    if kind is not None and fp32 and not decay:
        weights = flat_buffer(tbe, WEIGHTS)
        state = None if kind == "sgd" else flat_buffer(tbe, STATE)
        if weights is not None and (kind == "sgd" or state is not None):
            device = getattr(tbe, weights[0]).device
            layout = KernelLayout(
                kind,
                weights[0],
                weights[1].to(device),
                state[0] if state else None,
                state[1].to(device) if state else None,
                tuple(spec[1] for spec in tbe.embedding_specs),
            )
    _layouts[tbe] = layout
    return layout


class FlatRows:
    """Rows of ``dim`` elements starting at ``starts`` of a flat buffer: read and written as rows of a
    ``[n, dim]`` view when every start is a multiple of ``dim`` (fast), else element by element."""

    def __init__(self, flat: torch.Tensor, starts: torch.Tensor, dim: int, aligned: bool) -> None:
        self.flat, self.starts, self.dim = flat, starts, dim
        self.view = None
        if aligned:
            self.view = flat[: flat.numel() // dim * dim].view(-1, dim)
            self.index = starts // dim
        else:
            self.index = starts.unsqueeze(1) + torch.arange(dim, device=flat.device)

    def read(self) -> torch.Tensor:
        if self.view is not None:
            return self.view.index_select(0, self.index)
        return self.flat[self.index]

    def write(self, values: torch.Tensor) -> None:
        if self.view is not None:
            self.view.index_copy_(0, self.index, values)
        else:
            self.flat[self.index] = values


# ---- the row steps ---------------------------------------------------------------------------------


@torch.no_grad()
def apply_rows(
    tbe: TBE,
    tables: torch.Tensor,
    rows: torch.Tensor,
    grads: torch.Tensor,
    beyond: torch.Tensor | None = None,
    steps: torch.Tensor | None = None,
) -> None:
    """One optimizer step of ``tbe``: row ``rows[i]`` of its table ``tables[i]`` gets ``grads[i]``.

    Gradients of a repeated row are summed and the row is stepped once. Every table
    named in ``tables`` must have the width of ``grads``.

    Args:
        tbe: the kernel whose weights and optimizer state move.
        tables: int64 ``[n]`` table index within the kernel of each row.
        rows: int64 ``[n]`` row within its table.
        grads: ``[n, dim]`` gradients.
        beyond: held gradients (Adagrad family): per entry, its steps' summed squares minus the
            square of its sum (:func:`squares_of`; 0 for one step); the rows are then stepped
            by :func:`step_rows_held`. Kernels stepped by the fallback take the sum as one step.
        steps: with ``beyond``, the steps each entry's gradient spans (int64 ``[n]``); default 1.
    """
    if rows.numel() == 0:
        return
    layout = kernel_layout(tbe)
    if layout is None:
        apply_row_grads(tbe, tables, rows, grads)
        return
    dim = grads.size(1)
    # ``.data``: an optimizer write, as the kernel's own fused update inside its backward is, so it
    # leaves the version counter alone. A forward still in flight saved these weights (a pipeline
    # that looks batches up ahead), and its backward does not read them: an embedding's gradient
    # does not depend on the weights.
    flat = getattr(tbe, layout.weights).data.view(-1)
    tables, rows = tables.to(flat.device), rows.to(flat.device)
    starts, inverse = torch.unique(layout.weight_offsets.index_select(0, tables) + rows * dim, return_inverse=True)
    grad = torch.zeros(starts.numel(), dim, dtype=torch.float32, device=flat.device)
    grad.index_add_(0, inverse, grads.to(grad.dtype))
    aligned = layout.rows_aligned(dim)
    weights = FlatRows(flat, starts, dim, aligned)
    lr = learning_rate(tbe).to(flat.device)
    if layout.kind == "sgd":
        weights.write(step_rows("sgd", weights.read(), None, grad, lr, 0.0)[0])
        return
    state = getattr(tbe, layout.state).data.view(-1)
    first = torch.empty_like(starts).scatter_(0, inverse, torch.arange(rows.numel(), device=flat.device))
    width = dim if layout.kind == "adagrad" else 1
    state_starts = (
        layout.state_offsets.index_select(0, tables.index_select(0, first)) + rows.index_select(0, first) * width
    )
    states = FlatRows(state, state_starts, width, aligned if layout.kind == "adagrad" else True)
    squares, spans = None, None
    if beyond is not None:
        held = torch.zeros(starts.numel(), beyond.size(1), dtype=torch.float64, device=flat.device)
        squares = (held.index_add_(0, inverse, beyond.double()) + squares_of(layout.kind, grad)).clamp(min=0)
        spans = torch.ones(starts.numel(), dtype=torch.int64, device=flat.device)
        if steps is not None:
            spans = spans.scatter_reduce(0, inverse, steps.to(flat.device).clamp(min=1), "amax")
        spans = spans.unsqueeze(1)
    eps = optimizer_eps(tbe)
    if layout.kind == "rowwise_adagrad" and weights.view is not None:
        # additive, as KernelRows.step: w + (-(g * m)) is w - g * m bit for bit, and the rows are not read
        if squares is None:
            squares = squares_of(layout.kind, grad)
        else:  # step_rows_held's squares
            squares = held_squares(layout.kind, squares, grad, spans)
        momentum = states.read() + squares.float()
        states.write(momentum)
        weights.view.index_add_(0, weights.index, grad.mul_(-(lr / (momentum.sqrt() + _as(eps, torch.float32)))))
        return
    weight = weights.read()
    if squares is None:
        weight, momentum = step_rows(layout.kind, weight, states.read(), grad, lr, eps)
    else:
        weight, momentum = step_rows_held(layout.kind, weight, states.read(), grad, squares, lr, eps, spans)
    states.write(momentum)
    weights.write(weight)


def _as(value, dtype: torch.dtype):
    """A tensor in ``dtype``; a Python number as it is (torch rounds it to the tensor's dtype)."""
    return value.to(dtype) if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def step_rows(
    kind: str, weight: torch.Tensor, state: torch.Tensor | None, grad: torch.Tensor, lr, eps
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One optimizer step of dense rows, as FBGEMM's CPU kernels compute it (no weight decay).

    Args:
        kind: ``sgd``, ``adagrad`` or ``rowwise_adagrad``.
        weight: float32 ``[n, dim]`` rows.
        state: float32 optimizer state: ``[n, dim]`` (Adagrad), ``[n, 1]`` (row-wise
            Adagrad); ignored for SGD.
        grad: ``[n, dim]`` each row's gradient of the step, repeats already summed.
        lr: float32 learning rate, a tensor of one value or one per row (``[n, 1]``).
        eps: epsilon, a Python float or a float64 tensor of one value or one per row
            (float64: Adagrad adds it in double; a float32 copy would round it first).

    Returns:
        (new rows, new state); the state is ``state`` itself for SGD.
    """
    if kind == "sgd":  # the kernel's fused multiply-add: one rounding (float64 is exact here)
        return (weight.double() - _as(lr, torch.float64) * grad.double()).float(), state
    if kind == "adagrad":
        momentum = (state.double() + grad.double() * grad.double()).float()  # fused multiply-add
        step = (lr * grad).double() / (
            momentum.double().sqrt() + _as(eps, torch.float64)
        )  # the kernel divides in double
        return (weight.double() - step).float(), momentum
    if kind != "rowwise_adagrad":
        raise ValueError(f"no row update for optimizer {kind!r}")
    momentum = state + (grad * grad).sum(1, keepdim=True) / grad.size(1)
    return weight - grad * (lr / (momentum.sqrt() + _as(eps, torch.float32))), momentum


def square_width(kind: str | None, dim: int) -> int:
    """Floats of a row's squared-gradient state: ``dim`` (Adagrad), 1 (row-wise Adagrad), 0 (SGD, None)."""
    return {"adagrad": dim, "rowwise_adagrad": 1}.get(kind, 0)


def squares_of(kind: str, grad: torch.Tensor) -> torch.Tensor | None:
    """What one step's gradient adds to the optimizer's squared-gradient state: ``grad²`` for
    Adagrad (per element), its mean over the row for row-wise Adagrad (``[n, 1]``), None for SGD."""
    if kind == "adagrad":  # in float64, as the kernel squares (so one held step is the step itself)
        return grad.double() * grad.double()
    if kind == "rowwise_adagrad":
        return (grad * grad).sum(1, keepdim=True) / grad.size(1)
    return None


def held_squares(kind: str, squares: torch.Tensor, grad_sum: torch.Tensor, steps) -> torch.Tensor:
    """What k held steps add to the state, float64: ``squares``, never below ``squares_of(grad_sum) / k``
    (k gradients that sum to ``grad_sum`` have squares of at least that; ``steps``: k, a number or ``[n, 1]``)."""
    floor = squares_of(kind, grad_sum).double() / (steps.double() if isinstance(steps, torch.Tensor) else float(steps))
    return torch.maximum(squares.double(), floor)


@torch.no_grad()
def step_rows_held(
    kind: str,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    grad_sum: torch.Tensor,
    squares: torch.Tensor | None,
    lr,
    eps,
    steps=1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The step of gradients held back over several steps (a stale replica's sync, a HET push of k updates).

    The state grows by what the k steps would add; the weight moves by the held sum over the
    window's final denominator (see docs/internals.md#tbe).

    Args:
        kind: ``sgd``, ``adagrad`` or ``rowwise_adagrad``.
        weight: float32 ``[n, dim]`` rows.
        state: the optimizer state, as :func:`step_rows` takes it.
        grad_sum: ``[n, dim]`` the held gradients' sum.
        squares: the held steps' summed :func:`squares_of` (``[n, dim]`` or ``[n, 1]``).
        lr: learning rate (a tensor of one value or one per row, ``[n, 1]``).
        eps: epsilon, as :func:`step_rows` takes it.
        steps: k, the steps the held gradients span (a number, or one per row ``[n, 1]``).
    """
    if kind == "sgd":
        return step_rows(kind, weight, state, grad_sum, lr, eps)
    if kind not in ("adagrad", "rowwise_adagrad"):
        raise ValueError(f"no row update for optimizer {kind!r}")
    squares = held_squares(kind, squares, grad_sum, steps)
    if kind == "adagrad":  # the arithmetic of :func:`step_rows`, with the squares given
        momentum = (state.double() + squares.double()).float()
        step = (lr * grad_sum).double() / (momentum.double().sqrt() + _as(eps, torch.float64))
        return (weight.double() - step).float(), momentum
    momentum = state + squares.float()
    return weight - grad_sum * (lr / (momentum.sqrt() + _as(eps, torch.float32))), momentum


@torch.no_grad()
def apply_row_grads(tbe: TBE, tables: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
    """One optimizer step of ``tbe``: row ``rows[i]`` of its table ``tables[i]`` gets ``grads[i]``.

    Several gradients for one row are summed by the kernel and applied once.
    """
    if rows.numel() == 0:
        return
    device = tbe.current_device
    tables, rows, grads = tables.to(device), rows.to(device), grads.to(device)
    feature_table = list(tbe.feature_table_map)
    dims = [spec[1] for spec in tbe.embedding_specs]
    first_feature = torch.tensor([feature_table.index(t) for t in range(len(dims))], device=device)
    feature = first_feature[tables]
    order = torch.sort(feature, stable=True).indices
    feature, rows, grads = feature[order], rows[order], grads[order]
    per_feature = torch.bincount(feature, minlength=len(feature_table))
    batch = int(per_feature.max())
    lengths = (torch.arange(batch, device=device).unsqueeze(0) < per_feature.unsqueeze(1)).long().view(-1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(lengths, 0)])
    if tbe.pooling_mode == PoolingMode.NONE:  # one output row per index, in index (= sorted) order
        with torch.enable_grad():
            rows_out = tbe(rows.long(), offsets)
        rows_out.backward(grads.to(rows_out.dtype))
        return
    feature_dims = torch.tensor([dims[t] for t in feature_table], device=device)
    column = torch.cumsum(feature_dims, 0) - feature_dims
    position = torch.arange(rows.numel(), device=device) - (torch.cumsum(per_feature, 0) - per_feature)[feature]
    out_grad = torch.zeros(batch, sum(dims[t] for t in feature_table), device=device)
    dim = grads.size(1)
    out_grad[position.unsqueeze(1), column[feature].unsqueeze(1) + torch.arange(dim, device=device)] = grads.float()
    with torch.enable_grad():
        pooled = tbe(rows.long(), offsets)
    pooled.backward(out_grad.to(pooled.dtype))


def cpu_probe_kernel(tables: int, rows: int, dim: int) -> TBE:
    """A CPU training TBE of ``tables`` tables of ``rows`` x ``dim`` with the fused row-wise Adagrad
    update (the planner's compute probe times its steps)."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import ComputeDevice

    return SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)] * tables,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
    )

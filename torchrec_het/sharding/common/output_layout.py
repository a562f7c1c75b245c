"""The end of every plugin lookup's output dist: bags of rows, one autograd function.

Every output bag is ``sum over its entries e of weight_e * rows_e / divisor[bag]`` (divisor:
the bag's length for mean pooling, else 1), each entry reading a row of a :class:`Source`
(HET cache rows, a replica block, rows or partial sums received). The backward is the
transpose, into each source's ``sink`` or back to autograd. A :class:`Part` is the bags of one
width; several parts fill the columns of one ``[batch, width]`` output. Gradients come back scaled
as TorchRec's row-wise backward scales them (:func:`gradient_scale`).

Design (backward, CPU fast paths): docs/internals.md#output-layout
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchrec.distributed.comm_ops import get_gradient_division


def gradient_scale(world_size: int) -> float:
    """The factor TorchRec's row-wise backward applies to the gradients of the outputs (its gradient division)."""
    return 1.0 / world_size if get_gradient_division() else 1.0


@dataclass
class Source:
    """Rows that a part's entries read, and where their gradients go.

    Attributes:
        rows: ``[n, dim]``.
        bags: output bag of each entry; None: the source is the part's bags already pooled
            (``rows`` is ``[num_bags, dim]``, taken as the output's buffer); its sink is called
            as ``sink(scale, bag_grads)``: the bags' gradients, not to be changed, and the scale
            it applies itself.
        slots: row in ``rows`` of each entry; None: entry i reads row i.
        weights: per-entry weight, or None.
        sink: ``sink(slots, grads)`` gets, in the backward, the gradient of the rows read:
            per entry (``slots`` as above, repeats to be summed), or per row of ``rows``
            (``slots`` None, with ``row_order``). None: ``rows`` is an input of
            :func:`output_layout` and its gradient is returned to autograd.
        bag_order: (entries in bag order, ``[bags + 1]`` offsets): pooled by ``embedding_bag``.
        row_order: (entries in row order, ``[n + 1]`` offsets): row gradients by ``embedding_bag``.
    """

    rows: torch.Tensor
    bags: torch.Tensor | None
    slots: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    sink: Callable[[torch.Tensor | None, torch.Tensor], None] | None = None
    bag_order: tuple[torch.Tensor, torch.Tensor] | None = None
    row_order: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class Part:
    """``[num_bags, dim]`` bags of one width, at ``columns`` of the output (None: all of it).

    ``one_per_bag``: every bag has exactly one entry, unweighted (then a gather).
    """

    sources: list[Source]
    num_bags: int
    dim: int
    divisors: torch.Tensor | None = None  # [num_bags, 1], or None
    columns: torch.Tensor | None = None
    one_per_bag: bool = False


@dataclass
class OutputPlan:
    """The parts of one output of shape ``shape``, the gradient scale, and a hook run after every sink."""

    parts: list[Part]
    shape: tuple[int, ...]
    scale: float = 1.0
    after_backward: Callable[[], None] | None = None


def output_layout(plan: OutputPlan, anchor: torch.Tensor) -> torch.Tensor:
    """The output of ``plan``; ``anchor`` (requires grad) lets the backward reach the sinks."""
    inputs = [s.rows for part in plan.parts for s in part.sources if s.sink is None]
    return _OutputLayout.apply(plan, anchor, *inputs)


def bag_offsets(lengths: torch.Tensor) -> torch.Tensor:
    """``[n + 1]`` where each of ``n`` consecutive runs of these lengths starts (and the end)."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
    return offsets


class _OutputLayout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: OutputPlan, anchor, *inputs):  # noqa: ARG004
        ctx.plan = plan
        parts = plan.parts
        if len(parts) == 1 and parts[0].columns is None:
            return _pool(parts[0]).view(plan.shape)
        out = torch.empty(plan.shape, device=anchor.device)
        for part in parts:
            out.index_copy_(1, part.columns, _pool(part).view(plan.shape[0], -1))
        return out

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        returned = []
        for part in plan.parts:
            bag_grads = grad if part.columns is None else grad.index_select(1, part.columns)
            bag_grads = bag_grads.reshape(part.num_bags, part.dim)
            if part.divisors is not None:
                bag_grads = bag_grads / part.divisors
            for source in part.sources:
                grads = _row_grads(source, bag_grads, plan.scale)
                if grads is not None:
                    returned.append(grads)
        if plan.after_backward is not None:
            plan.after_backward()
        return None, None, *returned


def _pool(part: Part) -> torch.Tensor:
    """``[num_bags, dim]`` bags of one part (a new tensor)."""
    sources = part.sources
    if part.one_per_bag:
        out = _gather(part)
    elif len(sources) == 1 and sources[0].bag_order is not None:
        s = sources[0]
        order, offsets = s.bag_order
        out = F.embedding_bag(
            s.slots.index_select(0, order),
            s.rows,
            offsets,
            mode="sum",
            include_last_offset=True,
            per_sample_weights=None if s.weights is None else s.weights.index_select(0, order),
        )
    else:
        pooled = [s for s in sources if s.bags is None]
        if pooled:
            out, sources = pooled[0].rows, [s for s in sources if s is not pooled[0]]
        else:
            out = torch.zeros(part.num_bags, part.dim, device=sources[0].rows.device if sources else None)
        for s in sources:
            rows = s.rows
            if s.slots is not None:
                rows = rows.index_select(0, s.slots)
                if s.weights is not None:
                    rows.mul_(s.weights.unsqueeze(1))
            elif s.weights is not None:
                rows = rows * s.weights.unsqueeze(1)
            out.index_add_(0, s.bags, rows)
    return out if part.divisors is None else out.div_(part.divisors)


def _gather(part: Part) -> torch.Tensor:
    """One entry per bag: one ``index_select`` from one table of the sources' rows. A source
    goes in whole, or as only the rows its entries read where those are fewer."""
    sources, dim = part.sources, part.dim
    sizes = [s.rows.size(0) if s.slots is None else min(s.rows.size(0), s.slots.numel()) for s in sources]
    device = sources[0].rows.device
    single = len(sources) == 1 and sizes[0] == sources[0].rows.size(0)
    table = sources[0].rows if single else torch.empty(sum(sizes), dim, device=device)
    source_row = torch.empty(part.num_bags, dtype=torch.int64, device=device)
    base = 0
    for s, size in zip(sources, sizes):
        if s.slots is not None and size < s.rows.size(0):  # only the rows read
            torch.index_select(s.rows, 0, s.slots, out=table[base : base + size])
            at = torch.arange(base, base + size, device=device)
        else:
            if not single:
                table[base : base + size].copy_(s.rows)
            at = torch.arange(base, base + size, device=device) if s.slots is None else s.slots + base
        source_row.index_copy_(0, s.bags, at)
        base += size
    return table.index_select(0, source_row)


def _row_grads(source: Source, bag_grads: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Hands ``source`` the gradient of the rows it read (scaled); returns it where the source
    has no sink (the gradient of its rows), else None."""
    if source.bags is None:  # already pooled: the bags' gradients
        source.sink(scale, bag_grads)
        return None
    if source.row_order is not None:
        order, offsets = source.row_order
        grads = F.embedding_bag(
            source.bags.index_select(0, order),
            bag_grads,
            offsets,
            mode="sum",
            include_last_offset=True,
            per_sample_weights=None if source.weights is None else source.weights.index_select(0, order),
        )
        slots = None
    else:
        grads = bag_grads.index_select(0, source.bags)
        if source.weights is not None:
            grads.mul_(source.weights.unsqueeze(1))
        slots = source.slots
    if source.sink is not None:
        source.sink(slots, grads.mul_(scale) if scale != 1.0 else grads)
        return None
    if slots is not None:  # repeats summed into the source's rows
        grads = torch.zeros(source.rows.size(0), bag_grads.size(1), device=grads.device).index_add_(0, slots, grads)
    return (grads.mul_(scale) if scale != 1.0 else grads).view_as(source.rows)

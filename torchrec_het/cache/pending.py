"""Rows with unpushed gradients, as the HET cache hands them to their owners."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PendingRows:
    """Rows whose accumulated gradient must go to their owner.

    Attributes:
        ids: int64 ``[n]`` row ids in the table's global id space.
        grads: ``[n, dim]`` sum of the gradients accumulated since the last push.
        counts: int64 ``[n]`` updates (``accumulate`` calls) folded into ``grads``.
        squares: what those updates add to an Adagrad-family state (their gradients' squares,
            summed: ``[n, width]``), where the cache holds squares; else None.
    """

    ids: torch.Tensor
    grads: torch.Tensor
    counts: torch.Tensor
    squares: torch.Tensor | None = None

    @staticmethod
    def empty(dim: int, dtype: torch.dtype = torch.float32, device: torch.device | None = None) -> "PendingRows":
        """No rows, with gradients of width ``dim``."""
        return PendingRows(
            torch.empty(0, dtype=torch.int64, device=device),
            torch.empty(0, dim, dtype=dtype, device=device),
            torch.empty(0, dtype=torch.int64, device=device),
        )

    def __len__(self) -> int:
        return self.ids.numel()

    @staticmethod
    def concat(parts: list["PendingRows"]) -> "PendingRows":
        """All parts, one after the other (the parts share one dim; at least one part)."""
        if not parts:
            raise ValueError("PendingRows.concat needs at least one part (use PendingRows.empty)")
        with_squares = [p for p in parts if p.squares is not None]
        squares = None
        if with_squares:  # a part without squares holds one update per row: its square is its gradient's
            width = with_squares[0].squares.size(1)
            squares = torch.cat(
                [p.squares if p.squares is not None else _one_update_squares(p.grads, width) for p in parts]
            )
        return PendingRows(
            torch.cat([p.ids for p in parts]),
            torch.cat([p.grads for p in parts]),
            torch.cat([p.counts for p in parts]),
            squares,
        )


def _one_update_squares(grads: torch.Tensor, width: int) -> torch.Tensor:
    """Squares of rows that hold one update each (their gradient is that update's)."""
    squares = grads * grads
    return squares if width == grads.size(1) else squares.sum(1, keepdim=True) / grads.size(1)

"""Summing row gradients over the holders of replicated rows, so every copy takes the same step.

Two ways, chosen per step by the caller from the touched-row counts every rank knows:
*sparse* (all-gather of the touched ids and their gradients, then the same sum on every
rank) or *dense* (one all-reduce over the whole hot block). Both give every rank the
same bits: dense through the collective, sparse by summing the same inputs in rank order.
"""

import torch
import torch.distributed as dist


def collective_device(pg: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor of host facts must be for a collective on ``pg``: the current CUDA
    device for NCCL, else the CPU."""
    if dist.get_backend(pg) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gather_counts(count: int, pg: dist.ProcessGroup | None) -> list[int]:
    """Every rank's ``count`` (one small all-gather)."""
    device = collective_device(pg)
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(out, torch.tensor([count], dtype=torch.int64, device=device), group=pg)
    return torch.cat(out).tolist()


def sparse_bytes(counts: list[int], dim: int) -> int:
    """Bytes one rank receives in a sparse combine (ids and rows, padded to the largest count)."""
    return (len(counts) - 1) * max(counts, default=0) * (8 + 4 * dim)


def dense_bytes(block_rows: int, dim: int, world_size: int) -> int:
    """Bytes one rank receives in a ring all-reduce of the dense block."""
    return 2 * (world_size - 1) * block_rows * (dim + 1) * 4 // max(world_size, 1)


def combine_sparse(
    ids: torch.Tensor, grads: torch.Tensor, counts: list[int], pg: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids touched on any rank, their summed gradients); ``counts``: every rank's ``len(ids)``."""
    width = max(counts, default=0)
    dim = grads.size(1)
    if width == 0:
        return ids[:0], grads[:0]
    padded_ids = torch.full((width,), -1, dtype=torch.int64, device=ids.device)
    padded_ids[: ids.numel()] = ids
    padded = torch.zeros(width, dim, device=grads.device)
    padded[: ids.numel()] = grads
    all_ids = [torch.empty_like(padded_ids) for _ in counts]
    all_grads = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(all_ids, padded_ids, group=pg)
    dist.all_gather(all_grads, padded, group=pg)
    flat_ids, flat = torch.cat(all_ids), torch.cat(all_grads)
    valid = flat_ids >= 0
    uniq, inverse = torch.unique(flat_ids[valid], return_inverse=True)
    return uniq, torch.zeros(uniq.numel(), dim, device=flat.device).index_add_(0, inverse, flat[valid])


def combine_dense(
    ids: torch.Tensor, grads: torch.Tensor, block: torch.Tensor, pg: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums over ranks within the sorted id ``block`` (``ids`` must lie in it).

    Returns (touched ids, their summed gradients, on how many ranks each was touched).
    """
    dim = grads.size(1)
    dense = torch.zeros(block.numel(), dim + 1, device=grads.device)
    pos = torch.searchsorted(block, ids)
    dense[pos, :dim] = grads
    dense[pos, dim] = 1.0
    dist.all_reduce(dense, group=pg)
    touched = dense[:, dim] > 0
    return block[touched], dense[touched, :dim], dense[touched, dim]

"""All-to-all exchanges of variable-size segments, the only collectives the HET lookup issues.

Every rank calls each function in the same order with its own segments; sizes are
exchanged first so receivers can size their buffers.
"""

import torch
import torch.distributed as dist


def exchange_counts(counts: torch.Tensor, pg: dist.ProcessGroup | None) -> torch.Tensor:
    """Row d of ``counts`` goes to rank d; returns the rows every rank sent to this one.

    Args:
        counts: int64 ``[world_size, k]``.
        pg: the process group.
    """
    world_size, k = counts.shape
    received = torch.empty_like(counts)
    dist.all_to_all_single(received.view(-1), counts.contiguous().view(-1), [k] * world_size, [k] * world_size, group=pg)
    return received


def exchange_flat(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], pg: dist.ProcessGroup | None
) -> torch.Tensor:
    """Sends ``send[sum(send_splits[:d]) : ...]`` to rank d; returns what arrives, by source rank.

    Args:
        send: a 1-D tensor, its segments ordered by destination rank.
        send_splits: elements for each destination.
        recv_splits: elements from each source.
        pg: the process group.
    """
    received = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(received, send.contiguous(), recv_splits, send_splits, group=pg)
    return received

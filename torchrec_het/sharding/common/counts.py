"""The first collective of the plugin's input dists: every rank's send counts and batch size."""

import torch
import torch.distributed as dist


def gather_counts(dest: torch.Tensor, batch: int, pg):
    """Starts the input dist's one all-gather: every rank's ids per destination and batch size.

    Args:
        dest: the destination rank of each id this rank sends.
        batch: this rank's batch size.
        pg: the process group.

    Returns:
        (work, gathered): row s of ``gathered`` is rank s's counts, then its batch size.
    """
    world_size = dist.get_world_size(pg)
    counts = torch.cat([torch.bincount(dest, minlength=world_size), torch.tensor([batch], device=dest.device)])
    gathered = [torch.empty_like(counts) for _ in range(world_size)]
    return dist.all_gather(gathered, counts, group=pg, async_op=True), gathered

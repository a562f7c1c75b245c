"""The first collective of the plugin's input dists: every rank's send counts and batch size."""

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Splits:
    """Every rank's counts, once gathered: ``table[s][d]`` items rank s sends to rank d, then its batch size."""

    table: list[list[int]]
    rank: int

    @property
    def send(self) -> list[int]:
        return self.table[self.rank][: len(self.table)]

    @property
    def recv(self) -> list[int]:
        return [row[self.rank] for row in self.table]

    @property
    def batch_sizes(self) -> set[int]:
        return {row[-1] for row in self.table}

    def crosses_ranks(self) -> bool:
        """Whether any rank sends to another."""
        return any(c for s, row in enumerate(self.table) for d, c in enumerate(row[:-1]) if s != d)


class GatheredCounts:
    """The input dist's one all-gather in flight: every rank's items per destination and batch size.

    Args:
        dest: the destination rank of each item this rank sends.
        batch: this rank's batch size.
        pg: the process group.
    """

    def __init__(self, dest: torch.Tensor, batch: int, pg) -> None:
        world_size = dist.get_world_size(pg)
        counts = torch.cat([torch.bincount(dest, minlength=world_size), torch.tensor([batch], device=dest.device)])
        self.gathered = [torch.empty_like(counts) for _ in range(world_size)]
        self.rank = dist.get_rank(pg)
        self.work = dist.all_gather(self.gathered, counts, group=pg, async_op=True)

    def wait(self) -> Splits:
        """The counts of every rank (the input dist's host sync)."""
        self.work.wait()
        return Splits(torch.stack(self.gathered).tolist(), self.rank)

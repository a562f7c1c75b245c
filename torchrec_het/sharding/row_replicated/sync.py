"""The groups that sum hot rows' gradients over their holders, so every copy takes the same step.

Replicated rows (held by every rank): on several hosts (:class:`HostGroups`) their sums run
hierarchically: within each host, then between the host leaders (one copy of each host's sum
crosses the slow link, only the rows the host touched, with a bit mask), then handed back
within the host: every rank gets the same bits. Per-host rows (held by one rank per host)
sum over their holders' group (:func:`holder_group`).
"""

import torch
import torch.distributed as dist

from torchrec_het._compat import collective_device, process_group_timeout


def every_rank_count(count: int, pg: dist.ProcessGroup | None) -> list[int]:
    """Every rank's ``count`` (one small all-gather)."""
    device = collective_device(pg)
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(out, torch.tensor([count], dtype=torch.int64, device=device), group=pg)
    return torch.cat(out).tolist()


def holder_group(pg: dist.ProcessGroup | None, local_world_size: int) -> dist.ProcessGroup | None:
    """The group of the ranks that hold the same per-host rows as this one (this local rank on every
    host), created once, a collective: every rank of ``pg`` creates every such group, in order.
    None with one host (per-host rows are then read from their owners)."""
    ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
    local, me = local_world_size, dist.get_rank(pg)
    if len(ranks) % local:
        raise ValueError(f"world size {len(ranks)} is not a multiple of {local} ranks per host")
    if len(ranks) == local:
        return None
    backend, timeout, mine = dist.get_backend(pg), process_group_timeout(pg), None
    for index in range(local):
        group = dist.new_group(ranks[index::local], backend=backend, timeout=timeout)
        if me % local == index:
            mine = group
    return mine


class HostGroups:
    """Subgroups of ``pg`` that sum replicated rows' gradients hierarchically (created once, a collective).

    Ranks of a host are ``local_world_size`` consecutive ranks of ``pg``; each host's first
    rank is its leader. :meth:`all_reduce` sums within a host, then between the leaders (one
    copy per host crosses the slow link), then hands the leader's result to its host, so every
    rank ends with the same bits. With one host, or one rank per host, there are no subgroups
    and it is the flat all-reduce on ``pg``.

    Every rank of ``pg`` creates every subgroup, in the same order (the host groups, then the
    *cross* groups: the ranks of one local rank on every host, the leaders being cross group
    0), so each rank is in exactly one of each kind and later groups get the same names
    everywhere.

    Args:
        pg: the group whose ranks sum (None: the default group).
        local_world_size: ranks per host.
    """

    def __init__(self, pg: dist.ProcessGroup | None, local_world_size: int) -> None:
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(dist.get_world_size()))
        local, me = local_world_size, dist.get_rank(pg)
        if len(ranks) % local:
            raise ValueError(f"world size {len(ranks)} is not a multiple of {local} ranks per host")
        self.pg, self.local_world_size, self.num_hosts = pg, local, len(ranks) // local
        self.host: dist.ProcessGroup | None = None  # this rank's host
        self.cross: dist.ProcessGroup | None = None  # this rank's local rank on every host
        self.is_leader = me % local == 0
        self.leader = ranks[me - me % local]  # global rank of this host's leader
        if self.num_hosts == 1 or local == 1:
            return
        backend, timeout = dist.get_backend(pg), process_group_timeout(pg)
        for host in range(self.num_hosts):
            group = dist.new_group(ranks[host * local : (host + 1) * local], backend=backend, timeout=timeout)
            if me // local == host:
                self.host = group
        for index in range(local):
            group = dist.new_group(ranks[index::local], backend=backend, timeout=timeout)
            if me % local == index:
                self.cross = group

    @property
    def hierarchical(self) -> bool:
        return self.host is not None

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sums ``tensor`` over ``pg`` in place; with ``async_op``, returns a handle whose ``wait()``
        finishes the sum (the within-host sum is started now, the rest runs in ``wait()``)."""
        if not self.hierarchical:
            return dist.all_reduce(tensor, group=self.pg, async_op=async_op)
        work = _HostSum(self, tensor, dist.all_reduce(tensor, group=self.host, async_op=True))
        if async_op:
            return work
        work.wait()
        return None


class _HostSum:
    """A started hierarchical all-reduce: the within-host sum is in flight; ``wait()`` does the rest."""

    def __init__(self, hosts: HostGroups, tensor: torch.Tensor, work) -> None:
        self.hosts, self.tensor, self.work = hosts, tensor, work

    def wait(self) -> bool:
        if self.work is None:
            return True
        self.work.wait()
        self.work = None
        if self.hosts.is_leader:
            _sum_nonzero_rows(self.tensor, self.hosts.cross)  # between leaders: one copy per host
        dist.broadcast(self.tensor, src=self.hosts.leader, group=self.hosts.host)
        return True


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _sum_nonzero_rows(tensor: torch.Tensor, pg: dist.ProcessGroup) -> None:
    """Sums ``tensor`` (rows along dim 0) over ``pg`` in place, sending only the rows that are not
    all zero (a bit mask says which): the rows a host did not touch cost a bit, not a row.

    Every rank adds the same contributions in rank order, from zero, so all get the same bits
    (an omitted row adds exactly 0)."""
    rows = tensor.view(tensor.size(0), -1)
    nonzero = (rows != 0).any(1)
    mine = rows[nonzero]
    counts = every_rank_count(mine.size(0), pg)
    width = max(counts)
    if width == 0:
        return
    pad = (-nonzero.numel()) % 8
    bits = torch.cat([nonzero, nonzero.new_zeros(pad)]).view(-1, 8).to(torch.uint8)
    mask = (bits * _BITS.to(bits.device)).sum(1, dtype=torch.uint8)
    padded = rows.new_zeros(width, rows.size(1))
    padded[: mine.size(0)] = mine
    masks, parts = [torch.empty_like(mask) for _ in counts], [torch.empty_like(padded) for _ in counts]
    dist.all_gather(masks, mask, group=pg)
    dist.all_gather(parts, padded, group=pg)
    total = torch.zeros_like(rows)
    for other, part, count in zip(masks, parts, counts):
        present = ((other.view(-1, 1) & _BITS.to(other.device)) != 0).view(-1)[: rows.size(0)]
        total[present] += part[:count]
    rows.copy_(total)

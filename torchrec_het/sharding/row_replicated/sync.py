"""Summing row gradients over the holders of replicated rows, so every copy takes the same step.

Two ways, chosen per step by the caller from the touched-row counts every rank knows:
*sparse* (all-gather of the touched ids and their gradients, then the same sum on every
rank) or *dense* (one all-reduce over the whole hot block). Both give every rank the
same bits: dense through the collective, sparse by summing the same inputs in rank order.

On several hosts (:class:`HostGroups`) both run hierarchically: summed within each host,
then between the host leaders (one copy of each host's sum crosses the slow link, and of a
dense block only the rows the host touched, with a bit mask), then handed back within the
host: the same sum, in another float summation order.
"""

import torch
import torch.distributed as dist

from torchrec_het._compat import process_group_timeout


def collective_device(pg: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor of host facts must be for a collective on ``pg``: the current CUDA
    device for NCCL, else the CPU."""
    if dist.get_backend(pg) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def every_rank_count(count: int, pg: dist.ProcessGroup | None) -> list[int]:
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
    ids: torch.Tensor, grads: torch.Tensor, block: torch.Tensor, pg: dist.ProcessGroup | None,
    hosts: "HostGroups | None" = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sums over ranks within the sorted id ``block`` (``ids`` must lie in it); over ``hosts``
    (hierarchically) when given, else flat on ``pg``.

    Returns (touched ids, their summed gradients, on how many ranks each was touched).
    """
    dim = grads.size(1)
    dense = torch.zeros(block.numel(), dim + 1, device=grads.device)
    pos = torch.searchsorted(block, ids)
    dense[pos, :dim] = grads
    dense[pos, dim] = 1.0
    if hosts is not None:
        hosts.all_reduce(dense)
    else:
        dist.all_reduce(dense, group=pg)
    touched = dense[:, dim] > 0
    return block[touched], dense[touched, :dim], dense[touched, dim]


class HostGroups:
    """Subgroups of ``pg`` that sum replicated rows' gradients hierarchically (created once, a collective).

    Ranks of a host are ``local_world_size`` consecutive ranks of ``pg``; each host's first
    rank is its leader. :meth:`all_reduce` and :meth:`combine_sparse` sum within a host, then
    between the leaders (one copy per host crosses the slow link), then hand the leader's
    result to its host, so every rank ends with the same bits. With one host, or one rank
    per host, there are no subgroups and both are the flat collectives on ``pg``.

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

    def combine_sparse(self, ids: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids touched on any rank, their summed gradients), as :func:`combine_sparse` over ``pg``;
        only the leaders' host sums cross between hosts."""
        if not self.hierarchical:
            return combine_sparse(ids, grads, every_rank_count(ids.numel(), self.pg), self.pg)
        ids, grads = combine_sparse(ids, grads, every_rank_count(ids.numel(), self.host), self.host)
        if self.is_leader:
            ids, grads = combine_sparse(ids, grads, every_rank_count(ids.numel(), self.cross), self.cross)
        device = collective_device(self.host)
        count = torch.tensor([ids.numel()], dtype=torch.int64, device=device)
        dist.broadcast(count, src=self.leader, group=self.host)
        n = int(count.item())
        if not self.is_leader:
            ids = torch.empty(n, dtype=torch.int64, device=ids.device)
            grads = torch.empty(n, grads.size(1), dtype=grads.dtype, device=grads.device)
        if n:
            dist.broadcast(ids, src=self.leader, group=self.host)
            dist.broadcast(grads, src=self.leader, group=self.host)
        return ids, grads


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

"""A bounded cache of one table's remote rows on one rank (HET), as pure tensor code.

Every operation is vectorized over a batch of ids; nothing here talks to other ranks.
The distributed lookup decides what to fetch and push; this class keeps the rows,
their versions, their pending gradients and the eviction metadata.
"""

from dataclasses import dataclass

import torch

POLICIES = ("lru", "lfu")


@dataclass(frozen=True)
class PendingRows:
    """Rows whose accumulated gradient must go to their owner.

    Attributes:
        ids: int64 ``[n]`` row ids in the table's id space.
        grads: ``[n, dim]`` gradients accumulated since the last push.
        counts: int64 ``[n]`` updates folded into ``grads``.
    """

    ids: torch.Tensor
    grads: torch.Tensor
    counts: torch.Tensor

    @staticmethod
    def empty(dim: int, dtype: torch.dtype = torch.float32) -> "PendingRows":
        return PendingRows(torch.empty(0, dtype=torch.int64), torch.empty(0, dim, dtype=dtype), torch.empty(0, dtype=torch.int64))

    def __len__(self) -> int:
        return self.ids.numel()

    @staticmethod
    def concat(parts: list["PendingRows"]) -> "PendingRows":
        """All parts, one after the other (parts share one dim)."""
        return PendingRows(
            torch.cat([p.ids for p in parts]), torch.cat([p.grads for p in parts]), torch.cat([p.counts for p in parts])
        )


class RowCache:
    """Up to ``capacity`` rows of a table of ``num_rows`` rows, found through a dense id -> slot map.

    The id space may be cut into partitions (``partition_ends``, e.g. several tables
    laid end to end), each with its own capacity: a partition's rows only ever
    displace rows of the same partition.

    The map costs 8 bytes per table row (int64), which buys O(1) vectorized lookups
    without hashing; the rows themselves cost ``3 * dim`` values per slot (value,
    pending gradient, pending local delta) plus a few int64 counters.

    Args:
        num_rows: rows of the table (ids are in ``[0, num_rows)``).
        dim: embedding dimension.
        capacity: slots; 0 caches nothing.
        policy: ``lru`` (evict the least recently used) or ``lfu`` (the least used).
        dtype: dtype of values and gradients.
        partition_ends: exclusive end id of each partition (default: one partition).
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        capacity: int | list[int],
        policy: str = "lru",
        dtype: torch.dtype = torch.float32,
        partition_ends: list[int] | None = None,
    ):
        if num_rows < 1 or dim < 1:
            raise ValueError(f"num_rows and dim must be >= 1, got {num_rows} and {dim}")
        capacities = [capacity] if isinstance(capacity, int) else list(capacity)
        ends = [num_rows] if partition_ends is None else list(partition_ends)
        if len(ends) != len(capacities) or ends[-1] != num_rows or ends != sorted(ends):
            raise ValueError(f"partition_ends {ends} must ascend to num_rows={num_rows}, one per capacity {capacities}")
        if min(capacities) < 0:
            raise ValueError(f"capacity must be >= 0, got {capacities}")
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose from {POLICIES}")
        capacity = sum(capacities)
        self.num_rows, self.dim, self.capacity, self.policy = num_rows, dim, capacity, policy
        self.partition_ends = torch.tensor(ends, dtype=torch.int64)
        self.partition_capacity = torch.tensor(capacities, dtype=torch.int64)
        # slots of partition p: [slot_starts[p], slot_starts[p] + capacity[p])
        self.slot_starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self.partition_capacity, 0)])
        self.values = torch.zeros(capacity, dim, dtype=dtype)
        self.pending_grad = torch.zeros(capacity, dim, dtype=dtype)
        self.pending_delta = torch.zeros(capacity, dim, dtype=dtype)
        self.versions = torch.zeros(capacity, dtype=torch.int64)
        self.validated_step = torch.zeros(capacity, dtype=torch.int64)
        self.pending_count = torch.zeros(capacity, dtype=torch.int64)
        self.last_used = torch.zeros(capacity, dtype=torch.int64)
        self.frequency = torch.zeros(capacity, dtype=torch.int64)
        self.slot_ids = torch.full((capacity,), -1, dtype=torch.int64)
        self._slot_of = torch.full((num_rows,), -1, dtype=torch.int64)

    def __len__(self) -> int:
        return int((self.slot_ids >= 0).sum())

    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The slot of each id, -1 where it is not cached."""
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise ValueError(f"ids must be in [0, {self.num_rows}), got range [{int(ids.min())}, {int(ids.max())}]")
        return self._slot_of[ids]

    def touch(self, slots: torch.Tensor, step: int, uses: torch.Tensor | None = None) -> None:
        """Records a use of each slot at ``step`` (``uses`` lookups each, default 1)."""
        self.last_used[slots] = step
        self.frequency.index_add_(0, slots, uses if uses is not None else torch.ones_like(slots))

    def partition_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The partition of each id."""
        return torch.bucketize(ids, self.partition_ends, right=True)

    def _eviction_keys(self, lo: int, hi: int) -> torch.Tensor:
        """Slots lo:hi ordered for eviction by one int64 key: (primary, secondary) of the policy."""
        primary, secondary = (
            (self.last_used, self.frequency) if self.policy == "lru" else (self.frequency, self.last_used)
        )
        return primary[lo:hi] * (1 << 31) + secondary[lo:hi].clamp(max=(1 << 31) - 1)

    def _slots_for(self, partition: int, count: int, protect_mask: torch.Tensor) -> torch.Tensor:
        """Up to ``count`` slots of a partition: free ones (in slot order), then victims by the policy."""
        lo, hi = int(self.slot_starts[partition]), int(self.slot_starts[partition + 1])
        occupied = self.slot_ids[lo:hi] >= 0
        free = (~occupied).nonzero().flatten()[:count] + lo
        missing = count - free.numel()
        if missing <= 0:
            return free
        eligible = occupied & ~protect_mask[lo:hi]
        missing = min(missing, int(eligible.sum()))
        if missing == 0:
            return free
        keys = torch.where(eligible, self._eviction_keys(lo, hi), torch.iinfo(torch.int64).max)
        victims = torch.topk(keys, missing, largest=False, sorted=True).indices + lo
        return torch.cat([free, victims])

    def insert(
        self, ids: torch.Tensor, values: torch.Tensor, versions: torch.Tensor, step: int, protect: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, PendingRows, torch.Tensor]:
        """Caches new rows, evicting by the policy within each partition (never a slot in ``protect``).

        Args:
            ids: distinct ids not cached now.
            values: their rows.
            versions: the owner's version of each row.
            step: the current step.
            protect: slots in use this step.

        Returns:
            The slot of each id (-1 for ids that found none: the first ids of a
            partition, in the given order, get slots first), the evicted rows that
            still held unpushed gradients, and the ids of every evicted row.
        """
        if ids.numel() and bool((self.slots_of(ids) >= 0).any()):
            raise ValueError("insert() takes ids that are not cached yet")
        if ids.numel() != torch.unique(ids).numel():
            raise ValueError("insert() takes distinct ids")
        result = torch.full((ids.numel(),), -1, dtype=torch.int64)
        if ids.numel() == 0 or self.capacity == 0:
            return result, PendingRows.empty(self.dim, self.values.dtype), ids[:0]
        protect_mask = torch.zeros(self.capacity, dtype=torch.bool)
        if protect is not None and protect.numel():
            protect_mask[protect] = True
        partition = self.partition_of(ids)
        order = torch.sort(partition, stable=True).indices  # ids of a partition keep their order
        wanted = torch.bincount(partition, minlength=len(self.partition_capacity)).tolist()
        chosen, start = [], 0
        placed_positions = []
        for p, n in enumerate(wanted):
            if n == 0:
                continue
            slots_p = self._slots_for(p, n, protect_mask)
            chosen.append(slots_p)
            placed_positions.append(order[start : start + slots_p.numel()])
            start += n
        slots = torch.cat(chosen) if chosen else torch.empty(0, dtype=torch.int64)
        placed_at = torch.cat(placed_positions) if placed_positions else torch.empty(0, dtype=torch.int64)
        placed = torch.zeros(ids.numel(), dtype=torch.bool)
        placed[placed_at] = True
        slots_in_id_order = torch.empty(ids.numel(), dtype=torch.int64)
        slots_in_id_order[placed_at] = slots
        slots = slots_in_id_order[placed]
        victims = slots[self.slot_ids[slots] >= 0]
        evicted_ids = self.slot_ids[victims].clone()
        dirty = self._evict(victims)
        result[placed] = slots
        ids, values, versions = ids[placed], values[placed], versions[placed]
        self.slot_ids[slots] = ids
        self._slot_of[ids] = slots
        self.values[slots] = values.to(self.values.dtype)
        self.versions[slots] = versions
        self.validated_step[slots] = step
        self.last_used[slots] = step
        self.frequency[slots] = 1
        self.pending_grad[slots] = 0
        self.pending_delta[slots] = 0
        self.pending_count[slots] = 0
        return result, dirty, evicted_ids

    def _evict(self, slots: torch.Tensor) -> PendingRows:
        dirty = slots[self.pending_count[slots] > 0]
        out = PendingRows(self.slot_ids[dirty].clone(), self.pending_grad[dirty].clone(), self.pending_count[dirty].clone())
        self._slot_of[self.slot_ids[slots]] = -1
        self.slot_ids[slots] = -1
        self.pending_count[slots] = 0
        return out

    def refresh(self, slots: torch.Tensor, values: torch.Tensor, versions: torch.Tensor, step: int) -> None:
        """A newer value from the owner; this rank's unpushed local updates stay applied."""
        self.values[slots] = values.to(self.values.dtype) + self.pending_delta[slots]
        self.versions[slots] = versions
        self.validated_step[slots] = step

    def mark_validated(self, slots: torch.Tensor, step: int) -> None:
        """The owner confirmed the cached copy at ``step``."""
        self.validated_step[slots] = step

    def accumulate(self, slots: torch.Tensor, grads: torch.Tensor, deltas: torch.Tensor) -> None:
        """Adds a gradient to each (distinct) slot and applies the local update ``deltas``."""
        self.pending_grad[slots] += grads.to(self.pending_grad.dtype)
        self.pending_count[slots] += 1
        self.values[slots] += deltas.to(self.values.dtype)
        self.pending_delta[slots] += deltas.to(self.values.dtype)

    def take_due(self, s_write: int) -> PendingRows:
        """Rows with more than ``s_write`` pending updates, in ascending id order; their pending is reset."""
        due = (self.pending_count > s_write).nonzero().flatten()
        due = due[torch.sort(self.slot_ids[due]).indices]
        out = PendingRows(self.slot_ids[due].clone(), self.pending_grad[due].clone(), self.pending_count[due].clone())
        self.pending_grad[due] = 0
        self.pending_delta[due] = 0
        self.pending_count[due] = 0
        return out

    def take_all(self) -> PendingRows:
        """Every row with pending updates (a flush)."""
        return self.take_due(0)

    def clear(self) -> None:
        """Forgets every row; pending gradients are dropped (flush first to keep them)."""
        self._slot_of[self.slot_ids[self.slot_ids >= 0]] = -1
        self.slot_ids.fill_(-1)
        self.pending_count.zero_()
        self.pending_grad.zero_()
        self.pending_delta.zero_()

    def nbytes(self) -> int:
        """Bytes held by the cache, its metadata and the id -> slot map."""
        tensors = (
            self.values, self.pending_grad, self.pending_delta, self.versions, self.validated_step,
            self.pending_count, self.last_used, self.frequency, self.slot_ids, self._slot_of,
        )
        return sum(t.numel() * t.element_size() for t in tensors)

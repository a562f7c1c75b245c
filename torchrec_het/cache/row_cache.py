"""A bounded cache of remote embedding rows on one rank (HET), as pure tensor code.

Every operation is vectorized over a batch of ids; nothing here talks to other ranks.
The distributed lookup decides what to fetch and push; this class keeps the rows,
their versions, their pending gradients and the eviction metadata.
"""

from dataclasses import dataclass

import torch

POLICIES = ("lru", "lfu")

_INT64_MAX = torch.iinfo(torch.int64).max
_INT32_MAX = torch.iinfo(torch.int32).max


@dataclass(frozen=True)
class PendingRows:
    """Rows whose accumulated gradient must go to their owner.

    Attributes:
        ids: int64 ``[n]`` row ids in the table's global id space.
        grads: ``[n, dim]`` sum of the gradients accumulated since the last push.
        counts: int64 ``[n]`` updates (``accumulate`` calls) folded into ``grads``.
    """

    ids: torch.Tensor
    grads: torch.Tensor
    counts: torch.Tensor

    @staticmethod
    def empty(dim: int, dtype: torch.dtype = torch.float32) -> "PendingRows":
        """No rows, with gradients of width ``dim``."""
        return PendingRows(
            torch.empty(0, dtype=torch.int64), torch.empty(0, dim, dtype=dtype), torch.empty(0, dtype=torch.int64)
        )

    def __len__(self) -> int:
        return self.ids.numel()

    @staticmethod
    def concat(parts: list["PendingRows"]) -> "PendingRows":
        """All parts, one after the other (the parts share one dim; at least one part)."""
        if not parts:
            raise ValueError("PendingRows.concat needs at least one part (use PendingRows.empty)")
        return PendingRows(
            torch.cat([p.ids for p in parts]), torch.cat([p.grads for p in parts]), torch.cat([p.counts for p in parts])
        )


class RowCache:
    """Up to ``capacity`` rows of a table of ``num_rows`` rows, found through a dense id -> slot map.

    The id space may be cut into partitions (``partition_ends``, e.g. several tables
    laid end to end), each with its own capacity: a partition's rows only ever
    displace rows of the same partition, and its slots are a contiguous range.

    Memory: the id -> slot map costs 4 bytes per table row (int32; 8 bytes if the
    capacity reaches 2**31), which buys O(1) vectorized lookups without hashing.
    Each slot costs ``3 * dim`` values (value, pending gradient, pending local
    delta) plus six int64 counters; ``nbytes()`` gives the exact total.

    Eviction: free slots are used first (lowest slot first), then victims among the
    occupied, unprotected slots of the partition: LRU takes the smallest
    ``last_used`` (ties: smallest ``frequency``, then smallest slot), LFU the
    smallest ``frequency`` (ties: smallest ``last_used``, then smallest slot).
    Victims are handed out in that eviction order.

    Args:
        num_rows: rows of the table (ids are in ``[0, num_rows)``).
        dim: embedding dimension.
        capacity: slots (0 caches nothing), or one capacity per partition.
        policy: ``lru`` (evict the least recently used) or ``lfu`` (the least used).
        dtype: dtype of values and gradients.
        partition_ends: exclusive end id of each partition, ascending to ``num_rows``
            (default: one partition).
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        capacity: int | list[int],
        policy: str = "lru",
        dtype: torch.dtype = torch.float32,
        partition_ends: list[int] | None = None,
    ) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {num_rows}")
        if dim < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose from {POLICIES}")
        capacities = [capacity] if isinstance(capacity, int) else list(capacity)
        if not capacities or min(capacities) < 0:
            raise ValueError(f"capacity must be >= 0 (one per partition), got {capacity}")
        ends = [num_rows] if partition_ends is None else list(partition_ends)
        if len(ends) != len(capacities) or ends[-1] != num_rows or ends != sorted(ends) or ends[0] < 0:
            raise ValueError(f"partition_ends {ends} must ascend to num_rows={num_rows}, one per capacity {capacities}")
        total = sum(capacities)
        self.num_rows, self.dim, self.capacity, self.policy = num_rows, dim, total, policy
        self.partition_ends = torch.tensor(ends, dtype=torch.int64)
        self.partition_capacity = torch.tensor(capacities, dtype=torch.int64)
        # slots of partition p: [slot_starts[p], slot_starts[p + 1])
        self.slot_starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(self.partition_capacity, 0)])
        self.values = torch.zeros(total, dim, dtype=dtype)
        self.pending_grad = torch.zeros(total, dim, dtype=dtype)
        self.pending_delta = torch.zeros(total, dim, dtype=dtype)
        self.versions = torch.zeros(total, dtype=torch.int64)
        self.validated_step = torch.zeros(total, dtype=torch.int64)
        self.pending_count = torch.zeros(total, dtype=torch.int64)
        self.last_used = torch.zeros(total, dtype=torch.int64)
        self.frequency = torch.zeros(total, dtype=torch.int64)
        self.slot_ids = torch.full((total,), -1, dtype=torch.int64)
        map_dtype = torch.int32 if total <= _INT32_MAX else torch.int64
        self._slot_of = torch.full((num_rows,), -1, dtype=map_dtype)

    def __len__(self) -> int:
        """Occupied slots."""
        return int((self.slot_ids >= 0).sum())

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise ValueError(f"ids must be in [0, {self.num_rows}), got range [{int(ids.min())}, {int(ids.max())}]")

    def slots_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The int64 slot of each id (ids may repeat), -1 where it is not cached."""
        self._check_ids(ids)
        return self._slot_of[ids].long()

    def partition_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The partition of each id."""
        return torch.bucketize(ids, self.partition_ends, right=True)

    def touch(self, slots: torch.Tensor, step: int, uses: torch.Tensor | None = None) -> None:
        """Records a use of each (distinct, occupied) slot at ``step``.

        Both policies' metadata are kept: ``last_used = step`` and
        ``frequency += uses`` (default 1 each).
        """
        self.last_used[slots] = step
        added = torch.ones_like(slots) if uses is None else uses.to(torch.int64)
        self.frequency.index_add_(0, slots, added)

    def _victims(self, lo: int, hi: int, count: int, eligible: torch.Tensor) -> torch.Tensor:
        """The ``count`` eligible slots of ``lo:hi`` that go first, in eviction order (exact ties by slot)."""
        if self.policy == "lru":
            primary, secondary = self.last_used[lo:hi], self.frequency[lo:hi]
        else:
            primary, secondary = self.frequency[lo:hi], self.last_used[lo:hi]
        chosen = torch.zeros(hi - lo, dtype=torch.bool)
        candidates = eligible
        for key in (primary, secondary):
            # the smallest `count` keys among the candidates; the last kept key may tie
            masked = torch.where(candidates, key, _INT64_MAX)
            threshold = torch.topk(masked, count, largest=False, sorted=False).values.max()
            below = candidates & (masked < threshold)
            chosen |= below
            count -= int(below.sum())
            candidates = candidates & (masked == threshold)  # at least `count` ties remain
        chosen[candidates.nonzero().flatten()[:count]] = True  # the last tie: smallest slots
        victims = chosen.nonzero().flatten()  # ascending slot
        victims = victims[torch.sort(secondary[victims], stable=True).indices]
        victims = victims[torch.sort(primary[victims], stable=True).indices]
        return victims + lo

    def _slots_for(self, partition: int, count: int, protect_mask: torch.Tensor) -> torch.Tensor:
        """Up to ``count`` slots of a partition: free ones (in slot order), then victims by the policy."""
        lo, hi = int(self.slot_starts[partition]), int(self.slot_starts[partition + 1])
        occupied = self.slot_ids[lo:hi] >= 0
        free = (~occupied).nonzero().flatten()[:count] + lo
        eligible = occupied & ~protect_mask[lo:hi]
        missing = min(count - free.numel(), int(eligible.sum()))
        if missing <= 0:
            return free
        return torch.cat([free, self._victims(lo, hi, missing, eligible)])

    def insert(
        self,
        ids: torch.Tensor,
        values: torch.Tensor,
        versions: torch.Tensor,
        step: int,
        protect: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, PendingRows, torch.Tensor]:
        """Caches new rows, evicting by the policy within each partition (never a slot in ``protect``).

        Inserted rows get ``validated_step = last_used = step``, ``frequency = 1``
        and no pending updates.

        Args:
            ids: distinct ids, none cached now.
            values: ``[n, dim]`` their rows.
            versions: ``[n]`` the owner's version of each row.
            step: the current step.
            protect: slots in use this step, which must survive (-1 entries are ignored).

        Returns:
            The slot of each id (-1 for ids that found none: within a partition the
            first ids, in the given order, get slots first), the evicted rows that
            still held unpushed updates (their whole pending gradient and count),
            and the ids of every evicted row, dirty or clean (its length is the
            number of evictions).
        """
        n = ids.numel()
        if values.shape != (n, self.dim) or versions.shape != (n,):
            raise ValueError(f"insert() wants values [{n}, {self.dim}] and versions [{n}], got "
                             f"{list(values.shape)} and {list(versions.shape)}")
        if n and bool((self.slots_of(ids) >= 0).any()):
            raise ValueError("insert() takes ids that are not cached yet")
        if n != torch.unique(ids).numel():
            raise ValueError("insert() takes distinct ids")
        result = torch.full((n,), -1, dtype=torch.int64)
        if n == 0 or self.capacity == 0:
            return result, PendingRows.empty(self.dim, self.values.dtype), ids[:0].to(torch.int64)
        protect_mask = torch.zeros(self.capacity, dtype=torch.bool)
        if protect is not None and protect.numel():
            protect_mask[protect[protect >= 0]] = True
        partition = self.partition_of(ids)
        order = torch.sort(partition, stable=True).indices  # ids of a partition keep their order
        wanted = torch.bincount(partition, minlength=len(self.partition_capacity)).tolist()
        slot_parts, position_parts, start = [], [], 0
        for p, count in enumerate(wanted):  # one pass per partition, never per id
            if count:
                slots_p = self._slots_for(p, count, protect_mask)
                slot_parts.append(slots_p)
                position_parts.append(order[start : start + slots_p.numel()])
                start += count
        slots, positions = torch.cat(slot_parts), torch.cat(position_parts)
        victims = slots[self.slot_ids[slots] >= 0]
        evicted_ids = self.slot_ids[victims].clone()
        dirty = self._evict(victims)
        result[positions] = slots
        ids = ids[positions].to(torch.int64)
        self.slot_ids[slots] = ids
        self._slot_of[ids] = slots.to(self._slot_of.dtype)
        self.values[slots] = values[positions].to(self.values.dtype)
        self.versions[slots] = versions[positions].to(torch.int64)
        self.validated_step[slots] = step
        self.last_used[slots] = step
        self.frequency[slots] = 1
        self.pending_grad[slots] = 0
        self.pending_delta[slots] = 0
        self.pending_count[slots] = 0
        return result, dirty, evicted_ids

    def _evict(self, slots: torch.Tensor) -> PendingRows:
        """Frees occupied slots; returns those that held pending updates."""
        dirty = slots[self.pending_count[slots] > 0]
        out = PendingRows(
            self.slot_ids[dirty].clone(), self.pending_grad[dirty].clone(), self.pending_count[dirty].clone()
        )
        self._slot_of[self.slot_ids[slots]] = -1
        self.slot_ids[slots] = -1
        self.pending_count[slots] = 0
        return out

    def refresh(self, slots: torch.Tensor, values: torch.Tensor, versions: torch.Tensor, step: int) -> None:
        """A newer value from the owner; this rank's unpushed local updates stay applied."""
        self.values[slots] = values.to(self.values.dtype) + self.pending_delta[slots]
        self.versions[slots] = versions.to(torch.int64)
        self.validated_step[slots] = step

    def mark_validated(self, slots: torch.Tensor, step: int) -> None:
        """The owner confirmed at ``step`` that the cached copy is within the bound."""
        self.validated_step[slots] = step

    def accumulate(self, slots: torch.Tensor, grads: torch.Tensor, deltas: torch.Tensor) -> None:
        """Adds a gradient to each (distinct, occupied) slot and applies the local update ``deltas``."""
        dtype = self.values.dtype
        self.pending_grad.index_add_(0, slots, grads.to(dtype))
        self.pending_count.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int64))
        self.values.index_add_(0, slots, deltas.to(dtype))
        self.pending_delta.index_add_(0, slots, deltas.to(dtype))

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
        """Forgets every row; pending updates are dropped (flush first to keep them)."""
        self._slot_of[self.slot_ids[self.slot_ids >= 0]] = -1
        self.slot_ids.fill_(-1)
        for tensor in (
            self.values, self.pending_grad, self.pending_delta, self.versions, self.validated_step,
            self.pending_count, self.last_used, self.frequency,
        ):
            tensor.zero_()

    def nbytes(self) -> int:
        """Bytes held by the cached rows, their metadata and the id -> slot map."""
        tensors = (
            self.values, self.pending_grad, self.pending_delta, self.versions, self.validated_step,
            self.pending_count, self.last_used, self.frequency, self.slot_ids, self._slot_of,
        )
        return sum(t.numel() * t.element_size() for t in tensors)

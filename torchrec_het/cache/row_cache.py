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

    The map costs 8 bytes per table row (int64), which buys O(1) vectorized lookups
    without hashing; the rows themselves cost ``3 * dim`` values per slot (value,
    pending gradient, pending local delta) plus a few int64 counters.

    Args:
        num_rows: rows of the table (ids are in ``[0, num_rows)``).
        dim: embedding dimension.
        capacity: slots; 0 caches nothing.
        policy: ``lru`` (evict the least recently used) or ``lfu`` (the least used).
        dtype: dtype of values and gradients.
    """

    def __init__(self, num_rows: int, dim: int, capacity: int, policy: str = "lru", dtype: torch.dtype = torch.float32):
        if num_rows < 1 or dim < 1:
            raise ValueError(f"num_rows and dim must be >= 1, got {num_rows} and {dim}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose from {POLICIES}")
        self.num_rows, self.dim, self.capacity, self.policy = num_rows, dim, capacity, policy
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

    def _victims(self, count: int, protect: torch.Tensor | None) -> torch.Tensor:
        occupied = self.slot_ids >= 0
        if protect is not None and protect.numel():
            occupied[protect] = False
        candidates = occupied.nonzero().flatten()
        if count <= 0 or candidates.numel() == 0:
            return candidates[:0]
        primary, secondary = (
            (self.last_used, self.frequency) if self.policy == "lru" else (self.frequency, self.last_used)
        )
        # lexicographic (primary, secondary, slot): stable sorts from the last key to the first
        order = candidates
        order = order[torch.sort(secondary[order], stable=True).indices]
        order = order[torch.sort(primary[order], stable=True).indices]
        return order[:count]

    def insert(
        self, ids: torch.Tensor, values: torch.Tensor, versions: torch.Tensor, step: int, protect: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, PendingRows, int]:
        """Caches new rows, evicting by the policy (never a slot in ``protect``).

        Args:
            ids: distinct ids not cached now.
            values: their rows.
            versions: the owner's version of each row.
            step: the current step.
            protect: slots in use this step.

        Returns:
            The slot of each id (-1 for ids that found none), the evicted rows that
            still held unpushed gradients, and how many rows were evicted.
        """
        if ids.numel() and bool((self.slots_of(ids) >= 0).any()):
            raise ValueError("insert() takes ids that are not cached yet")
        if ids.numel() != torch.unique(ids).numel():
            raise ValueError("insert() takes distinct ids")
        free = (self.slot_ids < 0).nonzero().flatten()[: ids.numel()]
        victims = self._victims(ids.numel() - free.numel(), protect)
        evicted = self._evict(victims)
        slots = torch.cat([free, victims])
        placed = slots.numel()
        result = torch.full((ids.numel(),), -1, dtype=torch.int64)
        result[:placed] = slots
        ids, values, versions = ids[:placed], values[:placed], versions[:placed]
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
        return result, evicted, victims.numel()

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

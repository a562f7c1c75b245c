"""A bounded cache of remote embedding rows on one rank (HET), as pure tensor code.

Every operation is vectorized over a batch of ids; nothing here talks to other ranks.
The distributed lookup decides what to fetch and push; this class keeps the rows,
their versions, their pending gradients and the eviction metadata.
"""

import torch

from torchrec_het.cache.eviction import EvictionOrder
from torchrec_het.cache.pending import PendingRows

POLICIES = ("lru", "lfu")


class RowCache:
    """Up to ``capacity`` rows of a table of ``num_rows`` rows, found through a dense id -> slot map.

    The id space may be cut into partitions (``partition_ends``), each with its own capacity
    and contiguous slots; a partition's rows only displace rows of the same partition. Free
    slots go first, then victims in :class:`EvictionOrder`'s order. ``nbytes()`` gives the
    memory (memory model: docs/internals.md#row-cache).

    Args:
        num_rows: rows of the table (ids are in ``[0, num_rows)``).
        dim: embedding dimension.
        capacity: slots (0 caches nothing), or one capacity per partition.
        policy: ``lru`` (evict the least recently used) or ``lfu`` (the least used).
        dtype: dtype of values and gradients.
        partition_ends: exclusive end id of each partition, ascending to ``num_rows``
            (default: one partition).
        device: where every tensor of the cache lives.
    """

    def __init__(
        self,
        num_rows: int,
        dim: int,
        capacity: int | list[int],
        policy: str = "lru",
        dtype: torch.dtype = torch.float32,
        partition_ends: list[int] | None = None,
        device: torch.device | str | None = None,
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
        self.device = device = torch.device(device) if device is not None else torch.device("cpu")
        self.num_rows, self.dim, self.capacity, self.policy = num_rows, dim, total, policy
        self.partition_ends = torch.tensor(ends, dtype=torch.int64, device=device)
        self.partition_capacity = torch.tensor(capacities, dtype=torch.int64, device=device)
        # slots of partition p: [slot_starts[p], slot_starts[p + 1])
        self.slot_starts = torch.cat(
            [torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(self.partition_capacity, 0)]
        )
        self.values = torch.zeros(total, dim, dtype=dtype, device=device)
        self.pending_grad = torch.zeros(total, dim, dtype=dtype, device=device)
        self.pending_delta = torch.zeros(total, dim, dtype=dtype, device=device)
        self.versions = torch.zeros(total, dtype=torch.int64, device=device)
        self.validated_step = torch.zeros(total, dtype=torch.int64, device=device)
        self.pending_count = torch.zeros(total, dtype=torch.int64, device=device)
        self.pending_squares = torch.zeros(total, 0, dtype=dtype, device=device)  # see :meth:`hold_optimizer_state`
        self.states = torch.zeros(total, 0, dtype=dtype, device=device)
        self.last_used = torch.zeros(total, dtype=torch.int64, device=device)
        self.frequency = torch.zeros(total, dtype=torch.int64, device=device)
        self.slot_ids = torch.full((total,), -1, dtype=torch.int64, device=device)
        map_dtype = torch.int32 if total <= torch.iinfo(torch.int32).max else torch.int64
        self._slot_of = torch.full((num_rows if total else 0,), -1, dtype=map_dtype, device=device)  # no slots: no map
        self._protected = torch.zeros(total, dtype=torch.bool, device=device)
        self.eviction = EvictionOrder(policy, self.slot_starts, self.last_used, self.frequency)

    def hold_optimizer_state(self, width: int) -> None:
        """Keeps an Adagrad-family optimizer state of ``width`` floats per slot (``dim`` or 1).

        The owner's fetched state plus the pending gradients' squares is the row's state as this
        rank knows it (:meth:`known_states`). Call before the first :meth:`accumulate`."""
        if self.pending_squares.size(1) != width:
            if bool(self.pending_count.any()):
                raise RuntimeError("hold_optimizer_state() must come before the first accumulate()")
            self.pending_squares = torch.zeros(self.capacity, width, dtype=self.values.dtype, device=self.device)
            self.states = torch.zeros(self.capacity, width, dtype=self.values.dtype, device=self.device)

    @property
    def state_width(self) -> int:
        """Floats of optimizer state kept per row (0: none, see :meth:`hold_optimizer_state`)."""
        return self.states.size(1)

    def known_states(self, slots: torch.Tensor) -> torch.Tensor:
        """The optimizer state of each slot's row as this rank knows it: the owner's at the last
        fetch plus the squares of this rank's updates not yet pushed."""
        return self.states.index_select(0, slots) + self.pending_squares.index_select(0, slots)

    def __len__(self) -> int:
        """Occupied slots."""
        return int((self.slot_ids >= 0).sum())

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_rows):
            raise ValueError(f"ids must be in [0, {self.num_rows}), got range [{int(ids.min())}, {int(ids.max())}]")

    def slots_of(self, ids: torch.Tensor, check: bool = True) -> torch.Tensor:
        """The int64 slot of each id (ids may repeat), -1 where it is not cached.

        Args:
            ids: ids in ``[0, num_rows)``.
            check: raise ValueError for ids out of range (two host syncs); callers that
                validated their ids pass False.
        """
        if check:
            self._check_ids(ids)
        if not self.capacity:
            return torch.full_like(ids, -1, dtype=torch.int64)
        return self._slot_of.index_select(0, ids).long()

    def held_versions(self, slots: torch.Tensor) -> torch.Tensor:
        """The version of each slot's row, -1 for slot -1 (no copy)."""
        if not self.capacity:
            return torch.full_like(slots, -1)
        return torch.where(slots >= 0, self.versions.index_select(0, slots.clamp(min=0)), -1)

    def partition_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The partition of each id."""
        return torch.bucketize(ids, self.partition_ends, right=True)

    def touch(self, slots: torch.Tensor, step: int, uses: torch.Tensor | None = None) -> None:
        """Records a use of each (distinct, occupied) slot at ``step`` (``last_used``, ``frequency += uses``).

        ``last_used`` never goes back to an earlier step.
        """
        self.last_used.index_copy_(0, slots, self.last_used.index_select(0, slots).clamp_min(step))
        added = torch.ones_like(slots) if uses is None else uses.to(torch.int64)
        self.frequency.index_add_(0, slots, added)

    # --- rows in and out ----------------------------------------------------------------

    def insert(
        self,
        ids: torch.Tensor,
        values: torch.Tensor,
        versions: torch.Tensor,
        step: int,
        protect: torch.Tensor | None = None,
        check: bool = True,
        states: torch.Tensor | None = None,
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
            check: verify the ids (in range, distinct, not cached; host syncs).
            states: ``[n, state_width]`` the owner's optimizer state of each row, where the
                cache keeps one (:meth:`hold_optimizer_state`).

        Returns:
            The slot of each id (-1 for ids that found none: within a partition the
            first ids, in the given order, get slots first), the evicted rows that
            still held unpushed updates (their whole pending gradient and count),
            and the ids of every evicted row, dirty or clean (its length is the
            number of evictions).
        """
        n = ids.numel()
        if values.shape != (n, self.dim):
            raise ValueError(f"insert() wants values [{n}, {self.dim}], got {list(values.shape)}")
        if self.state_width:
            self._checked_states(states, n)  # before anything changes
        slots, dirty, evicted = self.reserve(ids, versions, step, protect, check)
        self.fill(slots, values, states)
        return slots, dirty, evicted

    def fill(self, slots: torch.Tensor, values: torch.Tensor, states: torch.Tensor | None = None) -> None:
        """Writes the rows of reserved slots (``slots[i] < 0``: ``values[i]`` found no slot), and their
        owner's optimizer state where the cache keeps one."""
        kept = (slots >= 0).nonzero().flatten()
        at = slots.index_select(0, kept)
        self.values.index_copy_(0, at, values.index_select(0, kept).to(self.values.dtype))
        if self.state_width:
            self.states.index_copy_(0, at, self._checked_states(states, slots.numel()).index_select(0, kept))

    def _checked_states(self, states: torch.Tensor | None, n: int) -> torch.Tensor:
        if states is None or states.shape != (n, self.state_width):
            got = None if states is None else list(states.shape)
            raise ValueError(f"this cache keeps optimizer state: rows need states [{n}, {self.state_width}], got {got}")
        return states.to(self.values.dtype)

    def reserve(
        self,
        ids: torch.Tensor,
        versions: torch.Tensor,
        step: int,
        protect: torch.Tensor | None = None,
        check: bool = True,
        rescan: bool | None = None,
    ) -> tuple[torch.Tensor, PendingRows, torch.Tensor]:
        """:meth:`insert` without the values: the slots are taken, their rows come with :meth:`fill`.

        Lets a caller evict (and push what the victims held) before the new rows arrive.
        ``rescan``: what :meth:`shortfall` said for these ids and ``protect`` (read to the host
        with the caller's own data); None finds out here, with a host sync.
        """
        n = ids.numel()
        if versions.shape != (n,):
            raise ValueError(f"insert() wants versions [{n}], got {list(versions.shape)}")
        if check:
            if n and bool((self.slots_of(ids) >= 0).any()):
                raise ValueError("insert() takes ids that are not cached yet")
            if n != torch.unique(ids).numel():
                raise ValueError("insert() takes distinct ids")
        result = torch.full((n,), -1, dtype=torch.int64, device=self.device)
        if n == 0 or self.capacity == 0:
            return result, PendingRows.empty(self.dim, self.values.dtype, self.device), ids[:0].to(torch.int64)
        partition, wanted, free, protect, protect_count, evictable = self._demand(ids, protect)
        protected = self._protected  # a scratch mask, all False between calls
        protected[protect] = True
        try:
            victims = self.eviction.victims(evictable, protected, protect_count, rescan)
        finally:
            protected[protect] = False
        free_slots = self.eviction.take_free(free)
        # per partition: its free slots (in slot order), then its victims (in eviction order)
        granted = torch.cat([free_slots, victims])
        granted = granted[torch.sort(self.eviction.partition_of_slot(granted), stable=True).indices]
        count = free + evictable
        order = torch.sort(partition, stable=True).indices  # ids of a partition keep their order
        part = partition[order]
        rank = torch.arange(n, device=self.device) - (torch.cumsum(wanted, 0) - wanted)[part]
        gets = rank < count[part]
        positions = order[gets]
        slots = granted[(torch.cumsum(count, 0) - count)[part[gets]] + rank[gets]]
        evicted_ids = self.slot_ids.index_select(0, victims)
        dirty = self._evict(victims)
        result[positions] = slots
        ids = ids.index_select(0, positions).to(torch.int64)
        self.slot_ids.index_copy_(0, slots, ids)
        self._slot_of.index_copy_(0, ids, slots.to(self._slot_of.dtype))
        self.versions.index_copy_(0, slots, versions.index_select(0, positions).to(torch.int64))
        for tensor, value in (
            (self.validated_step, step),
            (self.last_used, step),
            (self.frequency, 1),
            (self.pending_grad, 0),
            (self.pending_delta, 0),
            (self.pending_count, 0),
            (self.pending_squares, 0),
            (self.states, 0),
        ):
            tensor.index_fill_(0, slots, value)
        self.eviction.admit(slots)  # e.g. LFU's fresh rows
        return result, dirty, evicted_ids

    def _demand(self, ids: torch.Tensor, protect: torch.Tensor | None):
        """(partition of each id, ids wanted, free slots granted, distinct protected slots and their
        count, victims wanted) per partition."""
        partitions = self.partition_capacity.numel()
        partition = self.partition_of(ids)
        wanted = torch.bincount(partition, minlength=partitions)
        free = torch.minimum(wanted, self.partition_capacity - self.eviction.filled)
        protect = torch.unique(protect[protect >= 0]) if protect is not None else ids[:0].long()
        protect_count = torch.bincount(self.eviction.partition_of_slot(protect), minlength=partitions)
        evictable = torch.minimum(wanted - free, self.eviction.filled - protect_count)
        return partition, wanted, free, protect, protect_count, evictable

    def shortfall(self, ids: torch.Tensor, protect: torch.Tensor | None = None) -> torch.Tensor:
        """Whether caching ``ids`` (never evicting ``protect``) needs a rescan of some partition's
        slots: a 0-d bool tensor, for callers that read it with their own data (see :meth:`reserve`)."""
        if ids.numel() == 0 or self.capacity == 0:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        _, _, _, protect, _, evictable = self._demand(ids, protect)
        protected = self._protected
        protected[protect] = True
        try:
            part, _, _ = self.eviction.usable(protected)
        finally:
            protected[protect] = False
        return (torch.bincount(part, minlength=evictable.numel()) < evictable).any()

    def _evict(self, slots: torch.Tensor) -> PendingRows:
        """Frees occupied slots (about to be refilled); returns those that held pending updates."""
        dirty = slots[self.pending_count.index_select(0, slots) > 0]
        out = PendingRows(
            self.slot_ids.index_select(0, dirty),
            self.pending_grad.index_select(0, dirty),
            self.pending_count.index_select(0, dirty),
            self._squares_of_slots(dirty),
        )
        self._slot_of.index_fill_(0, self.slot_ids.index_select(0, slots), -1)
        self.slot_ids.index_fill_(0, slots, -1)
        self.pending_count.index_fill_(0, slots, 0)
        return out

    def refresh(
        self,
        slots: torch.Tensor,
        values: torch.Tensor,
        versions: torch.Tensor,
        step: int,
        states: torch.Tensor | None = None,
    ) -> None:
        """A newer value (and optimizer state, where kept) from the owner; this rank's unpushed local
        updates stay applied (and their squares stay pending)."""
        self.values.index_copy_(0, slots, values.to(self.values.dtype) + self.pending_delta.index_select(0, slots))
        if self.state_width:
            self.states.index_copy_(0, slots, self._checked_states(states, slots.numel()))
        self.versions.index_copy_(0, slots, versions.to(torch.int64))
        self.validated_step.index_fill_(0, slots, step)

    def mark_validated(self, slots: torch.Tensor, step: int) -> None:
        """The owner confirmed at ``step`` that the cached copy is within the bound."""
        self.validated_step.index_fill_(0, slots, step)

    def accumulate(
        self, slots: torch.Tensor, grads: torch.Tensor, deltas: torch.Tensor, squares: torch.Tensor | None = None
    ) -> None:
        """Adds a gradient to each (distinct, occupied) slot and applies the local update ``deltas``
        (``squares``: the gradients' squares, where the cache holds them)."""
        dtype = self.values.dtype
        if self.pending_squares.size(1):
            if squares is None:
                raise ValueError("this cache holds squares: accumulate() needs them")
            self.pending_squares.index_add_(0, slots, squares.to(dtype))
        self.pending_grad.index_add_(0, slots, grads.to(dtype))
        self.pending_count.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int64))
        self.values.index_add_(0, slots, deltas.to(dtype))
        self.pending_delta.index_add_(0, slots, deltas.to(dtype))

    def write_through(
        self, slots: torch.Tensor, grads: torch.Tensor, deltas: torch.Tensor, squares: torch.Tensor | None = None
    ) -> PendingRows:
        """:meth:`accumulate` then :meth:`take` of the same slots, for a cache that holds no update
        back (a write bound of 0, so nothing is ever pending): the local update ``deltas`` is applied
        and the gradients go out as they came, in ascending id order."""
        dtype = self.values.dtype
        if self.pending_squares.size(1) and squares is None:
            raise ValueError("this cache holds squares: write_through() needs them")
        self.values.index_add_(0, slots, deltas.to(dtype))
        ids, order = torch.sort(self.slot_ids.index_select(0, slots))
        held = squares.to(dtype).index_select(0, order) if self.pending_squares.size(1) else None
        return PendingRows(ids, grads.to(dtype).index_select(0, order), torch.ones_like(ids), held)

    def take_due(self, s_write: int, slots: torch.Tensor | None = None) -> PendingRows:
        """Rows with more than ``s_write`` pending updates, in ascending id order; their pending is reset.

        Args:
            s_write: the write bound.
            slots: look only at these (distinct, occupied) slots, e.g. the ones just
                accumulated into; None looks at every slot.
        """
        if slots is None:
            due = (self.pending_count > s_write).nonzero().flatten()
        else:
            due = slots[self.pending_count.index_select(0, slots) > s_write]
        return self.take(due)

    def take(self, slots: torch.Tensor) -> PendingRows:
        """The pending updates of these (distinct, occupied) slots, in ascending id order; their pending is reset."""
        ids, order = torch.sort(self.slot_ids.index_select(0, slots))
        slots = slots.index_select(0, order)
        out = PendingRows(
            ids,
            self.pending_grad.index_select(0, slots),
            self.pending_count.index_select(0, slots),
            self._squares_of_slots(slots),
        )
        for tensor in (self.pending_grad, self.pending_delta, self.pending_count, self.pending_squares):
            tensor.index_fill_(0, slots, 0)
        return out

    def _squares_of_slots(self, slots: torch.Tensor) -> torch.Tensor | None:
        return self.pending_squares.index_select(0, slots) if self.pending_squares.size(1) else None

    def take_all(self) -> PendingRows:
        """Every row with pending updates (a flush)."""
        return self.take_due(0)

    def clear(self) -> None:
        """Forgets every row; pending updates are dropped (flush first to keep them)."""
        self._slot_of[self.slot_ids[self.slot_ids >= 0]] = -1
        self.slot_ids.fill_(-1)
        for tensor in self._slot_tensors():
            tensor.zero_()
        self.eviction.reset()

    def nbytes(self) -> int:
        """Bytes held by the cached rows, their metadata and the id -> slot map."""
        tensors = (*self._slot_tensors(), self.slot_ids, self._slot_of)
        return sum(t.numel() * t.element_size() for t in tensors)

    def _slot_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every per-slot tensor but the slot's id: what ``clear()`` zeroes."""
        return (
            self.values,
            self.pending_grad,
            self.pending_delta,
            self.versions,
            self.validated_step,
            self.pending_count,
            self.last_used,
            self.frequency,
            self.pending_squares,
            self.states,
        )

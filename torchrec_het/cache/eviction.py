"""The HET cache's eviction order: which occupied slots of each partition go first.

A slot's eviction key never decreases while it holds a row (uses only add). Each partition
keeps a small set of candidate slots and a bound such that every occupied slot outside the
set orders after the bound; candidates that still order before it are exactly the
partition's first victims. A partition rescans its slots (one sort, every partition needing
it at once) only when too few candidates remain, and rows inserted below the bound (LFU's
fresh rows) join the candidates.
"""

import torch

_INT64_MAX = torch.iinfo(torch.int64).max
_INT32_MAX = torch.iinfo(torch.int32).max
_UINT32_MAX = (1 << 32) - 1


class EvictionOrder:
    """Free slots and eviction candidates of a cache's partitions.

    LRU evicts the smallest ``last_used`` (ties: smallest ``frequency``, then smallest slot),
    LFU the smallest ``frequency`` (ties: smallest ``last_used``, then smallest slot). Keys
    saturate at 2**31 steps and 2**32 uses, where ties fall to the next key.

    Args:
        policy: ``lru`` or ``lfu``.
        slot_starts: int64 ``[P + 1]``: partition p's slots are ``[slot_starts[p], slot_starts[p + 1])``.
        last_used: the cache's per-slot last step of use (read, never written here).
        frequency: the cache's per-slot uses (read, never written here).
    """

    CANDIDATES_PER_VICTIM = 8  # a rescan keeps this many candidates per victim wanted, so rescans are rare
    MIN_CANDIDATES = 64

    def __init__(
        self, policy: str, slot_starts: torch.Tensor, last_used: torch.Tensor, frequency: torch.Tensor
    ) -> None:
        self.policy, self.slot_starts, self.last_used, self.frequency = policy, slot_starts, last_used, frequency
        self.device = slot_starts.device
        self.reset()

    def reset(self) -> None:
        """Every slot free, no candidates."""
        partitions = self.slot_starts.numel() - 1
        self.filled = torch.zeros(partitions, dtype=torch.int64, device=self.device)  # slots ever filled: a prefix
        self._candidates = torch.zeros(0, dtype=torch.int64, device=self.device)
        # (key, slot) every occupied non-candidate slot orders at or after; (-1, -1): none known yet
        self._bound_key = torch.full((partitions,), -1, dtype=torch.int64, device=self.device)
        self._bound_slot = torch.full((partitions,), -1, dtype=torch.int64, device=self.device)

    def partition_of_slot(self, slots: torch.Tensor) -> torch.Tensor:
        """The partition of each slot."""
        return torch.bucketize(slots, self.slot_starts[1:], right=True)

    def take_free(self, free: torch.Tensor) -> torch.Tensor:
        """``free[p]`` never-filled slots of each partition, grouped by partition, in slot order."""
        slots = _ranges(self.slot_starts[:-1] + self.filled, free)
        self.filled += free
        return slots

    def admit(self, slots: torch.Tensor) -> None:
        """Slots just filled: those ordering before their partition's bound become candidates."""
        early = self._before_bound(self._keys(slots), slots, self.partition_of_slot(slots))
        self._candidates = torch.cat([self._candidates, slots[early]])

    def _keys(self, slots: torch.Tensor) -> torch.Tensor:
        """One int64 per slot that orders as the policy's (primary, secondary) keys."""
        last = self.last_used.index_select(0, slots).clamp_max(_INT32_MAX)  # 31 bits
        uses = self.frequency.index_select(0, slots).clamp_max(_UINT32_MAX)  # 32 bits
        if self.policy == "lru":
            return (last << 32) | uses
        return (uses << 31) | last

    def _before_bound(self, keys: torch.Tensor, slots: torch.Tensor, partitions: torch.Tensor) -> torch.Tensor:
        bound_key, bound_slot = self._bound_key[partitions], self._bound_slot[partitions]
        return (keys < bound_key) | ((keys == bound_key) & (slots < bound_slot))

    def _rescan(self, partitions: torch.Tensor, keep: torch.Tensor) -> None:
        """Rebuilds the candidates of ``partitions`` (bool [P]): their first ``keep[p]`` occupied slots."""
        counts = torch.where(partitions, self.filled, 0)
        slots = _ranges(self.slot_starts[:-1], counts)  # ascending: ties stay in slot order
        part = self.partition_of_slot(slots)
        order = torch.sort(self._keys(slots), stable=True).indices
        order = order[torch.sort(part[order], stable=True).indices]
        slots, part = slots[order], part[order]
        rank = torch.arange(slots.numel(), device=self.device) - (torch.cumsum(counts, 0) - counts)[part]
        kept = rank < keep[part]
        bound = rank == keep[part]  # the first slot left out: every other one orders after it
        self._bound_key[partitions] = _INT64_MAX
        self._bound_slot[partitions] = _INT64_MAX
        self._bound_key[part[bound]] = self._keys(slots[bound])
        self._bound_slot[part[bound]] = slots[bound]
        old = self._candidates[~partitions[self.partition_of_slot(self._candidates)]]
        self._candidates = torch.cat([old, slots[kept]])

    def usable(self, protected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(partition, key, position in the candidates) of every candidate that may go now
        (``protected``: bool mask of slots that must stay)."""
        cand = self._candidates
        part = self.partition_of_slot(cand)
        keys = self._keys(cand)
        live = self._before_bound(keys, cand, part)
        self._candidates, part, keys = cand[live], part[live], keys[live]  # the others never order first again
        ok = (~protected[self._candidates]).nonzero().flatten()
        return part[ok], keys[ok], ok

    def victims(
        self, wanted: torch.Tensor, protected: torch.Tensor, protect_count: torch.Tensor, rescan: bool | None
    ) -> torch.Tensor:
        """``wanted[p]`` eligible victims of each partition (never a slot marked in the bool mask
        ``protected``), grouped by partition, in eviction order; they leave the candidates.
        ``rescan``: whether some partition has too few candidates (None: find out, a host sync)."""
        part, keys, ok = self.usable(protected)
        found = torch.bincount(part, minlength=wanted.numel())
        short = found < wanted
        if bool(short.any()) if rescan is None else rescan:
            keep = wanted * self.CANDIDATES_PER_VICTIM + protect_count + self.MIN_CANDIDATES
            self._rescan(short, keep)
            part, keys, ok = self.usable(protected)
            found = torch.bincount(part, minlength=wanted.numel())
        order = torch.sort(self._candidates[ok]).indices  # ties of both keys go to the smallest slot
        order = order[torch.sort(keys[order], stable=True).indices]
        order = order[torch.sort(part[order], stable=True).indices]
        rank = torch.arange(order.numel(), device=self.device) - (torch.cumsum(found, 0) - found)[part[order]]
        chosen = ok[order[rank < wanted[part[order]]]]
        victims = self._candidates[chosen]
        left = torch.ones(self._candidates.numel(), dtype=torch.bool, device=self.device)
        left[chosen] = False
        self._candidates = self._candidates[left]
        return victims


def _ranges(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``starts[p] + 0 .. counts[p] - 1`` for every p, one after the other."""
    base = torch.repeat_interleave(starts, counts)
    return (
        base
        + torch.arange(base.numel(), device=base.device)
        - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    )

"""Counted collective bytes: one sender-by-receiver matrix per (phase, collective family).

A rank's own :class:`CommTotals` only has its own row filled; summing the
totals of all ranks (:func:`sum_totals`, or ``sum_over_ranks`` across
processes) fills the whole matrix. Payload, cross-rank and inter-host figures
are all read from the same matrices: payload is every entry, cross-rank the
off-diagonal entries, inter-host the entries whose sender and receiver sit on
different hosts.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

PHASES = ("fwd_ids", "fwd_emb", "bwd_grad", "dense_allreduce", "other")
EMBEDDING_PHASES = tuple(p for p in PHASES if p != "dense_allreduce")
COLLECTIVE_FAMILIES = ("all_to_all", "reduce_scatter", "all_gather", "all_reduce", "broadcast")

PhaseSelection = str | Iterable[str] | None


def _phases(selection: PhaseSelection) -> tuple[str, ...]:
    if selection is None:
        return PHASES
    chosen = (selection,) if isinstance(selection, str) else tuple(selection)
    unknown = [p for p in chosen if p not in PHASES]
    if unknown:
        raise ValueError(f"unknown phase(s) {unknown}; expected some of {PHASES}")
    return chosen


def _zeros(world_size: int) -> list[list[int]]:
    return [[0] * world_size for _ in range(world_size)]


@dataclass
class CommTotals:
    """Bytes and call counts of counted collectives.

    Attributes:
        world_size: global world size; every matrix is ``world_size`` square.
        traffic: ``(phase, family) -> matrix`` where ``matrix[src][dst]`` is the
            number of bytes global rank ``src`` sent to global rank ``dst``.
            Only keys that saw a call are present.
        calls: ``(phase, family) -> number of collective calls`` (summed over
            ranks once totals are summed).
    """

    world_size: int
    traffic: dict[tuple[str, str], list[list[int]]] = field(default_factory=dict)
    calls: dict[tuple[str, str], int] = field(default_factory=dict)

    def add_sends(self, phase: str, family: str, sender: int, sends: Sequence[int]) -> None:
        """Adds one collective call: ``sends[dst]`` bytes from global rank ``sender``.

        Args:
            phase: one of :data:`PHASES`.
            family: one of :data:`COLLECTIVE_FAMILIES`.
            sender: global rank that sent.
            sends: bytes per destination global rank, ``world_size`` entries.
        """
        key = (phase, family)
        row = self.traffic.setdefault(key, _zeros(self.world_size))[sender]
        for dst, n in enumerate(sends):
            row[dst] += n
        self.calls[key] = self.calls.get(key, 0) + 1

    def matrix(self, phases: PhaseSelection = None, families: Iterable[str] | None = None) -> list[list[int]]:
        """``[src][dst]`` bytes summed over the selected phases and collective families.

        Args:
            phases: a phase name, several, or ``None`` for all.
            families: collective families, or ``None`` for all.
        """
        chosen_phases = _phases(phases)
        chosen_families = COLLECTIVE_FAMILIES if families is None else tuple(families)
        total = _zeros(self.world_size)
        for (phase, family), counted in self.traffic.items():
            if phase in chosen_phases and family in chosen_families:
                for src, row in enumerate(counted):
                    for dst, n in enumerate(row):
                        total[src][dst] += n
        return total

    def payload(self, phases: PhaseSelection = None) -> int:
        """Every byte sent in the selected phases, a rank's copy to itself included."""
        return sum(map(sum, self.matrix(phases)))

    def cross_rank(self, phases: PhaseSelection = None) -> int:
        """Bytes sent from one rank to a different rank in the selected phases."""
        counted = self.matrix(phases)
        return sum(n for src, row in enumerate(counted) for dst, n in enumerate(row) if src != dst)

    def inter_host(self, host_of_rank: Sequence[int], phases: PhaseSelection = None) -> int:
        """Bytes sent between ranks on different hosts in the selected phases.

        Args:
            host_of_rank: host id of every global rank.
            phases: a phase name, several, or ``None`` for all.
        """
        if len(host_of_rank) != self.world_size:
            raise ValueError(f"host_of_rank has {len(host_of_rank)} entries for world size {self.world_size}")
        counted = self.matrix(phases)
        return sum(
            n for src, row in enumerate(counted) for dst, n in enumerate(row) if host_of_rank[src] != host_of_rank[dst]
        )

    def per_peer(self, phases: PhaseSelection = None) -> list[int]:
        """Bytes addressed to each global rank; for one rank's totals, what it sent to each peer."""
        counted = self.matrix(phases)
        return [sum(row[dst] for row in counted) for dst in range(self.world_size)]

    def call_count(self, phases: PhaseSelection = None) -> int:
        """Collective calls counted in the selected phases."""
        chosen = _phases(phases)
        return sum(n for (phase, _), n in self.calls.items() if phase in chosen)

    def by_collective(self, phases: PhaseSelection = EMBEDDING_PHASES) -> dict[str, int]:
        """Cross-rank bytes per collective family, over the embedding phases by default."""
        result = {}
        for family in COLLECTIVE_FAMILIES:
            counted = self.matrix(phases, (family,))
            result[family] = sum(n for src, row in enumerate(counted) for dst, n in enumerate(row) if src != dst)
        return result

    def summary(self, host_of_rank: Sequence[int] | None = None) -> dict:
        """A plain, JSON-ready dict of the totals.

        Args:
            host_of_rank: host id of every global rank, or ``None`` to leave
                ``inter_host`` out (``None`` in the dict).

        Returns:
            ``{"phases": {<phase>: cross-rank bytes, ..., "embedding_total": payload
            of every phase but dense_allreduce, "embedding_cross_rank": cross-rank
            bytes of every phase but dense_allreduce}, "payload": {<phase>: payload
            bytes}, "calls": {<phase>: calls}, "by_collective": {<family>:
            embedding cross-rank bytes}, "inter_host": bytes between hosts over all
            phases or None}``.
        """
        phases = {p: self.cross_rank(p) for p in PHASES}
        phases["embedding_total"] = self.payload(EMBEDDING_PHASES)
        phases["embedding_cross_rank"] = self.cross_rank(EMBEDDING_PHASES)
        return {
            "phases": phases,
            "payload": {p: self.payload(p) for p in PHASES},
            "calls": {p: self.call_count(p) for p in PHASES},
            "by_collective": self.by_collective(),
            "inter_host": None if host_of_rank is None else self.inter_host(host_of_rank),
        }

    def __add__(self, other: "CommTotals") -> "CommTotals":
        if other.world_size != self.world_size:
            raise ValueError(f"cannot add totals of world sizes {self.world_size} and {other.world_size}")
        result = CommTotals(self.world_size)
        for source in (self, other):
            for key, counted in source.traffic.items():
                target = result.traffic.setdefault(key, _zeros(self.world_size))
                for src, row in enumerate(counted):
                    for dst, n in enumerate(row):
                        target[src][dst] += n
            for key, n in source.calls.items():
                result.calls[key] = result.calls.get(key, 0) + n
        return result

    def as_tensor(self) -> torch.Tensor:
        """Dense int64 layout: every (phase, family) matrix, then every call count."""
        ws = self.world_size
        traffic = torch.zeros(len(PHASES), len(COLLECTIVE_FAMILIES), ws, ws, dtype=torch.int64)
        calls = torch.zeros(len(PHASES), len(COLLECTIVE_FAMILIES), dtype=torch.int64)
        for (phase, family), counted in self.traffic.items():
            traffic[PHASES.index(phase), COLLECTIVE_FAMILIES.index(family)] = torch.tensor(counted, dtype=torch.int64)
        for (phase, family), n in self.calls.items():
            calls[PHASES.index(phase), COLLECTIVE_FAMILIES.index(family)] = n
        return torch.cat([traffic.flatten(), calls.flatten()])

    @classmethod
    def from_tensor(cls, world_size: int, dense: torch.Tensor) -> "CommTotals":
        """Inverse of :meth:`as_tensor`; keys with neither bytes nor calls are left out."""
        shape = (len(PHASES), len(COLLECTIVE_FAMILIES))
        split = shape[0] * shape[1] * world_size * world_size
        traffic = dense[:split].view(*shape, world_size, world_size)
        calls = dense[split:].view(*shape)
        result = cls(world_size)
        for p, phase in enumerate(PHASES):
            for f, family in enumerate(COLLECTIVE_FAMILIES):
                if calls[p, f] or traffic[p, f].any():
                    result.traffic[(phase, family)] = traffic[p, f].tolist()
                    result.calls[(phase, family)] = int(calls[p, f])
        return result


def sum_totals(totals: Iterable[CommTotals]) -> CommTotals:
    """Adds totals of one world size, e.g. every rank's, or every window's of one rank.

    Args:
        totals: at least one :class:`CommTotals`.
    """
    items = list(totals)
    if not items:
        raise ValueError("sum_totals needs at least one CommTotals")
    result = CommTotals(items[0].world_size)
    for item in items:
        result = result + item
    return result

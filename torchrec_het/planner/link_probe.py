"""A short collective probe of the links between ranks, run at plan time.

Times all-to-all rounds in which every rank sends at once and reports the rate at which
one rank's bytes leave it (TorchRec's ``intra_host_bw`` / ``inter_host_bw`` unit, bytes
per ms): ``intra`` within hosts, ``inter`` between hosts, and on request ``inter_one_way``.
Latency is fitted out with the medians of tiny and of large rounds; a large size whose rounds
spread is re-measured, and reported not steady if they still spread; on a link faster than
``ProbeBudget.enough_bytes_per_ms`` the escalation stops early with a lower bound. Every rank
ends with the same figures; rounds, bytes and time are bounded by :class:`ProbeBudget`.

Design: docs/internals.md#link-probe
"""

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

FLOAT = 4  # the probe sends float32 elements
TINY_ROUNDS = 5  # rounds of one element per peer that time a round's fixed cost (their median)
KINDS = ("intra", "inter", "inter_one_way")


@dataclass(frozen=True)
class ProbeBudget:
    """How much the probe may do.

    Attributes:
        seconds: the whole probe, agreed across ranks, shared among the kinds it measures;
            checked before each round (the first round of each size always runs).
        first_bytes: bytes one rank sends in the first escalating round of a kind.
        max_bytes: at most this many bytes one rank sends in a round.
        target_s: escalation stops at the first size whose round takes this long twice.
        repeats: at most this many more rounds of the final size, while the time allows; as many
            again when the final size's rounds spread more than ``max_spread`` (a re-measure).
        max_spread: the final size's rounds are steady when their slowest over their fastest is at
            most this (:func:`unsteady`).
        enough_bytes_per_ms: a rate (TorchRec's unit, bytes per ms one rank sends) above which the
            figure matters to nothing: once an escalating round's bytes over its time (latency
            included, a lower bound) reach it, the kind stops there, ``enough`` (:func:`is_enough`).
            None: escalate to ``target_s`` / ``max_bytes`` whatever the rate.
    """

    seconds: float = 2.0
    first_bytes: int = 1 << 16
    max_bytes: int = 1 << 26
    target_s: float = 0.05
    repeats: int = 5
    max_spread: float = 1.5
    enough_bytes_per_ms: float | None = None

    def __post_init__(self) -> None:
        if not self.seconds > 0 or not self.target_s > 0:
            raise ValueError(f"ProbeBudget: seconds and target_s must be > 0, got {self.seconds}, {self.target_s}")
        if not 0 < self.first_bytes <= self.max_bytes or self.repeats < 0:
            raise ValueError(f"ProbeBudget: need 0 < first_bytes <= max_bytes and repeats >= 0, got {self}")
        if not self.max_spread >= 1:
            raise ValueError(f"ProbeBudget: max_spread must be >= 1, got {self.max_spread}")
        if self.enough_bytes_per_ms is not None and not self.enough_bytes_per_ms > 0:
            raise ValueError(f"ProbeBudget: enough_bytes_per_ms must be > 0 or None, got {self.enough_bytes_per_ms}")

    @property
    def escalation_sizes(self) -> int:
        """At most this many sizes per kind (doubling from ``first_bytes`` to ``max_bytes``)."""
        return (self.max_bytes // self.first_bytes).bit_length()

    @property
    def max_rounds(self) -> int:
        """At most this many all-to-all rounds per kind: a warm-up, the tiny rounds, two per size
        (a round that reaches ``target_s`` is confirmed once), the repeats and their re-measure."""
        return 1 + TINY_ROUNDS + 2 * self.escalation_sizes + 2 * self.repeats

    def max_bytes_per_kind(self, peers: int = 1) -> int:
        """At most this many bytes one rank sends to ``peers`` peers for one kind (when
        ``first_bytes`` holds an element per peer): an element per peer in each tiny round, two
        rounds per size (under four times ``max_bytes`` in all), the repeats and their re-measure."""
        return FLOAT * peers * (1 + TINY_ROUNDS) + (4 + 2 * self.repeats) * self.max_bytes


@dataclass(frozen=True)
class LinkMeasurement:
    """One kind of round as the probe saw it.

    Attributes:
        bytes_per_ms: the rate at which one sending rank's bytes left it (TorchRec's unit).
        latency_ms: the fixed cost of one round (the fit's intercept, >= 0; when ``enough``, the
            tiny rounds' median).
        rounds: all-to-all rounds it took.
        bytes_sent: bytes the busiest rank sent in them.
        fitted: False when the figure is a large round's bytes over its time, latency included (a
            lower bound): the large rounds were not slower than the tiny ones (noise), or ``enough``.
        steady: False when the final size's rounds spread more than ``ProbeBudget.max_spread``,
            re-measured too (or when too few ran to tell): the figure is their median, not to be priced.
        why: what was not steady ("" when steady).
        enough: the escalation stopped at a round faster than ``ProbeBudget.enough_bytes_per_ms``:
            ``bytes_per_ms`` is that round's rate, a lower bound of the link's.
        bounds: (low, high) rates of the slowest and the fastest round of the final size the figure
            came from (every one measured when not steady); None when not known (``enough``).
    """

    bytes_per_ms: float
    latency_ms: float
    rounds: int
    bytes_sent: int
    fitted: bool = True
    steady: bool = True
    why: str = ""
    enough: bool = False
    bounds: tuple[float, float] | None = None

    @property
    def gbit_per_s(self) -> float:
        return self.bytes_per_ms * 8e3 / 1e9


@dataclass(frozen=True)
class ProbeResult:
    """What one probe measured, identical on every rank.

    Attributes:
        intra: exchange within hosts (None: one rank per host).
        inter: exchange between hosts (None: one host).
        inter_one_way: one way between hosts (None: one host).
        seconds: the probe's duration (the slowest rank's), from when every rank had arrived.
        budget: the budget it ran under.
    """

    intra: LinkMeasurement | None
    inter: LinkMeasurement | None
    inter_one_way: LinkMeasurement | None
    seconds: float
    budget: ProbeBudget

    def measurements(self) -> dict[str, LinkMeasurement]:
        """The kinds measured, by name."""
        return {kind: m for kind in KINDS if (m := getattr(self, kind)) is not None}

    @property
    def rounds(self) -> int:
        return sum(m.rounds for m in self.measurements().values())

    @property
    def bytes_sent(self) -> int:
        return sum(m.bytes_sent for m in self.measurements().values())

    @property
    def steady(self) -> bool:
        """Every kind measured was steady (a planner prices none of the figures otherwise)."""
        return all(m.steady for m in self.measurements().values())

    @property
    def why(self) -> str:
        """The kinds that were not steady and why ("" when all were)."""
        return "; ".join(f"{kind}: {m.why}" for kind, m in self.measurements().items() if not m.steady)


@dataclass(frozen=True)
class Pattern:
    """Who one rank sends to and receives from in a kind's rounds.

    Attributes:
        send_to: ranks this rank sends to (an equal share each).
        receive_from: ranks it receives from.
        fanout: ranks every sender sends to (the same for all senders of the kind).
    """

    send_to: tuple[int, ...]
    receive_from: tuple[int, ...]
    fanout: int

    def elements_per_peer(self, nbytes: int) -> int:
        """float32 elements a sender gives each of its peers in a round of ``nbytes`` (at least one)."""
        return max(1, nbytes // (FLOAT * self.fanout))

    def sender_bytes(self, nbytes: int) -> int:
        """Bytes a sending rank really sends in a round of ``nbytes`` (whole elements per peer)."""
        return self.elements_per_peer(nbytes) * FLOAT * self.fanout


def pattern(rank: int, world_size: int, local_world_size: int, kind: str) -> Pattern:
    """``rank``'s part in the rounds of ``kind`` (one of :data:`KINDS`); hosts are
    ``rank // local_world_size``. None of the kind's rounds exists (no peers): ``fanout`` 0."""
    host, hosts = rank // local_world_size, world_size // local_world_size
    if kind == "intra":
        first = host * local_world_size
        peers = tuple(r for r in range(first, first + local_world_size) if r != rank)
        return Pattern(peers, peers, local_world_size - 1)
    if kind == "inter":
        peers = tuple(r for r in range(world_size) if r // local_world_size != host)
        return Pattern(peers, peers, world_size - local_world_size)
    if kind == "inter_one_way":
        fanout = 1 if hosts > 1 else 0
        if host % 2 == 0 and host + 1 < hosts:  # even hosts send to the next one; a last odd-numbered host idles
            return Pattern((rank + local_world_size,), (), fanout)
        if host % 2 == 1:
            return Pattern((), (rank - local_world_size,), fanout)
        return Pattern((), (), fanout)
    raise ValueError(f"link kind must be one of {KINDS}, got {kind!r}")


def fit_link(small_bytes: int, small_s: float, large_bytes: int, large_s: float) -> tuple[float, float, bool]:
    """(bytes per ms, latency ms, fitted) of ``time = latency + bytes / bandwidth`` through two
    rounds; when the larger round is not slower (noise), its bytes over its time, latency 0, not fitted."""
    if large_bytes <= small_bytes or not large_s > 0:
        raise ValueError(
            f"fit_link needs large_bytes > small_bytes and a positive time, got {small_bytes}, {large_bytes}, {large_s}"
        )
    if large_s <= small_s:
        return large_bytes / (large_s * 1e3), 0.0, False
    seconds_per_byte = (large_s - small_s) / (large_bytes - small_bytes)
    latency_s = max(0.0, small_s - small_bytes * seconds_per_byte)
    return 1.0 / (seconds_per_byte * 1e3), latency_s * 1e3, True


def spread(times: Sequence[float]) -> float:
    """The slowest of ``times`` over the fastest (inf when the fastest took no time)."""
    fastest = min(times)
    return max(times) / fastest if fastest > 0 else float("inf")


def unsteady(times: Sequence[float], max_spread: float) -> str:
    """Why the rounds of one size that took ``times`` are not steady, or "" when they are: at least
    two rounds, the slowest at most ``max_spread`` times the fastest."""
    if len(times) < 2:
        return f"{len(times)} round of the final size, nothing to compare"
    if spread(times) > max_spread:
        return f"{len(times)} rounds of the final size spread {spread(times):.2f}x (> {max_spread:g}x)"
    return ""


def used_rounds(first: Sequence[float], again: Sequence[float] | None, max_spread: float) -> list[float]:
    """The final size's rounds :func:`settle` takes its figure from."""
    if not unsteady(first, max_spread) or not again:
        return list(first)
    return list(again) if not unsteady(again, max_spread) else [*first, *again]


def settle(first: Sequence[float], again: Sequence[float] | None, max_spread: float) -> tuple[float, bool, str]:
    """(seconds, steady, why) of the final size from its rounds ``first`` and, when those were not
    steady, the re-measure ``again`` (None or empty: none ran). Steady rounds give their median; a
    steady re-measure replaces the first rounds; otherwise the median of all, not steady."""
    why = unsteady(first, max_spread)
    if not why:
        return statistics.median(first), True, ""
    if not again:
        return statistics.median(first), False, f"{why}; no time to re-measure"
    why_again = unsteady(again, max_spread)
    if not why_again:
        return statistics.median(again), True, ""
    return statistics.median([*first, *again]), False, f"{why}; re-measured, {why_again}"


def is_enough(nbytes: int, seconds: float, enough_bytes_per_ms: float | None) -> bool:
    """Whether a round that sent ``nbytes`` in ``seconds`` shows a rate (latency included, a lower
    bound of the link's) of at least ``enough_bytes_per_ms``; never when that is None."""
    return enough_bytes_per_ms is not None and nbytes >= enough_bytes_per_ms * seconds * 1e3


def probe_device(group: dist.ProcessGroup, compute_device: str) -> torch.device:
    """Where the probe's tensors live: CPU for gloo (or a CPU topology), else the current accelerator."""
    if compute_device == "cpu" or str(dist.get_backend(group)) == "gloo":
        return torch.device("cpu")
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None and accelerator.type == compute_device:
        return torch.device(compute_device, torch.accelerator.current_device_index())
    return torch.device(compute_device)


class _Rounds:
    """Timed all-to-all rounds of one kind on ``group``; every time agreed across ranks."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, pattern: Pattern, deadline_s: float):
        self.group, self.device, self.pattern, self.deadline_s = group, device, pattern, deadline_s
        self.world_size = dist.get_world_size(group)
        self.start = time.perf_counter()
        self.rounds = self.bytes_sent = 0
        self.spent_s = 0.0  # agreed: the slowest rank's time since the kind started

    def run(self, nbytes: int) -> float:
        """One round in which every sender sends ``nbytes``; returns the slowest rank's time."""
        per_peer = self.pattern.elements_per_peer(nbytes)
        send_splits, receive_splits = [0] * self.world_size, [0] * self.world_size
        for peer in self.pattern.send_to:
            send_splits[peer] = per_peer
        for peer in self.pattern.receive_from:
            receive_splits[peer] = per_peer
        sent = torch.ones(sum(send_splits), dtype=torch.float32, device=self.device)
        received = torch.empty(sum(receive_splits), dtype=torch.float32, device=self.device)
        self._sync()
        start = time.perf_counter()
        dist.all_to_all_single(received, sent, receive_splits, send_splits, group=self.group)
        self._sync()
        elapsed = time.perf_counter() - start
        agreed = torch.tensor([elapsed, time.perf_counter() - self.start], dtype=torch.float64, device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        elapsed, self.spent_s = (float(v) for v in agreed.cpu())
        self.rounds += 1
        self.bytes_sent += self.pattern.sender_bytes(nbytes)
        return elapsed

    def time_left(self) -> float:
        return self.deadline_s - self.spent_s

    def restart_clock(self) -> None:
        """Counts the kind's time from now (after a round every rank has left: they are in step)."""
        self.start, self.spent_s = time.perf_counter(), 0.0

    def _sync(self) -> None:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)


def measure_kind(rounds: _Rounds, budget: ProbeBudget) -> LinkMeasurement:
    """Measures one kind: warm-up, latency from tiny rounds, doubling rounds up to ``target_s`` (or
    ``enough``), repeats (re-measured when they spread), fit through the medians."""
    rounds.run(1)
    rounds.restart_clock()  # every rank has arrived: a rank that came late does not eat the budget
    tiny, tiny_s = rounds.pattern.sender_bytes(1), statistics.median([rounds.run(1) for _ in range(TINY_ROUNDS)])
    size = budget.first_bytes
    times = [rounds.run(size)]  # the rounds of the current size
    while True:
        large = rounds.pattern.sender_bytes(size)
        if is_enough(large, times[-1], budget.enough_bytes_per_ms):
            rate = large / (times[-1] * 1e3)
            return LinkMeasurement(rate, tiny_s * 1e3, rounds.rounds, rounds.bytes_sent, False, enough=True)
        if min(times) >= budget.target_s:
            if len(times) > 1:  # confirmed: a single noisy round does not stop the escalation
                break
            times.append(rounds.run(size))
            continue
        if 2 * size > budget.max_bytes or rounds.time_left() < 5 * min(times):  # next round ~2x, and a repeat
            break
        size *= 2
        times = [rounds.run(size)]
    times += _repeat(rounds, size, budget.repeats, statistics.median(times))
    again = None
    if unsteady(times, budget.max_spread):
        again = _repeat(rounds, size, budget.repeats, statistics.median(times))
    seconds, steady, why = settle(times, again, budget.max_spread)
    used = used_rounds(times, again, budget.max_spread)

    def rate(round_s: float) -> tuple[float, float, bool]:
        if large <= tiny:  # nothing to separate: a lower bound
            return large / (round_s * 1e3), 0.0, False
        return fit_link(tiny, tiny_s, large, round_s)

    bytes_per_ms, latency_ms, fitted = rate(seconds)
    bounds = (rate(max(used))[0], rate(min(used))[0])
    return LinkMeasurement(
        bytes_per_ms, latency_ms, rounds.rounds, rounds.bytes_sent, fitted, steady, why, bounds=bounds
    )


def _repeat(rounds: _Rounds, size: int, count: int, estimate_s: float) -> list[float]:
    """Up to ``count`` rounds of ``size``, each while the time left allows one of ``estimate_s``."""
    times: list[float] = []
    for _ in range(count):
        if rounds.time_left() < 1.5 * estimate_s:
            break
        times.append(rounds.run(size))
    return times


def probe_links(
    group: dist.ProcessGroup,
    local_world_size: int,
    device: torch.device,
    budget: ProbeBudget | None = None,
    kinds: Sequence[str] = KINDS,
) -> ProbeResult:
    """Measures the links within and between hosts on ``group``: a collective, every rank calls it.

    Args:
        group: the process group the model will train on.
        local_world_size: ranks per host (TorchRec's topology: host = rank // local_world_size).
        device: where the probe's tensors live (:func:`probe_device`).
        budget: rounds, bytes and time it may take (default ``ProbeBudget()``: about 2 s at most).
        kinds: which of :data:`KINDS` to measure (those the topology has: several ranks in a host,
            several hosts); the same on every rank.

    Raises:
        ValueError: ``local_world_size`` does not divide the world size.
    """
    budget = budget or ProbeBudget()
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"local_world_size {local_world_size} does not divide the world size {world_size}")
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown link kinds {sorted(unknown)}; choose from {KINDS}")
    kinds = [k for k in KINDS if k in kinds and pattern(0, world_size, local_world_size, k).fanout > 0]
    arrived = torch.zeros(1, device=device)
    dist.all_reduce(arrived, group=group)  # the probe's time starts when every rank is here
    start = time.perf_counter()
    measured: dict[str, LinkMeasurement] = {}
    spent = 0.0
    for index, kind in enumerate(kinds):
        share = (budget.seconds - spent) / (len(kinds) - index)
        rounds = _Rounds(group, device, pattern(rank, world_size, local_world_size, kind), share)
        measured[kind] = measure_kind(rounds, budget)
        spent += rounds.spent_s
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return ProbeResult(
        measured.get("intra"), measured.get("inter"), measured.get("inter_one_way"), float(elapsed.cpu()), budget
    )

"""Which networks a benchmark invocation runs on (``--network``), and where each run writes.

``loopback`` and ``emulated`` run once, into ``--out``. ``auto`` (what ``make bench`` asks for)
runs on loopback into ``<out>/loopback``, then on emulated hosts at the link given (default: the
2-host reference link, :data:`~torchrec_het_bench.presets.REFERENCE_GBIT`) into
``<out>/emulated``, where this machine allows them (root, iproute2, network namespaces;
:func:`torchrec_het_bench.netem.check_available`); elsewhere it says in one line why it skipped them.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NETWORK_MODES = ("loopback", "emulated", "auto")


@dataclass(frozen=True)
class NetworkRun:
    """One run's network (``RunSpec.network`` before the run adds what it measures) and output folder."""

    network: dict
    out_dir: str


def _emulated(hosts: int, gbit: float, delay_ms: float) -> dict:
    return {"mode": "emulated", "hosts": hosts, "gbit": gbit, "delay_ms": delay_ms}


def emulation_unavailable() -> str | None:
    """Why emulated hosts cannot be built here, or None when they can."""
    from torchrec_het_bench.netem import NetworkEmulationUnavailable, check_available

    try:
        check_available()
    except NetworkEmulationUnavailable as error:
        return str(error)
    return None


def skip_line(hosts: int, gbit: float, reason: str) -> str:
    """The one line ``auto`` prints when it skips the emulated hosts."""
    return f"torchrec_het_bench: skipped the run on {hosts} emulated hosts at {gbit:g} Gbit/s: {reason}"


def plan_networks(
    mode: str, out: str, hosts: int, gbit: float, delay_ms: float, unavailable: Callable[[], str | None] | None = None
) -> tuple[list[NetworkRun], str | None]:
    """The runs of ``--network mode``, and for ``auto`` without emulation the line that says why it skipped
    the emulated hosts (the caller prints it once the runs are done, where a reader looks).

    Args:
        unavailable: why emulation is impossible here, or None; default :func:`emulation_unavailable`.

    Raises:
        SystemExit: ``emulated`` asked for where emulation is impossible (the message says why).
    """
    if mode not in NETWORK_MODES:
        raise ValueError(f"unknown network mode {mode!r}; choose from {NETWORK_MODES}")
    if mode == "loopback":
        return [NetworkRun({"mode": "loopback"}, out)], None
    reason = (unavailable or emulation_unavailable)()
    if mode == "emulated":
        if reason is not None:
            raise SystemExit(f"error: --network emulated is not possible here: {reason}")
        return [NetworkRun(_emulated(hosts, gbit, delay_ms), out)], None
    loopback = NetworkRun({"mode": "loopback"}, str(Path(out) / "loopback"))
    if reason is not None:
        return [loopback], skip_line(hosts, gbit, reason)
    return [loopback, NetworkRun(_emulated(hosts, gbit, delay_ms), str(Path(out) / "emulated"))], None

"""The link bandwidths the planner prices with, and where each figure came from.

Figures are TorchRec's ``intra_host_bw`` / ``inter_host_bw``, in its unit (bytes per ms), and
mean what the pricing means: the rate of one rank's bytes while every rank sends at once
(:mod:`~torchrec_het.planner.link_probe`). Each figure is, first to last that applies:

- **stated**: ``LinkSettings`` (``link_gbit=``, ``$TORCHREC_HET_LINK_GBIT``), or bandwidths the
  caller's ``Topology`` carries that are not TorchRec's defaults;
- **measured**: by the probe, in ``collective_plan`` (unless the probe is off);
- **assumed**: on a CPU topology gloo over TCP (2 GB/s in a host, 10 Gbit/s between hosts), else
  TorchRec's defaults (which describe GPU interconnects).
"""

import math
from dataclasses import dataclass

from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH
from torchrec.distributed.planner.types import BasicCommsBandwidths

from torchrec_het import _compat
from torchrec_het.planner.link_probe import LinkMeasurement, ProbeResult

# gloo over TCP, in TorchRec's unit (bytes per ms): ~2 GB/s between ranks of a host
# (loopback), 10 Gbit/s Ethernet between hosts.
CPU_INTRA_HOST_BW = 2e9 / 1e3
CPU_INTER_HOST_BW = 10e9 / 8 / 1e3
GBIT = 1e9 / 8 / 1e3  # one Gbit/s in bytes per ms
MEASURED, STATED, ASSUMED = "measured", "stated", "assumed"
_SWITCH = {"1": True, "on": True, "true": True, "yes": True, "0": False, "off": False, "false": False, "no": False}


@dataclass(frozen=True)
class LinkSettings:
    """Bandwidths a user states, and whether the planner measures the others.

    Attributes:
        intra_gbit: Gbit/s per rank within a host, every rank sending at once (None: not stated).
        inter_gbit: likewise between hosts (with ``L`` ranks per host, about a host link's rate / ``L``).
        probe: measure what is not stated in ``collective_plan`` (a short collective on its group).
        origin: where the stated figures come from, shown beside them.
    """

    intra_gbit: float | None = None
    inter_gbit: float | None = None
    probe: bool = True
    origin: str = "link_gbit"

    def __post_init__(self) -> None:
        for name in ("intra_gbit", "inter_gbit"):
            value = getattr(self, name)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if value is not None and (not number or not 0 < value < math.inf):
                raise ValueError(f"{self.origin}: {name} must be a number of Gbit/s > 0, got {value!r}")
        if not isinstance(self.probe, bool):
            raise ValueError(f"link_probe must be True or False, got {self.probe!r}")


def parse_link_gbit(text: str, origin: str) -> tuple[float | None, float | None]:
    """``"intra,inter"`` in Gbit/s per rank; either may be left empty (not stated), not both.

    Raises:
        ValueError: naming ``origin``.
    """
    fields = text.split(",")
    if len(fields) != 2 or not any(f.strip() for f in fields):
        raise ValueError(f"{origin} must be 'INTRA,INTER' in Gbit/s per rank (one may be empty), got {text!r}")
    out = []
    for which, field in zip(("intra", "inter"), fields):
        field = field.strip()
        try:
            value = float(field) if field else None
        except ValueError:
            value = -1.0
        if value is not None and not 0 < value < math.inf:
            raise ValueError(
                f"{origin}: the {which}-host figure must be a number of Gbit/s > 0, got {field!r} in {text!r}"
            )
        out.append(value)
    return out[0], out[1]


def parse_switch(text: str, origin: str) -> bool:
    """``1/0``, ``on/off``, ``true/false``, ``yes/no`` (any case).

    Raises:
        ValueError: naming ``origin``.
    """
    value = _SWITCH.get(text.strip().lower())
    if value is None:
        raise ValueError(f"{origin} must be 1 or 0 (on/off, true/false, yes/no), got {text!r}")
    return value


@dataclass(frozen=True)
class LinkFigures:
    """What the planner prices communication with.

    Attributes:
        intra_host_bw: bytes per ms per rank within a host, every rank sending at once.
        inter_host_bw: likewise between hosts.
        intra_source: ``measured``, ``stated`` or ``assumed``.
        inter_source: likewise.
        intra_note: what the source was (the setting, the probe's rounds, the assumption and why).
        inter_note: likewise.
        probe: the probe's full result when one ran (also the one-way rate between hosts).
    """

    intra_host_bw: float
    inter_host_bw: float
    intra_source: str
    inter_source: str
    intra_note: str = ""
    inter_note: str = ""
    probe: ProbeResult | None = None

    def describe(self) -> str:
        """One line: each figure in Gbit/s per rank, its source and note, and the probe's cost."""
        parts = [
            f"within a host {_gbit(self.intra_host_bw)} ({self.intra_source}{_note(self.intra_note)})",
            f"between hosts {_gbit(self.inter_host_bw)} ({self.inter_source}{_note(self.inter_note)})",
        ]
        line = "links (per rank, all ranks sending at once): " + ", ".join(parts)
        if self.probe is not None:
            one_way = self.probe.inter_one_way
            extra = f"; one way between hosts {_gbit(one_way.bytes_per_ms)}{_flags(one_way)}" if one_way else ""
            line += f"; probe {self.probe.seconds:.2f} s, {self.probe.rounds} rounds{extra}"
            if not self.probe.steady:
                line += " (not steady)"
        return line

    def as_dict(self) -> dict:
        """The figures in Gbit/s with their sources, and the probe's measurements (for results files)."""
        out = {
            "intra_gbit": self.intra_host_bw / GBIT, "intra_source": self.intra_source, "intra_note": self.intra_note,
            "inter_gbit": self.inter_host_bw / GBIT, "inter_source": self.inter_source, "inter_note": self.inter_note,
        }  # fmt: skip
        if self.probe is not None:
            out["probe"] = {
                "seconds": self.probe.seconds, "rounds": self.probe.rounds, "bytes_sent": self.probe.bytes_sent,
                **{kind: _measurement_dict(m) for kind, m in self.probe.measurements().items()},
            }  # fmt: skip
        return out


class HetCommsBandwidths(BasicCommsBandwidths):
    """TorchRec's two-figure bandwidths, carrying the :class:`LinkFigures` they came from
    (the planner's stats print them; equal to ``BasicCommsBandwidths`` of the same figures)."""

    def __init__(self, figures: LinkFigures) -> None:
        super().__init__(inter_host_bw=figures.inter_host_bw, intra_host_bw=figures.intra_host_bw)
        self.name = "HetCommsBandwidths"
        self.figures = figures


def stated_in_topology(topology: Topology) -> bool:
    """Whether ``topology`` carries bandwidths of its own (not TorchRec's defaults)."""
    bandwidths = topology.comms_bandwidths
    if isinstance(bandwidths, HetCommsBandwidths):
        return False
    if not isinstance(bandwidths, BasicCommsBandwidths):
        return True
    return (bandwidths.intra_host_bw, bandwidths.inter_host_bw) != (INTRA_NODE_BANDWIDTH, CROSS_NODE_BANDWIDTH)


def kinds_to_probe(topology: Topology, settings: LinkSettings) -> list[str]:
    """The figures ``collective_plan`` would measure: those the topology has (several ranks in a
    host, several hosts) and nothing states; none with the probe off."""
    if not settings.probe or stated_in_topology(topology):
        return []
    local, world = topology.local_world_size, topology.world_size
    wanted = {
        "intra": local > 1 and settings.intra_gbit is None,
        "inter": world > local and settings.inter_gbit is None,
    }
    return [kind for kind, want in wanted.items() if want]


def link_figures(
    topology: Topology, settings: LinkSettings, probe: ProbeResult | None = None, cpu_bandwidths: bool = True,
    unmeasured: str = "",
) -> LinkFigures:  # fmt: skip
    """The figures for ``topology``, each stated (``settings``, else the topology's own), else
    measured by ``probe``, else assumed (on a CPU topology with ``cpu_bandwidths``, gloo over TCP);
    ``unmeasured`` says why a figure the probe would measure was not (shown beside an assumed one)."""
    own = stated_in_topology(topology)
    own_note = f"the Topology's {type(topology.comms_bandwidths).__name__}"
    cpu = topology.compute_device == "cpu" and cpu_bandwidths
    local, world = topology.local_world_size, topology.world_size
    chosen = {}
    for kind, gbit, measured, given, default, cpu_default, used in (
        ("intra", settings.intra_gbit, probe and probe.intra, topology.intra_host_bw, INTRA_NODE_BANDWIDTH,
         CPU_INTRA_HOST_BW, local > 1),
        ("inter", settings.inter_gbit, probe and probe.inter, topology.inter_host_bw, CROSS_NODE_BANDWIDTH,
         CPU_INTER_HOST_BW, world > local),
    ):  # fmt: skip
        if gbit is not None:
            chosen[kind] = (gbit * GBIT, STATED, settings.origin)
        elif own:
            chosen[kind] = (given, STATED, own_note)
        elif measured:
            chosen[kind] = (measured.bytes_per_ms, MEASURED, _measured_note(measured))
        else:
            why = unmeasured if used else ("one rank per host" if kind == "intra" else "one host")
            what = "gloo over TCP" if cpu else "TorchRec's default"
            chosen[kind] = (cpu_default if cpu else default, ASSUMED, f"{what}; {why}" if why else what)
    (intra, intra_source, intra_note), (inter, inter_source, inter_note) = chosen["intra"], chosen["inter"]
    return LinkFigures(intra, inter, intra_source, inter_source, intra_note, inter_note, probe)


def with_links(topology: Topology, figures: LinkFigures, settings: LinkSettings) -> Topology:
    """``topology`` pricing with ``figures``; a topology with bandwidths of its own stays itself
    (its own class may do more than two figures) unless ``settings`` state one."""
    if stated_in_topology(topology) and settings.intra_gbit is None and settings.inter_gbit is None:
        return topology
    return _compat.with_comms_bandwidths(topology, HetCommsBandwidths(figures))


def cpu_network(topology: Topology) -> Topology:
    """``topology`` with gloo-over-TCP bandwidths if it is a CPU topology with TorchRec's
    default (GPU) bandwidths; otherwise ``topology`` itself."""
    if topology.compute_device != "cpu" or stated_in_topology(topology):
        return topology
    if isinstance(topology.comms_bandwidths, HetCommsBandwidths):  # the planner's figures already
        return topology
    return _compat.with_comms_bandwidths(
        topology, BasicCommsBandwidths(intra_host_bw=CPU_INTRA_HOST_BW, inter_host_bw=CPU_INTER_HOST_BW)
    )


def _measured_note(measured: LinkMeasurement) -> str:
    if measured.enough:
        fit = "enough: a lower bound"
    elif measured.fitted:
        fit = f"latency {measured.latency_ms:.2f} ms removed"
    else:
        fit = "latency not separable: a lower bound"
    steady = "" if measured.steady else f", not steady: {measured.why}"
    return f"probe, {measured.rounds} rounds, {fit}{steady}"


def _flags(measured: LinkMeasurement) -> str:
    flags = [name for name, on in (("enough", measured.enough), ("not steady", not measured.steady)) if on]
    return f" ({', '.join(flags)})" if flags else ""


def _measurement_dict(m: LinkMeasurement) -> dict:
    return {"gbit": m.gbit_per_s, "latency_ms": m.latency_ms, "rounds": m.rounds, "bytes_sent": m.bytes_sent,
            "fitted": m.fitted, "steady": m.steady, "why": m.why, "enough": m.enough}  # fmt: skip


def _gbit(bytes_per_ms: float) -> str:
    return f"{bytes_per_ms / GBIT:.3g} Gbit/s"


def _note(note: str) -> str:
    return f": {note}" if note else ""

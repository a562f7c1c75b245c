"""The links a benchmark run trains over, as the plugin's planner measures them at plan time.

Recorded in results.json beside the emulated link's rate (``network.gbit``, what ``tc`` shapes)
and what bulk TCP gets over it (``network.tcp``, :func:`~torchrec_het_bench.netem_measure.link_truth`).
The run's ``planned`` configurations price these figures, as a user's planner would
(:attr:`~torchrec_het_bench.worker.RunSpec.link_bytes_per_s`: the link the ranks cross: between
emulated hosts as measured, on one host where steady, else loopback's stated figure). One probe per run, so
every entry of the run plans for the same links.
"""

import torch
import torch.distributed as dist

from torchrec_het.planner.link_probe import probe_links
from torchrec_het.planner.network import LinkSettings, link_figures
from torchrec_het_bench.topology import cpu_topology


def measure_run_links(world_size: int, local_world_size: int) -> dict:
    """The planner's link figures on the default group (a collective: every rank calls it), as
    ``LinkFigures.as_dict()``: Gbit/s per rank within and between hosts, their sources, the probe."""
    probe = probe_links(dist.GroupMember.WORLD, local_world_size, torch.device("cpu"))
    return link_figures(cpu_topology(world_size, local_world_size), LinkSettings(), probe).as_dict()

"""``EmbeddingShardingPlanner`` with the plugin's enumerator and stats as defaults."""

import inspect
from typing import ClassVar

from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH
from torchrec.distributed.planner.types import BasicCommsBandwidths

from torchrec_het import _compat
from torchrec_het.planner.enumerator import HetEmbeddingEnumerator
from torchrec_het.planner.pricing import PluginPricing
from torchrec_het.planner.stats import HetEmbeddingStats

# gloo over TCP, in TorchRec's unit (bytes per ms): ~2 GB/s between ranks of a host
# (loopback), 10 Gbit/s Ethernet between hosts.
CPU_INTRA_HOST_BW = 2e9 / 1e3
CPU_INTER_HOST_BW = 10e9 / 8 / 1e3


class HetEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's planner; unless given their own, it enumerates and prices the plugin's types
    (:class:`HetEmbeddingEnumerator`) and prints them (:class:`HetEmbeddingStats`).

    Args:
        pricing: the plugin's settings and reads per row (default: what ``torchrec_het.install()``
            was given, else ``PluginPricing()``).
        cpu_bandwidths: on a CPU topology that carries TorchRec's default bandwidths (which
            describe GPU interconnects), price communication at gloo-over-TCP speeds
            (:func:`cpu_network`) instead.
        *args, **kwargs: as ``EmbeddingShardingPlanner``.
    """

    # The pricing ``torchrec_het.install()`` was given: set (and put back) by
    # ``torchrec_het.registration``, which imports this module; this module never imports it.
    installed_pricing: ClassVar[PluginPricing | None] = None

    def __init__(self, *args, pricing: PluginPricing | None = None, cpu_bandwidths: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        given = inspect.signature(EmbeddingShardingPlanner.__init__).bind(self, *args, **kwargs).arguments
        topology, batch_size, constraints = _compat.planner_settings(self)
        if cpu_bandwidths:
            topology = cpu_network(topology)
        enumerator = None
        if given.get("enumerator") is None:
            enumerator = HetEmbeddingEnumerator(
                topology=topology, batch_size=batch_size, constraints=constraints, pricing=pricing or default_pricing()
            )
        stats = [HetEmbeddingStats()] if given.get("stats") is None else None
        _compat.set_planner_parts(self, topology=topology, enumerator=enumerator, stats=stats)


def cpu_network(topology: Topology) -> Topology:
    """``topology`` with gloo-over-TCP bandwidths if it is a CPU topology with TorchRec's
    default (GPU) bandwidths; otherwise ``topology`` itself."""
    bandwidths = topology.comms_bandwidths
    stock = isinstance(bandwidths, BasicCommsBandwidths) and (bandwidths.intra_host_bw, bandwidths.inter_host_bw) == (
        INTRA_NODE_BANDWIDTH, CROSS_NODE_BANDWIDTH,
    )
    if topology.compute_device != "cpu" or not stock:
        return topology
    return _compat.with_comms_bandwidths(
        topology, BasicCommsBandwidths(intra_host_bw=CPU_INTRA_HOST_BW, inter_host_bw=CPU_INTER_HOST_BW)
    )


def default_pricing() -> PluginPricing:
    """The pricing ``torchrec_het.install()`` was given, else ``PluginPricing()``."""
    return HetEmbeddingShardingPlanner.installed_pricing or PluginPricing()

"""What the planner assumes about a CPU cluster's network (gloo over TCP), where TorchRec's
defaults describe GPU interconnects."""

from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.constants import CROSS_NODE_BANDWIDTH, INTRA_NODE_BANDWIDTH
from torchrec.distributed.planner.types import BasicCommsBandwidths

from torchrec_het import _compat

# gloo over TCP, in TorchRec's unit (bytes per ms): ~2 GB/s between ranks of a host
# (loopback), 10 Gbit/s Ethernet between hosts.
CPU_INTRA_HOST_BW = 2e9 / 1e3
CPU_INTER_HOST_BW = 10e9 / 8 / 1e3


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

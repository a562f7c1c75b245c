"""The benchmark's planner topologies."""

from torchrec.distributed.planner.types import HardwareConfig, KernelConfig, Topology, TopologyFactory, TrainerConfig


def cpu_topology(
    world_size: int, local_world_size: int, intra_host_bw: float | None = None, inter_host_bw: float | None = None
) -> Topology:
    """A CPU ``Topology`` built the way TorchRec asks (``TopologyFactory``); the bandwidths (bytes
    per ms) where given, else TorchRec's defaults."""
    given = intra_host_bw is not None or inter_host_bw is not None
    return TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=local_world_size),
        HardwareConfig(intra_host_bw=intra_host_bw, inter_host_bw=inter_host_bw),
        KernelConfig(compute_device="cpu", use_hardware_based_bandwidth=given),
    )

"""Perf and storage estimators that price the plugin's types and hand every other type to TorchRec.

A plugin option is first priced by TorchRec as the row_wise option it is built on (same
shards); then its communication is replaced by the plugin's expected bytes
(:mod:`torchrec_het.planner.traffic`; embeddings at the wire bytes of its sharder's quantized-comms
codecs, :mod:`torchrec_het.planner.qcomms`) over the topology's bandwidth (on several hosts,
the bytes that stay within a host, of the per-host tier and the hierarchical replica sync,
over the intra-host bandwidth), its compute grows by
the lookups' measured extra cost per id (:mod:`torchrec_het.planner.compute_costs`) times the
table's ids per rank, and its storage grows by the rows each rank keeps beyond its shard
(replicas or cache slots).
"""

import copy

from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.types import CollectiveType, Perf, ShardingOption, Storage, Topology
from torchrec.distributed.types import ShardingType

from torchrec_het import _compat
from torchrec_het.planner.pricing import PLUGIN_TYPES, PluginPricing
from torchrec_het.replication.memory import ROUTE_MAP_BYTES_PER_ROW, TierTopology, bytes_per_row
from torchrec_het.types import HET_ROW_REPLICATED

DEFAULT_OPTIMIZER = "exact_row_wise_adagrad"


def split_plugin(options: list[ShardingOption]) -> tuple[list[ShardingOption], list[ShardingOption]]:
    """(stock options, plugin options)."""
    return [o for o in options if o.sharding_type not in PLUGIN_TYPES], [
        o for o in options if o.sharding_type in PLUGIN_TYPES
    ]


def as_row_wise(option: ShardingOption) -> ShardingOption:
    twin = copy.deepcopy(option)
    twin.sharding_type = ShardingType.ROW_WISE.value
    return twin


def estimate_with_twins(stock_estimate, options: list[ShardingOption], sharder_data_map):
    """Runs TorchRec's ``stock_estimate`` on the stock options and on a row_wise twin of each
    plugin option; returns ``[(plugin option, estimated twin)]``."""
    stock, plugin = split_plugin(options)
    if stock:
        stock_estimate(stock, sharder_data_map)
    twins = [as_row_wise(o) for o in plugin]
    if twins:
        stock_estimate(twins, sharder_data_map)
    return list(zip(plugin, twins))


class HetPerfEstimator(EmbeddingPerfEstimator):
    """TorchRec's perf estimator, plus the plugin's types.

    Args:
        topology: the planner's topology.
        constraints: per-table constraints.
        pricing: the plugin's settings and reads per row.
    """

    def __init__(
        self, topology: Topology, constraints=None, pricing: PluginPricing | None = None, is_inference: bool = False
    ):
        super().__init__(topology, constraints, is_inference=is_inference)
        self.pricing = pricing or PluginPricing()

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:
        pairs = estimate_with_twins(super().estimate, sharding_options, sharder_data_map)
        topology = _compat.estimator_topology(self)
        ws, local = topology.world_size, topology.local_world_size
        bandwidth = topology.comms_bandwidths.get_bw(local, ws, CollectiveType.ALL_TO_ALL)
        intra_bandwidth = topology.comms_bandwidths.get_bw(local, min(local, ws), CollectiveType.ALL_TO_ALL)
        tiers = TierTopology.from_torchrec(topology) if ws > local > 1 else None
        for option, twin in pairs:
            traffic = self.pricing.bytes(option, self.pricing.load(option, ws, tiers))
            # bytes that stay within a host (several hosts: the per-host tier, the hierarchical sync) at its bandwidth
            fwd_comms = (traffic.forward - traffic.intra_forward) / (ws * bandwidth) + traffic.intra_forward / (
                ws * intra_bandwidth
            )
            bwd = traffic.backward + traffic.sync
            bwd_comms = (bwd - traffic.intra_backward) / (ws * bandwidth) + traffic.intra_backward / (
                ws * intra_bandwidth
            )
            extra_ms = self.pricing.extra_compute_seconds(option, topology.compute_device) * 1e3  # perf is in ms
            for shard, base in zip(option.shards, twin.shards):
                fwd_compute, bwd_compute = with_extra_compute(base.perf.fwd_compute, base.perf.bwd_compute, extra_ms)
                shard.perf = Perf(
                    fwd_compute=fwd_compute,
                    fwd_comms=fwd_comms,
                    bwd_compute=bwd_compute,
                    bwd_comms=bwd_comms,
                    prefetch_compute=base.perf.prefetch_compute,
                )


def with_extra_compute(fwd: float, bwd: float, extra: float) -> tuple[float, float]:
    """(fwd, bwd) compute plus ``extra`` (may be negative), split as the row_wise twin splits its
    own (1:2, TorchRec's backward multiplier, if the twin has none); the total stays >= 0."""
    base = fwd + bwd
    if base + extra <= 0:
        return 0.0, 0.0
    fwd_share = fwd / base if base > 0 else 1.0 / 3.0
    return fwd + extra * fwd_share, bwd + extra * (1.0 - fwd_share)


class HetStorageEstimator(EmbeddingStorageEstimator):
    """TorchRec's storage estimator, plus the plugin's types (shard + replicas or cache per rank).

    Args:
        topology: the planner's topology.
        constraints: per-table constraints.
        pricing: the plugin's settings and reads per row.
    """

    def __init__(self, topology: Topology, constraints=None, pricing: PluginPricing | None = None, **kwargs):
        super().__init__(topology, constraints, **kwargs)
        self.pricing = pricing or PluginPricing()

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:
        pairs = estimate_with_twins(super().estimate, sharding_options, sharder_data_map)
        topology = _compat.estimator_topology(self)
        ws, on_device = topology.world_size, topology.compute_device in ("cuda", "mtia")
        tiers = TierTopology.from_torchrec(topology) if ws > topology.local_world_size > 1 else None
        for option, twin in pairs:
            data = (sharder_data_map or {}).get(option.module_type_key)
            optimizer = (data.fused_params if data else {}).get("optimizer", DEFAULT_OPTIMIZER)
            row_bytes = bytes_per_row(option.tensor.shape[1], optimizer)
            extra = self.pricing.extra_rows(option, self.pricing.load(option, ws, tiers)) * row_bytes
            if option.sharding_type == HET_ROW_REPLICATED:  # its route map: a code per row of the table
                extra += option.tensor.shape[0] * ROUTE_MAP_BYTES_PER_ROW
            more = Storage(hbm=extra, ddr=0) if on_device else Storage(hbm=0, ddr=extra)
            for shard, base in zip(option.shards, twin.shards):
                shard.storage = base.storage + more

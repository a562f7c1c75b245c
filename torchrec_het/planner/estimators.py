"""The planner's estimators: perf from the step model for every option (the one cost model,
:mod:`torchrec_het.planner.cost_model`); storage from TorchRec's estimator, a plugin option's as its
row_wise twin's plus the rows each rank keeps beyond its shard (replicas or cache slots).
"""

import copy

from torchrec.distributed.planner.shard_estimators import EmbeddingPerfEstimator, EmbeddingStorageEstimator
from torchrec.distributed.planner.types import CollectiveType, ShardingOption, Storage, Topology
from torchrec.distributed.types import ShardingType

from torchrec_het import _compat
from torchrec_het.planner.compute_costs import ComputeCosts, default_compute_costs
from torchrec_het.planner.cost_model import CostInputs, option_perf, option_table
from torchrec_het.planner.pricing import PLUGIN_TYPES, PluginPricing
from torchrec_het.planner.step_model import Cluster, Compute, Links
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
    """Prices every option, TorchRec's types and the plugin's alike, with the step model
    (:mod:`~torchrec_het.planner.cost_model`): the planner's one cost model.

    Args:
        topology: the planner's topology.
        constraints: per-table constraints.
        pricing: the plugin's settings and reads per row.
        costs: the links, compute and pipeline to price with (the planner sets them from its probes;
            None: the topology's bandwidths, no latency, the calibration's stock lookup per id).

    ``registries`` (set by the enumerator) gives each sharder's quantized-comms codecs, which price its
    options' embeddings. ``shares`` holds, per table and sharding type, the cheapest predicted share of the step (seconds)
    of the options estimated; ``rank_costs`` the cheapest cost to a rank (seconds): the table's shards'
    perf summed and shared over the ranks, what TorchRec's search balances (a row_wise table costs
    every rank its share; a table_wise one costs its owner alone, and such tables spread over the ranks).
    The planner's stats compare the chosen type with the runner-up by ``rank_costs``.
    """

    def __init__(
        self,
        topology: Topology,
        constraints=None,
        pricing: PluginPricing | None = None,
        is_inference: bool = False,
        costs: CostInputs | None = None,
    ):
        super().__init__(topology, constraints, is_inference=is_inference)
        self.pricing = pricing or PluginPricing()
        self.costs = costs
        self.shares: dict[str, dict[str, float]] = {}
        self.rank_costs: dict[str, dict[str, float]] = {}
        self.registries: dict[str, dict | None] = {}  # sharder key -> its qcomm_codecs_registry (the enumerator's)

    def estimate(self, sharding_options: list[ShardingOption], sharder_data_map=None) -> None:
        topology = _compat.estimator_topology(self)
        inputs = self.costs or topology_inputs(topology, self.pricing.compute)
        ws, local = topology.world_size, topology.local_world_size
        tiers = TierTopology.from_torchrec(topology) if ws > local > 1 else None
        for option in sharding_options:
            registry = self.registries.get(option.module_type_key)
            table = option_table(option, self.pricing, ws, tiers, registry)
            seconds = option_perf(option, table, Cluster(ws, local, option.batch_size), inputs)
            kinds = self.shares.setdefault(option.name, {})
            kinds[option.sharding_type] = min(seconds, kinds.get(option.sharding_type, float("inf")))
            per_rank = sum(shard.perf.total for shard in option.shards) / 1e3 / ws  # ms summed -> seconds a rank
            costs = self.rank_costs.setdefault(option.name, {})
            costs[option.sharding_type] = min(per_rank, costs.get(option.sharding_type, float("inf")))

    def forget(self, name: str, sharding_type: str) -> None:
        """Drops what was priced for ``sharding_type`` of table ``name`` (a stand-in the table may not take)."""
        self.shares.get(name, {}).pop(sharding_type, None)
        self.rank_costs.get(name, {}).pop(sharding_type, None)


def topology_inputs(topology: Topology, costs: ComputeCosts | None = None) -> CostInputs:
    """Cost inputs from a topology alone: its bandwidths, no latency, the calibration's stock lookup
    per id and the plugin types' extras (what an estimator prices with when no planner measured)."""
    ws, local = topology.world_size, topology.local_world_size
    bandwidths = topology.comms_bandwidths
    inter = bandwidths.get_bw(local, ws, CollectiveType.ALL_TO_ALL) * 1e3  # bytes/ms -> bytes/s
    intra = bandwidths.get_bw(local, min(local, ws), CollectiveType.ALL_TO_ALL) * 1e3
    costs = costs or default_compute_costs()
    on_device = costs.applies_to(topology.compute_device)
    compute = Compute(
        lookup_s_per_id=(costs.reference_seconds_per_id or 0.0) if on_device else 0.0,
        dense_s_per_sample=0.0,
        extra_s_per_id=costs.extras_on(topology.compute_device),
        source="the calibration's stock lookup per id (compute_costs.json), not measured",
    )
    return CostInputs(Links(intra, inter, 0.0, "the topology's bandwidths"), compute, source="the topology alone")


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

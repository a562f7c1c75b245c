"""Benchmark configurations where the planner chooses every table's type, the plugin's included.

``planned`` (exact: replicas synced every step, HET cache without staleness),
``planned_s10`` (replicas synced every 10 steps, cache bounds s_read = s_write = 10),
``planned_fp16`` and ``planned_int8`` (exact, with TorchRec's quantized comms fp16/bf16 or int8 on
the plugin's sharders, as ``stock_table_wise_fp16`` / ``_int8`` have them on the stock one), ``planned_lookahead`` (exact, row-replicated
bags with lookahead: the next batch's partial sums leave their owners during this step), and their ``seq_`` twins for the sequence workload. Each profiles a 5% sample of its
stream (as the row-replicated configurations do), prices the plugin's types from it with
:class:`~torchrec_het.planner.HetEmbeddingShardingPlanner` on a topology whose bandwidth
is the run's network, and shards with the plugin's sharders, whose hot rows come from
the same profile (:class:`~torchrec_het.planner.ProfileTiers`).
"""

from torchrec.distributed.planner import Topology

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.planner import AccessModel, HetEmbeddingShardingPlanner, PluginPricing, ProfileTiers
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfile
from torchrec_het_bench import qcomms
from torchrec_het_bench.config_types import BenchConfig, ShardingContext
from torchrec_het_bench.replicated_configs import plugin_sharders, stream_profile
from torchrec_het_bench.topology import cpu_topology

PLANNED = {"planned": 1, "planned_s10": 10}  # name -> staleness (replica sync interval and cache bounds)
# exact, with TorchRec's quantized comms on the plugin's sharders
QUANTIZED = {"planned_fp16": qcomms.FP16, "planned_int8": qcomms.INT8}
SUMS_ONLY = (
    "planned_sums"  # exact, the planner choosing no fetched cold rows (ReplicationConfig(cold_rows=frozenset()))
)
LOOKAHEAD = "planned_lookahead"  # exact, row-replicated bags with lookahead (ReplicationConfig(lookahead=True))


def per_rank_profile(context: ShardingContext) -> AccessProfile:
    """The stream's profile in the planner's units: reads per batch of one rank (a collective)."""
    summed = stream_profile(context)  # every rank's sample, summed: reads per step
    return AccessProfile(summed.tables, summed.num_rows, summed.counts, summed.batches * context.world_size)


def _cache(staleness: int) -> HetCacheConfig:
    return HetCacheConfig(
        default=CacheSettings(s_read=staleness, s_write=staleness) if staleness > 1 else CacheSettings()
    )


def _planner_topology(context: ShardingContext, topology: Topology | None = None) -> Topology:
    """The topology the planner prices with: the run's link (``context.link_bytes_per_s``: what the
    planner's probe measured on the run's group) within and between hosts, else ``topology``
    (default: the benchmark's CPU topology)."""
    if context.link_bytes_per_s is not None:  # TorchRec's bandwidths are bytes per ms
        per_ms = context.link_bytes_per_s / 1e3
        return cpu_topology(context.world_size, context.local_world_size, per_ms, per_ms)
    return topology if topology is not None else cpu_topology(context.world_size, context.local_world_size)


def _make_sharders(staleness: int, pair: str | None = None, lookahead: bool = False, sums_only: bool = False):
    def build(context: ShardingContext):
        # the planner's topology: the per-host tier it priced is the one built
        tiers = ProfileTiers(
            per_rank_profile(context), replica_sync_every=staleness, topology=_planner_topology(context)
        )
        replication = ReplicationConfig(
            tiers=tiers,
            replica_sync_every=staleness,
            local_world_size=context.local_world_size,
            lookahead=lookahead,
            cold_rows=frozenset() if sums_only else None,  # None: the planner chooses each table's cold tier
        )
        return plugin_sharders(context, replication, cache=_cache(staleness), pair=pair)

    return build


def _make_planner(staleness: int):
    def build(context: ShardingContext, topology: Topology, **planner_args):
        pricing = PluginPricing(AccessModel(per_rank_profile(context)))  # the settings: the sharders' options
        return HetEmbeddingShardingPlanner(
            topology=_planner_topology(context, topology), pricing=pricing, **planner_args
        )

    return build


def planned_configs() -> list[BenchConfig]:
    """``planned``, ``planned_s10`` and their ``seq_`` twins, for the registry
    (:func:`torchrec_het_bench.configs.all_configs`)."""
    configs = []
    for workload in ("dlrm", "sequence"):
        for base, staleness in PLANNED.items():
            configs.append(_planned(workload, base, staleness))
        for base, pair in QUANTIZED.items():
            configs.append(_planned(workload, base, 1, pair))
    configs.append(_planned("dlrm", LOOKAHEAD, 1, lookahead=True))  # bags only
    configs.append(_planned("dlrm", SUMS_ONLY, 1, sums_only=True))  # bags only
    return configs


def _planned(
    workload: str, base: str, staleness: int, pair: str | None = None, lookahead: bool = False,
    sums_only: bool = False,
) -> BenchConfig:  # fmt: skip
    name = base if workload == "dlrm" else f"seq_{base}"
    sync = "exact" if staleness == 1 else f"replicas synced and cache bounds of {staleness} steps"
    if pair is not None:
        sync += f", TorchRec's quantized comms {pair} on every sharder"
    if lookahead:
        sync += ", row-replicated bags looking one batch ahead"
    params = {"sharding": "planner+torchrec_het", "replica_sync_every": staleness}
    if pair is not None:
        params["qcomms"] = pair
    if lookahead:
        params["lookahead"] = True
    if sums_only:
        sync += ", row-replicated cold ids as partial sums only (no fetched rows)"
        params["cold_rows"] = False
    return BenchConfig(
        name=name,
        stock=False,
        description=f"{workload}: the planner chooses each table's type, the plugin's included ({sync})",
        make_sharders=lambda: [],
        make_constraints=lambda tables, preset: None,
        applies=(lambda preset: preset.sequence is not None) if workload == "sequence" else (lambda preset: True),
        workload=workload,
        params=params,
        make_sharders_for=_make_sharders(staleness, pair, lookahead, sums_only),
        make_planner_for=_make_planner(staleness),
    )

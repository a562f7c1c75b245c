"""The planner components: the plugin's types enumerated, sized, priced, constrained and printed.

Golden plans on fake topologies (2 ranks, 8 ranks on one host, 2 hosts x 4) of a small
model whose reads follow Zipf(1.1); no process group is needed (``plan``, not
``collective_plan``). The evidence rule: the plugin's types are offered only for tables a
profile names (or whose constraints name the type); without a profile the plan is stock.
These plans price the plugin's types by their bytes alone (``ComputeCosts.bytes_only()``,
``BYTES_ONLY`` below); with the lookups' measured compute they are in test_compute_pricing.py.
"""

import logging
import math

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.plan_options import ReplicaOptions, options_of
from torchrec_het.planner import (
    AccessModel,
    HetEmbeddingEnumerator,
    HetEmbeddingShardingPlanner,
    HetEmbeddingStats,
    PluginPricing,
    ProfileTiers,
    zipf_shares,
)
from torchrec_het.planner.access import tier_topology
from torchrec_het.planner.compute_costs import ComputeCosts
from torchrec_het.planner.planner import cpu_network
from torchrec_het.planner.step_model import Compute
from torchrec_het.planner.traffic import TableLoad, row_replicated_bytes, row_wise_bytes, table_wise_bytes
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.hot_rows import hot_row_count, replication_threshold
from torchrec_het.replication.memory import ROUTE_MAP_BYTES_PER_ROW, TierTopology, bytes_per_row
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder

SIZES = {"tiny": 40, "small": 2000, "mid": 100_000, "big": 1_000_000, "cold": 300_000}
MEASURED = [n for n in SIZES if n != "cold"]  # "cold" is not in the profile
BATCH = 512
MB = 2**20
PLUGIN = {"het_row_replicated", "het_cached_row_wise"}
BYTES_ONLY = ComputeCosts.bytes_only()
BYTES_ALONE = Compute(lookup_s_per_id=0.0, dense_s_per_sample=0.0)  # stated: no lookup or dense compute
CPU_LIKE = Compute(lookup_s_per_id=2e-7, dense_s_per_sample=2e-5)  # stated: this machine's order of magnitude


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=32, num_embeddings=rows)
        for n, rows in SIZES.items()
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _profile(tables: list[str] = MEASURED) -> AccessProfile:
    """10 batches of one rank, BATCH one-hot reads each, Zipf(1.1) over each table's rows."""
    counts = tuple((zipf_shares(SIZES[n], 1.1) * BATCH * 10).floor().long() for n in tables)
    return AccessProfile(tuple(tables), tuple(SIZES[n] for n in tables), counts, 10)


def _pricing(**kwargs) -> PluginPricing:
    return PluginPricing(AccessModel(_profile()), **{"compute": BYTES_ONLY, **kwargs})


def _plan(world_size: int, local_world_size: int, constraints=None, sharder=None, bandwidth=None, pricing=None) -> dict:
    extra = {} if bandwidth is None else {"intra_host_bw": bandwidth, "inter_host_bw": bandwidth / 8}
    topology = Topology(world_size=world_size, local_world_size=local_world_size, compute_device="cpu", **extra)
    pricing = pricing if pricing is not None else _pricing()
    planner = HetEmbeddingShardingPlanner(
        topology=topology, batch_size=BATCH, constraints=constraints, pricing=pricing, compute=BYTES_ALONE
    )
    plan = planner.plan(_ebc(), [sharder or HetEmbeddingBagCollectionSharder()]).plan[""]
    return {name: _entry(p, world_size) for name, p in plan.items()}


def _entry(sharding, world_size: int) -> tuple:
    """(type, ranks or "all"), and "rows" for a het_row_replicated table whose cold ids fetch rows."""
    entry = (sharding.sharding_type, sharding.ranks if len(sharding.ranks) < world_size else "all")
    return entry + ("rows",) if getattr(options_of(sharding), "cold_rows", False) else entry


# --- golden plans -------------------------------------------------------------------------

HR_ALL, DP_ALL = ("het_row_replicated", "all"), ("data_parallel", "all")
HR_ROWS = HR_ALL + ("rows",)  # het_row_replicated, its cold ids fetching rows
HC_ALL = ("het_cached_row_wise", "all")

# a profile of every table: the plugin's types where the step model prices them cheaper and the
# whole plan beats TorchRec's by more than the model's error. By bytes alone (these plans state no
# compute; the 40-row table's all-reduce is cheapest replicated whole) fetching each distinct remote
# row a rank reads once often wins over a partial per bag and server, and replicas synced every step
# cost more than fetching their rows on one host: the exact HET cache, which runs as row
# replication's fetched-rows tier with no hot rows. Between hosts the replicas' partial sums win.
GOLDEN_PROFILED = {
    (2, 2): {"tiny": DP_ALL, "small": HC_ALL, "mid": HC_ALL, "big": HC_ALL, "cold": HC_ALL},
    (8, 8): {"tiny": DP_ALL, "small": HC_ALL, "mid": HC_ALL, "big": HC_ALL, "cold": HC_ALL},
    (8, 4): {"tiny": DP_ALL, "small": HR_ALL, "mid": HR_ALL, "big": HR_ALL, "cold": HR_ALL},
}

# a profile without "cold": TorchRec's types for it (its table_wise shard on one rank then
# outweighs spreading the others on 8 ranks)
GOLDEN_PARTIAL = {
    (2, 2): {"tiny": DP_ALL, "small": HC_ALL, "mid": HC_ALL, "big": ("table_wise", [0]), "cold": ("table_wise", [1])},
    (8, 8): {"tiny": ("table_wise", [4]), "small": ("table_wise", [3]), "mid": ("table_wise", [2]),
             "big": ("table_wise", [0]), "cold": ("table_wise", [1])},
    (8, 4): {"tiny": ("table_wise", [2]), "small": ("table_wise", [5]), "mid": ("table_wise", [1]),
             "big": ("table_wise", [0]), "cold": ("table_wise", [4])},
}  # fmt: skip

# no profile: TorchRec's types only, whatever the topology
GOLDEN_NO_PROFILE = {
    (2, 2): {"tiny": DP_ALL, "small": ("table_wise", [1]), "mid": ("table_wise", [0]),
             "big": ("table_wise", [0]), "cold": ("table_wise", [1])},
    (8, 8): {"tiny": ("table_wise", [4]), "small": ("table_wise", [3]), "mid": ("table_wise", [2]),
             "big": ("table_wise", [0]), "cold": ("table_wise", [1])},
    (8, 4): {"tiny": ("table_wise", [2]), "small": ("table_wise", [5]), "mid": ("table_wise", [1]),
             "big": ("table_wise", [0]), "cold": ("table_wise", [4])},
}  # fmt: skip

TOPOLOGIES = sorted(GOLDEN_PROFILED)


def test_the_planner_chooses_fetched_cold_rows_only_where_the_sharder_leaves_it_the_choice() -> None:
    """Among row-replicated options, pinned to partial sums (``ReplicationConfig(cold_rows=frozenset())``),
    no table fetches rows where the planner, left the choice, fetches them for every table; pinned
    to fetched rows for one table, that table fetches them whatever they cost."""
    pricing = PluginPricing(AccessModel(_profile(list(SIZES))), compute=BYTES_ONLY)
    replicated = {name: ParameterConstraints(sharding_types=["het_row_replicated"]) for name in SIZES}
    chosen = _plan(2, 2, replicated, bandwidth=2e6, pricing=pricing)
    assert {name for name, entry in chosen.items() if entry == HR_ROWS} == set(SIZES)
    sums = HetEmbeddingBagCollectionSharder(replication=ReplicationConfig(cold_rows=frozenset()))
    pinned = _plan(2, 2, replicated, bandwidth=2e6, pricing=pricing, sharder=sums)
    assert not [entry for entry in pinned.values() if "rows" in entry], pinned
    one = HetEmbeddingBagCollectionSharder(replication=ReplicationConfig(cold_rows=frozenset({"big"})))
    constraints = {"big": ParameterConstraints(sharding_types=["het_row_replicated"])}
    assert _plan(2, 2, constraints, one, bandwidth=2e6, pricing=pricing)["big"] == HR_ROWS


@pytest.mark.parametrize("world_size,local_world_size", TOPOLOGIES, ids=lambda v: str(v))
def test_golden_plans_with_a_profile_of_every_table(world_size: int, local_world_size: int) -> None:
    pricing = PluginPricing(AccessModel(_profile(list(SIZES))), compute=BYTES_ONLY)
    plan = _plan(world_size, local_world_size, bandwidth=2e6, pricing=pricing)
    assert plan == GOLDEN_PROFILED[(world_size, local_world_size)]


@pytest.mark.parametrize("world_size,local_world_size", TOPOLOGIES, ids=lambda v: str(v))
def test_golden_plans_give_plugin_types_only_to_profiled_tables(world_size: int, local_world_size: int) -> None:
    plan = _plan(world_size, local_world_size, bandwidth=2e6)
    assert plan == GOLDEN_PARTIAL[(world_size, local_world_size)]
    assert plan["cold"][0] not in PLUGIN


@pytest.mark.parametrize("world_size,local_world_size", TOPOLOGIES, ids=lambda v: str(v))
@pytest.mark.parametrize("online_profile_steps", [0, 5])
def test_golden_plans_without_a_profile_are_stock(
    world_size: int, local_world_size: int, online_profile_steps: int
) -> None:
    """No evidence, no plugin type: the plan is the one TorchRec's own types give (online counting
    comes after planning, so it is no evidence)."""
    pricing = PluginPricing(online_profile_steps=online_profile_steps)
    plan = _plan(world_size, local_world_size, bandwidth=2e6, pricing=pricing)
    assert plan == GOLDEN_NO_PROFILE[(world_size, local_world_size)]
    stock = _plan(world_size, local_world_size, bandwidth=2e6, sharder=_StockTypesOnly())
    assert plan == stock


class _StockTypesOnly(HetEmbeddingBagCollectionSharder):
    """The plugin's sharder less the plugin's types: what TorchRec's own types plan."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [t for t in super().sharding_types(compute_device_type) if t not in PLUGIN]


def test_a_stated_skew_offers_the_cache_for_every_table() -> None:
    """``AccessModel(alpha=...)``: the user vouches for a skew; the cache is offered (and chosen here)
    for every table, row replication only where a profile or online counting names hot rows."""
    options = _options(pricing=PluginPricing(AccessModel(alpha=1.05)))
    assert {n for n, t in options if t == "het_cached_row_wise"} == set(SIZES)
    assert not {n for n, t in options if t == "het_row_replicated"}
    online = _options(pricing=PluginPricing(AccessModel(alpha=1.05), online_profile_steps=5))
    assert {n for n, t in online if t == "het_row_replicated"} == set(SIZES)


def test_stock_sharders_get_stock_plans_from_the_same_planner() -> None:
    plan = _plan(2, 2, sharder=EmbeddingBagCollectionSharder())
    assert {t for t, _ in plan.values()} <= {"table_wise", "data_parallel", "column_wise", "table_column_wise"}


# --- sizes, storage, perf -----------------------------------------------------------------


def _options(world_size: int = 4, pricing: PluginPricing | None = None, constraints=None, sharder=None) -> dict:
    topology = Topology(world_size=world_size, local_world_size=world_size, compute_device="cpu")
    enumerator = HetEmbeddingEnumerator(topology, BATCH, constraints=constraints, pricing=pricing or _pricing())
    out: dict = {}
    for option in enumerator.enumerate(_ebc(), [sharder or HetEmbeddingBagCollectionSharder()]):
        out[(option.name, option.sharding_type)] = option
    return out


def test_plugin_options_are_sized_as_row_wise_and_hold_their_hot_rows_on_top() -> None:
    options = _options()
    for name in MEASURED:
        rw, rep = options[(name, "row_wise")], options[(name, "het_row_replicated")]
        assert [s.size for s in rep.shards] == [s.size for s in rw.shards]
        assert [s.offset for s in rep.shards] == [s.offset for s in rw.shards]
        assert rep.partition_by == "uniform"
        reads = AccessModel(_profile()).reads(name, SIZES[name], 0.0, 4).reads
        hot = hot_row_count(reads, replication_threshold(4), 0.5)
        extra = hot * bytes_per_row(32, "exact_row_wise_adagrad") + SIZES[name] * ROUTE_MAP_BYTES_PER_ROW  # + route map
        for shard_rw, shard_rep in zip(rw.shards, rep.shards):
            assert shard_rep.storage.ddr - shard_rw.storage.ddr == extra, name
        cached = options[(name, "het_cached_row_wise")]
        # the default cache is exact (both bounds 0): it holds no row, so no slot is priced
        assert cached.shards[0].storage.ddr == rw.shards[0].storage.ddr, name
    bounded = _options(sharder=HetEmbeddingBagCollectionSharder(cache=HetCacheConfig(CacheSettings(s_read=1))))
    for name in MEASURED:
        slots = int(0.1 * SIZES[name]) * bytes_per_row(32, "exact_row_wise_adagrad")  # default capacity: 10% of rows
        cached, rw = bounded[(name, "het_cached_row_wise")], bounded[(name, "row_wise")]
        assert cached.shards[0].storage.ddr - rw.shards[0].storage.ddr == slots, name
    assert ("cold", "row_wise") in options
    assert not {("cold", t) for t in PLUGIN} & set(options)  # no profile of the table: no plugin type


def test_constraints_that_name_a_plugin_type_offer_it_without_a_profile() -> None:
    """The user's choice stands: het_cached_row_wise named for an unprofiled table is offered, priced
    as uniform reads (no skew assumed); the other unprofiled tables get TorchRec's types."""
    constraints = {"cold": ParameterConstraints(sharding_types=["row_wise", "het_cached_row_wise"])}
    options = _options(pricing=PluginPricing(), constraints=constraints)
    assert {(n, t) for n, t in options if t in PLUGIN} == {("cold", "het_cached_row_wise")}
    uniform = AccessModel().reads("cold", SIZES["cold"], 100.0, 4).reads
    assert torch.allclose(uniform, torch.full_like(uniform, 100.0 / SIZES["cold"]))


def test_replicated_options_are_priced_below_row_wise_communication() -> None:
    options = _options()
    for name in ("mid", "big"):
        rw = options[(name, "row_wise")].shards[0].perf
        rep = options[(name, "het_row_replicated")].shards[0].perf
        assert rep.fwd_comms + rep.bwd_comms < rw.fwd_comms + rw.bwd_comms, name
        assert rep.fwd_compute == rw.fwd_compute  # the lookup work is row_wise's


def test_traffic_model_matches_the_measured_default_preset() -> None:
    """Default preset, 2 ranks, 26 one-hot tables of dim 64, 1024 samples per rank: the benchmark
    measured 13.30 MiB per step for table_wise and 26.41 for row_wise (README)."""
    loads = [TableLoad(torch.full((1,), 2048.0), 2048.0, 64, 2)] * 26
    assert sum(table_wise_bytes(load).total for load in loads) / MB == pytest.approx(13.30, rel=0.02)
    assert sum(row_wise_bytes(load).total for load in loads) / MB == pytest.approx(26.41, rel=0.02)


def test_more_hot_rows_mean_fewer_cold_bytes() -> None:
    load = TableLoad(zipf_shares(100_000, 1.1) * 2048, 2048.0, 64, 2)
    none, some = row_replicated_bytes(load, 0), row_replicated_bytes(load, 1000)
    assert some.forward < none.forward and some.sync > 0 == none.sync
    assert row_replicated_bytes(load, 1000, sync_every=10).sync < some.sync


def test_profile_tiers_pick_the_rows_the_planner_priced() -> None:
    tiers = ProfileTiers(_profile(), world_size=4).tables
    for name in MEASURED:
        reads = AccessModel(_profile()).reads(name, SIZES[name], 0.0, 4)
        hot = hot_row_count(reads.reads, replication_threshold(4), 0.5)
        assert tiers[name].replicated.numel() == hot
        assert torch.equal(tiers[name].replicated, torch.sort(reads.rows[:hot]).values)
    assert tiers["small"].replicated[:3].tolist() == [0, 1, 2]  # Zipf: the lowest ids are hottest


# (replicated, per-host) rows of the profile's tables on 2 hosts x 2 ranks: the rows read at least
# once per rank a step are replicated (the same count at 4 and 8 ranks: reads per step grow with the
# ranks), and the next ones that are cheaper held once per host than sharded get the per-host tier
# (with the link between hosts 10x slower than within, or at gloo's CPU speeds: 2 GB/s within, 10
# Gbit/s between); on one host, none
GOLDEN_HOST_TIERS = {
    (4, 2, 2e6, 2e5): {"tiny": (20, 0), "small": (57, 411), "mid": (46, 334), "big": (43, 309)},
    (4, 2, None, None): {"tiny": (20, 0), "small": (57, 51), "mid": (46, 42), "big": (43, 38)},
    (4, 4, 2e6, 2e5): {"tiny": (20, 0), "small": (57, 0), "mid": (46, 0), "big": (43, 0)},
    (8, 4, 2e6, 2.5e5): {"tiny": (20, 0), "small": (57, 411), "mid": (46, 334), "big": (43, 309)},
}


def _topology(world_size: int, local_world_size: int, intra=None, inter=None) -> Topology:
    bandwidths = {} if intra is None else {"intra_host_bw": intra, "inter_host_bw": inter}
    return Topology(world_size=world_size, local_world_size=local_world_size, compute_device="cpu", **bandwidths)


@pytest.mark.parametrize("key", sorted(GOLDEN_HOST_TIERS, key=str), ids=str)
def test_profile_tiers_take_the_per_host_tier_the_planner_priced(key) -> None:
    """ProfileTiers given the planner's topology builds the tiers the planner priced: its storage
    holds the per-host rows as (hosts - 1) / world_size of a row per rank, and the per-host rows
    and the hierarchical sync are priced below the same table's row_wise communication."""
    world_size, local, intra, inter = key
    topology = _topology(*key)
    tiers = ProfileTiers(_profile(), replica_sync_every=1, topology=topology).tables
    assert {n: (tiers[n].replicated.numel(), tiers[n].per_host.numel()) for n in MEASURED} == GOLDEN_HOST_TIERS[key]
    pricing = _pricing()
    options = HetEmbeddingEnumerator(cpu_network(topology), BATCH, pricing=pricing).enumerate(
        _ebc(), [HetEmbeddingBagCollectionSharder()]
    )
    by_key = {(o.name, o.sharding_type): o for o in options}
    hosts = world_size // local
    for name in MEASURED:
        rep, rw = by_key[(name, "het_row_replicated")], by_key[(name, "row_wise")]
        hot, host = GOLDEN_HOST_TIERS[key][name]
        extra = (hot + math.ceil(host * (hosts - 1) / world_size)) * bytes_per_row(32, "exact_row_wise_adagrad")
        extra += SIZES[name] * ROUTE_MAP_BYTES_PER_ROW
        assert rep.shards[0].storage.ddr == rw.shards[0].storage.ddr + extra, name
        rep_comms = rep.shards[0].perf.fwd_comms + rep.shards[0].perf.bwd_comms
        assert rep_comms < rw.shards[0].perf.fwd_comms + rw.shards[0].perf.bwd_comms, name
    assert torch.equal(tiers["small"].per_host, ProfileTiers(_profile(), topology=topology).tables["small"].per_host)
    if tiers["small"].per_host.numel():  # the per-host rows are the next hottest after the replicated ones
        reads = AccessModel(_profile()).reads("small", SIZES["small"], 0.0, world_size)
        both = torch.sort(torch.cat([tiers["small"].replicated, tiers["small"].per_host])).values
        assert torch.equal(both, torch.sort(reads.rows[: both.numel()]).values)


def test_the_per_host_tier_lowers_the_price_and_install_does_not_price_it() -> None:
    """On 2 hosts x 2 with a slow link, pricing the per-host tier lowers het_row_replicated's
    communication; with ``per_host_tier=False`` (what ``install()`` prices: its tiers know no
    topology) the table is priced with replicated rows only, as the sharders then build it."""
    topology = cpu_network(_topology(4, 2, 2e6, 2e5))

    def comms(pricing: PluginPricing) -> float:
        options = HetEmbeddingEnumerator(topology, BATCH, pricing=pricing).enumerate(
            _ebc(), [HetEmbeddingBagCollectionSharder()]
        )
        rep = next(o for o in options if (o.name, o.sharding_type) == ("mid", "het_row_replicated"))
        return rep.shards[0].perf.fwd_comms + rep.shards[0].perf.bwd_comms

    assert comms(_pricing()) < comms(_pricing(per_host_tier=False))
    flat = _pricing(per_host_tier=False)
    load = flat.load(_options()[("mid", "het_row_replicated")], 4, tier_topology(topology))
    unnamed = ReplicaOptions()  # the default sharder names no tier sizes: the planner estimates them
    assert flat.host_rows(load, unnamed, "mid") == 0 and _pricing().host_rows(load, unnamed, "mid") == 334
    assert _pricing().host_rows(load, unnamed, "cold") == 0  # not profiled: hot rows counted online are replicated


def test_hierarchical_sync_sends_one_copy_per_host_between_hosts() -> None:
    """The replicated rows' sync on 2 hosts x 2 (every one of the 1,000 rows is touched: one dense
    all-reduce of dim + 1 floats a row): flat, 2 (ws - 1) copies of it; hierarchical, an all-reduce
    and a broadcast within each host and one copy of each host's rows (and a bit mask, and a
    count) between the 2 leaders; on one host nothing is marked within-host."""
    reads = torch.cat(
        [torch.full((1000,), 20.0, dtype=torch.float64), torch.full((99_000,), 0.01, dtype=torch.float64)]
    )
    flat = row_replicated_bytes(TableLoad(reads, 2048.0, 64, 4), 1000)
    hier = row_replicated_bytes(TableLoad(reads, 2048.0, 64, 4, TierTopology(4, 2, 2e9, 2e8)), 1000)
    row = 65 * 4
    assert flat.sync == pytest.approx(2 * 3 * 1000 * row) and flat.intra_backward == 0.0
    assert hier.sync - hier.intra_backward == pytest.approx(2 * (125 + 1000 * row + 8), rel=1e-4)
    assert hier.intra_backward == pytest.approx(2 * 3 * 1000 * row)
    with_host = row_replicated_bytes(
        TableLoad(reads, 2048.0, 64, 4, TierTopology(4, 2, 2e9, 2e8)), 1000, host_rows=2000
    )
    assert with_host.forward - with_host.intra_forward < hier.forward  # per-host reads stay within hosts


# --- constraints ----------------------------------------------------------------------------


def test_constraints_force_and_forbid_plugin_types_per_table() -> None:
    constraints = {
        "mid": ParameterConstraints(sharding_types=["het_cached_row_wise"]),
        "big": ParameterConstraints(sharding_types=["table_wise", "row_wise"]),  # no plugin type
        "small": ParameterConstraints(sharding_types=["het_row_replicated"]),
    }
    plan = _plan(2, 2, constraints=constraints)
    assert plan["mid"][0] == "het_cached_row_wise"
    assert plan["big"][0] in ("table_wise", "row_wise")
    assert plan["small"][0] == "het_row_replicated"


def test_forcing_row_replication_on_an_unprofiled_table_names_it() -> None:
    with pytest.raises(ValueError, match="'cold'.*het_row_replicated needs measured"):
        _plan(2, 2, constraints={"cold": ParameterConstraints(sharding_types=["het_row_replicated"])})


def test_forcing_row_replication_without_a_profile_works_with_online_counting() -> None:
    forced = {"cold": ParameterConstraints(sharding_types=["het_row_replicated"])}
    plan = _plan(2, 2, constraints=forced, pricing=PluginPricing(online_profile_steps=5))
    assert plan["cold"][0] == "het_row_replicated"
    assert not {t for n, (t, _) in plan.items() if n != "cold"} & PLUGIN


@pytest.mark.parametrize("profile,message", [
    (AccessProfile(("other",), (10,), (torch.ones(10, dtype=torch.int64),), 1), r"names none of the model's tables: it has \['other'\]"),
    (AccessProfile(("tiny",), (40,), (torch.zeros(40, dtype=torch.int64),), 0), r"is empty \(0 batches, 1 tables, 0 reads\)"),
    (AccessProfile((), (), (), 3), r"is empty \(3 batches, 0 tables, 0 reads\)"),
])  # fmt: skip
def test_a_profile_that_names_no_table_of_the_model_or_is_empty_names_the_path_and_the_tables(profile, message) -> None:
    pricing = PluginPricing(AccessModel(profile, source="/data/p.pt"))
    with pytest.raises(ValueError, match=message) as raised:
        _plan(2, 2, pricing=pricing)
    assert "'/data/p.pt'" in str(raised.value) and "'big', 'cold', 'mid', 'small', 'tiny'" in str(raised.value)


def test_stock_enumerator_still_rejects_the_plugin_types() -> None:
    """Why the plugin needs its own enumerator (and nothing of TorchRec is changed by importing it)."""
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    with pytest.raises(ValueError):
        EmbeddingEnumerator(topology, BATCH).enumerate(_ebc(), [HetEmbeddingBagCollectionSharder()])


# --- stats ----------------------------------------------------------------------------------


def test_stats_print_the_plugin_types(caplog) -> None:
    caplog.set_level(logging.INFO)
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    forced = {  # "cold": no profile of it: forced
        "cold": ParameterConstraints(sharding_types=["het_cached_row_wise"]),
        "small": ParameterConstraints(sharding_types=["het_row_replicated"]),
    }
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=BATCH,
        constraints=forced,
        enumerator=HetEmbeddingEnumerator(topology, BATCH, constraints=forced, pricing=_pricing()),
        stats=HetEmbeddingStats(),
    )
    planner.plan(_ebc(), [HetEmbeddingBagCollectionSharder()])
    text = caplog.text
    assert "HR: " in text and "HC: " in text, text[-3000:]
    assert "HR = het_row_replicated" in text and "HC = het_cached_row_wise" in text


def test_cpu_topologies_with_torchrec_default_bandwidths_are_priced_at_gloo_speeds() -> None:
    from torchrec_het.planner.planner import CPU_INTER_HOST_BW, CPU_INTRA_HOST_BW, cpu_network

    default = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    priced = cpu_network(default).comms_bandwidths
    assert (priced.intra_host_bw, priced.inter_host_bw) == (CPU_INTRA_HOST_BW, CPU_INTER_HOST_BW)
    assert default.comms_bandwidths.intra_host_bw != CPU_INTRA_HOST_BW  # the caller's topology is not changed
    given = Topology(world_size=2, local_world_size=2, compute_device="cpu", intra_host_bw=5e5)
    assert cpu_network(given) is given
    gpu = Topology(world_size=2, local_world_size=2, compute_device="cuda")
    assert cpu_network(gpu) is gpu
    # priced by bytes, at gloo speeds the plugin's types win on 2 ranks (the 40-row table is replicated whole)
    pricing = PluginPricing(AccessModel(_profile(list(SIZES))), compute=BYTES_ONLY)
    assert {t for n, (t, *_) in _plan(2, 2, pricing=pricing).items() if n != "tiny"} <= PLUGIN


def test_stated_link_figures_are_what_the_plugin_types_are_priced_with() -> None:
    from torchrec.distributed.planner.constants import INTRA_NODE_BANDWIDTH

    from torchrec_het.planner.network import GBIT

    pricing = PluginPricing(AccessModel(_profile(list(SIZES))))  # with the lookups' calibrated extra compute
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")

    def planned(link_gbit) -> dict[str, str]:
        planner = HetEmbeddingShardingPlanner(
            topology=topology, batch_size=BATCH, pricing=pricing, link_gbit=link_gbit, compute=CPU_LIKE
        )
        return {
            n: p.sharding_type for n, p in planner.plan(_ebc(), [HetEmbeddingBagCollectionSharder()]).plan[""].items()
        }

    slow, fast = planned((0.5, None)), planned((INTRA_NODE_BANDWIDTH / GBIT, None))
    assert {slow[name] for name in ("mid", "big", "cold")} == {"het_row_replicated"}  # a slow link: bytes matter
    assert not set(fast.values()) & PLUGIN  # NVLink-fast: the lookups' extra compute is not worth it


def test_stated_compute_is_said_to_be_stated_not_measured() -> None:
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    pricing = PluginPricing(AccessModel(_profile(list(SIZES))))
    planner = HetEmbeddingShardingPlanner(
        topology=topology, batch_size=BATCH, pricing=pricing, link_gbit=(1.0, None), compute=CPU_LIKE
    )
    source = planner._cost_inputs(_ebc()).source
    assert "compute (stated): lookup" in source and "measured at plan time" not in source


def test_measured_tables_are_priced_with_the_profiles_ids_per_sample_for_every_type() -> None:
    sizes = {"hist": 5000, "plain": 5000}
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=16, num_embeddings=r)
        for n, r in sizes.items()
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    reads = {"hist": 3.0, "plain": 1.0}  # ids per sample
    counts = tuple(
        torch.cat([torch.full((1024,), int(BATCH * 4 * reads[n] / 1024)), torch.zeros(5000 - 1024, dtype=torch.int64)])
        for n in sizes
    )  # 4 batches of BATCH samples, reads[n] ids each
    profile = AccessProfile(tuple(sizes), tuple(sizes.values()), counts, 4)
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    given = {"plain": ParameterConstraints(pooling_factors=[7.0])}  # the user's own figure wins
    enumerator = HetEmbeddingEnumerator(topology, BATCH, constraints=given, pricing=PluginPricing(AccessModel(profile)))
    for option in enumerator.enumerate(ebc, [HetEmbeddingBagCollectionSharder()]):
        expected = 7.0 if option.name == "plain" else 3.0
        assert option.input_lengths == [pytest.approx(expected, rel=1e-3)], (option.name, option.sharding_type)

"""The planner components: the plugin's types enumerated, sized, priced, constrained and printed.

Golden plans on fake topologies (2 ranks, 8 ranks on one host, 2 hosts x 4) of a small
model whose reads follow Zipf(1.1); no process group is needed (``plan``, not
``collective_plan``).
"""

import logging

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator

from torchrec_het.planner import (
    AccessModel,
    HetEmbeddingEnumerator,
    HetEmbeddingShardingPlanner,
    HetEmbeddingStats,
    PluginPricing,
    ProfileTiers,
    zipf_shares,
)
from torchrec_het.replication.tiers import hot_row_count
from torchrec_het.planner.traffic import TableLoad, row_replicated_bytes, row_wise_bytes, table_wise_bytes
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.replication.tiers import bytes_per_row
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder

SIZES = {"tiny": 40, "small": 2000, "mid": 100_000, "big": 1_000_000, "cold": 300_000}
MEASURED = [n for n in SIZES if n != "cold"]  # "cold" is not in the profile
BATCH = 512
MB = 2**20


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=32, num_embeddings=rows)
        for n, rows in SIZES.items()
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _profile() -> AccessProfile:
    """10 batches of one rank, BATCH one-hot reads each, Zipf(1.1) over each table's rows."""
    counts = tuple((zipf_shares(SIZES[n], 1.1) * BATCH * 10).floor().long() for n in MEASURED)
    return AccessProfile(tuple(MEASURED), tuple(SIZES[n] for n in MEASURED), counts, 10)


def _pricing(**kwargs) -> PluginPricing:
    return PluginPricing(AccessModel(_profile()), **kwargs)


def _plan(world_size: int, local_world_size: int, constraints=None, sharder=None, bandwidth=None) -> dict:
    extra = {} if bandwidth is None else {"intra_host_bw": bandwidth, "inter_host_bw": bandwidth / 8}
    topology = Topology(world_size=world_size, local_world_size=local_world_size, compute_device="cpu", **extra)
    planner = HetEmbeddingShardingPlanner(topology=topology, batch_size=BATCH, constraints=constraints, pricing=_pricing())
    plan = planner.plan(_ebc(), [sharder or HetEmbeddingBagCollectionSharder()]).plan[""]
    return {name: (p.sharding_type, p.ranks if len(p.ranks) < world_size else "all") for name, p in plan.items()}


# --- golden plans -------------------------------------------------------------------------

GOLDEN = {
    (2, 2): {
        "tiny": ("het_row_replicated", "all"),
        "small": ("het_row_replicated", "all"),
        "mid": ("het_row_replicated", "all"),
        "big": ("het_row_replicated", "all"),
        "cold": ("het_cached_row_wise", "all"),
    },
    (8, 8): {
        "tiny": ("data_parallel", "all"),
        "small": ("het_row_replicated", "all"),
        "mid": ("het_row_replicated", "all"),
        "big": ("het_row_replicated", "all"),
        "cold": ("het_cached_row_wise", "all"),
    },
    (8, 4): {
        "tiny": ("data_parallel", "all"),
        "small": ("het_row_replicated", "all"),
        "mid": ("het_row_replicated", "all"),
        "big": ("het_row_replicated", "all"),
        "cold": ("het_cached_row_wise", "all"),
    },
}


@pytest.mark.parametrize("world_size,local_world_size", sorted(GOLDEN), ids=lambda v: str(v))
def test_golden_plans_on_fake_topologies(world_size: int, local_world_size: int) -> None:
    assert _plan(world_size, local_world_size, bandwidth=2e6) == GOLDEN[(world_size, local_world_size)]


def test_stock_sharders_get_stock_plans_from_the_same_planner() -> None:
    plan = _plan(2, 2, sharder=EmbeddingBagCollectionSharder())
    assert {t for t, _ in plan.values()} <= {"table_wise", "data_parallel", "column_wise", "table_column_wise"}


# --- sizes, storage, perf -----------------------------------------------------------------


def _options(world_size: int = 4) -> dict:
    topology = Topology(world_size=world_size, local_world_size=world_size, compute_device="cpu")
    enumerator = HetEmbeddingEnumerator(topology, BATCH, pricing=_pricing())
    out: dict = {}
    for option in enumerator.enumerate(_ebc(), [HetEmbeddingBagCollectionSharder()]):
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
        hot = hot_row_count(reads, 1.0, 0.5)
        extra = hot * bytes_per_row(32, "exact_row_wise_adagrad")
        for shard_rw, shard_rep in zip(rw.shards, rep.shards):
            assert shard_rep.storage.ddr - shard_rw.storage.ddr == extra, name
    cached = options[("cold", "het_cached_row_wise")]
    slots = int(0.1 * SIZES["cold"]) * bytes_per_row(32, "exact_row_wise_adagrad")  # default capacity: 10% of rows
    assert cached.shards[0].storage.ddr - options[("cold", "row_wise")].shards[0].storage.ddr == slots
    assert ("cold", "het_row_replicated") not in options  # no profile of the table: no hot rows to name


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
        hot = hot_row_count(reads.reads, 1.0, 0.5)
        assert tiers[name].replicated.numel() == hot
        assert torch.equal(tiers[name].replicated, torch.sort(reads.rows[:hot]).values)
    assert tiers["small"].replicated[:3].tolist() == [0, 1, 2]  # Zipf: the lowest ids are hottest


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


def test_stock_enumerator_still_rejects_the_plugin_types() -> None:
    """Why the plugin needs its own enumerator (and nothing of TorchRec is changed by importing it)."""
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    with pytest.raises(ValueError):
        EmbeddingEnumerator(topology, BATCH).enumerate(_ebc(), [HetEmbeddingBagCollectionSharder()])


# --- stats ----------------------------------------------------------------------------------


def test_stats_print_the_plugin_types(caplog) -> None:
    caplog.set_level(logging.INFO)
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    planner = EmbeddingShardingPlanner(
        topology=topology, batch_size=BATCH,
        enumerator=HetEmbeddingEnumerator(topology, BATCH, pricing=_pricing()), stats=HetEmbeddingStats(),
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
    # at gloo speeds the plugin's types win on 2 ranks; TorchRec's NVLink figures make communication free
    assert {t for t, _ in _plan(2, 2).values()} <= {"het_row_replicated", "het_cached_row_wise"}


def test_measured_tables_are_priced_with_the_profiles_ids_per_sample_for_every_type() -> None:
    sizes = {"hist": 5000, "plain": 5000}
    tables = [EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=16, num_embeddings=r) for n, r in sizes.items()]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    reads = {"hist": 3.0, "plain": 1.0}  # ids per sample
    counts = tuple(torch.cat([torch.full((1024,), int(BATCH * 4 * reads[n] / 1024)), torch.zeros(5000 - 1024, dtype=torch.int64)])
                   for n in sizes)  # 4 batches of BATCH samples, reads[n] ids each
    profile = AccessProfile(tuple(sizes), tuple(sizes.values()), counts, 4)
    topology = Topology(world_size=2, local_world_size=2, compute_device="cpu")
    given = {"plain": ParameterConstraints(pooling_factors=[7.0])}  # the user's own figure wins
    enumerator = HetEmbeddingEnumerator(topology, BATCH, constraints=given, pricing=PluginPricing(AccessModel(profile)))
    for option in enumerator.enumerate(ebc, [HetEmbeddingBagCollectionSharder()]):
        expected = 7.0 if option.name == "plain" else 3.0
        assert option.input_lengths == [pytest.approx(expected, rel=1e-3)], (option.name, option.sharding_type)

"""Plan options: the frozen per-table settings that ride in the ParameterSharding the planner emits."""

import pickle
from types import SimpleNamespace

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.plan_options import HetParameterSharding, ReplicaOptions, options_of
from torchrec_het.planner import AccessModel, HetEmbeddingShardingPlanner, PluginPricing
from torchrec_het.planner.pricing import priced_options
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.replication.tiers import TableTiers
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het.sharders.defaults import with_profile_tiers
from torchrec_het.sharders.plugin_sharder import plan_hot_rows
from torchrec_het.sharding import het_cached_row_wise, het_row_replicated

ROWS = {"c": 64, "r": 80}
CACHED = CacheSettings(s_read=3, s_write=2, capacity=10, policy="lfu", protocol="lease")


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=8, num_embeddings=r) for n, r in ROWS.items()
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _profile() -> AccessProfile:
    counts = tuple((1000 / torch.arange(1, r + 1, dtype=torch.float64)).long() for r in ROWS.values())
    return AccessProfile(tuple(ROWS), tuple(ROWS.values()), counts, 10)


def _sharder() -> HetEmbeddingBagCollectionSharder:
    replication = with_profile_tiers(ReplicationConfig(replica_sync_every=3), _profile())
    return HetEmbeddingBagCollectionSharder(cache=HetCacheConfig(per_table={"c": CACHED}), replication=replication)


def _planned(sharder) -> dict:
    constraints = {"c": ParameterConstraints(sharding_types=["het_cached_row_wise"]),
                   "r": ParameterConstraints(sharding_types=["het_row_replicated"])}  # fmt: skip
    planner = HetEmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"), batch_size=16, constraints=constraints,
        pricing=PluginPricing(AccessModel(_profile())), link_probe=False,
    )  # fmt: skip
    return planner, planner.plan(_ebc(), [sharder])


def test_the_planner_emits_the_sharders_options_and_prices_them() -> None:
    sharder = _sharder()
    planner, plan = _planned(sharder)
    entries = plan.plan[""]
    assert all(isinstance(p, HetParameterSharding) for p in entries.values())
    assert options_of(entries["c"]) == CACHED
    replica = options_of(entries["r"])
    tiers = sharder._replication.tiers.tables_for(2)["r"]
    assert replica == ReplicaOptions(3, True, None, tiers.replicated.numel(), 0, _profile().fingerprint())
    assert replica.replicated_rows > 0
    for (_, name, sharding_type), options in planner.priced_options.items():
        assert options == options_of(entries[name]) or sharding_type != entries[name].sharding_type
    assert "torchrec_het options" in str(entries) and "sync_every=3 skip_all_hot" in str(entries)
    restored = pickle.loads(pickle.dumps(plan))  # collective_plan broadcasts it pickled
    assert restored.plan[""] == entries and type(restored.plan[""]["r"]) is HetParameterSharding


def test_a_hand_written_plan_carries_options_or_takes_the_sharders() -> None:
    sharder = _sharder()
    plan = construct_module_sharding_plan(
        _ebc(), per_param_sharding={"c": het_cached_row_wise(CacheSettings(s_read=1)), "r": het_row_replicated()},
        world_size=2, local_size=2, device_type="cpu", sharder=sharder,
    )  # fmt: skip
    assert options_of(plan["c"]) == CacheSettings(s_read=1) and options_of(plan["r"]) is None
    filled = sharder.with_table_options(_ebc(), plan, 2)
    assert options_of(filled["c"]) == CacheSettings(s_read=1)  # the plan's, not the sharder's
    assert options_of(filled["r"]) == sharder.table_options(_ebc(), "r", "het_row_replicated", 2)
    with pytest.raises(TypeError, match="het_cached_row_wise takes CacheSettings"):
        het_cached_row_wise(ReplicaOptions())


def test_hot_rows_that_are_not_the_planned_sizes_raise_naming_the_table() -> None:
    sharder = _sharder()
    _, plan = _planned(sharder)
    entries = plan.plan[""]
    rows = dict(ROWS)
    hot = plan_hot_rows(sharder._replication.tiers, entries, rows)
    assert set(hot) == {"r"} and torch.equal(hot["r"][0], sharder._replication.tiers.tables["r"].replicated)
    empty = torch.zeros(0, dtype=torch.int64)
    other = SimpleNamespace(tables={"r": TableTiers("r", ROWS["r"], torch.tensor([0, 1]), empty)})
    with pytest.raises(ValueError, match="table 'r': the plan prices"):
        plan_hot_rows(other, entries, rows)
    with pytest.raises(ValueError, match=r"\['r'\] are planned het_row_replicated"):
        plan_hot_rows(None, entries, rows)


def test_pricing_without_attached_options_uses_the_types_defaults() -> None:
    option = SimpleNamespace(sharding_type="het_cached_row_wise")
    assert priced_options(option) == CacheSettings()
    option.sharding_type = "het_row_replicated"
    assert priced_options(option) == ReplicaOptions()

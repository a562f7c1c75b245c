"""Sharders and configs pickle: TorchRec's test harness and ``mp.spawn`` users send them to child processes.

Every config class and every sharder (with and without settings, with tiers from a profile,
with ``module_type``) survives ``pickle`` with the same settings, offers the same sharding
types and kernels, and plans a module the same way; one spawned 2-rank world shards with
sharders that reached it by pickling.
"""

import copy
import dataclasses
import json
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.planner import Topology
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.planner import AccessModel, HetEmbeddingShardingPlanner, PluginPricing, ProfileTiers
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.memory import TableMemory, TierTopology
from torchrec_het.sharders import (
    HetEmbeddingBagCollection,
    HetEmbeddingBagCollectionSharder,
    HetEmbeddingCollection,
    HetEmbeddingCollectionSharder,
    get_het_sharders,
)
from torchrec_het.sharding import het_cached_row_wise, het_row_replicated
from torchrec_het_testing import pickle_ranks
from torchrec_het_testing.spawn import free_port

DEVICES = ("cpu", "cuda")


def round_trip(obj):
    return pickle.loads(pickle.dumps(obj))


def assert_same(a, b, where: str = "") -> None:
    """``a`` and ``b`` hold the same settings (tensors by value, tier objects field by field)."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, Mapping):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (ProfileTiers, SimpleNamespace)):
        assert_same(vars(a), vars(b), where)
    else:
        assert a == b, (where, a, b)


def tier_plan():
    return pickle_ranks.seq_tiers()


def profile_tiers(read: bool) -> ProfileTiers:
    tiers = ProfileTiers(pickle_ranks.profile(), 2, replica_sync_every=2, max_hot_fraction=0.25)
    if read:
        assert tiers.tables["hot"].replicated.numel() > 0  # computed (and cached) before pickling
    return tiers


CONFIGS: dict[str, Callable[[], object]] = {
    "cache_settings": lambda: CacheSettings(s_read=3, s_write=1, capacity=0.25, policy="lfu", protocol="lease"),
    "het_cache_default": HetCacheConfig,
    "het_cache_per_table": lambda: HetCacheConfig(
        CacheSettings(s_read=1), {"a": CacheSettings(capacity=7), "b": CacheSettings()}
    ),
    "replication_default": ReplicationConfig,
    "replication_options": lambda: ReplicationConfig(
        replica_sync_every=2,
        skip_all_hot=False,
        local_world_size=2,
        online_profile_steps=5,
        online_max_hot_fraction=0.25,
    ),
    "replication_tier_plan": lambda: ReplicationConfig(tiers=tier_plan()),
    "replication_profile_tiers": lambda: ReplicationConfig(tiers=profile_tiers(read=False)),
    "access_profile": pickle_ranks.profile,
    "tier_plan": tier_plan,
    "profile_tiers_unread": lambda: profile_tiers(read=False),
    "profile_tiers_read": lambda: profile_tiers(read=True),
    "tier_topology": lambda: TierTopology(4, 2, 1e9, 1e8),
    "table_memory": lambda: TableMemory("t", 10, 4, 32),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_configs_round_trip(name: str) -> None:
    config = CONFIGS[name]()
    for twin in (round_trip(config), copy.deepcopy(config)):
        assert_same(config, twin, name)
        if isinstance(config, (CacheSettings, HetCacheConfig)) or name in (
            "replication_default",
            "replication_options",
        ):
            assert twin == config


def test_unpickled_profile_tiers_choose_the_same_hot_rows() -> None:
    tiers = profile_tiers(read=False)
    twin = round_trip(tiers)
    assert_same(tiers.tables, twin.tables)
    assert twin.tables["hot"].replicated.tolist() == list(range(5)) + list(range(30, 35))


def test_unpickled_het_cache_config_stays_read_only_and_checked() -> None:
    special = CacheSettings(s_read=4)
    twin = round_trip(HetCacheConfig(per_table={"t1": special}))
    assert twin.for_table("t1") == special and twin.for_table("t0") == CacheSettings()
    with pytest.raises(TypeError):
        twin.per_table["t2"] = special  # still a read-only view
    with pytest.raises(dataclasses.FrozenInstanceError):
        twin.default = special
    with pytest.raises(ValueError, match="unknown table"):
        twin.check_tables(["t0"])


def _bag_settings() -> dict:
    return {
        "cache": HetCacheConfig(CacheSettings(s_read=1), {"t_cached": CacheSettings(s_read=2, capacity=5)}),
        "replication": ReplicationConfig(tiers=profile_tiers(read=False), replica_sync_every=2),
    }


SHARDERS: dict[str, Callable[[], object]] = {
    "bag_default": HetEmbeddingBagCollectionSharder,
    "bag_cache_and_tier_plan": lambda: HetEmbeddingBagCollectionSharder(
        cache=HetCacheConfig(per_table={"t_cached": CacheSettings(s_write=3)}),
        replication=ReplicationConfig(tiers=tier_plan(), replica_sync_every=2),
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
    ),
    "bag_profile_tiers": lambda: HetEmbeddingBagCollectionSharder(**_bag_settings()),
    "bag_module_type": lambda: HetEmbeddingBagCollectionSharder(
        module_type=HetEmbeddingBagCollection, **_bag_settings()
    ),
    "ec_default": HetEmbeddingCollectionSharder,
    "ec_tier_plan": lambda: HetEmbeddingCollectionSharder(replication=ReplicationConfig(tiers=tier_plan())),
    "ec_module_type": pickle_ranks.ec_sharder,
}


def assert_same_sharder(sharder, twin) -> None:
    assert type(twin) is type(sharder) and twin.module_type is sharder.module_type
    for device in DEVICES:
        assert twin.sharding_types(device) == sharder.sharding_types(device)
        for sharding_type in sharder.sharding_types(device):
            assert twin.compute_kernels(sharding_type, device) == sharder.compute_kernels(sharding_type, device)
    assert twin.fused_params == sharder.fused_params and twin.qcomm_codecs_registry == sharder.qcomm_codecs_registry
    for settings in ("_cache", "_replication"):  # what the sharder hands to the modules it shards
        if hasattr(sharder, settings):
            assert_same(getattr(sharder, settings), getattr(twin, settings), settings)


@pytest.mark.parametrize("name", sorted(SHARDERS))
def test_sharders_round_trip(name: str) -> None:
    sharder = SHARDERS[name]()
    assert_same_sharder(sharder, round_trip(sharder))
    assert_same_sharder(sharder, copy.deepcopy(sharder))


def test_get_het_sharders_round_trip() -> None:
    sharders = get_het_sharders(**_bag_settings())
    twins = round_trip(sharders)
    assert [type(s) for s in twins] == [type(s) for s in sharders]
    for sharder, twin in zip(sharders, twins):
        if isinstance(sharder, (HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder)):
            assert_same_sharder(sharder, twin)


BAG_PLAN = {
    "t_cached": het_cached_row_wise(),
    "hot": het_row_replicated(),
    "t_rw": row_wise(),
    "t_tw": table_wise(rank=1),
}


def _bag_module(module_type: type = EmbeddingBagCollection) -> EmbeddingBagCollection:
    rows = {"t_cached": 30, "hot": pickle_ranks.BAG_TABLES["hot"], "t_rw": 20, "t_tw": 10}
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=4, num_embeddings=r) for n, r in rows.items()
    ]
    return module_type(tables=tables, device=torch.device("meta"))


def _seq_module() -> HetEmbeddingCollection:
    tables = [EmbeddingConfig(name="seq", feature_names=["f_seq"], embedding_dim=4, num_embeddings=24)]
    return HetEmbeddingCollection(tables, device=torch.device("meta"))


@pytest.mark.parametrize("name", ["bag_profile_tiers", "bag_module_type", "ec_module_type"])
def test_unpickled_sharder_plans_a_module_the_same_way(name: str) -> None:
    sharder = SHARDERS[name]()
    twin = round_trip(sharder)
    if isinstance(sharder, HetEmbeddingCollectionSharder):
        module, generators = _seq_module(), {"seq": het_row_replicated()}
    else:
        module, generators = _bag_module(sharder.module_type), BAG_PLAN
    plans = [
        construct_module_sharding_plan(
            module, per_param_sharding=generators, local_size=2, world_size=2, device_type="cpu", sharder=s
        )
        for s in (sharder, twin)
    ]
    assert plans[0] == plans[1]
    if isinstance(sharder, HetEmbeddingBagCollectionSharder):  # and the planner, which asks the sharder too
        planner = HetEmbeddingShardingPlanner(
            topology=Topology(world_size=2, compute_device="cpu"),
            pricing=PluginPricing(AccessModel(pickle_ranks.profile())),
        )
        chosen = [planner.plan(module, [s]).plan[""] for s in (sharder, twin)]
        assert {n: p.sharding_type for n, p in chosen[0].items()} == {n: p.sharding_type for n, p in chosen[1].items()}
        assert chosen[0] == chosen[1]


def test_a_spawned_rank_shards_with_pickled_sharders(tmp_path: Path) -> None:
    """``mp.spawn`` pickles its arguments: the ranks shard with what arrived (2 ranks, one step)."""
    world = pickle_ranks.WORLD_SIZE
    sharders = {"bag": pickle_ranks.bag_sharder(), "ec": pickle_ranks.ec_sharder()}
    mp.spawn(pickle_ranks.run_world, args=(sharders, world, free_port(), str(tmp_path)), nprocs=world, join=True)
    results = [json.loads(Path(tmp_path, f"rank{rank}.json").read_text()) for rank in range(world)]
    hot = sharders["bag"]._replication.tiers.tables["hot"].replicated
    for rank, seen in enumerate(results):
        assert seen["bag_sharding_types"] == sharders["bag"].sharding_types("cpu"), rank
        assert seen["bag_cache_settings"] == dataclasses.asdict(pickle_ranks.CACHED), rank
        assert seen["bag_module"] == "HetShardedEmbeddingBagCollection" and seen["bag_cache_tables"] == ["cached"], rank
        assert seen["bag_hot_rows"] == hot.numel() == 10 and seen["bag_replica_nbytes"] > 0, (rank, seen)
        assert (
            seen["ec_module_type"] == "HetEmbeddingCollection" and seen["ec_module"] == "HetShardedEmbeddingCollection"
        )
        assert seen["ec_hot_rows"] == 3 and seen["ec_replica_nbytes"] > 0, (rank, seen)
        assert seen["bag_loss"] > 0 and seen["ec_loss"] > 0, (rank, seen)

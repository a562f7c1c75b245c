"""The plugin's sharders refuse to shard a table planned ``het_row_replicated`` for which they have
no hot rows (it would train with zero replicas), and ``get_het_sharders(profile=...)`` gives them
the profile's (one gloo rank in this process)."""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.sharding_plan import construct_module_sharding_plan

from torchrec_het.replication import AccessProfile, ReplicationConfig
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder, get_het_sharders
from torchrec_het.sharding import het_row_replicated

ROWS = 8


def _bags() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=4, num_embeddings=ROWS) for n in "ab"
        ]
    )


def _sequences() -> EmbeddingCollection:
    return EmbeddingCollection(
        tables=[EmbeddingConfig(name="s", feature_names=["f_s"], embedding_dim=4, num_embeddings=ROWS)]
    )


def _shard(module, sharder, env):
    names = list(sharder.shardable_parameters(module))
    plan = construct_module_sharding_plan(
        module, {n: het_row_replicated() for n in names}, local_size=1, world_size=1, device_type="cpu", sharder=sharder
    )
    return sharder.shard(module, plan, env, torch.device("cpu"))


def _het(sharders: list) -> tuple[HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder]:
    bag = next(s for s in sharders if isinstance(s, HetEmbeddingBagCollectionSharder))
    seq = next(s for s in sharders if isinstance(s, HetEmbeddingCollectionSharder))
    return bag, seq


def test_replicated_tables_without_hot_rows_are_refused_naming_them(one_rank_env) -> None:
    bag, seq = _het(get_het_sharders())
    with pytest.raises(
        ValueError,
        match=r"table\(s\) \['a', 'b'\] are planned het_row_replicated.*zero replicas.*get_het_sharders\(profile=profile\)",
    ):
        _shard(_bags(), bag, one_rank_env)
    with pytest.raises(ValueError, match=r"table\(s\) \['s'\] are planned het_row_replicated"):
        _shard(_sequences(), seq, one_rank_env)


def test_hot_rows_from_the_profile_or_online_counting_are_accepted(one_rank_env) -> None:
    counts = tuple(torch.tensor([5, 5, 0, 0, 0, 0, 0, 1], dtype=torch.int64) for _ in "abs")
    profile = AccessProfile(("a", "b", "s"), (ROWS,) * 3, counts, 1)
    bag, seq = _het(get_het_sharders(profile=profile))
    sharded = _shard(_bags(), bag, one_rank_env)
    hot = sum(int(g.hot.numel()) for lookup in sharded.replicated_lookups() for g in lookup.groups)
    assert hot == 2 * 3  # rows 0, 1 and 7 of each table are read at least once per step
    _shard(_sequences(), seq, one_rank_env)
    online, online_seq = _het(get_het_sharders(replication=ReplicationConfig(online_profile_steps=2)))
    _shard(_bags(), online, one_rank_env)
    _shard(_sequences(), online_seq, one_rank_env)


def test_embedding_collection_sharder_offers_no_data_parallel_on_cpu() -> None:
    # TorchRec 1.8's data-parallel EmbeddingCollection fails its first batch on CPU (one row per
    # bag comes back, not one per id); the planner must not choose it there
    sharder = HetEmbeddingCollectionSharder()
    assert "data_parallel" not in sharder.sharding_types("cpu")
    assert {"row_wise", "table_wise", "het_row_replicated"} <= set(sharder.sharding_types("cpu"))
    assert "data_parallel" in sharder.sharding_types("cuda")

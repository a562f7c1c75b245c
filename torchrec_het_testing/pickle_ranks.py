"""Rank bodies of tests/unit/test_pickle.py: sharders that reached a spawned rank by pickling shard modules.

``mp.spawn`` pickles its ``args``; :func:`run_world` receives the plugin's sharders that way,
shards a small EmbeddingBagCollection (one ``het_cached_row_wise`` and one
``het_row_replicated`` table) and a HetEmbeddingCollection (``het_row_replicated``) with
them, trains one step, and writes what it saw for the test to compare.
"""

import dataclasses

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import LazyAwaitable, ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.planner.access import ProfileTiers
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.replication.tiers import TableTiers, TierPlan
from torchrec_het.sharders import (
    HetEmbeddingBagCollectionSharder,
    HetEmbeddingCollection,
    HetEmbeddingCollectionSharder,
)
from torchrec_het.sharding import het_cached_row_wise, het_row_replicated
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

WORLD_SIZE = 2
BATCH = 4
BAG_TABLES = {"cached": 30, "hot": 40}  # name -> rows; feature f_<name>
SEQ_TABLES = {"seq": 24}
CACHED = CacheSettings(s_read=2, s_write=1, capacity=8, policy="lfu")


def profile() -> AccessProfile:
    """Reads of table ``hot``: rows 0-4 and 30-34 (in both ranks' shards) read every batch."""
    counts = torch.zeros(BAG_TABLES["hot"], dtype=torch.int64)
    counts[0:5] = counts[30:35] = 10
    counts[12] = 1  # read once in 10 batches: cold
    return AccessProfile(("hot",), (BAG_TABLES["hot"],), (counts,), 10)


def seq_tiers() -> TierPlan:
    """Rows 1, 2 (rank 0's shard) and 20 (rank 1's) of table ``seq`` replicated."""
    empty = torch.zeros(0, dtype=torch.int64)
    return TierPlan({"seq": TableTiers("seq", SEQ_TABLES["seq"], torch.tensor([1, 2, 20]), empty)}, 0, 0)


def bag_sharder() -> HetEmbeddingBagCollectionSharder:
    """Cache settings for table ``cached``, hot rows from :func:`profile` (tiers of a whole model)."""
    return HetEmbeddingBagCollectionSharder(
        cache=HetCacheConfig(per_table={"cached": CACHED}),
        replication=ReplicationConfig(tiers=ProfileTiers(profile(), WORLD_SIZE)),
    )


def ec_sharder() -> HetEmbeddingCollectionSharder:
    """Shards HetEmbeddingCollections with :func:`seq_tiers`."""
    return HetEmbeddingCollectionSharder(
        replication=ReplicationConfig(tiers=seq_tiers()), module_type=HetEmbeddingCollection
    )


def _batch(rank: int, names: dict[str, int]) -> KeyedJaggedTensor:
    generator = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 3, (len(names) * BATCH,), generator=generator)
    per_key = lengths.view(len(names), BATCH).sum(1).tolist()
    ids = [torch.randint(0, rows, (n,), generator=generator) for rows, n in zip(names.values(), per_key)]
    return KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in names], values=torch.cat(ids), lengths=lengths)


def _shard(module: torch.nn.Module, sharder: ModuleSharder, generators: dict) -> DistributedModelParallel:
    apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})
    plan = construct_module_sharding_plan(
        module, per_param_sharding=generators, world_size=dist.get_world_size(), device_type="cpu", sharder=sharder
    )
    return DistributedModelParallel(
        module, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def _train_step(model: DistributedModelParallel, features: KeyedJaggedTensor) -> float:
    out = model(features)
    out = out.wait() if isinstance(out, LazyAwaitable) else out
    if isinstance(out, dict):  # an EmbeddingCollection's JaggedTensor per feature
        values = torch.cat([jt.values() for jt in out.values()])
    else:  # an EmbeddingBagCollection's KeyedTensor
        values = out.values()
    loss = (values**2).sum()
    loss.backward()
    return float(loss)


def _hot_rows(model: DistributedModelParallel) -> int:
    return sum(int(g.hot.numel()) for lookup in model.module.replicated_lookups() for g in lookup.groups)


def run_world(rank: int, sharders: dict[str, ModuleSharder], world_size: int, port: int, out_dir: str) -> None:
    """Shards with the unpickled ``sharders`` (``bag``, ``ec``) and writes what they built."""
    with gloo_rank(rank, world_size, port):
        bag, ec = sharders["bag"], sharders["ec"]
        configs = [
            EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=4, num_embeddings=rows)
            for n, rows in BAG_TABLES.items()
        ]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        bag_model = _shard(ebc, bag, {"cached": het_cached_row_wise(), "hot": het_row_replicated()})
        bag_loss = _train_step(bag_model, _batch(rank, BAG_TABLES))

        seq_configs = [
            EmbeddingConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=4, num_embeddings=rows)
            for n, rows in SEQ_TABLES.items()
        ]
        seq = HetEmbeddingCollection(seq_configs, device=torch.device("meta"))
        ec_model = _shard(seq, ec, {"seq": het_row_replicated()})
        ec_loss = _train_step(ec_model, _batch(rank, SEQ_TABLES))

        result = {
            "bag_sharder": type(bag).__name__,
            "bag_sharding_types": bag.sharding_types("cpu"),
            "bag_cache_settings": dataclasses.asdict(bag._cache.for_table("cached")),
            "bag_module": type(bag_model.module).__name__,
            "bag_cache_tables": sorted(bag_model.module.cache_stats()),
            "bag_hot_rows": _hot_rows(bag_model),
            "bag_replica_nbytes": bag_model.module.replica_nbytes(),
            "bag_loss": bag_loss,
            "ec_module_type": ec.module_type.__name__,
            "ec_module": type(ec_model.module).__name__,
            "ec_hot_rows": _hot_rows(ec_model),
            "ec_replica_nbytes": ec_model.module.replica_nbytes(),
            "ec_loss": ec_loss,
        }
        del bag_model, ec_model
    write_rank_result(out_dir, rank, result)

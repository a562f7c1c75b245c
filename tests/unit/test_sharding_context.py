"""The plugin's per-batch state travels in TorchRec's sharding context (one gloo rank in this process).

After ``input_dist``, each plugin sharding's entry of ``ctx.sharding_contexts`` is a
``HetShardingContext`` holding the batch its input dist planned (its type's own dataclass) and
the module's ``training``; stock shardings keep TorchRec's context. Nothing rides the KJTs or
the lookups: the lookups get the context as an argument, the output dists as TorchRec's
``sharding_ctx``.
"""

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from torchrec_het._compat import sharded_lookups
from torchrec_het.config import CacheSettings
from torchrec_het.replication import ReplicationConfig
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder
from torchrec_het.sharding import het_cached_row_wise, het_row_replicated
from torchrec_het.sharding.common.context import HetSequenceShardingContext, HetShardingContext
from torchrec_het.sharding.het_cache.batch import CachedBatch
from torchrec_het.sharding.row_replicated.batch import ReplicatedBagBatch, ReplicatedSequenceBatch

ROWS, BATCH = 16, 3
ONLINE = ReplicationConfig(online_profile_steps=2)  # hot rows counted online: no profile needed


def _features(names: list[str], seed: int) -> KeyedJaggedTensor:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 3, (len(names) * BATCH,), generator=generator)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=generator)
    return KeyedJaggedTensor.from_lengths_sync(names, values, lengths.int())


def _shard(module, sharder, generators, env):
    apply_optimizer_in_backward(torch.optim.SGD, module.parameters(), {"lr": 0.1})  # fused kernels
    plan = construct_module_sharding_plan(
        module, generators, local_size=1, world_size=1, device_type="cpu", sharder=sharder
    )
    return sharder.shard(module, plan, env, torch.device("cpu"))


@pytest.fixture(scope="module")
def bags(one_rank_env):
    tables = [EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=4, num_embeddings=ROWS) for n in "hrt"]
    sharder = HetEmbeddingBagCollectionSharder(replication=ONLINE)
    bounded = CacheSettings(s_read=1)  # HET's cache (an exact one is the fetched-rows tier, as "r")
    generators = {"h": het_cached_row_wise(bounded), "r": het_row_replicated(), "t": table_wise(rank=0)}
    return _shard(EmbeddingBagCollection(tables=tables), sharder, generators, one_rank_env)


@pytest.fixture(scope="module")
def sequences(one_rank_env):
    tables = [EmbeddingConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=4, num_embeddings=ROWS) for n in "rt"]
    sharder = HetEmbeddingCollectionSharder(replication=ONLINE)
    generators = {"r": het_row_replicated(), "t": table_wise(rank=0)}
    return _shard(EmbeddingCollection(tables=tables), sharder, generators, one_rank_env)


def _batch_types(ctx) -> list:
    return [type(c.batch) if isinstance(c, HetShardingContext) else type(c) for c in ctx.sharding_contexts]


def test_bag_shardings_get_their_batch_in_the_sharding_context(bags) -> None:
    features = _features(["f_h", "f_r", "f_t"], 0)
    for training in (True, False):
        bags.train(training)
        ctx = bags.create_context()
        kjts = bags.input_dist(ctx, features).wait().wait()
        assert sorted(map(str, _batch_types(ctx))) == sorted(
            map(str, [CachedBatch, ReplicatedBagBatch, EmbeddingShardingContext])
        )
        plugin = [c for c in ctx.sharding_contexts if isinstance(c, HetShardingContext)]
        assert len(plugin) == 2 and all(c.training is training for c in plugin)
        assert all(not name.startswith("_het") for kjt in kjts for name in vars(kjt)), "state set on a KJT"
        with torch.set_grad_enabled(training):
            pooled = bags.compute_and_output_dist(ctx, kjts).wait()
        assert pooled.values().shape == (BATCH, 3 * 4)
        if training:
            pooled.values().sum().backward()
    assert not any(hasattr(lookup, "last_batch") for lookup in sharded_lookups(bags))


def test_prefetch_reaches_the_het_lookup_with_its_batch(bags) -> None:
    bags.train(True)
    ctx = bags.create_context()
    kjts = bags.input_dist(ctx, _features(["f_h", "f_r", "f_t"], 1)).wait().wait()
    before = sum(lookup.prefetched_batches for lookup in bags.het_lookups())
    bags.prefetch(dist_input=kjts, forward_stream=None, ctx=ctx)
    assert sum(lookup.prefetched_batches for lookup in bags.het_lookups()) == before + 1
    bags.compute_and_output_dist(ctx, kjts).wait().values().sum().backward()


def test_a_context_that_skipped_input_dist_is_refused(bags) -> None:
    ctx = bags.create_context()
    kjts = bags.input_dist(bags.create_context(), _features(["f_h", "f_r", "f_t"], 2)).wait().wait()
    ctx.sharding_contexts = [EmbeddingShardingContext() for _ in range(3)]
    with pytest.raises(RuntimeError, match="did not come from this module's input_dist"):
        bags.compute_and_output_dist(ctx, kjts)


def test_sequence_shardings_keep_torchrecs_sequence_context(sequences) -> None:
    features = _features(["f_r", "f_t"], 3)
    ctx = sequences.create_context()
    kjts = sequences.input_dist(ctx, features).wait().wait()
    plugin = [c for c in ctx.sharding_contexts if isinstance(c, HetShardingContext)]
    assert len(plugin) == 1 and isinstance(plugin[0], HetSequenceShardingContext)
    assert isinstance(plugin[0], SequenceShardingContext) and isinstance(plugin[0].batch, ReplicatedSequenceBatch)
    assert plugin[0].features_before_input_dist is not None  # TorchRec's own fields came along
    out = sequences.compute_and_output_dist(ctx, kjts).wait()
    assert out["f_r"].values().shape == (int(features["f_r"].lengths().sum()), 4)
    assert not any(hasattr(lookup, "last_batch") for lookup in sharded_lookups(sequences))

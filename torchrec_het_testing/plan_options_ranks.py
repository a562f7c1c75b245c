"""Rank body of tests/distributed/test_plan_options.py: what the planner priced is what the lookups run with.

Every rank plans with :class:`~torchrec_het.planner.HetEmbeddingShardingPlanner` (``collective_plan``:
rank 0 plans, the plan is broadcast), shards with DistributedModelParallel and trains one step; it
writes the options rank 0 priced, the options its plan entries carry, and the settings its lookups
were built with (cache groups' settings, replica holders' settings and hot rows per table).
"""

import dataclasses

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.types import LazyAwaitable
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.plan_options import options_of
from torchrec_het.planner import AccessModel, HetEmbeddingShardingPlanner, PluginPricing
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het.sharders.defaults import with_profile_tiers
from torchrec_het_testing.settings import qcomms_registry
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

WORLD_SIZE = 2
BATCH = 8
TABLES = {"cached_a": 60, "cached_b": 50, "hot_a": 80, "hot_b": 40}  # name -> rows; feature f_<name>
TYPES = {"cached_a": "het_cached_row_wise", "cached_b": "het_cached_row_wise",
         "hot_a": "het_row_replicated", "hot_b": "het_row_replicated"}  # fmt: skip
CACHED_A = CacheSettings(s_read=2, s_write=1, capacity=12, policy="lfu")
CACHE = HetCacheConfig(default=CacheSettings(capacity=0.25), per_table={"cached_a": CACHED_A})
REPLICATION = ReplicationConfig(replica_sync_every=2, skip_all_hot=False)
QCOMMS = "fp16/bf16"  # TorchRec's quantized comms on the sharder: the replicated tables' payloads take them


def profile() -> AccessProfile:
    """Zipf-like reads of every table over 10 batches: a few rows of each read every batch."""
    counts = []
    for rows in TABLES.values():
        c = (1000 / torch.arange(1, rows + 1, dtype=torch.float64)).long()
        counts.append(c)
    return AccessProfile(tuple(TABLES), tuple(TABLES.values()), tuple(counts), 10)


def _batch(rank: int) -> KeyedJaggedTensor:
    generator = torch.Generator().manual_seed(rank)
    lengths = torch.randint(1, 4, (len(TABLES) * BATCH,), generator=generator)
    per_key = lengths.view(len(TABLES), BATCH).sum(1).tolist()
    ids = [torch.randint(0, rows, (n,), generator=generator) for rows, n in zip(TABLES.values(), per_key)]
    return KeyedJaggedTensor.from_lengths_sync(keys=[f"f_{n}" for n in TABLES], values=torch.cat(ids), lengths=lengths)


def _runs_with(model: DistributedModelParallel) -> dict[str, dict]:
    """Per table: the settings its lookup was built with."""
    runs: dict[str, dict] = {}
    for lookup in model.module.het_lookups():
        for g in lookup.groups:
            for t in g.tables:
                runs[t.name] = dataclasses.asdict(g.settings)
    for lookup in model.module.replicated_lookups():
        replicas = lookup.replicas
        config = replicas.placement.settings
        for g in replicas.groups:
            for i, t in enumerate(g.tables):
                lo, hi = int(g.offsets[i]), int(g.offsets[i + 1])
                runs[t.name] = {
                    "replica_sync_every": config.replica_sync_every, "codecs": replicas.placement.codecs.name,
                    "skip_all_hot": config.skip_all_hot, "replicated_rows": int(((g.hot >= lo) & (g.hot < hi)).sum()),
                }  # fmt: skip
    return runs


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Plans (collectively), shards, trains one step; writes priced, planned and built settings."""
    with gloo_rank(rank, world_size, port):
        configs = [
            EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=4, num_embeddings=rows)
            for n, rows in TABLES.items()
        ]
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
        topology = Topology(world_size=world_size, local_world_size=world_size, compute_device="cpu")
        sharder = HetEmbeddingBagCollectionSharder(
            cache=CACHE,
            replication=with_profile_tiers(REPLICATION, profile(), topology),
            qcomm_codecs_registry=qcomms_registry(QCOMMS),
        )
        constraints = {name: ParameterConstraints(sharding_types=[t]) for name, t in TYPES.items()}
        planner = HetEmbeddingShardingPlanner(
            topology=topology, batch_size=BATCH, constraints=constraints,
            pricing=PluginPricing(AccessModel(profile())), link_probe=False,
        )  # fmt: skip
        plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
        module_plan = plan.plan[""]
        planned = {
            name: {"type": p.sharding_type, "class": type(p).__name__, "options": dataclasses.asdict(options_of(p))}
            for name, p in module_plan.items()
        }
        priced = {
            name: dataclasses.asdict(options)
            for (path, name, sharding_type), options in planner.priced_options.items()
            if path == "" and sharding_type == TYPES[name]
        }
        model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=[sharder])
        out = model(_batch(rank))
        out = out.wait() if isinstance(out, LazyAwaitable) else out
        loss = (out.values() ** 2).sum()
        loss.backward()
        write_rank_result(out_dir, rank, {
            "priced": priced, "planned": planned, "runs": _runs_with(model), "loss": float(loss),
            "printed": str(module_plan),
        })  # fmt: skip

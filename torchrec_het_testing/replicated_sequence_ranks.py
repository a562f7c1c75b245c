"""Rank bodies of tests/distributed/test_row_replicated_sequence.py: what ``het_row_replicated``
for EmbeddingCollection does beyond training as the unsharded model (that is checked by the
generic tests, :mod:`~torchrec_het_testing.equivalence`): held replica gradients applied whole
at the flush, bad batches and settings refused naming the feature or table, and tiers carried by
HetEmbeddingCollections training the same model as tiers given to the sharder.

TorchRec's EmbeddingCollection holds tables of one dimension only, so the model is a
pair of ECs (dims 8 and 4, one table of the dim-4 EC shared by two features), both
sharded by one sharder in one plan.
"""

import dataclasses
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import LazyAwaitable, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import HetEmbeddingCollection, HetEmbeddingCollectionSharder
from torchrec_het.sharding import het_row_replicated
from torchrec_het_testing.replica_state import (
    held_gradients,
    refresh_replicas,
    replica_disagreement,
    replicated_lookups,
    replicated_rows,
)
from torchrec_het_testing.settings import OPTIMIZERS, hot_rows, unchecked_tiers
from torchrec_het_testing.spawn import gloo_rank, write_rank_result
from torchrec_het_testing.weights import full_tables, relative_error, seeded_tables, set_tables

SEED = 3
STEPS = 5

BATCH = 5
MAX_LENGTH = 7  # sequence lengths 0..6
# module, name, features, dim, rows
TABLES = [
    ("ec8", "t0", ["f0"], 8, 50),
    ("ec8", "t2", ["f3"], 8, 101),
    ("ec4", "t1", ["f1", "f2"], 4, 37),
]
MODULES = ("ec8", "ec4")


def table_configs() -> dict[str, list[EmbeddingConfig]]:
    configs: dict[str, list[EmbeddingConfig]] = {m: [] for m in MODULES}
    for module, name, features, dim, rows in TABLES:
        configs[module].append(
            EmbeddingConfig(name=name, feature_names=features, embedding_dim=dim, num_embeddings=rows)
        )
    return configs


def all_configs(configs) -> list[EmbeddingConfig]:
    return [c for m in MODULES for c in configs[m]]


class Pair(nn.Module):
    """Two ECs of different dimensions; ``forward`` takes one batch per EC and returns every feature's JaggedTensor."""

    def __init__(self, ec8: EmbeddingCollection, ec4: EmbeddingCollection) -> None:
        super().__init__()
        self.ec8, self.ec4 = ec8, ec4

    def forward(self, ec8: KeyedJaggedTensor, ec4: KeyedJaggedTensor):
        out8, out4 = self.ec8(ec8), self.ec4(ec4)  # sharded ECs return lazy awaitables
        out8, out4 = (o.wait() if isinstance(o, LazyAwaitable) else o for o in (out8, out4))
        return {**out8, **out4}


def batch(rank: int, step: int, configs) -> dict[str, KeyedJaggedTensor]:
    """Sequences of lengths 0..6 (empty ones included), skewed ids; the same for every run of (rank, step)."""
    generator = torch.Generator().manual_seed(10_000 * rank + step + 7)
    out = {}
    for module in MODULES:
        keys, lengths, values = [], [], []
        for config in configs[module]:
            for feature in config.feature_names:
                n = torch.randint(0, MAX_LENGTH, (BATCH,), generator=generator)
                n[(step + len(keys)) % BATCH] = 0  # an empty sequence in every feature
                ids = (torch.rand(int(n.sum()), generator=generator) ** 3 * config.num_embeddings).long()
                keys.append(feature)
                lengths.append(n)
                values.append(ids)
        out[module] = KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
        )
    return out


def projections(configs) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    return {
        f: torch.randn(c.embedding_dim, 3, generator=generator) for c in all_configs(configs) for f in c.feature_names
    }


def loss_of(out, proj: dict[str, torch.Tensor]) -> torch.Tensor:
    return sum(((out[f].values() @ p) ** 2).sum() for f, p in proj.items())


def _pair(configs, optimizer: str, device: str, carried: ReplicationConfig | None = None) -> Pair:
    """Plain ECs, or HetEmbeddingCollections each carrying the tiers of its own tables from ``carried``."""
    if carried is None:
        ecs = [EmbeddingCollection(configs[m], device=torch.device(device)) for m in MODULES]
    else:
        ecs = [
            HetEmbeddingCollection(configs[m], device=torch.device(device), replication=_own(carried, configs[m]))
            for m in MODULES
        ]
    pair = Pair(*ecs)
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, pair.parameters(), dict(kwargs))  # TorchRec edits the dict it is given
    return pair


def sharded(configs, optimizer: str, replication: ReplicationConfig, carried: bool = False):
    """The pair with every table ``het_row_replicated``, weights set: ``replication`` from the
    modules (HetEmbeddingCollections) if ``carried``, else from the sharder (plain ECs)."""
    pair = _pair(configs, optimizer, "meta", replication if carried else None)
    if carried:
        sharder = HetEmbeddingCollectionSharder(module_type=HetEmbeddingCollection)
    else:
        sharder = HetEmbeddingCollectionSharder(replication=replication)
    plan = {
        m: construct_module_sharding_plan(
            getattr(pair, m),
            per_param_sharding={c.name: het_row_replicated() for c in configs[m]},
            world_size=dist.get_world_size(),
            device_type="cpu",
            sharder=sharder,
        )
        for m in MODULES
    }
    model = DistributedModelParallel(pair, device=torch.device("cpu"), plan=ShardingPlan(plan), sharders=[sharder])
    set_tables(model, seeded_tables(all_configs(configs), SEED))
    return model


def _own(config: ReplicationConfig, tables) -> ReplicationConfig:
    names = {t.name for t in tables}
    own = {n: t for n, t in config.tiers.tables.items() if n in names}
    return dataclasses.replace(config, tiers=SimpleNamespace(tables=own))


def held_replica_gradients(rank: int, world_size: int, lr: float = 0.1) -> dict:
    """``replica_sync_every`` beyond the run (SGD): a rank's replicated rows move only by its own
    steps while training, their gradients are held, and the flush before a state dict applies
    exactly their sum over ranks everywhere."""
    configs = table_configs()
    proj = projections(configs)
    config = ReplicationConfig(tiers=hot_rows(all_configs(configs), 8, stride=4), replica_sync_every=1000)
    rep = sharded(configs, "sgd", config)
    found = replicated_lookups(rep)
    for lookup in found:
        refresh_replicas(lookup)  # replicas take the owners' rows (the first forward would do it)
    before = [replicated_rows(lookup) for lookup in found]
    for step in range(STEPS):
        loss_of(rep(**batch(rank, step, configs)), proj).backward()
    held = [[p.clone() for p in held_gradients(lookup)] for lookup in found]
    own = [  # this rank's own SGD steps on its copy: the rows before, less lr times its held gradients
        relative_error(now, first - lr * mine[:, : g.dim])
        for lookup, start, per_lookup in zip(found, before, held)
        for g, now, first, mine in zip(lookup.groups, replicated_rows(lookup), start, per_lookup)
    ]
    for per_lookup in held:
        for p in per_lookup:
            dist.all_reduce(p)
    rep.state_dict()  # flush: the held sums are applied
    flushed = [  # held gradients are already divided by the world size
        relative_error(end, first - lr * total[:, : g.dim])
        for lookup, per_lookup, start in zip(found, held, before)
        for g, total, first, end in zip(lookup.groups, per_lookup, start, replicated_rows(lookup))
    ]
    return {
        "moved_beyond_own_steps": max(own),
        "flushed_vs_sum": max(flushed),
        "replica_disagreement": replica_disagreement(rep),
        "held_rows": sum(int((p[:, -1] > 0).sum()) for per_lookup in held for p in per_lookup),
    }


def bad_settings(configs) -> dict:
    """Error messages for a tier plan that does not fit a table (carried and from the sharder) and a non-fused plan."""
    messages = {}
    wrong = unchecked_tiers(all_configs(configs), hot=4)
    wrong.tables["t0"].num_rows = 49
    attempts = {
        "wrong_rows/module": lambda: HetEmbeddingCollection(
            configs["ec8"],
            device=torch.device("meta"),
            replication=_own(ReplicationConfig(tiers=wrong), configs["ec8"]),
        ),
        "wrong_rows/sharder": lambda: sharded(configs, "sgd", ReplicationConfig(tiers=wrong)),
        "dense_kernel": lambda: _dense_plan(configs),
    }
    for case, attempt in attempts.items():
        try:
            attempt()
            messages[case] = None
        except ValueError as error:
            messages[case] = str(error)
    return messages


def _dense_plan(configs):
    ec = EmbeddingCollection(configs["ec4"], device=torch.device("meta"))
    sharder = HetEmbeddingCollectionSharder()
    plan = construct_module_sharding_plan(
        ec,
        per_param_sharding={"t1": het_row_replicated()},
        world_size=dist.get_world_size(),
        device_type="cpu",
        sharder=sharder,
    )
    plan["t1"].compute_kernel = "dense"
    return DistributedModelParallel(ec, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder])


def bad_input(rank: int, world_size: int) -> dict:
    """Error messages for batches with an unknown feature or an id beyond its table; weights after them."""
    configs = table_configs()
    proj = projections(configs)
    rep = sharded(configs, "rowwise_adagrad", ReplicationConfig(tiers=hot_rows(all_configs(configs), 4, per_host=2)))
    loss_of(rep(**batch(rank, 0, configs)), proj).backward()
    before = {k: v.local_shards()[0].tensor.clone() for k, v in rep.state_dict().items()}
    good = batch(rank, 1, configs)
    messages = {}
    assert int(good["ec8"].length_per_key()[-1]) > 0  # every rank raises on the same batch
    values = good["ec8"].values().clone()
    values[-1] = 101  # beyond t2 (feature f3, the last key of ec8)
    cases = {
        "bad_id": dict(
            good, ec8=KeyedJaggedTensor(keys=good["ec8"].keys(), values=values, lengths=good["ec8"].lengths())
        ),
        "unknown_feature": dict(
            good, ec4=KeyedJaggedTensor(keys=["f1", "f9"], values=good["ec4"].values(), lengths=good["ec4"].lengths())
        ),
    }
    for case, bad in cases.items():
        try:
            rep(**bad)
            messages[case] = None
        except ValueError as error:
            messages[case] = str(error)
    after = rep.state_dict()
    messages["unchanged"] = all(torch.equal(before[k], after[k].local_shards()[0].tensor) for k in before)
    rep(**good)  # the module still works, and every rank is still in step
    messages["replica_disagreement"] = replica_disagreement(rep)
    messages.update(bad_settings(configs))
    return messages


def carried_route(rank: int) -> dict:
    """The same tiers carried by the modules and given to the sharder, STEPS steps on the same
    batches: the largest difference of the two models' tables, how far they trained, their syncs."""
    configs = table_configs()
    proj = projections(configs)
    replication = ReplicationConfig(tiers=hot_rows(all_configs(configs), 8, stride=4))
    models = {carried: sharded(configs, "rowwise_adagrad", replication, carried) for carried in (False, True)}
    for step in range(STEPS):
        for model in models.values():
            loss_of(model(**batch(rank, step, configs)), proj).backward()
    given, carried = (full_tables(models[c], all_configs(configs)) for c in (False, True))
    start = seeded_tables(all_configs(configs), SEED)
    return {
        "difference": max(relative_error(carried[n], given[n]) for n in given),
        "trained": min(relative_error(given[n], start[n]) for n in given),
        "syncs": [
            sum(
                s["sparse_syncs"] + s["dense_syncs"]
                for s in (m.module.ec8.replication_stats(), m.module.ec4.replication_stats())
            )
            for m in models.values()
        ],
    }


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: held replica gradients, bad batches and settings, the carried tiers; writes ``rank<r>.json``."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {
            "held": held_replica_gradients(rank, world_size),
            "bad_input": bad_input(rank, world_size),
            "carried": carried_route(rank),
        }
    write_rank_result(out_dir, rank, results)

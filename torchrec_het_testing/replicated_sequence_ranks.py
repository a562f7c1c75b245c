"""Rank bodies of tests/distributed/test_row_replicated_sequence.py.

``het_row_replicated`` for EmbeddingCollection against the unsharded EC trained on the
global batch and against stock row_wise (``EmbeddingCollectionSharder``), with and
without hot rows, with the fused optimizers users use; plus a stock table in the same
EC, all-hot steps, held replica gradients, replica agreement and bad batches.

TorchRec's EmbeddingCollection holds tables of one dimension only, so the model is a
pair of ECs (dims 8 and 4, one table of the dim-4 EC shared by two features), both
sharded by one sharder in one plan.
"""

import dataclasses
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import LazyAwaitable, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het_bench.table_init import init_tables_by_row
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import HetEmbeddingCollection, HetEmbeddingCollectionSharder
from torchrec_het.sharding import het_row_replicated
from torchrec_het_testing.het_ranks import OPTIMIZERS, SEED, STEPS, _rel_error, _worst
from torchrec_het_testing.replicated_ranks import _hot_rows, _pending, _refresh, per_host_held, replica_disagreement, tiers
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

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
        configs[module].append(EmbeddingConfig(name=name, feature_names=features, embedding_dim=dim, num_embeddings=rows))
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


def batch(rank: int, step: int, configs, modulo: int | None = None) -> dict[str, KeyedJaggedTensor]:
    """Sequences of lengths 0..6 (empty ones included), skewed ids; the same for every run of (rank, step).

    ``modulo`` folds ids into rows ``[0, modulo)`` (an all-hot batch when those rows are replicated).
    """
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
                values.append(ids % modulo if modulo else ids)
        out[module] = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    return out


def projections(configs) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    return {f: torch.randn(c.embedding_dim, 3, generator=generator) for c in all_configs(configs) for f in c.feature_names}


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


def sharded(
    kind: str,
    configs,
    optimizer: str,
    replication: ReplicationConfig | None = None,
    carried: bool = False,
    stock_tables: tuple[str, ...] = (),
    device: str = "cpu",
):
    """The pair sharded ``rep`` (every table het_row_replicated but ``stock_tables``, which stay
    stock row_wise in the same modules) or ``row_wise`` (stock ``EmbeddingCollectionSharder``),
    weights set, on ``device``. ``rep`` takes ``replication`` from the modules
    (HetEmbeddingCollection) if ``carried``, else from the sharder (plain ECs)."""
    pair = _pair(configs, optimizer, "meta", replication if carried else None)
    if kind == "rep" and carried:
        sharder = HetEmbeddingCollectionSharder(module_type=HetEmbeddingCollection)
    elif kind == "rep":
        sharder = HetEmbeddingCollectionSharder(replication=replication)
    else:
        sharder = EmbeddingCollectionSharder()
    generator = het_row_replicated if kind == "rep" else row_wise
    plan = {
        m: construct_module_sharding_plan(
            getattr(pair, m),
            per_param_sharding={c.name: (row_wise if c.name in stock_tables else generator)() for c in configs[m]},
            world_size=dist.get_world_size(),
            device_type=torch.device(device).type,
            sharder=sharder,
        )
        for m in MODULES
    }
    model = DistributedModelParallel(pair, device=torch.device(device), plan=ShardingPlan(plan), sharders=[sharder])
    init_tables_by_row(model, all_configs(configs), SEED)
    return model


def _own(config: ReplicationConfig, tables) -> ReplicationConfig:
    names = {t.name for t in tables}
    own = {n: t for n, t in config.tiers.tables.items() if n in names}
    return dataclasses.replace(config, tiers=SimpleNamespace(tables=own))


def unsharded(configs, optimizer: str, device: str = "cpu") -> Pair:
    pair = _pair(configs, optimizer, device)
    init_tables_by_row(pair, all_configs(configs), SEED)
    return pair


def lookups(model) -> list:
    return [lookup for m in MODULES for lookup in getattr(model.module, m).replicated_lookups()]


def disagreement(model) -> float:
    """Largest difference between any replica copy and its owner's row, over both ECs."""
    found = lookups(model)
    return replica_disagreement(SimpleNamespace(module=SimpleNamespace(replicated_lookups=lambda: found)))


def stats(model) -> dict[str, int]:
    totals: dict[str, int] = {}
    for m in MODULES:
        for key, value in getattr(model.module, m).replication_stats().items():
            totals[key] = totals.get(key, 0) + value
    return totals


def _local_shard_errors(model, reference: Pair, errors: dict, label: str) -> None:
    full = {key.split(".")[-2]: value.detach() for key, value in reference.state_dict().items()}
    for key, value in model.state_dict().items():
        for shard in value.local_shards():
            row0 = shard.metadata.shard_offsets[0]
            want = full[key.split(".")[-2]][row0 : row0 + shard.tensor.size(0)]
            _worst(errors, label, _rel_error(shard.tensor, want))


def _distinct_remote(model, batches: dict[str, KeyedJaggedTensor], rank: int) -> int:
    """Distinct (table, row) pairs of the batch owned by other ranks: what a no-hot step fetches."""
    count = 0
    for m, lookup in zip(MODULES, lookups(model)):
        by_feature = batches[m].to_dict()
        for g in lookup.groups:
            ids = torch.cat([by_feature[f].values() + g.offsets[t] for f, t in zip(g.features, g.feature_table.tolist())])
            count += int((g.owner_of(torch.unique(ids)) != rank).sum())
    return count


def equivalence(
    rank: int, world_size: int, optimizer: str, hot: int, local_world_size: int | None = None, per_host: int | None = None
) -> dict:
    """Largest relative differences over STEPS steps: outputs every step, local shards at the end."""
    configs = table_configs()
    proj = projections(configs)
    # rows 0, 4, 8, ...: the hottest rows, owned by every rank (per-host rows by the last ones)
    per_host = (3 if hot else 0) if per_host is None else per_host
    tier_plan = tiers(all_configs(configs), hot=hot, per_host=per_host, stride=4)
    config = ReplicationConfig(tiers=tier_plan, local_world_size=local_world_size)
    rep = sharded("rep", configs, optimizer, config, carried=True)
    stock = sharded("row_wise", configs, optimizer) if hot == 0 else None  # the stock comparison: no hot rows
    reference = unsharded(configs, optimizer)
    errors: dict = {"fetched": 0, "distinct_remote": 0}
    for step in range(STEPS):
        batches = [batch(r, step, configs) for r in range(world_size)]
        mine = batches[rank]
        out_rep = rep(**mine)
        ref_outs = [reference(**b) for b in batches]
        errors["distinct_remote"] += _distinct_remote(rep, mine, rank)
        for f in proj:
            assert torch.equal(out_rep[f].lengths(), ref_outs[rank][f].lengths()), f
            _worst(errors, "out_rep_vs_unsharded", _rel_error(out_rep[f].values(), ref_outs[rank][f].values()))
        loss_of(out_rep, proj).backward()
        if stock is not None:
            out_stock = stock(**mine)
            for f in proj:
                _worst(errors, "out_rep_vs_row_wise", _rel_error(out_rep[f].values(), out_stock[f].values()))
                _worst(errors, "out_row_wise_vs_unsharded", _rel_error(out_stock[f].values(), ref_outs[rank][f].values()))
            loss_of(out_stock, proj).backward()
        (sum(loss_of(o, proj) for o in ref_outs) / world_size).backward()  # TorchRec averages over ranks
    _local_shard_errors(rep, reference, errors, "weights_rep_vs_unsharded")
    if stock is not None:
        _local_shard_errors(stock, reference, errors, "weights_row_wise_vs_unsharded")
    errors["fetched"] = sum(lookup.replicas.stats["rows_fetched"] for lookup in lookups(rep))
    errors["replica_disagreement"] = disagreement(rep)
    errors["stats"] = stats(rep)
    errors["per_host_held"] = sum(per_host_held(lookup) for lookup in lookups(rep))
    return errors


def train_against_unsharded(rep, reference, proj, batches_of, rank: int, world_size: int, errors: dict, device="cpu") -> None:
    """STEPS steps: ``rep`` on this rank's batches, the unsharded ``reference`` on every rank's
    (their mean loss: TorchRec averages gradients over ranks); ``batches_of(rank, step)``: a
    rank's batch per EC. Records the largest relative output difference as
    ``out_rep_vs_unsharded`` in ``errors``; AssertionError if sequence lengths differ."""
    for step in range(STEPS):
        batches = [{m: kjt.to(device) for m, kjt in batches_of(r, step).items()} for r in range(world_size)]
        out = rep(**batches[rank])
        ref_outs = [reference(**b) for b in batches]
        for f in proj:
            if not torch.equal(out[f].lengths(), ref_outs[rank][f].lengths()):
                raise AssertionError(f"feature {f!r}: sequence lengths differ from the unsharded EC's")
            _worst(errors, "out_rep_vs_unsharded", _rel_error(out[f].values(), ref_outs[rank][f].values()))
        loss_of(out, proj).backward()
        (sum(loss_of(o, proj) for o in ref_outs) / world_size).backward()


def mixed(rank: int, world_size: int, optimizer: str = "rowwise_adagrad") -> dict:
    """t2 stock row_wise inside the same EC as het_row_replicated t0 (tiers from the sharder, one host:
    per-host rows read from their owners): exact."""
    configs = table_configs()
    proj = projections(configs)
    plan = tiers(all_configs(configs), hot=6, per_host=2, stride=3)
    plan.tables.pop("t2")
    rep = sharded("rep", configs, optimizer, ReplicationConfig(tiers=plan), stock_tables=("t2",))
    reference = unsharded(configs, optimizer)
    errors: dict = {"sharding_types": sorted(rep.module.ec8._sharding_type_to_sharding)}
    train_against_unsharded(rep, reference, proj, lambda r, step: batch(r, step, configs), rank, world_size, errors)
    _local_shard_errors(rep, reference, errors, "weights_rep_vs_unsharded")
    errors["replica_disagreement"] = disagreement(rep)
    return errors


def all_hot(rank: int, world_size: int, optimizer: str = "rowwise_adagrad", hot: int = 12) -> dict:
    """Batches that read replicated rows only: every step skips the cold exchange, training stays exact."""
    configs = table_configs()
    proj = projections(configs)
    rep = sharded("rep", configs, optimizer, ReplicationConfig(tiers=tiers(all_configs(configs), hot=hot)))
    reference = unsharded(configs, optimizer)
    errors: dict = {}
    train_against_unsharded(rep, reference, proj, lambda r, step: batch(r, step, configs, modulo=hot), rank, world_size, errors)
    _local_shard_errors(rep, reference, errors, "weights_rep_vs_unsharded")
    errors["replica_disagreement"] = disagreement(rep)
    errors["stats"] = stats(rep)
    return errors


def held_replica_gradients(rank: int, world_size: int, lr: float = 0.1) -> dict:
    """``replica_sync_every`` beyond the run (SGD): a rank's replicated rows move only by its own
    steps while training, their gradients are held, and the flush before a state dict applies
    exactly their sum over ranks everywhere."""
    configs = table_configs()
    proj = projections(configs)
    config = ReplicationConfig(tiers=tiers(all_configs(configs), hot=8, stride=4), replica_sync_every=1000)
    rep = sharded("rep", configs, "sgd", config)
    found = lookups(rep)
    for lookup in found:
        _refresh(lookup)  # replicas take the owners' rows (the first forward would do it)
    before = [_hot_rows(lookup) for lookup in found]
    for step in range(STEPS):
        loss_of(rep(**batch(rank, step, configs)), proj).backward()
    held = [[p.clone() for p in _pending(lookup)] for lookup in found]
    own = [  # this rank's own SGD steps on its copy: the rows before, less lr times its held gradients
        _rel_error(now, first - lr * mine[:, : g.dim])
        for lookup, start, per_lookup in zip(found, before, held)
        for g, now, first, mine in zip(lookup.groups, _hot_rows(lookup), start, per_lookup)
    ]
    for per_lookup in held:
        for p in per_lookup:
            dist.all_reduce(p)
    rep.state_dict()  # flush: the held sums are applied
    errors = {"moved_beyond_own_steps": max(own), "replica_disagreement": disagreement(rep), "flushed_vs_sum": 0.0}
    for lookup, per_lookup, start in zip(found, held, before):
        for g, total, first, end in zip(lookup.groups, per_lookup, start, _hot_rows(lookup)):
            want = first - lr * total[:, : g.dim]  # held gradients are already divided by the world size
            _worst(errors, "flushed_vs_sum", _rel_error(end, want))
    errors["held_rows"] = sum(int((p[:, -1] > 0).sum()) for per_lookup in held for p in per_lookup)
    return errors


def bad_settings(configs) -> dict:
    """Error messages for a tier plan that does not fit a table (carried and from the sharder) and a non-fused plan."""
    messages = {}
    wrong = tiers(all_configs(configs), hot=4)
    wrong.tables["t0"].num_rows = 49
    attempts = {
        "wrong_rows/module": lambda: HetEmbeddingCollection(
            configs["ec8"], device=torch.device("meta"), replication=_own(ReplicationConfig(tiers=wrong), configs["ec8"])
        ),
        "wrong_rows/sharder": lambda: sharded("rep", configs, "sgd", ReplicationConfig(tiers=wrong)),
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
    rep = sharded("rep", configs, "rowwise_adagrad", ReplicationConfig(tiers=tiers(all_configs(configs), hot=4, per_host=2)))
    loss_of(rep(**batch(rank, 0, configs)), proj).backward()
    before = {k: v.local_shards()[0].tensor.clone() for k, v in rep.state_dict().items()}
    good = batch(rank, 1, configs)
    messages = {}
    assert int(good["ec8"].length_per_key()[-1]) > 0  # every rank raises on the same batch
    values = good["ec8"].values().clone()
    values[-1] = 101  # beyond t2 (feature f3, the last key of ec8)
    cases = {
        "bad_id": dict(good, ec8=KeyedJaggedTensor(keys=good["ec8"].keys(), values=values, lengths=good["ec8"].lengths())),
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
    messages["replica_disagreement"] = disagreement(rep)
    messages.update(bad_settings(configs))
    return messages


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: every optimizer with no hot rows and with both tiers; all-hot steps; bad input."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {}
        for optimizer in OPTIMIZERS:
            results[f"{optimizer}/hot0"] = equivalence(rank, world_size, optimizer, hot=0)
            # one rank per host: per-host rows are held on every host and combined over the holder group
            results[f"{optimizer}/hot8"] = equivalence(rank, world_size, optimizer, hot=8, local_world_size=1)
            # replicated rows only
            results[f"{optimizer}/replicated8"] = equivalence(rank, world_size, optimizer, hot=8, per_host=0)
        results["mixed"] = mixed(rank, world_size)
        results["all_hot"] = all_hot(rank, world_size)
        results["held"] = held_replica_gradients(rank, world_size)
        results["bad_input"] = bad_input(rank, world_size)
    write_rank_result(out_dir, rank, results)

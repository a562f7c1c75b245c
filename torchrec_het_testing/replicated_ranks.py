"""Rank bodies of tests/distributed/test_row_replicated.py: what ``het_row_replicated`` (bags)
does beyond training as the unsharded model (that is checked by the generic tests,
:mod:`~torchrec_het_testing.equivalence`).

``online``
    No tier plan, ``online_profile_steps=3``: row-wise for 3 steps while counting reads, then
    the rows every rank's counts say are read at least once a step get replicas, chosen once.
``online_evaluated``
    The same with an evaluation forward of other rows before every training step: the profile
    does not count them, so the same rows are chosen at the same step.
``held``, ``held_sparse``
    ``replica_sync_every`` beyond the run (SGD): while training, a rank's replicated rows move
    only by its own steps (in its replica blocks), their gradients are held, and the flush before a state dict applies exactly their sum over
    ranks everywhere.
``bad_input``
    Tier plans that do not fit the model and bad batches raise naming the table or feature,
    and leave the weights unchanged.
``carried``
    Tiers carried by a HetEmbeddingBagCollection train the same model as tiers given to the sharder.
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import HetEmbeddingBagCollection
from torchrec_het_testing.bag_models import (
    SEED,
    STEPS,
    batch,
    loss_of,
    projections,
    replicated,
    table_configs,
    unsharded,
)
from torchrec_het_testing.replica_state import (
    held_gradients,
    refresh_replicas,
    replica_disagreement,
    replicated_lookups,
    replicated_rows,
)
from torchrec_het_testing.settings import hot_rows, unchecked_tiers
from torchrec_het_testing.spawn import gloo_rank, write_rank_result
from torchrec_het_testing.weights import full_tables, relative_error, seeded_tables


def online_choice(rank: int, world_size: int, profile_steps: int = 3, evaluate: bool = False) -> dict:
    """Hot rows chosen online: how many every step had, and which ones in the end.

    ``evaluate``: an evaluation forward (``model.eval()``, no grad) of another batch before every
    training step, which the profile must not count."""
    configs = table_configs(False)
    proj = projections(configs)
    rep = replicated(configs, False, "rowwise_adagrad", ReplicationConfig(online_profile_steps=profile_steps))
    hot_after_step = []
    for step in range(profile_steps + 3):
        if evaluate:
            rep.eval()
            with torch.no_grad():
                rep(batch(rank, 1_000 + step, False, configs))
            rep.train()
        out = rep(batch(rank, step, False, configs))
        hot_after_step.append(sum(g.hot.numel() for lookup in replicated_lookups(rep) for g in lookup.groups))
        loss_of(out, proj).backward()
    return {
        "hot_after_step": hot_after_step,
        "hot_rows": [g.hot.tolist() for lookup in replicated_lookups(rep) for g in lookup.groups],
        "stats": rep.module.replication_stats(),
        "replica_disagreement": replica_disagreement(rep),
    }


def held_replica_gradients(rank: int, world_size: int, lr: float = 0.1, hot: int = 8, per_host: int = 0) -> dict:
    """Replicated rows trained with syncs held back to the flush (module docstring)."""
    configs = table_configs(False)
    proj = projections(configs)
    rep = replicated(
        configs, False, "sgd", ReplicationConfig(tiers=hot_rows(configs, hot, per_host), replica_sync_every=1000)
    )
    lookup = replicated_lookups(rep)[0]
    refresh_replicas(lookup)  # replicas take the owners' rows (the first forward would do it)
    before = replicated_rows(lookup)
    for step in range(STEPS):
        loss_of(rep(batch(rank, step, False, configs)), proj).backward()
    held = [p.clone() for p in held_gradients(lookup)]
    moved_beyond_own_steps = max(
        relative_error(now, first - lr * mine[:, : g.dim])
        for g, now, first, mine in zip(lookup.groups, replicated_rows(lookup), before, held)
    )
    for p in held:
        dist.all_reduce(p)
    rep.state_dict()  # flush: the held sums are applied
    flushed = max(
        relative_error(end, start - lr * total[:, : g.dim])  # held gradients are already divided by the world size
        for g, total, start, end in zip(lookup.groups, held, before, replicated_rows(lookup))
    )
    return {
        "moved_beyond_own_steps": moved_beyond_own_steps,
        "flushed_vs_sum": flushed,
        "held_rows": int(sum(int((p[:, -1] > 0).sum()) for p in held)),
        "replica_disagreement": replica_disagreement(rep),
        "stats": rep.module.replication_stats(),
    }


def bad_input(rank: int, world_size: int) -> dict:
    """Error messages for tier plans that do not fit the model and for bad batches; weights after a bad batch."""
    configs = table_configs(False)
    messages = {}
    wrong_rows = unchecked_tiers(configs, hot=4)
    wrong_rows.tables["t1"].num_rows = 36
    unknown = unchecked_tiers(configs, hot=4)
    unknown.tables["t9"] = unknown.tables.pop("t2")
    outside = unchecked_tiers(configs, hot=4)
    outside.tables["t2"].replicated = torch.tensor([3, 101])
    for case, plan in (("wrong_rows", wrong_rows), ("unknown_table", unknown), ("row_outside", outside)):
        for how in ("module", "sharder"):
            try:
                if how == "module":
                    HetEmbeddingBagCollection(
                        configs, replication=ReplicationConfig(tiers=plan), device=torch.device("meta")
                    )
                else:
                    replicated(configs, False, "sgd", ReplicationConfig(tiers=plan))
                messages[f"{case}/{how}"] = None
            except ValueError as error:
                messages[f"{case}/{how}"] = str(error)
    rep = replicated(configs, False, "sgd", ReplicationConfig(tiers=hot_rows(configs, 4)))
    loss_of(rep(batch(rank, 0, False, configs)), projections(configs)).backward()
    before = {k: v.local_shards()[0].tensor.clone() for k, v in rep.state_dict().items()}
    good = batch(rank, 1, False, configs)
    values = good.values().clone()
    values[-1] = 101  # beyond t2 (feature f3, the last key)
    try:
        rep(type(good)(keys=good.keys(), values=values, lengths=good.lengths()))
        messages["bad_id"] = None
    except ValueError as error:
        messages["bad_id"] = str(error)
    after = rep.state_dict()
    messages["unchanged"] = all(torch.equal(before[k], after[k].local_shards()[0].tensor) for k in before)
    messages["replica_disagreement"] = replica_disagreement(rep)
    return messages


def carried_route(rank: int, world_size: int) -> dict:  # noqa: ARG001
    """The same tiers carried by the module and given to the sharder, STEPS steps on the same batches:
    the largest difference of the two models' tables, how far they trained, and their replica syncs."""
    configs = table_configs(True)
    proj = projections(configs)
    replication = ReplicationConfig(tiers=hot_rows(configs, 8))
    models = {
        carried: replicated(configs, True, "rowwise_adagrad", replication, carried=carried) for carried in (False, True)
    }
    for step in range(STEPS):
        for model in models.values():
            loss_of(model(batch(rank, step, True, configs)), proj).backward()
    given, carried = (full_tables(models[c], configs) for c in (False, True))
    start = seeded_tables(configs, SEED)
    stats = {c: m.module.replication_stats() for c, m in models.items()}
    return {
        "difference": max(relative_error(carried[n], given[n]) for n in given),
        "trained": min(relative_error(given[n], start[n]) for n in given),
        "syncs": [s["sparse_syncs"] + s["dense_syncs"] for s in stats.values()],
    }


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: every check above; writes ``rank<r>.json``."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {
            "online": online_choice(rank, world_size),
            "online_evaluated": online_choice(rank, world_size, evaluate=True),
            "held": held_replica_gradients(rank, world_size),  # mostly touched blocks: one dense all-reduce
            "held_sparse": held_replica_gradients(
                rank, world_size, hot=36, per_host=3
            ),  # a mostly untouched block: synced sparse
            "bad_input": bad_input(rank, world_size),
            "carried": carried_route(rank, world_size),
        }
    write_rank_result(out_dir, rank, results)


# --- checkpoints saved on one world size and loaded on another --------------------------------


def save_after(rank: int, world_size: int, path: str, steps: int) -> None:
    """Trains ``steps`` steps (SGD, some hot rows) and saves the state dict with torch.distributed.checkpoint."""
    configs = table_configs(False)
    proj = projections(configs)
    rep = replicated(configs, False, "sgd", ReplicationConfig(tiers=hot_rows(configs, 6, per_host=2)))
    for step in range(steps):
        loss_of(rep(batch(rank, step, False, configs)), proj).backward()
    dcp.save(rep.state_dict(), checkpoint_id=path)


def load_and_continue(rank: int, world_size: int, path: str, saved_world: int, saved_steps: int) -> dict:
    """Loads the checkpoint into this world size (other hot rows), trains on, compares with the unsharded model."""
    configs = table_configs(False)
    proj = projections(configs)
    rep = replicated(configs, False, "sgd", ReplicationConfig(tiers=hot_rows(configs, 9, stride=2)), seed=123)
    rep(batch(rank, 0, False, configs))  # a step on other weights first: the load must replace everything
    state = rep.state_dict()
    dcp.load(state, checkpoint_id=path)
    rep.load_state_dict(state)
    reference = unsharded(configs, False, "sgd")
    for step in range(saved_steps):  # what the saving world did
        outs = [reference(batch(r, step, False, configs)) for r in range(saved_world)]
        (sum(loss_of(o, proj) for o in outs) / saved_world).backward()
    want = {c.name: reference.embedding_bags[c.name].weight for c in configs}
    errors = {"loaded_vs_unsharded": max(relative_error(t, want[n]) for n, t in full_tables(rep, configs).items())}
    worst_out = 0.0
    for step in range(saved_steps, saved_steps + STEPS):
        batches = [batch(r, step, False, configs) for r in range(world_size)]
        out = rep(batches[rank])
        ref_outs = [reference(b) for b in batches]
        worst_out = max([worst_out] + [relative_error(out[f], ref_outs[rank][f]) for f in proj])
        loss_of(out, proj).backward()
        (sum(loss_of(o, proj) for o in ref_outs) / world_size).backward()
    errors["out_rep_vs_unsharded"] = worst_out
    errors["weights_rep_vs_unsharded"] = max(relative_error(t, want[n]) for n, t in full_tables(rep, configs).items())
    errors["replica_disagreement"] = replica_disagreement(rep)
    errors["state_rows"] = {k: list(v.size()) for k, v in rep.state_dict().items()}
    return errors


def run_save(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port, timeout_s=120):
        save_after(rank, world_size, f"{out_dir}/checkpoint", steps=3)
        write_rank_result(out_dir, rank, {"saved": True})
        dist.barrier()  # nobody leaves while another rank still writes


def run_load(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port, timeout_s=120):
        saved_world = int(open(f"{out_dir}/saved_world").read())
        write_rank_result(out_dir, rank, load_and_continue(rank, world_size, f"{out_dir}/checkpoint", saved_world, 3))
        dist.barrier()

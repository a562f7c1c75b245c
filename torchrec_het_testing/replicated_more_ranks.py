"""Rank bodies of tests/distributed/test_row_replicated_hosts.py.

``het_row_replicated`` on 4 ranks as 2 hosts x 2 (the per-host tier, replica gradients
summed hierarchically, bytes inside and between hosts), and checkpoints saved on one world size and loaded on another.
"""

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchrec.distributed.planner import Topology

from torchrec_het_bench.comm import CommAccountant, EMBEDDING_PHASES, sum_over_ranks
from torchrec_het.planner import ProfileTiers
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import count_accesses
from torchrec_het_testing.het_ranks import (
    STEPS,
    _local_shard_errors,
    _rel_error,
    _worst,
    batch,
    loss_of,
    projections,
    sharded,
    table_configs,
    unsharded,
)
from torchrec_het_testing.replicated_ranks import replica_disagreement, replicated, tiers
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

HOSTS = (0, 0, 1, 1)


def two_hosts(rank: int, world_size: int, optimizer: str = "rowwise_adagrad") -> dict:
    """Replicated and per-host tiers on 2 hosts x 2 ranks vs the unsharded model; bytes by link."""
    configs = table_configs(False)
    proj = projections(configs)
    config = ReplicationConfig(tiers=tiers(configs, hot=4, per_host=12), local_world_size=2)
    rep = replicated(configs, False, optimizer, config)
    stock = sharded("row_wise", configs, False, optimizer)
    reference = unsharded(configs, False, optimizer)
    errors: dict = {}
    bytes_by_model = {}
    for name, model in (("rep", rep), ("row_wise", stock)):
        with CommAccountant() as accountant:
            for step in range(STEPS):
                out = model(batch(rank, step, False, configs))
                loss_of(out, proj).backward()
        totals = sum_over_ranks(accountant.totals())
        bytes_by_model[name] = {
            "cross_rank": totals.cross_rank(EMBEDDING_PHASES),
            "inter_host": totals.inter_host(HOSTS, EMBEDDING_PHASES),
        }
    for step in range(STEPS):
        batches = [batch(r, step, False, configs) for r in range(world_size)]
        ref_outs = [reference(b) for b in batches]
        (sum(loss_of(o, proj) for o in ref_outs) / world_size).backward()
    _local_shard_errors(rep, reference, configs, errors, "weights_rep_vs_unsharded")
    errors["replica_disagreement"] = replica_disagreement(rep)
    errors["bytes"] = bytes_by_model
    lookup = rep.module.replicated_lookups()[0]
    errors["per_host_held"] = sum(int(g.is_host(g.held).sum()) for g in lookup.groups)
    return errors


def _bytes_by_link(model, rank: int, configs, proj) -> dict:
    """Embedding bytes over STEPS steps of ``model`` (summed over ranks): between ranks, between hosts."""
    with CommAccountant() as accountant:
        for step in range(STEPS):
            loss_of(model(batch(rank, step, False, configs)), proj).backward()
    totals = sum_over_ranks(accountant.totals())
    return {"cross_rank": totals.cross_rank(EMBEDDING_PHASES), "inter_host": totals.inter_host(HOSTS, EMBEDDING_PHASES)}


def two_hosts_hierarchical(rank: int, world_size: int, optimizer: str = "rowwise_adagrad", hot: int = 12) -> dict:
    """The replicated tier alone (the pipelined lookup) on 2 hosts x 2 ranks: replica gradients
    summed within each host, then between host leaders; against the unsharded model, and its
    bytes against the same tiers synced flat (one host of 4) and stock row_wise. And tiers that
    :class:`ProfileTiers` chose from a profile of the batches and a 2 x 2 topology with a slow
    link between hosts (a per-host tier: the lookup that has one), trained the same way."""
    configs = table_configs(False)
    proj = projections(configs)
    reference = unsharded(configs, False, optimizer)
    errors: dict = {"bytes": {}}
    models = {}
    for name, local in (("hier", 2), ("flat", 4)):
        config = ReplicationConfig(tiers=tiers(configs, hot=hot), local_world_size=local)
        models[name] = replicated(configs, False, optimizer, config)
        errors["bytes"][name] = _bytes_by_link(models[name], rank, configs, proj)
    # the planner's rule: tiers from a profile of the batches on 2 hosts x 2 whose link between hosts is 10x slower
    profile = count_accesses([batch(r, s, False, configs) for r in range(world_size) for s in range(STEPS)], configs)
    topology = Topology(world_size=world_size, local_world_size=2, compute_device="cpu", intra_host_bw=2e6, inter_host_bw=2e5)
    config = ReplicationConfig(tiers=ProfileTiers(profile, topology=topology, max_hot_fraction=0.25), local_world_size=2)
    models["profiled"] = replicated(configs, False, optimizer, config)
    errors["bytes"]["profiled"] = _bytes_by_link(models["profiled"], rank, configs, proj)
    errors["profiled_tiers"] = {n: [t.replicated.numel(), t.per_host.numel()] for n, t in config.tiers.tables.items()}
    errors["bytes"]["row_wise"] = _bytes_by_link(sharded("row_wise", configs, False, optimizer), rank, configs, proj)
    for step in range(STEPS):
        batches = [batch(r, step, False, configs) for r in range(world_size)]
        ref_outs = [reference(b) for b in batches]
        (sum(loss_of(o, proj) for o in ref_outs) / world_size).backward()
    for name, model in models.items():
        _local_shard_errors(model, reference, configs, errors, f"weights_{name}_vs_unsharded")
        errors[f"replica_disagreement_{name}"] = replica_disagreement(model)
        lookup = model.module.replicated_lookups()[0]
        errors[f"hierarchical_{name}"] = lookup._hosts.hierarchical
        errors[f"syncs_{name}"] = lookup.stats["sparse_syncs"] + lookup.stats["dense_syncs"]
    return errors


def save_after(rank: int, world_size: int, path: str, steps: int) -> None:
    """Trains ``steps`` steps (SGD, some hot rows) and saves the state dict with torch.distributed.checkpoint."""
    configs = table_configs(False)
    proj = projections(configs)
    rep = replicated(configs, False, "sgd", ReplicationConfig(tiers=tiers(configs, hot=6, per_host=2)))
    for step in range(steps):
        loss_of(rep(batch(rank, step, False, configs)), proj).backward()
    state = rep.state_dict()
    dcp.save(state, checkpoint_id=path)


def load_and_continue(rank: int, world_size: int, path: str, saved_world: int, saved_steps: int) -> dict:
    """Loads the checkpoint into this world size (other hot rows), trains on, compares with the unsharded model."""
    configs = table_configs(False)
    proj = projections(configs)
    rep = replicated(configs, False, "sgd", ReplicationConfig(tiers=tiers(configs, hot=9, stride=2)), seed=123)
    rep(batch(rank, 0, False, configs))  # a step on other weights first: the load must replace everything
    state = rep.state_dict()
    dcp.load(state, checkpoint_id=path)
    rep.load_state_dict(state)
    reference = unsharded(configs, False, "sgd")
    for step in range(saved_steps):  # what the saving world did
        outs = [reference(batch(r, step, False, configs)) for r in range(saved_world)]
        (sum(loss_of(o, proj) for o in outs) / saved_world).backward()
    errors: dict = {}
    _local_shard_errors(rep, reference, configs, errors, "loaded_vs_unsharded")
    for step in range(saved_steps, saved_steps + STEPS):
        batches = [batch(r, step, False, configs) for r in range(world_size)]
        out = rep(batches[rank])
        ref_outs = [reference(b) for b in batches]
        for f in proj:
            _worst(errors, "out_rep_vs_unsharded", _rel_error(out[f], ref_outs[rank][f]))
        loss_of(out, proj).backward()
        (sum(loss_of(o, proj) for o in ref_outs) / world_size).backward()
    _local_shard_errors(rep, reference, configs, errors, "weights_rep_vs_unsharded")
    errors["replica_disagreement"] = replica_disagreement(rep)
    errors["state_keys"] = sorted(rep.state_dict())
    errors["state_rows"] = {k: list(v.size()) for k, v in rep.state_dict().items()}
    return errors


def run_two_hosts(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port, timeout_s=120):
        write_rank_result(out_dir, rank, two_hosts(rank, world_size))


def run_two_hosts_hierarchical(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port, timeout_s=120):
        write_rank_result(out_dir, rank, two_hosts_hierarchical(rank, world_size))


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

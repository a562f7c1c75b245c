"""What ``het_row_replicated``'s lookups hold, read through their internals, for the tests that
look at replicas directly (held gradients, agreement after a flush or a bad batch).

The generic tests (:mod:`~torchrec_het_testing.equivalence`) see replicas through what the model
reads, and through :func:`replica_disagreement` at the end of a case; this is the one module of
``torchrec_het_testing`` that knows the lookups' insides (both the pipelined
:class:`~torchrec_het.sharding.row_replicated.holder.ReplicaHolder` and the per-host tier's lookups), so
it is the one to follow them when they change.
"""

import torch
import torch.distributed as dist

from torchrec_het._compat import lookup_kernels
from torchrec_het.sharding.row_replicated.holder import ReplicaHolder


def replicated_lookups(model) -> list:
    """The replicated lookups of every plugin-sharded module of ``model`` (a DistributedModelParallel)."""
    return [lookup for m in model.module.modules() if hasattr(m, "replicated_lookups") for lookup in m.replicated_lookups()]


def _owner_rows(lookup, group) -> torch.Tensor:
    """The group's replicated rows as their owners' shards hold them (every rank gets all; a collective)."""
    weights = [m.split_embedding_weights() for m in lookup_kernels(lookup)]
    block = torch.zeros(group.hot.numel(), group.dim, device=group.hot.device)
    owned = group.owner_of(group.hot) == lookup._rank
    block[owned] = group.read_owned(group.hot[owned], [weights[t.module_index][t.table_index] for t in group.tables])
    dist.all_reduce(block)
    return block


def replica_disagreement(model) -> float:
    """Largest difference between any replica copy and its owner's row over every replicated
    lookup of ``model`` (0.0: all copies agree; a collective, on the lookups' device)."""
    worst = 0.0
    for lookup in replicated_lookups(model):
        if isinstance(lookup, ReplicaHolder):  # every rank's replica block against the owners' rows
            for group, block in zip(lookup.groups, lookup._blocks):
                if group.hot.numel():
                    worst = max(worst, float((block.weights - _owner_rows(lookup, group)).abs().max()))
            continue
        lookup._weights = [m.split_embedding_weights() for m in lookup_kernels(lookup)]
        for group in lookup.groups:
            for i, t in enumerate(group.tables):
                rows = torch.sort(torch.cat([group.hot, group.host])).values
                rows = rows[group.table_of(rows) == i]
                block = torch.zeros(rows.numel(), group.dim, device=rows.device)
                owned = group.owner_of(rows) == lookup._rank
                block[owned] = group.read_owned(rows[owned], lookup._shard_weights(group))
                dist.all_reduce(block)
                held = torch.isin(rows, group.held)
                if bool(held.any()):
                    replica = lookup._replicas[t.module_index].split_embedding_weights()[t.table_index]
                    got = replica[group.replica_rows_of(rows[held])]
                    worst = max(worst, float((got - block[held]).abs().max()))
    return worst


def refresh_replicas(lookup) -> None:
    """Replicas take their owners' rows now (the first forward would do it)."""
    if isinstance(lookup, ReplicaHolder):
        for block in lookup._blocks:
            block.refresh()
        lookup._needs_refresh = False
    else:
        lookup.refresh()


def held_gradients(lookup) -> list[torch.Tensor]:
    """Per group: the replicated rows' held gradients, their touch counts in the last column."""
    if isinstance(lookup, ReplicaHolder):
        return [torch.cat([block.pending, block.touches.unsqueeze(1)], 1) for block in lookup._blocks]
    return lookup._pending


def replicated_rows(lookup) -> list[torch.Tensor]:
    """Per group: the replicated rows as this rank reads them (its replica block; the per-host
    tier's lookup: the owners' shards and the other ranks' replicas)."""
    if isinstance(lookup, ReplicaHolder):
        return [block.weights.clone() for block in lookup._blocks]
    lookup._weights = [m.split_embedding_weights() for m in lookup_kernels(lookup)]
    views = [r.split_embedding_weights() for r in lookup._replicas]
    out = []
    for group in lookup.groups:
        replicas = [views[t.module_index][t.table_index] for t in group.tables]
        out.append(group.read(group.hot, lookup._shard_weights(group), replicas).clone())
    return out


def steps_locally(lookup) -> bool:
    """Whether a rank's replicated rows move by its own steps between syncs (the pipelined lookup)."""
    return isinstance(lookup, ReplicaHolder)

"""What ``het_row_replicated``'s lookups hold, read through their replica holders, for the tests
that look at replicas directly (held gradients, agreement after a flush or a bad batch).

The generic tests (:mod:`~torchrec_het_testing.equivalence`) see replicas through what the model
reads, and through :func:`replica_disagreement` at the end of a case; this is the one module of
``torchrec_het_testing`` that knows the lookups' insides (the
:class:`~torchrec_het.sharding.row_replicated.holder.ReplicaHolder` each lookup owns as
``lookup.replicas``), so it is the one to follow them when they change.
"""

import torch
import torch.distributed as dist

from torchrec_het._compat import lookup_kernels


def replicated_lookups(model) -> list:
    """The replicated lookups of every plugin-sharded module of ``model`` (a DistributedModelParallel)."""
    return [
        lookup for m in model.module.modules() if hasattr(m, "replicated_lookups") for lookup in m.replicated_lookups()
    ]


def _owner_rows(lookup, group, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of ``group`` as their owners' shards hold them (every rank gets all; a collective)."""
    weights = [m.split_embedding_weights() for m in lookup_kernels(lookup)]
    block = torch.zeros(ids.numel(), group.dim, device=ids.device)
    owned = group.owner_of(ids) == lookup.replicas.rank
    block[owned] = group.read_owned(ids[owned], [weights[t.module_index][t.table_index] for t in group.tables])
    dist.all_reduce(block)
    return block


def replica_disagreement(model) -> float:
    """Largest difference between any replica copy (a replicated row's on every rank, a per-host
    row's on its holders) and its owner's row, over every replicated lookup of ``model`` (0.0:
    all copies agree; a collective, on the lookups' device)."""
    worst = 0.0
    for lookup in replicated_lookups(model):
        for group, block in zip(lookup.groups, lookup.replicas.blocks):
            if group.hot.numel():
                worst = max(worst, float((block.weights - _owner_rows(lookup, group, group.hot)).abs().max()))
        for group, block in zip(lookup.groups, lookup.replicas.host_blocks):
            if group.host.numel():  # every rank reads all per-host rows' owners' copies, then checks the ones it holds
                owners = _owner_rows(lookup, group, group.host)
                mine = torch.searchsorted(group.host, group.host_block)
                if mine.numel():
                    worst = max(worst, float((block.weights - owners[mine]).abs().max()))
    return worst


def per_host_held(lookup) -> int:
    """Per-host rows this rank holds for its host and does not own (copies away from their owners)."""
    if not lookup.replicas.host_blocks:
        return 0
    return sum(int((g.owner_of(g.host_block) != g.rank).sum()) for g in lookup.groups)


def refresh_replicas(lookup) -> None:
    """Replicas take their owners' rows now (the first forward would do it)."""
    lookup.replicas.refresh()


def held_gradients(lookup) -> list[torch.Tensor]:
    """Per group: the replicated rows' held gradients, their touch counts in the last column."""
    return [torch.cat([block.pending, block.touches.unsqueeze(1)], 1) for block in lookup.replicas.blocks]


def replicated_rows(lookup) -> list[torch.Tensor]:
    """Per group: the replicated rows as this rank reads them (its replica block)."""
    return [block.weights.clone() for block in lookup.replicas.blocks]

"""The rules of ``het_cached_row_wise``, per group of tables: what a requester asks, what an owner
sends, what the requester's cache keeps (:func:`plan_read`, :func:`asked_ids`, :func:`sends`,
:func:`settle`). Local compute on one group's tensors; the lookup runs them and its dists carry
what they decide.

Design: docs/internals.md#het-cache-protocol
"""

import torch

from torchrec_het.sharding.common import id_space
from torchrec_het.sharding.het_cache.batch import CachedBatch, GroupRead, SlotPlan
from torchrec_het.sharding.het_cache.groups import HetGroup


def read_bounds(
    groups: list[HetGroup], world_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(each group's bound on a held copy's lag; the same when the owners answer one step early;
    whether they may: ``ahead``).

    Fetching ahead is allowed where one step of lag, ``margin = ws * (s_write + 1)`` updates,
    fits every group's bound (why: docs/internals.md#het-cache-protocol).
    """
    bounds = torch.tensor(
        [g.settings.s_read if g.settings.protocol == "het" else 0 for g in groups], dtype=torch.int64, device=device
    )
    margins = [world_size * (g.settings.s_write + 1) if g.settings.protocol == "het" else 1 for g in groups]
    ahead = bool(groups) and all(g.settings.s_read >= m for g, m in zip(groups, margins))
    bounds_ahead = torch.tensor(
        [g.settings.s_read - m if g.settings.protocol == "het" else 0 for g, m in zip(groups, margins)],
        dtype=torch.int64,
        device=device,
    )
    return bounds, bounds_ahead, ahead


def plan_read(g: HetGroup, ids, bags, weights, lengths, counts, step: int, rank: int) -> GroupRead:
    """One group's read of a batch: distinct ids (ascending), owned or remote; counts the lookups."""
    sorted_ids, by_row = torch.sort(ids, stable=True)
    uniq, sorted_inverse, uses = torch.unique_consecutive(sorted_ids, return_inverse=True, return_counts=True)
    inverse = torch.empty_like(sorted_inverse).index_copy_(0, by_row, sorted_inverse)
    owned = g.owner_of(uniq) == rank
    local, remote = owned.nonzero().flatten(), (~owned).nonzero().flatten()
    tables = g.table_of(uniq)
    read = GroupRead(step, lengths, weights, bags, uniq, inverse, by_row, uses, tables, local, remote)
    remote_tables = tables.index_select(0, remote)
    per_table = torch.zeros(len(g.tables), dtype=torch.int64, device=g.device).index_add_(0, g.feature_table, counts)
    g.stats.add_per_table("lookups", per_table)
    g.stats.add("unique_lookups", tables)
    g.stats.add("remote_unique", remote_tables)
    g.stats.add("remote_lookups", remote_tables, uses.index_select(0, remote))
    return read


def asked_ids(g: HetGroup, slots: torch.Tensor, step: int) -> torch.Tensor:
    """Positions in the remote ids (cache ``slots``, -1: none) of those to ask their owners about."""
    if g.settings.protocol == "het" or not g.cache.capacity:
        return torch.arange(slots.numel(), device=g.device)
    validated = g.cache.validated_step.index_select(0, slots.clamp(min=0))
    leased = (slots >= 0) & (step <= validated + g.settings.s_read)
    return (~leased).nonzero().flatten()


def sends(held: torch.Tensor, current: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """The answer rule: which requests bring a row (the requester holds none, or holds it more than
    its group's bound behind the owner's ``current`` version)."""
    return (held < 0) | (current - held > bounds)


def plan_slots(
    g: HetGroup, read: GroupRead, batch: CachedBatch, index: int, brings: torch.Tensor, training: bool
) -> SlotPlan:
    """Requester side, once the owners' versions are known: the group's requests, their slots now, the
    rows that come without a slot, and (training) whether caching them needs a rescan."""
    mine = (batch.group == index).nonzero().flatten()
    asked = read.asked.index_select(0, batch.at.index_select(0, mine))  # positions in read.remote
    read.slots = g.cache.slots_of(read.uniq.index_select(0, read.remote), check=False)
    held_slots = read.slots.index_select(0, asked)
    group_brings = brings.index_select(0, mine)
    missing = (group_brings & (held_slots < 0)).nonzero().flatten()
    missing_ids = read.uniq.index_select(0, read.remote.index_select(0, asked.index_select(0, missing)))
    if not training:  # nothing is admitted: no slot is reserved
        none = torch.zeros(1, dtype=torch.int64, device=g.device)
        return SlotPlan(mine, asked, held_slots, group_brings, missing, missing_ids, missing_ids[:0], none)
    protect = torch.cat([read.slots[read.slots >= 0], (g.pins > 0).nonzero().flatten()])
    shortfall = g.cache.shortfall(missing_ids, protect).view(1).long()
    return SlotPlan(mine, asked, held_slots, group_brings, missing, missing_ids, protect, shortfall)


def settle(
    g: HetGroup,
    read: GroupRead,
    plan: SlotPlan,
    versions: torch.Tensor,
    rows: torch.Tensor,
    owned: torch.Tensor,
    validated: int,
    training: bool,
    keep_pinned: bool,
) -> torch.Tensor:
    """Requester side: the rows of the batch (``read.rows``), the cache settled, the counters counted.

    Training refreshes stale copies, fills new rows, renews leases and records the uses;
    evaluation reads the same values and changes no slot. The input dist's pins are released
    (``keep_pinned``: cached slots stay pinned until the batch's backward).

    Args:
        versions: the owners' version of each of the group's requests.
        rows: the rows that came, in request order (each followed by its owner's optimizer state
            where the cache keeps one).
        owned: the rows of the batch's owned ids (``read.local``), from the local shards.
        validated: the step the owners' answer counts as (the batch's own, or the one before
            when fetched ahead).

    Returns:
        bool per remote id: served from the cache (no row came for it).
    """
    cache, stats = g.cache, g.stats
    asked, held_slots, brings, missing = plan.asked, plan.held_slots, plan.brings, plan.missing
    rows, states = rows[:, : g.dim], rows[:, g.dim :]
    asked_tables = read.tables.index_select(0, read.remote.index_select(0, asked))
    fresh = ~brings  # the owner kept the row: the cached copy is within the bound
    if g.settings.protocol == "lease":
        held = held_slots >= 0  # how far each leased copy fell behind while served unasked
        stats.add_staleness(asked_tables[held], versions[held] - cache.versions[held_slots[held]])
        if training:
            cache.mark_validated(held_slots[fresh], validated)
    else:
        stats.add_staleness(asked_tables[fresh], versions[fresh] - cache.versions[held_slots[fresh]])
    row_of = torch.cumsum(brings.long(), 0) - 1  # row in ``rows`` of each request that brought one
    stale = (brings & (held_slots >= 0)).nonzero().flatten()
    stale_rows = row_of.index_select(0, stale)
    missing_rows = row_of.index_select(0, missing)
    fetched = rows.index_select(0, missing_rows)
    if training:
        cache.refresh(
            held_slots.index_select(0, stale),
            rows.index_select(0, stale_rows),
            versions.index_select(0, stale),
            validated,
            states.index_select(0, stale_rows),
        )
        new_slots = read.slots.index_select(0, asked.index_select(0, missing))
        cache.fill(new_slots, fetched, states.index_select(0, missing_rows))
        cache.versions.index_copy_(0, new_slots[new_slots >= 0], versions.index_select(0, missing)[new_slots >= 0])
        fetched = fetched[new_slots < 0]
    stats.add("rows_fetched", asked_tables[brings])
    served = torch.ones(read.remote.numel(), dtype=torch.bool, device=g.device)
    served[asked[brings]] = False
    remote_tables = read.tables.index_select(0, read.remote)
    stats.add("hits_unique", remote_tables[served])
    stats.add("hits_lookups", remote_tables[served], read.uses.index_select(0, read.remote)[served])
    cached = (read.slots >= 0).nonzero().flatten()
    cached_slots = read.slots.index_select(0, cached)
    if training:
        cache.touch(cached_slots, read.step, read.uses.index_select(0, read.remote.index_select(0, cached)))
    # the rows of this step: owned from the shards, remote from the cache or as fetched
    out = torch.empty(read.uniq.numel(), g.dim, device=g.device)
    out.index_copy_(0, read.local, owned)
    out.index_copy_(0, read.remote.index_select(0, cached), cache.values.index_select(0, cached_slots))
    if not training:
        refreshed = rows.index_select(0, stale_rows).to(cache.values.dtype) + cache.pending_delta.index_select(
            0, held_slots.index_select(0, stale)
        )
        out.index_copy_(0, read.remote.index_select(0, asked.index_select(0, stale)), refreshed)
    out.index_copy_(0, read.uncached, fetched)
    read.rows = out
    g.pins.index_add_(0, read.pinned, torch.full_like(read.pinned, -1, dtype=g.pins.dtype))  # settled
    read.pinned = read.pinned[:0]
    if keep_pinned:  # later batches settle before this backward
        read.pinned = cached_slots
        g.pins.index_add_(0, read.pinned, torch.ones_like(read.pinned, dtype=g.pins.dtype))
    return served


def sample_major(read: GroupRead) -> None:
    """Orders the bags sample by sample (the output's layout, so pooling writes it in place):
    ``read.bags`` is each id's bag in that order, ``read.by_bag`` the ids in that order."""
    features, batch = read.lengths.shape
    read.bags, read.by_bag, read.bag_offsets = id_space.sample_major(read.value_bags, features, batch)

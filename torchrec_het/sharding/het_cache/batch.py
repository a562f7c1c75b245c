"""The per-batch state of ``het_cached_row_wise``: what the input dist plans, the lookup answers
and the output dist settles, kept for the batch's backward. It travels in the batch's
:class:`~torchrec_het.sharding.common.context.HetShardingContext` (``batch``)."""

from dataclasses import dataclass, field

import torch

from torchrec_het.cache import PendingRows
from torchrec_het.sharding.het_cache.coded_rows import CodedPayload, PayloadRows


@dataclass
class GroupRead:
    """One group's read of one batch, from the input dist to that batch's backward."""

    step: int
    lengths: torch.Tensor  # [F, B] bag lengths of the group's features
    weights: torch.Tensor | None  # per-id weights, or None
    value_bags: torch.Tensor  # bag of every id, the group's features one after the other (f * batch + sample)
    uniq: torch.Tensor  # distinct fused ids of the batch, ascending
    inverse: torch.Tensor  # position in uniq of every id
    by_row: torch.Tensor  # positions of the ids sorted by row (stable): the backward's bags
    uses: torch.Tensor  # occurrences of each distinct id
    tables: torch.Tensor  # group table index of each distinct id
    local: torch.Tensor  # positions in uniq of owned ids
    remote: torch.Tensor  # positions in uniq of ids owned elsewhere
    asked: torch.Tensor | None = None  # positions in remote of the ids asked about (ascending)
    pinned: torch.Tensor | None = None  # cache slots pinned by the input dist until the settle
    slots: torch.Tensor | None = None  # cache slot of each remote id at the settle (-1: none)
    rows: torch.Tensor | None = None  # [len(uniq), dim] values used this step
    bags: torch.Tensor | None = None  # bag of every id, bags ordered sample by sample
    by_bag: torch.Tensor | None = None  # the ids in that bag order
    bag_offsets: torch.Tensor | None = None  # [bags + 1] where each bag starts in that order
    uncached: torch.Tensor | None = None  # positions in uniq of fetched rows that found no slot
    due: torch.Tensor | None = None  # cache slots whose pending gradients go out in this step's backward
    outbox: list[PendingRows] = field(default_factory=list)  # evicted dirty rows that go out with them
    push_counts: torch.Tensor | None = None  # rows this rank pushes to each rank in the backward


@dataclass
class SlotPlan:
    """Requester side, per group, once the owners' versions are known: the group's requests, the
    rows they bring and the slots those rows need (read by the reservation and the settle)."""

    mine: torch.Tensor  # positions among the batch's requests of the group's
    asked: torch.Tensor  # their positions in the group read's ``remote``
    held_slots: torch.Tensor  # their cache slots before the reservation (-1: none)
    brings: torch.Tensor  # bool: which bring a row
    missing: torch.Tensor  # positions in ``mine`` of rows brought that have no slot
    missing_ids: torch.Tensor  # their fused ids
    protect: torch.Tensor  # slots the reservation may not evict
    shortfall: torch.Tensor  # [1] int64: whether the reservation must rescan (read with other data)


@dataclass
class CachedBatch:
    """One batch's bookkeeping, from the input dist to its backward.

    Requests are merged over the groups: ordered by owner, then group, then id.
    """

    step: int
    batch: int
    reads: list[GroupRead]
    ids: torch.Tensor  # requester: global id of each request
    held: torch.Tensor  # requester: the cached version sent with it (-1: none)
    dest: torch.Tensor  # requester: owner of each request
    group: torch.Tensor  # requester: group of each request
    at: torch.Tensor  # requester: position of each request in its group's ``asked``
    send_splits: list[int] = field(default_factory=list)  # requests to each rank
    recv_splits: list[int] = field(default_factory=list)  # requests from each rank
    local_only: bool = False  # no rank asked another one anything
    received: torch.Tensor | None = None  # owner: [n, 2] (global id, held) asked of this rank, by source
    current: torch.Tensor | None = None  # owner: the current version of each
    rows_out: torch.Tensor | None = None  # owner: float32 elements of rows it sends to each rank
    rows_in: torch.Tensor | None = None  # requester: float32 elements of rows it receives from each rank
    payload: torch.Tensor | None = None  # owner: those rows, flat, in request order
    writes: bool = False  # a backward is expected
    pull_counts: torch.Tensor | None = None  # [ws, groups] rows each rank pushes to this one in the backward
    push_counts: torch.Tensor | None = None  # [ws, groups] rows this rank pushes to each rank in the backward
    replies: torch.Tensor | None = None  # requester: the owners' versions
    brings: torch.Tensor | None = None  # requester: which requests bring a row
    slot_plans: list[SlotPlan] | None = None  # requester: per group, between the versions and the rows
    rows_received: torch.Tensor | None = None  # fetched ahead: the rows, flat, by source
    sent_rows: PayloadRows | None = None  # owner, under a forward codec: the rows it sends, per request
    coded_rows: CodedPayload | None = None  # under a forward codec: the rows' exchange, both sides

"""The per-batch state of ``het_row_replicated``: what its input dists plan, its lookups fill in and
its output dists finish, one dataclass per variant (bags, sequences); it travels in the batch's
:class:`~torchrec_het.sharding.common.context.HetShardingContext`."""

from dataclasses import dataclass, field

import torch

from torchrec_het.sharding.common.output_layout import bag_offsets
from torchrec_het.sharding.row_replicated.owner import OwnerBatch, OwnerValues


@dataclass
class HotValues:
    """The values of a batch one replica block serves on the reader, with the order its lookup pools them in."""

    slots: torch.Tensor  # the block's row of each value, in value order
    bags: torch.Tensor  # its bag in its group's output part (sample-major)
    weights: torch.Tensor | None  # its weight (weighted tables)
    by_bag: torch.Tensor  # the values in bag order
    offsets: torch.Tensor  # [bags + 1] where each bag's values start in that order
    by_row: torch.Tensor  # the values in block-row order (the backward sums each row's gradient)
    row_offsets: torch.Tensor  # [block rows + 1] where each row's values start in that order
    row_counts: torch.Tensor  # [block rows] values that read each row

    @classmethod
    def of(cls, slots: torch.Tensor, rows: int, bags, weights, by_bag, offsets) -> "HotValues":
        """The values reading block rows ``slots`` of a block of ``rows`` rows (both orders made here)."""
        by_row = torch.sort(slots).indices
        counts = torch.bincount(slots, minlength=rows)
        return cls(slots, bags, weights, by_bag, offsets, by_row, bag_offsets(counts), counts)


@dataclass
class FetchedRows:
    """Reader: the cold values of ``cold_rows`` tables, whose rows come from their owners (each
    distinct one once) and are pooled here, at the output dist."""

    bags: torch.Tensor  # bag (position * batch + sample) of each such value
    entry_of: torch.Tensor  # the row entry it reads, among the entries sent (by owner, then id)
    weights: torch.Tensor | None  # its weight (weighted tables)
    position: torch.Tensor  # [entries] a position of each entry's table
    owners: torch.Tensor  # [entries] the owner each entry is asked of
    wire_at: torch.Tensor  # [bag entries + row entries]: where each entry (bag entries first) is in the exchange
    on_grad: object = None  # lookup -> output dist: called as (grads, positions, owners) of the rows in the backward


@dataclass
class ReplicatedBagBatch:
    """One batch's bookkeeping, from the input dist to the output dist."""

    batch: int
    hot_version: int  # the layout's hot rows this batch was routed with
    lengths: torch.Tensor  # [F * B] reader's bag lengths (mean pooling)
    hot: list[HotValues]  # per block: the reader's hot values
    sent_entries: torch.Tensor  # reader: distinct (dest, position, sample) keys of the bags sent
    sent_dest: torch.Tensor  # reader: the owner of every entry sent (bags and rows), in the exchange's order
    sent_position: torch.Tensor  # reader: its position (a row's: one of its table's), in that order
    fetched: FetchedRows | None = None  # reader: the values whose rows it fetches (``cold_rows`` tables)
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    local_only: bool = False
    served_source: torch.Tensor | None = None  # owner: the source of every entry received (a bag or a row)
    received: OwnerValues | None = None  # owner: the values received for its kernels' rows, in arrival order
    partial_at: tuple | None = None  # owner: (row, position, rows) of each partial in the kernels' compact output
    host_values: tuple | None = None  # holder: (block slots, element start of their partial, weights) of per-host ids
    host_entries: torch.Tensor | None = None  # holder: the entries of those ids
    early: object = None  # lookahead: the partials sent before the lookup (lookahead.EarlyPartials)
    hot_read: list | None = None  # reader: per block, its hot values pooled at the lookup (PooledHotRead)
    owner: OwnerBatch | None = None  # owner: the values it pools and steps itself (owner.py; else partial_at)
    owed: list | None = None  # lookup -> output dist: where the owners' deferred backward waits (ReplicaHolder.owed)
    owner_step: object = None  # lookup -> output dist: that backward where the owner steps its rows itself
    anchor: torch.Tensor | None = None  # lookup -> output dist: puts replica reads in the autograd graph


@dataclass
class ReplicatedSequenceBatch:
    """One batch's bookkeeping, from the input dist to the output dist."""

    hot_version: int
    num_values: int
    hot: list  # per block: (slots, value indexes) of the reader's hot values
    cold: torch.Tensor  # value indexes of the cold values
    need_of: torch.Tensor  # distinct cold id (in the order sent) of every cold value
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    local_only: bool = False
    received: torch.Tensor | None = None  # owner: int32 [ids, 2] (position, row), by source
    kernel_order: torch.Tensor | None = None  # owner: arrival index of each id in the KJT's order
    kernel_at: torch.Tensor | None = None  # owner: arrival indexes of the ids its kernels read (None: all)
    host_values: tuple | None = None  # holder: (arrival indexes, block slots) of per-host ids
    rows: torch.Tensor | None = None  # owner: the rows asked for, in arrival order
    hot_read: list | None = None  # reader: per block, the hot rows read at the lookup (HotRead)
    anchor: torch.Tensor | None = None  # lookup -> output dist: puts replica reads in the autograd graph

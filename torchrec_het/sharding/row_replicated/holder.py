"""What both ``het_row_replicated`` lookups (bags and sequences) share.

:class:`ReplicaHolder` is the collaborator each lookup owns (``lookup.replicas``): the hot-row
replica blocks and their syncs, the owners' deferred steps, the stats and the checkpoint hooks,
built from the sharding's :class:`~torchrec_het.sharding.row_replicated.placement.ReplicaPlacement`;
:class:`HotRead` is what one batch of sequences read of a block, :class:`PooledHotRead` what one
batch of bags pooled from it.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het import _tbe
from torchrec_het.sharding.common.groups import dedicated_group
from torchrec_het.sharding.row_replicated.batch import HotValues
from torchrec_het.sharding.row_replicated.owner import DirectOwner
from torchrec_het.sharding.row_replicated.placement import ReplicaGroup, ReplicaPlacement
from torchrec_het.sharding.row_replicated.replicas import ReplicaBlock, owned_rows, read_rows
from torchrec_het.sharding.row_replicated.sync import HostGroups, holder_group


@dataclass
class HotRead:
    """The replica rows one batch read at its lookup (one per value), and their block."""

    block: ReplicaBlock
    slots: torch.Tensor  # the block's row of each value read
    rows: torch.Tensor  # [values, dim]: those rows, as they were at the lookup

    def add_grads(self, _slots, grads: torch.Tensor) -> None:
        """An output layout's sink: the per-value gradients go to the block's rows read."""
        self.block.add_grads(self.slots, grads)


@dataclass
class PooledHotRead:
    """One block's hot values of a batch of bags, pooled at its lookup (``pooled``: ``[bags, dim]``,
    the bags of the values' group part), and their block."""

    block: ReplicaBlock
    values: HotValues
    pooled: torch.Tensor

    def add_grads(self, scale: float, bag_grads: torch.Tensor) -> None:
        """An output layout's sink: the bags' gradients (``scale`` to apply) summed into each block
        row's, over the values that read it (one ``embedding_bag`` in row order), go to the block."""
        values = self.values
        if values.row_counts.numel() != self.block.weights.size(0):  # routed before the online profile chose
            self.block.add_grads(values.slots, bag_grads.index_select(0, values.bags), scale)  # these rows: none read
            return
        weights = None if values.weights is None else values.weights.index_select(0, values.by_row)
        row_grads = F.embedding_bag(
            values.bags.index_select(0, values.by_row), bag_grads, values.row_offsets, mode="sum",
            include_last_offset=True, per_sample_weights=weights,
        )  # fmt: skip
        self.block.add_row_grads(row_grads, values.row_counts.to(self.block.touches.dtype), scale)


def check_same_tiers(groups: list[ReplicaGroup], pg, device) -> None:
    """ValueError naming the tables whose hot rows differ between the ranks of ``pg`` (a collective).

    Every rank must route with the same tiers: ranks whose profiles differ (each profiled its own
    batches) would exchange ids and gradients by other layouts, which fails in a collective or, where
    the sizes happen to agree, trains on another rank's rows without a word."""
    mix = torch.tensor(0x9E3779B97F4A7C15 - 2**64, dtype=torch.int64)  # wraps: a cheap fingerprint of the ids
    mine = torch.tensor(
        [[g.hot.numel(), g.host.numel(), int((g.hot * mix).sum() + (g.host * mix * 3).sum())] for g in groups],
        dtype=torch.int64,
    ).to(device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(gathered, mine, group=pg)
    for index, g in enumerate(groups):
        seen = [tuple(t[index].tolist()) for t in gathered]
        if len(set(seen)) > 1:
            sizes = ", ".join(f"rank {r}: {s[0]} replicated, {s[1]} per host" for r, s in enumerate(seen))
            raise ValueError(
                f"het_row_replicated tables {[t.name for t in g.tables]}: the ranks hold different hot rows ({sizes}); "
                "every rank must take its tiers from the same access profile (one file, not each rank's own batches)"
            )


def pool_values(rows: torch.Tensor, values: HotValues) -> torch.Tensor:
    """``[bags, dim]``: the values' bags pooled from ``rows`` (their weights applied)."""
    weights = None if values.weights is None else values.weights.index_select(0, values.by_bag)
    return F.embedding_bag(
        values.slots.index_select(0, values.by_bag), rows, values.offsets, mode="sum",
        include_last_offset=True, per_sample_weights=weights,
    )  # fmt: skip


class ReplicaHolder:
    """Hot-row replicas of a ``het_row_replicated`` lookup's tables, their syncs, the owners' deferred
    steps, the stats and the checkpoint hooks (built once, a collective: it creates the groups it
    syncs on). Only the lookup and the backward it starts change it; the dists never see it.

    Args:
        kernels: the lookup's fused kernels (FBGEMM TBEs), one per grouped config.
        placement: the sharding's tables, tiers and layout (:class:`ReplicaPlacement`).
        pg: the sharding's process group.
        device: where the lookup computes.
        pooled: the lookup pools bags (its owner may pool and step its rows itself).

    Attributes:
        placement: the sharding's :class:`~torchrec_het.sharding.row_replicated.placement.ReplicaPlacement`.
        blocks: per group, the replicated rows' block; ``host_blocks``: the per-host rows this rank holds.
        hosts: the host subgroups the replicated rows' syncs run over.
        rank, world_size: this rank, the group's size.
        anchor: a tensor that requires grad: it puts replica reads in the autograd graph.
        owner: bags' :class:`~torchrec_het.sharding.row_replicated.owner.DirectOwner`, where the owner
            pools and steps its rows itself; None where its kernel's call serves.
        owed: exchanges whose owners' backward is still to run (:meth:`settle`).
        stats: counters (steps, skipped steps, syncs; the lookups add theirs).
    """

    def __init__(self, kernels: list, placement: ReplicaPlacement, pg, device=None, pooled: bool = False) -> None:
        self.kernels, self.placement = kernels, placement
        self.rank, self.world_size = placement.rank, placement.world_size
        self.device = device if device is not None else torch.device("cpu")
        self._sync_pg = dedicated_group(pg)  # the replica blocks' syncs
        # replicated rows' gradients sum within each host, then between host leaders (created once);
        # per-host rows' over their holders, this local rank on every host (None: one host)
        self.hosts = HostGroups(self._sync_pg, placement.local_world_size)
        self._holder_pg = holder_group(self._sync_pg, placement.local_world_size)
        # bags: the owner pools and steps its rows in its kernel where it can (owner.py), else the kernel's call
        self.owner = self._direct_owner() if pooled else None
        self._build_blocks()
        check_same_tiers(self.groups, self._sync_pg, self.device)
        self._needs_refresh = True
        self._refreshed_version = -1
        self.anchor = torch.zeros(1, device=self.device, requires_grad=True)
        self.owed: list = []
        self.stats = {"steps": 0, "skipped_steps": 0, "sparse_syncs": 0, "dense_syncs": 0, "host_syncs": 0}

    @property
    def layout(self):
        """The placement's id layout (read only here)."""
        return self.placement.layout

    @property
    def groups(self) -> list[ReplicaGroup]:
        """The placement's groups (one per width) the blocks were built from."""
        return self.placement.groups

    def _direct_owner(self) -> DirectOwner | None:
        """Bags: the owner that pools and steps its rows in its kernels (None: the kernels' call serves)."""
        tables = self.placement.tables
        where = {t.name: (t.module_index, t.table_index) for infos in tables.values() for t in infos}
        dims = [dim for dim, infos in tables.items() for _ in infos]
        at = torch.tensor([where[name] for _, name in self.placement.positions], dtype=torch.int64).view(-1, 2)
        return DirectOwner.of(self.kernels, dims, at[:, 0], at[:, 1], self.device)

    def _build_blocks(self) -> None:
        """Per group of the placement: the replicated rows' block (synced every ``replica_sync_every``
        steps over all ranks) and, on several hosts, the block of the per-host rows this rank holds
        (synced every step over their holders)."""
        groups = self.placement.groups
        self._built_version = self.layout.hot_version
        self.blocks = [
            self._block(g, g.hot, self.placement.settings.replica_sync_every, self._sync_pg, self.hosts) for g in groups
        ]
        self.host_blocks = [] if self._holder_pg is None else [
            self._block(g, g.host_block, 1, self._holder_pg, None) for g in groups
        ]  # fmt: skip

    def _all_blocks(self) -> list[ReplicaBlock]:
        return self.blocks + self.host_blocks

    def _block(self, g: ReplicaGroup, ids: torch.Tensor, sync_every: int, pg, hosts: HostGroups | None) -> ReplicaBlock:
        """The block of rows ``ids`` of group ``g`` (sorted fused ids), synced on ``pg`` (over ``hosts``)."""
        kernels = self.kernels
        tables = g.table_of(ids)
        module_of = torch.tensor([t.module_index for t in g.tables], dtype=torch.int64)
        table_of = torch.tensor([t.table_index for t in g.tables], dtype=torch.int64)
        names = {_tbe.replica_kind(kernels[t.module_index]) for t in g.tables}
        if len(names) > 1:
            raise ValueError(f"tables {[t.name for t in g.tables]} of width {g.dim} mix optimizers {sorted(names)}")
        eps = torch.tensor([_tbe.optimizer_eps(kernels[t.module_index]) for t in g.tables], dtype=torch.float64)[tables]
        mine = (g.owner_of(ids) == self.rank).nonzero().flatten()
        owned = []
        for module_index in torch.unique(module_of[tables[mine]]).tolist():  # once, at build
            part = mine[module_of[tables[mine]] == module_index]
            rows = g.local_rows(ids[part], tables[part])
            owned.append(owned_rows(kernels[module_index], table_of[tables[part]], rows, part, g.dim))
        return ReplicaBlock(
            ids, g.dim, names.pop(), kernels, module_of[tables], eps, owned, sync_every, pg, self.device, hosts=hosts,
            sync_dtype=self.placement.sync_dtype,
        )  # fmt: skip

    def replica_nbytes(self) -> int:
        """Bytes this rank holds beyond its shards: the replica blocks and the placement's route map."""
        return sum(b.nbytes() for b in self._all_blocks()) + self.layout.nbytes

    def settle(self) -> None:
        """Runs the owners' backward of earlier batches whose gradients this rank's kernels still owe
        (their exchanges are in ``owed``, left by a backward pass on the main thread)."""
        owed = self.owed[:]
        self.owed.clear()
        for exchange in owed:
            exchange.hand_over()

    def begin_read(self, hot_version: int) -> None:
        """Before a batch's rows are read: replicas copied if due, the previous replica sync applied.

        The first batch routed with newer hot rows (the online profile's end) gets blocks of them,
        copied from the owners; batches routed before still update the owners' copies first."""
        if hot_version > self._built_version and hot_version == self.layout.hot_version:
            for block in self._all_blocks():
                block.wait()  # what the old blocks started is applied (and written through) first
            self._build_blocks()
            self.stats["online_hot_rows"] = self.placement.online_hot_rows
        if self._needs_refresh or hot_version > self._refreshed_version:
            self.refresh()
            self._refreshed_version = hot_version
        for block in self.blocks:
            synced = block.wait()  # the previous step's replica sync
            self.stats["dense_syncs" if synced and block.last_sync_dense else "sparse_syncs"] += int(synced)
        for block in self.host_blocks:
            self.stats["host_syncs"] += int(block.wait())
        self.stats["steps"] += 1

    def refresh(self) -> None:
        """Copies every replica block's rows and state from their owners (a collective)."""
        for block in self._all_blocks():
            block.refresh()
        self._needs_refresh = False

    def read_hot(self, slots_per_block: list[torch.Tensor]) -> list[HotRead]:
        """At the lookup, right after :meth:`begin_read`: per block, the rows a batch reads.

        Copied now, beside the owners' pooling of the cold ids, so all of a batch's rows are read
        at one moment (why: docs/internals.md#row-replicated-holder). Their gradients go to the
        block the batch read."""
        return [
            HotRead(block, slots, block.weights.index_select(0, slots))
            for block, slots in zip(self.blocks, slots_per_block)
        ]

    def pool_hot(self, values_per_block: list[HotValues]) -> list[PooledHotRead]:
        """At the bag lookup, right after :meth:`begin_read`: per block, its values' bags pooled
        from its rows as they are now (one ``embedding_bag``; why now: :meth:`read_hot`)."""
        return [
            PooledHotRead(block, values, pool_values(block.weights, values))
            for block, values in zip(self.blocks, values_per_block)
        ]

    def read_host(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """At the lookup, on a holder: per group, (indexes of the ``slots`` its per-host block
        serves, those rows, differentiable: their gradients go to the block). Called at every
        lookup while there are per-host blocks (an empty read too: every holder's backward then
        takes part in the blocks' syncs)."""
        parts = self.layout.host_block_of(slots)
        return [(mine, read_rows(self.anchor, block, rows)) for (mine, rows), block in zip(parts, self.host_blocks)]

    def samples_read_here(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """bool ``[batch]``: samples whose ids are all hot or owned here (they need no other rank),
        on the batch's device (a data loader's batch may still be on the host)."""
        if features.variable_stride_per_key():
            raise ValueError("samples_read_here needs one batch size for every feature")
        batch, device = features.stride(), features.device()
        bags, ids = self.layout.flatten(features.to(self.device))
        _, _, cold, dest, _ = self.layout.split(ids)
        remote = cold.index_select(0, (dest != self.rank).nonzero().flatten())
        return (torch.bincount(bags.index_select(0, remote) % batch, minlength=batch) == 0).to(device)

    @torch.no_grad()
    def flush(self) -> None:
        """Applies owed and held gradients (a collective); shards then hold current rows."""
        self.settle()
        for block in self.blocks:
            self.stats["sparse_syncs"] += block.flush()
        for block in self.host_blocks:
            self.stats["host_syncs"] += block.flush()

    def purge(self) -> None:
        """Replicas are copied from the (loaded) shards again at the next forward (owed steps first);
        partials the owner read early (lookahead) are void."""
        self.settle()
        if self.owner is not None:
            self.owner.reloaded()
        for block in self._all_blocks():
            block.wait()
            block.drop_held()
        self._needs_refresh = True

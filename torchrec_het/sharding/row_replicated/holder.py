"""What both ``het_row_replicated`` lookups (bags and sequences) share.

:class:`ReplicaHolder` is the collaborator each lookup owns (``lookup.replicas``): it keeps the
id layout the dists route with, the hot-row replica blocks and their syncs, the online profile,
the stats and the checkpoint hooks; :class:`HotRead` is what one batch of sequences read of a block,
:class:`PooledHotRead` what one batch of bags pooled from it.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het import _tbe
from torchrec_het.plan_options import WIRE_DTYPES
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.hot_rows import hottest_rows, replication_threshold
from torchrec_het.sharding.common.groups import dedicated_group
from torchrec_het.sharding.common.id_space import TableInfo
from torchrec_het.sharding.row_replicated.batch import HotValues
from torchrec_het.sharding.row_replicated.owner import DirectOwner
from torchrec_het.sharding.row_replicated.replicas import ReplicaBlock, owned_rows, read_rows
from torchrec_het.sharding.row_replicated.routing import IdLayout, ReplicaGroup
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


def pool_values(rows: torch.Tensor, values: HotValues) -> torch.Tensor:
    """``[bags, dim]``: the values' bags pooled from ``rows`` (their weights applied)."""
    weights = None if values.weights is None else values.weights.index_select(0, values.by_bag)
    return F.embedding_bag(
        values.slots.index_select(0, values.by_bag), rows, values.offsets, mode="sum",
        include_last_offset=True, per_sample_weights=weights,
    )  # fmt: skip


class ReplicaHolder:
    """Hot-row replicas of a ``het_row_replicated`` lookup's tables, their syncs, the online profile,
    the stats and the checkpoint hooks (built once, a collective: it creates the groups it syncs on).

    Args:
        kernels: the lookup's fused kernels (FBGEMM TBEs), one per grouped config.
        grouped_configs: the lookup's grouped configs (TorchRec's row-wise grouping).
        pg: the sharding's process group.
        config: replication settings for these tables.
        shards_by_table: each table's shard metadata.
        device: where the lookup computes.
        pooled: the lookup pools bags (its owner may pool and step its rows itself).

    Attributes:
        layout: the :class:`~torchrec_het.sharding.row_replicated.routing.IdLayout` the dists route with.
        groups: one :class:`~torchrec_het.sharding.row_replicated.routing.ReplicaGroup` per width.
        blocks: per group, the replicated rows' block; ``host_blocks``: the per-host rows this rank holds.
        hosts: the host subgroups the replicated rows' syncs run over.
        exchange_pg: the group of the dists' exchanges.
        rank, world_size, wire: this rank, the group's size, the cold traffic's dtype.
        anchor: a tensor that requires grad: it puts replica reads in the autograd graph.
        owner: bags' :class:`~torchrec_het.sharding.row_replicated.owner.DirectOwner`, where the owner
            pools and steps its rows itself; None where its kernel's call serves.
        stats: counters (steps, skipped steps, syncs; the lookups add theirs).
    """

    def __init__(
        self, kernels: list, grouped_configs, pg, config: ReplicationConfig, shards_by_table, device=None,
        pooled: bool = False,
    ) -> None:  # fmt: skip
        self.kernels, self.config = kernels, config
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.wire = WIRE_DTYPES[config.wire_dtype]
        self.device = device if device is not None else torch.device("cpu")
        self._pg = pg
        self.exchange_pg = dedicated_group(pg)  # the dists' exchanges
        self._sync_pg = dedicated_group(pg)  # the replica blocks' syncs
        # replicated rows' gradients sum within each host, then between host leaders (created once);
        # per-host rows' over their holders, this local rank on every host (None: one host)
        self.hosts = HostGroups(self._sync_pg, config.ranks_per_host(self.world_size))
        self._holder_pg = holder_group(self._sync_pg, config.ranks_per_host(self.world_size))
        self._tables, tiers = self._table_infos(grouped_configs, config, shards_by_table)
        if self._holder_pg is None:  # one host: per-host rows are read from their owners, as cold ones
            tiers = {name: (replicated, per_host[:0]) for name, (replicated, per_host) in tiers.items()}
        self.groups = self._replica_groups(tiers)
        self.layout = self._id_layout().to(self.device)
        # bags: the owner pools and steps its rows in its kernel where it can (owner.py), else the kernel's call
        self.owner = self._direct_owner(grouped_configs) if pooled else None
        self._build_blocks()
        online = config.tiers is None and config.online_profile_steps > 0
        self._online_left = config.online_profile_steps if online else 0
        self._online_counts = (
            torch.zeros(self.layout.total_rows, dtype=torch.int64, device=self.device) if online else None
        )
        self._needs_refresh = True
        self._refreshed_version = -1
        self.anchor = torch.zeros(1, device=self.device, requires_grad=True)
        self.owed: list = []  # exchanges whose owners' backward is still to run (``settle``)
        self.stats = {"steps": 0, "skipped_steps": 0, "sparse_syncs": 0, "dense_syncs": 0, "host_syncs": 0}

    def _table_infos(self, grouped_configs, config: ReplicationConfig, shards_by_table):
        """Per width: the tables (in the sharding's order) and their tiers; and (width, table) per position."""
        by_dim: dict[int, list] = {}
        self._positions: list[tuple[int, str]] = []  # (width, table name) per position
        for module_index, group in enumerate(grouped_configs):
            for table_index, table in enumerate(group.embedding_tables):
                info = TableInfo.of(table, module_index, table_index, shards_by_table[table.name], self.world_size)
                by_dim.setdefault(table.embedding_dim, []).append(info)
                self._positions += [(table.embedding_dim, table.name)] * len(table.feature_names)
        tiers = {t.name: config.table_tiers(t.name, t.num_rows) for infos in by_dim.values() for t in infos}
        return by_dim, tiers

    def _direct_owner(self, grouped_configs) -> DirectOwner | None:
        """Bags: the owner that pools and steps its rows in its kernels (None: the kernels' call serves)."""
        dims, where = [], {}
        for module_index, group in enumerate(grouped_configs):
            for table_index, table in enumerate(group.embedding_tables):
                dims.append(table.embedding_dim)
                where[table.name] = (module_index, table_index)
        at = torch.tensor([where[name] for _, name in self._positions], dtype=torch.int64).view(-1, 2)
        return DirectOwner.of(self.kernels, dims, at[:, 0], at[:, 1], self.device)

    def _replica_groups(self, tiers: dict[str, tuple]) -> list[ReplicaGroup]:
        local_ws = self.config.ranks_per_host(self.world_size)
        return [
            ReplicaGroup(infos, [tiers[t.name] for t in infos], dim, self.rank, self.world_size, local_ws)
            for dim, infos in self._tables.items()
        ]

    def _id_layout(self) -> IdLayout:
        table_pos = {t.name: (gi, ti) for gi, g in enumerate(self.groups) for ti, t in enumerate(g.tables)}
        positions = [table_pos[name] for _, name in self._positions]
        mean = [self.groups[g].tables[t].mean for g, t in positions]
        local_ws = self.config.ranks_per_host(self.world_size)
        dims = [d for d, _ in self._positions]
        return IdLayout(self.groups, positions, dims, mean, self.world_size, self.rank, local_ws)

    def _build_blocks(self) -> None:
        """Per group: the replicated rows' block (synced every ``replica_sync_every`` steps over all
        ranks) and, on several hosts, the block of the per-host rows this rank holds (synced every
        step over their holders)."""
        self.blocks = [
            self._block(g, g.hot, self.config.replica_sync_every, self._sync_pg, self.hosts) for g in self.groups
        ]
        self.host_blocks = [] if self._holder_pg is None else [
            self._block(g, g.host_block, 1, self._holder_pg, None) for g in self.groups
        ]  # fmt: skip

    def _all_blocks(self) -> list[ReplicaBlock]:
        return self.blocks + self.host_blocks

    def observe(self, ids: torch.Tensor, training: bool) -> None:
        """From the input dist: moves started replica syncs on and, while the online profile runs,
        counts training batches' ids; after the last counted batch the hot rows are chosen (one all-reduce)."""
        for block in self._all_blocks():
            block.advance()
        if self._online_counts is None or not training:  # evaluation batches are not counted
            return
        if self._online_left > 0:
            self._online_counts.index_add_(0, ids, torch.ones_like(ids))
            self._online_left -= 1
            return
        counts, self._online_counts = self._online_counts, None
        dist.all_reduce(counts, group=self._pg)
        config, tiers = self.config, {}
        steps = config.online_profile_steps
        empty = torch.zeros(0, dtype=torch.int64)
        threshold = replication_threshold(self.world_size, config.replica_sync_every)
        for g, base in zip(self.groups, self.layout.group_base.tolist()):  # once, at the end of the profile
            for i, t in enumerate(g.tables):
                reads = counts[base + int(g.offsets[i]) : base + int(g.offsets[i + 1])].double().cpu() / steps
                tiers[t.name] = (
                    hottest_rows(reads, threshold, config.online_max_hot_fraction),
                    empty,
                )
        self.groups = self._replica_groups(tiers)
        self.layout.set_hot(self.groups)
        self._build_blocks()
        # replicas are copied from the owners at the first lookup of a batch routed with these rows:
        # batches already in flight (pipelined) still update the owners' copies first
        self.stats["online_hot_rows"] = self.stats.get("online_hot_rows", 0) + sum(g.hot.numel() for g in self.groups)

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
            ids, g.dim, names.pop(), kernels, module_of[tables], eps, owned, sync_every, pg, self.device, hosts=hosts
        )

    def replica_nbytes(self) -> int:
        """Bytes this rank holds beyond its shards: the replica blocks and the route map."""
        return sum(b.nbytes() for b in self._all_blocks()) + self.layout.nbytes

    def settle(self) -> None:
        """Runs the owners' backward of earlier batches whose gradients this rank's kernels still owe
        (their exchanges are in ``owed``, left by a backward pass on the main thread)."""
        owed = self.owed[:]
        self.owed.clear()
        for exchange in owed:
            exchange.hand_over()

    def begin_read(self, hot_version: int) -> None:
        """Before a batch's rows are read: replicas copied if due, the previous replica sync applied."""
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
        """Replicas are copied from the (loaded) shards again at the next forward (owed steps first)."""
        self.settle()
        for block in self._all_blocks():
            block.wait()
            block.drop_held()
        self._needs_refresh = True

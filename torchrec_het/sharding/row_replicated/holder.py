"""What both pipelined ``het_row_replicated`` lookups (bags and sequences) share.

:class:`ReplicaHolder` is the lookup mixin that keeps the hot-row replica blocks, their syncs,
the online profile and the checkpoint hooks; :class:`HotRead` is what one batch read of a block.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het import _tbe
from torchrec_het._compat import lookup_kernels
from torchrec_het.replication.config import WIRE_DTYPES, ReplicationConfig
from torchrec_het.replication.tiers import hottest_rows
from torchrec_het.sharding.common.groups import dedicated_group
from torchrec_het.sharding.common.id_space import TableInfo
from torchrec_het.sharding.row_replicated.replicas import ReplicaBlock, owned_rows
from torchrec_het.sharding.row_replicated.routing import IdLayout, ReplicaGroup
from torchrec_het.sharding.row_replicated.sync import HostGroups


@dataclass
class HotRead:
    """The replica rows one batch read at its lookup (one per value), and their block."""

    block: ReplicaBlock
    slots: torch.Tensor  # the block's row of each value read
    rows: torch.Tensor  # [values, dim]: those rows, as they were at the lookup

    def add_grads(self, _slots, grads: torch.Tensor) -> None:
        """An output layout's sink: the per-value gradients go to the block's rows read."""
        self.block.add_grads(self.slots, grads)


class ReplicaHolder:
    """Hot-row replicas, the online profile and checkpoint hooks of a pipelined lookup (a mixin).

    The lookup (a TorchRec grouped lookup: ``grouped_configs``, ``_emb_modules``) calls
    :meth:`init_holder` at the end of its ``__init__`` and :meth:`begin_read` before it reads rows.
    """

    def init_holder(self, pg, feature_names, config: ReplicationConfig, shards_by_table, device) -> None:
        """Builds the layout, the replica blocks and the owners' row views (call after the lookup's ``__init__``)."""
        self._pg = pg
        self._rank, self._ws = dist.get_rank(pg), dist.get_world_size(pg)
        self._config = config
        self._wire = WIRE_DTYPES[config.wire_dtype]
        self._features = list(feature_names)
        self._device = device if device is not None else torch.device("cpu")
        self._exchange_pg = dedicated_group(pg)  # the dists' exchanges
        self._sync_pg = dedicated_group(pg)  # the replica blocks' syncs
        # replicated rows' gradients sum within each host, then between host leaders (created once)
        self._hosts = HostGroups(self._sync_pg, config.ranks_per_host(self._ws))
        self._tables, tiers = self._table_infos(config, shards_by_table)
        self._groups = self._replica_groups(tiers)
        if any(g.host.numel() for g in self._groups):
            raise NotImplementedError("the pipelined het_row_replicated path has no per-host tier")
        self.layout = self._id_layout().to(self._device)
        self._blocks = [self._block(g) for g in self._groups]
        online = config.tiers is None and config.online_profile_steps > 0
        self._online_left = config.online_profile_steps if online else 0
        self._online_counts = torch.zeros(self.layout.total_rows, dtype=torch.int64, device=self._device) if online else None
        self._needs_refresh = True
        self._refreshed_version = -1
        self._anchor = torch.zeros(1, device=self._device, requires_grad=True)
        self.stats = {"steps": 0, "skipped_steps": 0, "sparse_syncs": 0, "dense_syncs": 0}

    def _table_infos(self, config: ReplicationConfig, shards_by_table):
        """Per width: the tables (in the sharding's order) and their tiers; and (width, table) per position."""
        by_dim: dict[int, list] = {}
        self._positions: list[tuple[int, str]] = []  # (width, table name) per position
        for module_index, group in enumerate(self.grouped_configs):
            for table_index, table in enumerate(group.embedding_tables):
                info = TableInfo.of(table, module_index, table_index, shards_by_table[table.name], self._ws)
                by_dim.setdefault(table.embedding_dim, []).append(info)
                self._positions += [(table.embedding_dim, table.name)] * len(table.feature_names)
        tiers = {t.name: config.table_tiers(t.name, t.num_rows) for infos in by_dim.values() for t in infos}
        return by_dim, tiers

    def _replica_groups(self, tiers: dict[str, tuple]) -> list[ReplicaGroup]:
        local_ws = self._config.ranks_per_host(self._ws)
        return [
            ReplicaGroup(infos, [tiers[t.name] for t in infos], dim, self._rank, self._ws, local_ws)
            for dim, infos in self._tables.items()
        ]

    def _id_layout(self) -> IdLayout:
        table_pos = {t.name: (gi, ti) for gi, g in enumerate(self._groups) for ti, t in enumerate(g.tables)}
        positions = [table_pos[name] for _, name in self._positions]
        mean = [self._groups[g].tables[t].mean for g, t in positions]
        return IdLayout(self._groups, positions, [d for d, _ in self._positions], mean, self._ws)

    def observe(self, ids: torch.Tensor) -> None:
        """From the input dist: moves started replica syncs on (their gradients' all-reduce
        overlaps this batch's ids); while the online profile runs, counts the ids, and after
        the last counted batch every rank's counts choose the hot rows (one all-reduce)."""
        for block in self._blocks:
            block.advance()
        if self._online_counts is None:
            return
        if self._online_left > 0:
            self._online_counts.index_add_(0, ids, torch.ones_like(ids))
            self._online_left -= 1
            return
        counts, self._online_counts = self._online_counts, None
        dist.all_reduce(counts, group=self._pg)
        config, tiers = self._config, {}
        steps = config.online_profile_steps
        empty = torch.zeros(0, dtype=torch.int64)
        for g, base in zip(self._groups, self.layout.group_base.tolist()):  # once, at the end of the profile
            for i, t in enumerate(g.tables):
                reads = counts[base + int(g.offsets[i]) : base + int(g.offsets[i + 1])].double().cpu() / steps
                tiers[t.name] = (hottest_rows(reads, 1.0 / config.replica_sync_every, config.online_max_hot_fraction), empty)
        self._groups = self._replica_groups(tiers)
        self.layout.set_hot(self._groups)
        self._blocks = [self._block(g) for g in self._groups]
        # replicas are copied from the owners at the first lookup of a batch routed with these rows:
        # batches already in flight (pipelined) still update the owners' copies first
        self.stats["online_hot_rows"] = self.stats.get("online_hot_rows", 0) + sum(g.hot.numel() for g in self._groups)

    def _block(self, g: ReplicaGroup) -> ReplicaBlock:
        kernels = [m.emb_module for m in lookup_kernels(self)]
        tables = g.table_of(g.hot)
        module_of = torch.tensor([t.module_index for t in g.tables], dtype=torch.int64)
        table_of = torch.tensor([t.table_index for t in g.tables], dtype=torch.int64)
        names = {_tbe.replica_kind(kernels[t.module_index]) for t in g.tables}
        if len(names) > 1:
            raise ValueError(f"tables {[t.name for t in g.tables]} of width {g.dim} mix optimizers {sorted(names)}")
        eps = torch.tensor([_tbe.optimizer_eps(kernels[t.module_index]) for t in g.tables], dtype=torch.float64)[tables]
        mine = (g.owner_of(g.hot) == self._rank).nonzero().flatten()
        owned = []
        for module_index in torch.unique(module_of[tables[mine]]).tolist():  # once, at build
            part = mine[module_of[tables[mine]] == module_index]
            rows = g.local_rows(g.hot[part], tables[part])
            owned.append(owned_rows(kernels[module_index], table_of[tables[part]], rows, part, g.dim))
        return ReplicaBlock(
            g.hot, g.dim, names.pop(), kernels, module_of[tables], eps, owned, self._config.replica_sync_every,
            self._sync_pg, self._device, hosts=self._hosts,
        )

    @property
    def groups(self) -> list[ReplicaGroup]:
        return self._groups

    @property
    def exchange_pg(self):
        """The process group of the dists' exchanges (one of the lookup's own)."""
        return self._exchange_pg

    def replica_nbytes(self) -> int:
        return sum(b.nbytes() for b in self._blocks)

    def begin_read(self, hot_version: int) -> None:
        """Before a batch's rows are read: replicas copied if due, the previous replica sync applied."""
        if self._needs_refresh or hot_version > self._refreshed_version:
            for block in self._blocks:
                block.refresh()
            self._needs_refresh = False
            self._refreshed_version = hot_version
        for block in self._blocks:
            self.stats["sparse_syncs"] += int(block.wait())  # the previous step's replica sync
        self.stats["steps"] += 1

    def read_hot(self, slots_per_block: list[torch.Tensor]) -> list[HotRead]:
        """At the lookup, right after :meth:`begin_read`: per block, the rows a batch reads.

        The rows are copied now, beside the owners' pooling of the cold ids, so every row of a
        batch is read at one moment even when its output dist finishes steps later (the hybrid
        pipeline looks a batch up k steps ahead and finishes it one step ahead: pooling hot rows
        then read them fresher than its cold rows, and cost AUC). Their gradients go to the
        block the batch read."""
        return [HotRead(block, slots, block.weights.index_select(0, slots)) for block, slots in zip(self._blocks, slots_per_block)]

    def prefetch(self, sparse_features: KeyedJaggedTensor, forward_stream=None, sharding_ctx=None) -> None:  # noqa: ARG002
        """TorchRec's prefetch of the kernels (the plugin lookups' signature: the batch's context unused)."""
        super().prefetch(sparse_features, forward_stream)

    def samples_read_here(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """bool ``[batch]``: samples whose ids are all hot or owned here (they need no other rank),
        on the batch's device (a data loader's batch may still be on the host)."""
        if features.variable_stride_per_key():
            raise ValueError("samples_read_here needs one batch size for every feature")
        batch, device = features.stride(), features.device()
        bags, ids = self.layout.flatten(features.to(self._device))
        hot_pos, owner, _ = self.layout.route(ids)
        remote = (hot_pos < 0) & (owner != self._rank)
        return (torch.bincount(bags[remote] % batch, minlength=batch) == 0).to(device)

    @torch.no_grad()
    def flush(self) -> None:
        """Applies held replica gradients (a collective); shards already hold current hot rows."""
        for block in self._blocks:
            self.stats["sparse_syncs"] += block.flush()
        super().flush()

    def purge(self) -> None:
        """Replicas are copied from the (loaded) shards again at the next forward."""
        for block in self._blocks:
            block.wait()
            block.drop_held()
        self._needs_refresh = True
        super().purge()

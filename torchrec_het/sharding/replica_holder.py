"""What both pipelined ``het_row_replicated`` lookups (bags and sequences) share.

:class:`IdLayout` is one id space over every table of a sharding (static indexes, built
once); :class:`ReplicaHolder` is the lookup mixin that keeps the hot-row replica blocks, their
syncs, the online profile and the checkpoint hooks.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import lookup_kernels, process_group_timeout, sharding_lookup_arguments
from torchrec_het.replication.config import WIRE_DTYPES, ReplicationConfig
from torchrec_het.replication.tiers import hottest_rows
from torchrec_het.sharding.id_space import TableInfo, flatten_batch, members, tensors_to
from torchrec_het.sharding.replica_group import ReplicaGroup
from torchrec_het.sharding.replica_store import ReplicaBlock, optimizer_name, owned_rows
from torchrec_het.sharding.replica_sync import HostGroups


class IdLayout:
    """Static indexes of a sharding's features, built once: one id space over every table.

    Positions are the sharding's features in order (a feature shared by two tables has two
    positions). Table t's row r is id ``base[t] + r``; ids of one width are contiguous, so
    the ids of a :class:`ReplicaGroup` (one width) are ``group_base[g] + its fused ids``.
    The output's bags of one group are one part of it (:meth:`group_part`, :meth:`group_bags`).
    """

    def __init__(self, groups: list[ReplicaGroup], positions: list[tuple[int, int]], dims: list[int], mean: list[bool], world_size: int):
        self.groups, self.world_size = groups, world_size
        sizes = torch.tensor([int(g.offsets[-1]) for g in groups], dtype=torch.int64)
        self.group_base = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(sizes, 0)[:-1]])
        # per position: its group and fused offset of its table
        self.position_group = torch.tensor([g for g, _ in positions], dtype=torch.int64)
        self.position_base = torch.tensor(
            [int(self.group_base[g]) + int(groups[g].offsets[t]) for g, t in positions], dtype=torch.int64
        )
        self.num_positions = len(positions)
        self.dims = torch.tensor(dims, dtype=torch.int64)
        self.columns = torch.cumsum(self.dims, 0) - self.dims
        self.width = int(self.dims.sum())
        self.uniform_dim = dims[0] if dims and all(d == dims[0] for d in dims) else None
        self.mean = torch.tensor(mean, dtype=torch.bool)
        self.has_mean = bool(self.mean.any())
        # per group (one width): its positions and output columns, one group after the other
        at = [[p for p, (g, _) in enumerate(positions) if g == i] for i in range(len(groups))]
        starts = self.columns.tolist()
        self.group_sizes = [len(ps) for ps in at]
        self.group_positions = torch.tensor([p for ps in at for p in ps], dtype=torch.int64)
        self.group_columns = torch.tensor([c for ps in at for p in ps for c in range(starts[p], starts[p] + dims[p])], dtype=torch.int64)
        local = {p: i for ps in at for i, p in enumerate(ps)}
        self.position_local = torch.tensor([local[p] for p in range(len(positions))], dtype=torch.int64)
        self.group_spans, first, column = [], 0, 0  # per group: its ranges in group_positions and group_columns
        for ps in at:
            width = sum(dims[p] for p in ps)
            self.group_spans.append((first, first + len(ps), column, column + width))
            first, column = first + len(ps), column + width
        self.owner_ends = torch.cat([self.group_base[i] + g.owner_ends for i, g in enumerate(groups)])
        self.bucket_start = torch.cat([torch.zeros(1, dtype=torch.int64), self.owner_ends[:-1]])
        self.total_rows = int(sizes.sum())
        self.set_hot(groups)

    def to(self, device: torch.device) -> "IdLayout":
        """Moves every index to ``device`` (where the batches arrive)."""
        self.device = device
        return tensors_to(self, device)

    def set_hot(self, groups: list[ReplicaGroup]) -> None:
        """Takes the hot rows of ``groups`` (same tables and widths; after an online profile)."""
        self.groups = groups
        self.hot_version = getattr(self, "hot_version", -1) + 1
        hot = [self.group_base[i] + g.hot for i, g in enumerate(groups)]
        self.hot_ids = torch.cat([torch.zeros(0, dtype=torch.int64)] + hot)
        counts = torch.tensor([h.numel() for h in hot], dtype=torch.int64)
        self.hot_start = torch.cumsum(counts, 0) - counts
        self.hot_group_ends = torch.cumsum(counts, 0)
        if getattr(self, "device", None) is not None:
            self.to(self.device)

    def route(self, ids: torch.Tensor):
        """(hot position in ``hot_ids`` or -1, owner rank, row in the owner's shard) of global ids."""
        is_hot, pos = members(self.hot_ids, ids)
        bucket = torch.bucketize(ids, self.owner_ends, right=True)
        return torch.where(is_hot, pos, -1), bucket % self.world_size, ids - self.bucket_start[bucket]

    def flatten(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bag of every value, as position * batch + sample; its global id): :func:`flatten_batch`."""
        return flatten_batch(features, self.position_base, "het_row_replicated")

    def hot_of(self, hot_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per replica block: (indexes of the values it serves, their rows in the block)."""
        block_of = torch.bucketize(hot_pos, self.hot_group_ends, right=True)
        out = []
        for index in range(len(self.groups)):
            mine = ((hot_pos >= 0) & (block_of == index)).nonzero().flatten()
            out.append((mine, hot_pos[mine] - self.hot_start[index]))
        return out

    def group_part(self, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the group's positions, its output columns; None when it is the only group)."""
        start, end, first, last = self.group_spans[group]
        return self.group_positions[start:end], None if len(self.group_sizes) == 1 else self.group_columns[first:last]

    def group_bags(self, bags: torch.Tensor, batch: int, group: int) -> torch.Tensor:
        """Bags (``position * batch + sample``) of ``group``'s positions as bags of its output part,
        sample by sample: ``sample * its positions + the position's index among them``."""
        if len(self.group_sizes) == 1:
            return bags % batch * self.num_positions + bags // batch
        return bags % batch * self.group_sizes[group] + self.position_local.index_select(0, bags // batch)

    def elements(self, rows: torch.Tensor, positions: torch.Tensor, row_width: int) -> torch.Tensor:
        """Flat indexes of the blocks (row, position) in a ``[*, width]`` matrix, for mixed widths."""
        widths = self.dims[positions]
        start = rows * row_width + self.columns[positions]
        first = torch.repeat_interleave(torch.cumsum(widths, 0) - widths, widths)
        base = torch.repeat_interleave(start, widths)
        return base + torch.arange(base.numel(), device=base.device) - first


def gather_counts(dest: torch.Tensor, batch: int, pg):
    """Starts the input dist's one all-gather: every rank's ids per destination and batch size.

    Returns (work, gathered): row s of ``gathered`` is rank s's counts, then its batch size.
    """
    world_size = dist.get_world_size(pg)
    counts = torch.cat([torch.bincount(dest, minlength=world_size), torch.tensor([batch], device=dest.device)])
    gathered = [torch.empty_like(counts) for _ in range(world_size)]
    return dist.all_gather(gathered, counts, group=pg, async_op=True), gathered


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
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self._ws))
        # The plugin's exchanges and replica syncs run on groups of their own, so they neither wait
        # behind nor hold up the model's other collectives (DDP's dense all-reduce) on the default group.
        timeout = process_group_timeout(pg)  # the parent's, not the backend's default
        self._exchange_pg = dist.new_group(ranks, backend=dist.get_backend(pg), use_local_synchronization=True, timeout=timeout)
        self._sync_pg = dist.new_group(ranks, backend=dist.get_backend(pg), use_local_synchronization=True, timeout=timeout)
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
        names = {optimizer_name(kernels[t.module_index]) for t in g.tables}
        if len(names) > 1:
            raise ValueError(f"tables {[t.name for t in g.tables]} of width {g.dim} mix optimizers {sorted(names)}")
        eps = torch.tensor([float(kernels[t.module_index].optimizer_args.eps) for t in g.tables], dtype=torch.float64)[tables]
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




class StagedSharding:
    """Mixin for a TorchRec row-wise sharding whose dists share its one lookup (``lookup_class``).

    Args (before the row-wise sharding's own): sharding_infos, env, then ``config``, the
    replication settings for these tables, and device.

    The sharding builds the lookup once (TorchRec asks for lookups before output dists and
    input dists last) and hands its layout and online profile to the input dist
    (``input_dist_class(layout, feature_names, pg)``), and itself to the output dist
    (``output_dist_class(lookup, pg)``); both run on the lookup's exchange group.
    """

    lookup_class: type
    input_dist_class: type
    output_dist_class: type

    def __init__(self, sharding_infos, env, config: ReplicationConfig, device=None, **kwargs) -> None:
        super().__init__(sharding_infos, env, device, **kwargs)
        self._config = config
        self.shards_by_table = {
            info.embedding_config.name: list(info.param_sharding.sharding_spec.shards) for info in sharding_infos
        }
        self._lookup = None

    def create_lookup(self, device=None, fused_params=None, feature_processor=None):
        if feature_processor is not None:
            raise NotImplementedError("het_row_replicated does not support feature processors")
        if self._lookup is None:
            arguments = sharding_lookup_arguments(self)
            if device is not None:
                arguments["device"] = device
            self._lookup = self.lookup_class(
                feature_names=self.feature_names(), config=self._config, shards_by_table=self.shards_by_table, **arguments
            )
        return self._lookup

    def create_input_dist(self, device=None):
        lookup = self.create_lookup()
        dist_ = self.input_dist_class(lookup.layout, self.feature_names(), lookup._exchange_pg)
        dist_.observe = lookup.observe
        return dist_

    def create_output_dist(self, device=None):
        lookup = self.create_lookup()
        return self.output_dist_class(lookup, lookup._exchange_pg)

"""``het_row_replicated`` for EmbeddingBagCollections, in TorchRec's three stages.

Row-wise shards (TorchRec's own, with their fused FBGEMM kernels) plus the hot rows of
every table replicated on every rank (:mod:`~torchrec_het.sharding.replica_store`).

input dist (:class:`ColdIdsDist`, two awaitables as TorchRec's row-wise dist)
  hot ids stay on the reader; every other id goes to its owner as (bag, row[, weight]).
  First awaitable: every rank's send counts (and batch size), one all-gather. Second: the
  ids, one all-to-all (none when no rank reads a row owned elsewhere: FAE's all-hot step).
lookup (:class:`ReplicatedBagLookup`, local compute)
  the owner pools what it received with its fused kernel, as stock row-wise does, and
  keeps only the partial sums of bags that had ids (DES); the reader pools its hot ids
  from the replica block.
output dist (:class:`PartialSumsDist`)
  partial sums back to their readers (one all-to-all, sparse: no empty bags), added to
  the hot partials, mean pooling applied. Backward: partial gradients go back the same
  way into the owners' fused kernels (their optimizer steps as in stock row-wise); hot
  gradients are summed over ranks by one asynchronous all-reduce (every
  ``replica_sync_every`` steps) applied before the next read.

With no hot rows this is row-wise sharding with sparse partial sums in place of the
reduce-scatter, and trains exactly as stock row-wise does.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, BaseSparseFeaturesDist
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.replication.config import WIRE_DTYPES, ReplicationConfig
from torchrec_het.replication.tiers import hottest_rows
from torchrec_het.sharding.exchange_async import Exchange, start_exchange
from torchrec_het.sharding.id_space import TableInfo, members, row_starts_from_shards
from torchrec_het.sharding.replica_group import ReplicaGroup
from torchrec_het.sharding.replica_store import ReplicaBlock, optimizer_name, owned_rows, pool_hot, state_width, step_rows
from torchrec_het.sharding.row_optim import _layout as row_layout

STEP_ATTR = "_het_replicated_step"  # where the input dist leaves a batch's bookkeeping on its KJT


@dataclass
class _Batch:
    """One batch's bookkeeping, from the input dist to the output dist."""

    batch: int
    hot_version: int  # the layout's hot rows this batch was routed with
    lengths: torch.Tensor  # [F * B] reader's bag lengths (mean pooling)
    hot: list  # per block: (slots, bags, weights) of the reader's hot values
    sent_entries: torch.Tensor  # reader: distinct (dest, position, sample) keys of cold values sent
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    local_only: bool = False
    served_entries: torch.Tensor | None = None  # owner: (source, position, sample) of bags received
    served_inverse: torch.Tensor | None = None  # owner: entry of each id received (in arrival order)
    received: torch.Tensor | None = None  # owner: int32 [ids, 2 or 3] (bag, row, weight bits), by source
    hot_pooled: list | None = None
    partials: torch.Tensor | None = None


class BagLayout:
    """Static indexes of a sharding's features, built once: one id space over every table.

    Positions are the sharding's features in order (a feature shared by two tables has two
    positions). Table t's row r is id ``base[t] + r``; ids of one width are contiguous, so
    the ids of a :class:`ReplicaGroup` (one width) are ``group_base[g] + its fused ids``.
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
        self.column_position = torch.repeat_interleave(torch.arange(len(dims)), self.dims)
        self.owner_ends = torch.cat([self.group_base[i] + g.owner_ends for i, g in enumerate(groups)])
        self.bucket_start = torch.cat([torch.zeros(1, dtype=torch.int64), self.owner_ends[:-1]])
        self.total_rows = int(sizes.sum())
        self.set_hot(groups)

    def to(self, device: torch.device) -> "BagLayout":
        """Moves every index to ``device`` (where the batches arrive)."""
        self.device = device
        for name, value in vars(self).items():
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.to(device))
        return self

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

    def elements(self, rows: torch.Tensor, positions: torch.Tensor, row_width: int) -> torch.Tensor:
        """Flat indexes of the blocks (row, position) in a ``[*, width]`` matrix, for mixed widths."""
        widths = self.dims[positions]
        start = rows * row_width + self.columns[positions]
        first = torch.repeat_interleave(torch.cumsum(widths, 0) - widths, widths)
        base = torch.repeat_interleave(start, widths)
        return base + torch.arange(base.numel(), device=base.device) - first


class _Splits(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """First stage: every rank's send counts known; starts the ids' all-to-all."""

    def __init__(self, dist_: "ColdIdsDist", step: _Batch, payload: torch.Tensor, width: int, work, gathered):
        super().__init__()
        self.dist, self.step, self.payload, self.width, self.work, self.gathered = dist_, step, payload, width, work, gathered

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        self.work.wait()
        ws, rank = self.dist.world_size, self.dist.rank
        table = torch.stack(self.gathered).tolist()  # [source][dest counts..., batch size]
        batches = {row[ws] for row in table}
        if len(batches) != 1:
            raise ValueError(f"het_row_replicated needs one batch size on every rank, got {sorted(batches)}")
        step = self.step
        step.send_splits = [table[rank][d] for d in range(ws)]
        step.recv_splits = [table[s][rank] for s in range(ws)]
        step.local_only = all(table[s][d] == 0 for s in range(ws) for d in range(ws) if s != d)
        exchange = start_exchange(
            self.payload.view(-1),
            [c * self.width for c in step.send_splits],
            [c * self.width for c in step.recv_splits],
            self.dist.pg,
            torch.int32,
            step.local_only,
        )
        return _Ids(self.dist, step, exchange, self.width)


class _Ids(Awaitable[KeyedJaggedTensor]):
    """Second stage: the ids received, as the KJT the owner's kernels pool."""

    def __init__(self, dist_: "ColdIdsDist", step: _Batch, exchange: Exchange, width: int):
        super().__init__()
        self.dist, self.step, self.exchange, self.width = dist_, step, exchange, width

    def _wait_impl(self) -> KeyedJaggedTensor:
        received = self.exchange.wait().view(-1, self.width)
        kjt = self.dist.owner_features(self.step, received)
        setattr(kjt, STEP_ATTR, self.step)
        return kjt


class ColdIdsDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Keeps hot ids on the reader and sends every other id to its owner."""

    def __init__(self, layout: BagLayout, feature_names: list[str], pg, device):
        super().__init__()
        self.layout, self.feature_names, self.pg = layout, feature_names, pg
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.device = device
        self.observe = None  # the lookup's online profile, while it runs

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        if sparse_features.variable_stride_per_key():
            raise NotImplementedError("het_row_replicated does not support variable batch sizes per feature")
        layout, ws = self.layout, self.world_size
        batch = sparse_features.stride()
        lengths = sparse_features.lengths().long()
        values = sparse_features.values().long()
        weights = sparse_features.weights_or_none()
        bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        ids = values + layout.position_base[bags // batch]
        if self.observe is not None:
            self.observe(ids)  # replica syncs move on; online profile: counts, at its end new hot rows
        hot_pos, owner, row = layout.route(ids)
        hot = []
        block_of = torch.bucketize(hot_pos, layout.hot_group_ends, right=True)
        for index in range(len(layout.groups)):
            mine = (hot_pos >= 0) & (block_of == index)
            by_sample = (bags[mine] % batch) * layout.num_positions + bags[mine] // batch  # output rows are (sample, position)
            hot.append((hot_pos[mine] - layout.hot_start[index], by_sample, None if weights is None else weights[mine]))
        cold = (hot_pos < 0).nonzero().flatten()
        order = torch.sort(owner[cold], stable=True).indices
        cold = cold[order]
        dest = owner[cold]
        columns = [bags[cold].to(torch.int32), row[cold].to(torch.int32)]
        if weights is not None:
            columns.append(weights[cold].float().view(torch.int32))
        payload = torch.stack(columns, 1)
        num_bags = lengths.numel()
        step = _Batch(batch, layout.hot_version, lengths, hot, torch.unique(dest * num_bags + bags[cold]))
        counts = torch.cat([torch.bincount(dest, minlength=ws), torch.tensor([batch], device=dest.device)])
        gathered = [torch.empty_like(counts) for _ in range(ws)]
        work = dist.all_gather(gathered, counts, group=self.pg, async_op=True)
        return _Splits(self, step, payload, len(columns), work, gathered)

    def owner_features(self, step: _Batch, received: torch.Tensor) -> KeyedJaggedTensor:
        """The (bag, row) pairs received, as a KJT of ``world_size * batch`` bags per position."""
        ws, batch, positions = self.world_size, step.batch, self.layout.num_positions
        device = received.device
        source = torch.repeat_interleave(torch.arange(ws, device=device), torch.tensor(step.recv_splits, device=device))
        bag = received[:, 0].long()
        # ids arrive by source, each source's in bag order: (source, position, sample) never decreases
        step.served_entries, step.served_inverse = torch.unique_consecutive(
            source * (positions * batch) + bag, return_inverse=True
        )
        step.received = received
        key = (bag // batch) * (ws * batch) + source * batch + bag % batch
        key, order = torch.sort(key, stable=True)
        lengths = torch.bincount(key, minlength=positions * ws * batch)
        weights = received[order, 2].view(torch.float32) if received.size(1) > 2 else None
        return KeyedJaggedTensor(
            keys=self.feature_names,
            values=received[order, 1].long(),
            lengths=lengths.int(),
            weights=weights,
            stride=ws * batch,
        )


class ReplicatedBagLookup(GroupedPooledEmbeddingsLookup):
    """The owner pools received ids with its fused kernels; the reader pools hot ids from replicas.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: the sharding's features.
        pg: the sharding's process group.
        config: replication settings (tiers, sync interval, wire dtype).
        shards_by_table: each table's shard metadata.
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names, pg, config: ReplicationConfig, shards_by_table, device=None, env=None):
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env)
        self._pg = pg
        self._rank, self._ws = dist.get_rank(pg), dist.get_world_size(pg)
        self._config = config
        self._wire = WIRE_DTYPES[config.wire_dtype]
        self._features = list(feature_names)
        self._device = device if device is not None else torch.device("cpu")
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self._ws))
        self._sync_pg = dist.new_group(ranks, backend=dist.get_backend(pg), use_local_synchronization=True)
        self._tables, tiers = self._table_infos(config, shards_by_table)
        self._groups = self._replica_groups(tiers)
        if any(g.host.numel() for g in self._groups):
            raise NotImplementedError("the pipelined het_row_replicated path has no per-host tier")
        self.layout = self._bag_layout().to(self._device)
        self._blocks = [self._block(g) for g in self._groups]
        online = config.tiers is None and config.online_profile_steps > 0
        self._online_left = config.online_profile_steps if online else 0
        self._online_counts = torch.zeros(self.layout.total_rows, dtype=torch.int64, device=self._device) if online else None
        self._owner = OwnerRows.of(self) if self.layout.uniform_dim is not None else None
        self._needs_refresh = True
        self._refreshed_version = -1
        self._anchor = torch.zeros(1, device=self._device, requires_grad=True)
        self.stats = {"steps": 0, "skipped_steps": 0, "sparse_syncs": 0, "dense_syncs": 0}
        self.last_batch: _Batch | None = None

    def _table_infos(self, config: ReplicationConfig, shards_by_table):
        """Per width: the tables (in the sharding's order) and their tiers; and (width, table) per position."""
        by_dim: dict[int, list] = {}
        self._positions: list[tuple[int, str]] = []  # (width, table name) per position
        for module_index, group in enumerate(self.grouped_configs):
            for table_index, table in enumerate(group.embedding_tables):
                info = TableInfo(
                    name=table.name,
                    features=tuple(table.feature_names),
                    num_rows=table.num_embeddings,
                    row_starts=row_starts_from_shards(shards_by_table[table.name], self._ws, table.name),
                    module_index=module_index,
                    table_index=table_index,
                    mean=table.pooling == PoolingType.MEAN,
                    learning_rate=0.0,
                )
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

    def _bag_layout(self) -> BagLayout:
        table_pos = {t.name: (gi, ti) for gi, g in enumerate(self._groups) for ti, t in enumerate(g.tables)}
        positions = [table_pos[name] for _, name in self._positions]
        mean = [self._groups[g].tables[t].mean for g, t in positions]
        return BagLayout(self._groups, positions, [d for d, _ in self._positions], mean, self._ws)

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
        kernels = [m.emb_module for m in self._emb_modules]
        tables = g.table_of(g.hot)
        module_of = torch.tensor([t.module_index for t in g.tables], dtype=torch.int64)
        table_of = torch.tensor([t.table_index for t in g.tables], dtype=torch.int64)
        names = {optimizer_name(kernels[t.module_index]) for t in g.tables}
        if len(names) > 1:
            raise ValueError(f"tables {[t.name for t in g.tables]} of width {g.dim} mix optimizers {sorted(names)}")
        eps = torch.tensor([float(kernels[t.module_index].optimizer_args.eps) for t in g.tables])[tables]
        mine = (g.owner_of(g.hot) == self._rank).nonzero().flatten()
        owned = []
        for module_index in torch.unique(module_of[tables[mine]]).tolist():  # once, at build
            part = mine[module_of[tables[mine]] == module_index]
            rows = g.local_rows(g.hot[part], tables[part])
            owned.append(owned_rows(kernels[module_index], table_of[tables[part]], rows, part, g.dim))
        return ReplicaBlock(
            g.hot, g.dim, names.pop(), kernels, module_of[tables], eps, owned, self._config.replica_sync_every,
            self._sync_pg, self._device,
        )

    @property
    def groups(self) -> list[ReplicaGroup]:
        return self._groups

    def replica_nbytes(self) -> int:
        return sum(b.nbytes() for b in self._blocks)

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        step: _Batch = getattr(sparse_features, STEP_ATTR)
        if self._needs_refresh or step.hot_version > self._refreshed_version:
            for block in self._blocks:
                block.refresh()
            self._needs_refresh = False
            self._refreshed_version = step.hot_version
        for block in self._blocks:
            self.stats["sparse_syncs"] += int(block.wait())  # the previous step's replica sync
        ws, batch, positions = self._ws, step.batch, self.layout.num_positions
        if self._owner is not None:  # one width: pool from the kernels' rows, update them in the backward
            step.partials = _OwnerPartials.apply(self._anchor, self._owner, step).reshape(-1)
        else:  # mixed widths: the kernels' own forward and fused backward over every bag
            pooled = super().forward(sparse_features)  # [ws * batch, width] partial sums
            source, rest = step.served_entries // (positions * batch), step.served_entries % (positions * batch)
            position, sample = rest // batch, rest % batch
            index = self.layout.elements(source * batch + sample, position, self.layout.width)
            step.partials = pooled.reshape(-1)[index]
        if self.layout.uniform_dim is None:  # one width: the output dist pools hot rows as it finishes the bags
            step.hot_pooled = [
                pool_hot(self._anchor, block, slots, bags, weights, positions * batch)
                for block, (slots, bags, weights) in zip(self._blocks, step.hot)
            ]
        self.stats["steps"] += 1
        self.stats["skipped_steps"] += int(step.local_only)
        self.last_batch = step
        return step.partials

    def samples_read_here(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """bool ``[batch]``: samples whose ids are all hot or owned here (they need no other rank)."""
        if features.variable_stride_per_key():
            raise ValueError("samples_read_here needs one batch size for every feature")
        batch = features.stride()
        lengths = features.lengths().long()
        bags = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
        hot_pos, owner, _ = self.layout.route(features.values().long() + self.layout.position_base[bags // batch])
        remote = (hot_pos < 0) & (owner != self._rank)
        return torch.bincount(bags[remote] % batch, minlength=batch) == 0

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
            block.pending.zero_()
            block.steps_held = 0
        self._needs_refresh = True
        super().purge()


class OwnerRows:
    """Where the rows of one-width tables live in the owner's kernels, built once.

    Per position: its kernel, the table's index there and the kernel row (of a
    ``[rows, dim]`` view of the kernel's flat weights) where the table's shard starts.
    """

    def __init__(self, kernels, views, states, kinds, kernel_of, table_of, first_row, first_state, dim):
        self.kernels, self.views, self.states, self.kinds, self.dim = kernels, views, states, kinds, dim
        self.kernel_of, self.table_of, self.first_row, self.first_state = kernel_of, table_of, first_row, first_state

    @classmethod
    def of(cls, lookup: "ReplicatedBagLookup") -> "OwnerRows | None":
        """None unless every kernel keeps fp32 rows of one width in one flat buffer, updatable row by row."""
        dim = lookup.layout.uniform_dim
        kernels = [m.emb_module for m in lookup._emb_modules]
        views, states, kinds, kernel_of, table_of, first_row, first_state = [], [], [], [], [], [], []
        for k, (kernel, config) in enumerate(zip(kernels, lookup.grouped_configs)):
            layout = row_layout(kernel)
            if layout is None or float(kernel.optimizer_args.weight_decay) != 0.0:
                return None
            flat = getattr(kernel, layout.weights).detach()
            offsets = torch.tensor(list(kernel.weights_physical_offsets), dtype=torch.int64)
            if flat.numel() % dim or bool((offsets % dim).any()):
                return None
            width = state_width(layout.kind, dim)
            views.append(flat.view(-1, dim))
            states.append(getattr(kernel, layout.state).detach().view(-1, width) if width else None)
            kinds.append(layout.kind)
            state_offsets = layout.state_offsets.cpu() if width else torch.zeros(len(config.embedding_tables), dtype=torch.int64)
            for t, table in enumerate(config.embedding_tables):
                count = len(table.feature_names)
                kernel_of += [k] * count
                table_of += [t] * count
                first_row += [int(offsets[t]) // dim] * count
                first_state += [int(state_offsets[t]) // max(width, 1)] * count
        device = views[0].device
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        return cls(
            kernels, views, states, kinds, as_tensor(kernel_of), as_tensor(table_of), as_tensor(first_row),
            as_tensor(first_state), dim,
        )

    @torch.no_grad()
    def step(self, k: int, positions: torch.Tensor, rows: torch.Tensor, view_rows: torch.Tensor, grads: torch.Tensor) -> None:
        """Kernel ``k``'s optimizer step on its rows ``view_rows`` (repeats summed, each row stepped once)."""
        if rows.numel() == 0:
            return
        uniq, inverse = torch.unique(view_rows, return_inverse=True)
        grad = torch.zeros(uniq.numel(), self.dim, device=grads.device).index_add_(0, inverse, grads)
        weights = self.views[k][uniq]
        kernel, kind = self.kernels[k], self.kinds[k]
        if self.states[k] is None:
            step_rows(kind, weights, None, grad, kernel.learning_rate_tensor, 0.0)
        else:
            first = torch.empty_like(uniq).scatter_(0, inverse, torch.arange(rows.numel(), device=rows.device))
            state_rows = self.first_state[positions[first]] + rows[first]
            state = self.states[k][state_rows]
            step_rows(kind, weights, state, grad, kernel.learning_rate_tensor, kernel.optimizer_args.eps)
            self.states[k][state_rows] = state
        self.views[k][uniq] = weights

    def parts(self, step: _Batch):
        """Per kernel: (positions of its received ids, their tables, their rows in the table's shard)."""
        received, batch = step.received, step.batch
        position = received[:, 0].long() // batch
        rows = received[:, 1].long()
        kernel = self.kernel_of[position]
        for k in range(len(self.kernels)):
            mine = (kernel == k).nonzero().flatten() if len(self.kernels) > 1 else torch.arange(rows.numel(), device=rows.device)
            yield k, mine, position[mine], rows[mine], self.first_row[position[mine]] + rows[mine]

    def weights_of(self, step: _Batch) -> torch.Tensor | None:
        received = step.received
        return received[:, 2].view(torch.float32) if received.size(1) > 2 else None


class _OwnerPartials(torch.autograd.Function):
    """``[entries, dim]`` partial sums of the ids received; the backward steps the owners' optimizer."""

    @staticmethod
    def forward(ctx, anchor, owner: OwnerRows, step: _Batch):  # noqa: ARG004
        ctx.owner, ctx.step = owner, step
        weights = owner.weights_of(step)
        partials = torch.zeros(step.served_entries.numel(), owner.dim, device=owner.views[0].device)
        for k, mine, _, _, view_rows in owner.parts(step):
            values = owner.views[k][view_rows]
            if weights is not None:
                values = values * weights[mine].unsqueeze(1)
            partials.index_add_(0, step.served_inverse[mine], values)
        return partials

    @staticmethod
    def backward(ctx, grad):
        owner, step = ctx.owner, ctx.step
        weights = owner.weights_of(step)
        for k, mine, positions, rows, view_rows in owner.parts(step):
            grads = grad[step.served_inverse[mine]]
            if weights is not None:
                grads = grads * weights[mine].unsqueeze(1)
            owner.step(k, positions, rows, view_rows, grads)
        return None, None, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class _FinishBags(torch.autograd.Function):
    """One width: ``[batch, width]`` bags from the hot rows and the partials received, mean applied.

    Rows are (sample, position), so the result is the output layout with no copy. The
    backward hands the hot rows' gradients to their replica blocks and returns the
    partials' gradients, both scaled as TorchRec's row-wise backward scales them.
    """

    @staticmethod
    def forward(ctx, received, anchor, blocks, step: _Batch, layout: BagLayout, place, scale):  # noqa: ARG004
        batch, positions, dim = step.batch, layout.num_positions, layout.uniform_dim
        out = torch.zeros(batch * positions, dim, device=received.device)
        for block, (slots, bags, weights) in zip(blocks, step.hot):
            values = block.weights[slots]
            out.index_add_(0, bags, values if weights is None else values * weights.unsqueeze(1))
        out.index_add_(0, place, received.view(-1, dim))
        ctx.blocks, ctx.step, ctx.layout, ctx.place, ctx.scale = blocks, step, layout, place, scale
        ctx.divisors = _divisors(layout, step, batch).unsqueeze(2) if layout.has_mean else None
        if ctx.divisors is not None:
            out = out.view(batch, positions, dim).div_(ctx.divisors)
        return out.view(batch, layout.width)

    @staticmethod
    def backward(ctx, grad):
        step, layout = ctx.step, ctx.layout
        batch, positions, dim = step.batch, layout.num_positions, layout.uniform_dim
        grad = grad.reshape(batch, positions, dim)
        if ctx.divisors is not None:
            grad = grad / ctx.divisors
        grad = grad.reshape(batch * positions, dim)
        for block, (slots, bags, weights) in zip(ctx.blocks, step.hot):
            values = grad[bags] * ctx.scale
            block.add_grads(slots, values if weights is None else values * weights.unsqueeze(1))
        return (grad[ctx.place] * ctx.scale).view(-1), None, None, None, None, None, None


class _Bags(Awaitable[torch.Tensor]):
    def __init__(self, dist_: "PartialSumsDist", step: _Batch, exchange: Exchange):
        super().__init__()
        self.dist, self.step, self.exchange = dist_, step, exchange

    def _wait_impl(self) -> torch.Tensor:
        return self.dist.finish(self.step, self.exchange.wait().float())


class PartialSumsDist(BaseEmbeddingDist):
    """Sends the owners' partial sums back to their readers and finishes the bags."""

    def __init__(self, lookup: ReplicatedBagLookup, pg):
        super().__init__()
        self._lookup = [lookup]  # not a submodule: the lookup is the sharded module's own
        self.pg, self.layout = pg, lookup.layout

    def forward(self, local_embs: torch.Tensor, sharding_ctx=None) -> Awaitable[torch.Tensor]:
        lookup = self._lookup[0]
        step = lookup.last_batch
        layout = self.layout
        ws, batch, positions = lookup._ws, step.batch, layout.num_positions
        served_source = step.served_entries // (positions * batch)
        send_rows = torch.bincount(served_source, minlength=ws)
        recv_rows = torch.bincount(step.sent_entries // (positions * batch), minlength=ws)
        if layout.uniform_dim is not None:
            splits = torch.cat([send_rows, recv_rows]) * layout.uniform_dim
        else:  # elements: each entry is as wide as its position's table
            served_pos = (step.served_entries % (positions * batch)) // batch
            sent_pos = (step.sent_entries % (positions * batch)) // batch
            send_elements = torch.bincount(served_source, layout.dims[served_pos].double(), minlength=ws)
            recv_elements = torch.bincount(step.sent_entries // (positions * batch), layout.dims[sent_pos].double(), minlength=ws)
            splits = torch.cat([send_elements, recv_elements]).long()
        splits = splits.tolist()  # the output dist's one host sync
        send, recv = splits[:ws], splits[ws:]
        exchange = start_exchange(local_embs, send, recv, self.pg, lookup._wire, step.local_only)
        return _Bags(self, step, exchange)

    def finish(self, step: _Batch, received: torch.Tensor) -> torch.Tensor:
        """``[batch, width]`` bags: hot partials plus the partials received, mean applied."""
        layout, batch, positions = self.layout, step.batch, self.layout.num_positions
        rest = step.sent_entries % (positions * batch)
        position, sample = rest // batch, rest % batch
        lookup = self._lookup[0]
        scale = 1.0 / lookup._ws if get_gradient_division() else 1.0  # as TorchRec's row-wise backward
        if layout.uniform_dim is not None:
            return _FinishBags.apply(received, lookup._anchor, lookup._blocks, step, layout, sample * positions + position, scale)
        else:
            out = torch.zeros(batch * layout.width, device=received.device)
            for block, pooled in zip(self._lookup[0]._blocks, step.hot_pooled):
                mine = (layout.dims == block.dim).nonzero().flatten()
                rows = pooled.view(batch, positions, block.dim)[:, mine]  # [batch, mine, dim]
                index = layout.elements(
                    torch.arange(batch, device=out.device).repeat_interleave(mine.numel()), mine.repeat(batch), layout.width
                )
                out = out.index_add(0, index, rows.reshape(-1))
            out = out.index_add(0, layout.elements(sample, position, layout.width), received)
            out = out.view(batch, layout.width)
            if layout.has_mean:
                out = out / _divisors(layout, step, batch)[:, layout.column_position]
        return _ScaleGrad.apply(out, scale)


def _divisors(layout: BagLayout, step: _Batch, batch: int) -> torch.Tensor:
    """``[batch, positions]``: bag length for mean-pooled positions, else 1."""
    lengths = step.lengths.view(layout.num_positions, batch).t()
    return torch.where(layout.mean.unsqueeze(0), lengths.clamp(min=1), 1).float()


class PipelinedRowReplicatedSharding(RwPooledEmbeddingSharding):
    """``het_row_replicated`` bags: row-wise shards, hot replicas, partial sums, in TorchRec's stages.

    Args:
        sharding_infos: TorchRec's per-table sharding infos.
        env: sharding environment.
        config: replication settings for these tables.
        device: compute device.
    """

    sharding_type = "het_row_replicated"

    def __init__(self, sharding_infos, env, config: ReplicationConfig, device=None, **kwargs) -> None:
        super().__init__(sharding_infos, env, device, **kwargs)
        self._config = config
        self.shards_by_table = {
            info.embedding_config.name: list(info.param_sharding.sharding_spec.shards) for info in sharding_infos
        }
        self._lookup: ReplicatedBagLookup | None = None

    def create_lookup(self, device=None, fused_params=None, feature_processor=None) -> ReplicatedBagLookup:
        if feature_processor is not None:
            raise NotImplementedError("het_row_replicated does not support feature processors")
        if self._lookup is not None:  # the dists share the lookup's layout: build it once
            return self._lookup
        self._lookup = ReplicatedBagLookup(
            self._grouped_embedding_configs,
            self.feature_names(),
            self._pg,
            self._config,
            self.shards_by_table,
            device=device if device is not None else self._device,
            env=self._env,
        )
        return self._lookup

    def _layout(self) -> BagLayout:
        if self._lookup is None:
            self.create_lookup()
        return self._lookup.layout

    def create_input_dist(self, device=None) -> ColdIdsDist:
        dist_ = ColdIdsDist(self._layout(), self.feature_names(), self._pg, device or self._device)
        dist_.observe = self._lookup.observe
        return dist_

    def create_output_dist(self, device=None) -> PartialSumsDist:
        self._layout()
        return PartialSumsDist(self._lookup, self._pg)

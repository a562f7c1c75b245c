"""The lookup of ``het_cached_row_wise``: owned rows locally, remote rows from a stale-tolerant cache.

Each rank owns a row range of every table (TorchRec's row-wise shard, held by the
stock fused FBGEMM kernel this class extends) and caches rows of the other ranges.
A step, for the distinct ids of the local batch (tables of one dim and one cache
setting are handled together, see :mod:`torchrec_het.sharding.het_group`):

forward (read path)
  owned rows come from the local shard; a remote row is served from the cache when
  the bound allows (``het``: the owner, asked with the cached version, sends the row
  only on a miss or when it is more than ``s_read`` updates ahead; ``lease``: no
  question at all until ``s_read`` steps after the row was last fetched or
  validated); missing rows are fetched and cached (evicting by LRU or LFU). Bags are
  pooled here, on the rank that holds the batch: nothing pooled crosses the wire.
backward (write path)
  gradients of owned rows, of rows that found no cache slot, of cached rows with more
  than ``s_write`` pending updates, and of dirty rows evicted this step go to their
  owners, which apply the table's fused optimizer (one update per row per step with
  the summed gradient, as stock row-wise does) and bump the row's version by the
  number of updates received. Other cached rows keep their gradient pending and get
  a local SGD step so later reads see this rank's own writes.

With ``s_read = s_write = 0`` every remote row is fetched fresh and every gradient is
applied at its owner in the step it is produced: the same training as stock row-wise.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.cache import PendingRows
from torchrec_het.config import HetCacheConfig
from torchrec_het.sharding.exchange import exchange_counts, exchange_flat
from torchrec_het.sharding.het_group import HetGroup
from torchrec_het.sharding.id_space import TableInfo, row_starts_from_shards
from torchrec_het.sharding.row_apply import accumulates_squares, apply_row_grads


@dataclass
class _Read:
    """One group's read of one step, kept for the backward of that step."""

    lengths: torch.Tensor  # [F * B] bag lengths, features of the group one after the other
    weights: torch.Tensor | None  # per-id weights, or None
    uniq: torch.Tensor  # distinct fused ids of the batch, ascending
    inverse: torch.Tensor  # position in uniq of every id
    uses: torch.Tensor  # occurrences of each distinct id
    tables: torch.Tensor  # group table index of each distinct id
    local: torch.Tensor  # positions in uniq of owned ids
    remote: torch.Tensor  # positions in uniq of ids owned elsewhere
    slots: torch.Tensor  # cache slot of each remote id (-1: none this step)
    uncached_rows: torch.Tensor | None = None  # fetched rows without a slot, for remote[slots < 0]
    rows: torch.Tensor | None = None  # [len(uniq), dim] values used this step


class HetCachedEmbeddingLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's row-wise fused lookup plus the HET read and write protocol.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: input feature order (the sharding's ``feature_names()``).
        pg: the process group of the sharding.
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names: list[str], pg, device=None, env=None) -> None:
        super().__init__(
            grouped_configs=grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env
        )
        self._pg = pg
        self._rank = dist.get_rank(pg)
        self._ws = dist.get_world_size(pg)
        self._features = list(feature_names)
        self._groups: list[HetGroup] = []
        self._outbox: list[list[PendingRows]] = []
        self._weights: list[list[torch.Tensor]] = []
        self._step = 0
        self._anchor = torch.zeros(1, requires_grad=True)  # lets backward reach the write path
        self.on_serve: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, int], None] | None = None

    # --- set-up and inspection --------------------------------------------------------

    def attach_cache(self, config: HetCacheConfig, shards_by_table: dict[str, list]) -> None:
        """Creates the per-group state; called once by the sharded module after construction."""
        by_key: dict[tuple, list[TableInfo]] = {}
        for module_index, group in enumerate(self.grouped_configs):
            lr = float((group.fused_params or {}).get("learning_rate", 0.01))
            for table_index, table in enumerate(group.embedding_tables):
                info = TableInfo(
                    name=table.name,
                    features=tuple(table.feature_names),
                    num_rows=table.num_embeddings,
                    row_starts=row_starts_from_shards(shards_by_table[table.name], self._ws, table.name),
                    module_index=module_index,
                    table_index=table_index,
                    mean=table.pooling == PoolingType.MEAN,
                    learning_rate=lr,
                )
                by_key.setdefault((table.embedding_dim, config.for_table(table.name)), []).append(info)
        self._groups = [HetGroup(tables, dim, settings, self._rank, self._ws) for (dim, settings), tables in by_key.items()]
        self._outbox = [[] for _ in self._groups]

    @property
    def groups(self) -> list[HetGroup]:
        return self._groups

    def cache_stats(self) -> dict[str, dict]:
        """Per table: lookups, hits (distinct ids and all lookups), requests, rows fetched and
        pushed, evictions, dirty evictions, staleness histogram, gradient mass produced/applied."""
        return {t.name: g.stats.table(i) for g in self._groups for i, t in enumerate(g.tables)}

    def reset_cache_stats(self) -> None:
        for g in self._groups:
            g.stats = type(g.stats)(len(g.tables), g.dim)

    # --- forward: the read path -------------------------------------------------------

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if sparse_features.variable_stride_per_key():
            raise NotImplementedError("het_cached_row_wise does not support variable batch sizes per feature")
        step = self._step
        self._step += 1
        self._weights = [m.split_embedding_weights() for m in self._emb_modules]  # views of the local shards
        by_feature = sparse_features.to_dict()
        reads = []
        for g in self._groups:
            read = self._plan_read(g, by_feature, step)
            self._fetch(g, read, step)
            read.rows = self._gather_rows(g, read)
            reads.append(read)
        return _HetPooling.apply(self._anchor, self, reads, sparse_features.stride())

    def _table_weights(self, g: HetGroup) -> list[torch.Tensor]:
        return [self._weights[t.module_index][t.table_index] for t in g.tables]

    def _plan_read(self, g: HetGroup, by_feature, step: int) -> _Read:
        jts = [by_feature[f] for f in g.features]
        lengths = torch.cat([jt.lengths() for jt in jts]).long()
        weights = [jt.weights_or_none() for jt in jts]
        per_feature = torch.tensor([jt.values().numel() for jt in jts], dtype=torch.int64)
        value_table = torch.repeat_interleave(g.feature_table, per_feature)
        ids = torch.cat([jt.values() for jt in jts]).long() + g.offsets[value_table]
        uniq, inverse, uses = torch.unique(ids, return_inverse=True, return_counts=True)
        owned = g.owner_of(uniq) == self._rank
        local, remote = owned.nonzero().flatten(), (~owned).nonzero().flatten()
        uniq_table = g.table_of(uniq)
        read = _Read(
            lengths, torch.cat(weights) if weights[0] is not None else None,
            uniq, inverse, uses, uniq_table, local, remote, g.cache.slots_of(uniq[remote]),
        )
        g.stats.add("lookups", value_table)
        g.stats.add("unique_lookups", uniq_table)
        g.stats.add("remote_unique", uniq_table[remote])
        g.stats.add("remote_lookups", uniq_table[remote], uses[remote])
        return read

    def _asked(self, g: HetGroup, read: _Read, step: int) -> torch.Tensor:
        """Positions in ``read.remote`` of the ids to ask their owners about."""
        if g.settings.protocol == "het":
            return torch.arange(read.remote.numel())
        slots = read.slots
        leased = (slots >= 0) & (step <= g.cache.validated_step[slots.clamp(min=0)] + g.settings.s_read)
        return (~leased).nonzero().flatten()

    def _read_bound(self, g: HetGroup) -> int:
        # lease: a renewal brings the row whenever the owner has moved on at all
        return g.settings.s_read if g.settings.protocol == "het" else 0

    def _fetch(self, g: HetGroup, read: _Read, step: int) -> None:
        """Asks owners about the rows the bound does not cover; settles the answers into the cache."""
        ws, dim, cache = self._ws, g.dim, g.cache
        asked = self._asked(g, read, step)
        ids = read.uniq[read.remote[asked]]
        dest = g.owner_of(ids)
        order = torch.sort(dest, stable=True).indices  # exchange order: by owner, then ascending id
        asked, ids, dest = asked[order], ids[order], dest[order]
        slots = read.slots[asked]
        held = torch.where(slots >= 0, cache.versions[slots.clamp(min=0)], -1)
        g.stats.add("requests", read.tables[read.remote[asked]])
        counts = torch.bincount(dest, minlength=ws)
        recv_counts = exchange_counts(counts.view(ws, 1), self._pg).view(ws)
        requests = exchange_flat(
            torch.stack([ids, held], 1).view(-1), (counts * 2).tolist(), (recv_counts * 2).tolist(), self._pg
        ).view(-1, 2)
        current = g.versions[g.local_index(requests[:, 0])]
        replies = exchange_flat(current, recv_counts.tolist(), counts.tolist(), self._pg)
        # Both sides apply the same rule to (held version, owner version): which requests bring a row.
        bound = self._read_bound(g)
        sends = (requests[:, 1] < 0) | (current - requests[:, 1] > bound)
        brings = (held < 0) | (replies - held > bound)
        source = torch.repeat_interleave(torch.arange(ws), recv_counts)
        rows_out = torch.bincount(source[sends], minlength=ws)
        rows_in = torch.bincount(dest[brings], minlength=ws)
        rows = exchange_flat(
            g.read_owned(requests[sends, 0], self._table_weights(g)).view(-1),
            (rows_out * dim).tolist(),
            (rows_in * dim).tolist(),
            self._pg,
        ).view(-1, dim)
        self._settle(g, read, asked, replies, brings, rows, step)

    def _settle(self, g: HetGroup, read: _Read, asked, versions, brings, rows, step: int) -> None:
        """Requester side: refresh stale copies, cache new rows, renew leases, count."""
        cache, stats = g.cache, g.stats
        asked_slots = read.slots[asked]
        asked_tables = read.tables[read.remote[asked]]
        fresh = ~brings  # the owner kept the row: the cached copy is within the bound
        if g.settings.protocol == "lease":
            held = asked_slots >= 0  # how far each leased copy fell behind while served unasked
            stats.add_staleness(asked_tables[held], versions[held] - cache.versions[asked_slots[held]])
            cache.mark_validated(asked_slots[fresh], step)
        else:
            stats.add_staleness(asked_tables[fresh], versions[fresh] - cache.versions[asked_slots[fresh]])
        row_of = torch.cumsum(brings.long(), 0) - 1  # index into rows of each request that brought one
        stale = brings & (asked_slots >= 0)
        cache.refresh(asked_slots[stale], rows[row_of[stale]], versions[stale], step)
        missing = brings & (asked_slots < 0)
        in_use = read.slots[read.slots >= 0]
        new_slots, dirty, evicted = cache.insert(
            read.uniq[read.remote[asked[missing]]], rows[row_of[missing]], versions[missing], step, protect=in_use
        )
        read.slots[asked[missing]] = new_slots
        read.uncached_rows = rows[row_of[missing]][new_slots < 0]
        if len(dirty):
            self._outbox[self._groups.index(g)].append(dirty)
            stats.add("dirty_evictions", g.table_of(dirty.ids))
        stats.add("rows_fetched", asked_tables[brings])
        stats.add("evictions", g.table_of(evicted))
        served = torch.ones(read.remote.numel(), dtype=torch.bool)
        served[asked[brings]] = False
        remote_tables = read.tables[read.remote]
        stats.add("hits_unique", remote_tables[served])
        stats.add("hits_lookups", remote_tables[served], read.uses[read.remote[served]])
        cached = read.slots >= 0
        cache.touch(read.slots[cached], step, read.uses[read.remote[cached]])
        if self.on_serve is not None:
            hit = read.slots[served]
            ids, tables = read.uniq[read.remote[served]], remote_tables[served]
            for i, t in enumerate(g.tables):
                mine = tables == i
                self.on_serve(t.name, ids[mine] - g.offsets[i], cache.versions[hit[mine]], cache.validated_step[hit[mine]], step)

    def _gather_rows(self, g: HetGroup, read: _Read) -> torch.Tensor:
        rows = torch.empty(read.uniq.numel(), g.dim)
        rows[read.local] = g.read_owned(read.uniq[read.local], self._table_weights(g))
        cached = read.slots >= 0
        rows[read.remote[cached]] = g.cache.values[read.slots[cached]]
        rows[read.remote[~cached]] = read.uncached_rows
        return rows

    # --- backward: the write path -----------------------------------------------------

    def write_back(self, reads: list[_Read], row_grads: list[torch.Tensor]) -> None:
        """Called by the backward of a step with the gradient of every distinct row it read."""
        scale = 1.0 / self._ws if get_gradient_division() else 1.0  # as TorchRec's row-wise backward
        for index, (g, read, grad) in enumerate(zip(self._groups, reads, row_grads)):
            grad = grad * scale
            g.stats.add_mass("grad_produced", read.tables, grad)
            cached = read.slots >= 0
            slots, cached_grad = read.slots[cached], grad[read.remote[cached]]
            lr = g.learning_rates[read.tables[read.remote[cached]]].unsqueeze(1)
            g.cache.accumulate(slots, cached_grad, -lr * cached_grad)
            uncached = read.remote[~cached]
            parts = [
                PendingRows(read.uniq[read.local], grad[read.local], torch.ones_like(read.local)),
                PendingRows(read.uniq[uncached], grad[uncached], torch.ones_like(uncached)),
                g.cache.take_due(g.settings.s_write),
                *self._outbox[index],
            ]
            self._outbox[index] = []
            self._push(g, PendingRows.concat(parts))

    @torch.no_grad()
    def flush(self) -> None:
        """Pushes every pending gradient to its owner (a collective: every rank calls it)."""
        for index, g in enumerate(self._groups):
            pending = PendingRows.concat([g.cache.take_all(), *self._outbox[index]])
            self._outbox[index] = []
            self._push(g, pending)
        super().flush()

    def purge(self) -> None:
        """Forgets cached rows, pending gradients and versions (before a load)."""
        for index, g in enumerate(self._groups):
            g.reset()
            self._outbox[index] = []
        super().purge()

    def _push(self, g: HetGroup, pending: PendingRows) -> None:
        ws, dim = self._ws, g.dim
        dest = g.owner_of(pending.ids)
        order = torch.sort(dest, stable=True).indices
        counts = torch.bincount(dest, minlength=ws)
        recv_counts = exchange_counts(counts.view(ws, 1), self._pg).view(ws)
        headers = exchange_flat(
            torch.stack([pending.ids, pending.counts], 1)[order].view(-1),
            (counts * 2).tolist(),
            (recv_counts * 2).tolist(),
            self._pg,
        ).view(-1, 2)
        grads = exchange_flat(
            pending.grads[order].reshape(-1), (counts * dim).tolist(), (recv_counts * dim).tolist(), self._pg
        ).view(-1, dim)
        g.stats.add("rows_pushed", g.table_of(pending.ids[dest != self._rank]))
        self._apply(g, headers[:, 0], grads, headers[:, 1])

    @torch.no_grad()
    def _apply(self, g: HetGroup, ids: torch.Tensor, grads: torch.Tensor, updates: torch.Tensor) -> None:
        """Owner side: one fused-optimizer step per owned row with the summed gradient; versions move on.

        The local shard's fused kernel does the update: every (row, gradient) pair becomes
        a bag of one row whose pooled output gets that gradient; the kernel sums the
        gradients of a row and applies the table's optimizer once, as in stock row-wise.
        A pushed sum of k > 1 held-back gradients is scaled by 1/sqrt(k) for Adagrad-family
        optimizers so their squared-gradient state grows as it would over k steps.
        """
        if ids.numel() == 0:
            return
        tables = g.table_of(ids)
        rows = g.local_rows(ids, tables)
        for module_index in sorted({t.module_index for t in g.tables}):
            in_module = torch.tensor([t.module_index == module_index for t in g.tables])[tables]
            if bool(in_module.any()):
                step = grads[in_module]
                if accumulates_squares(self._emb_modules[module_index].emb_module):
                    # k held-back gradients g_i arrive as their sum. Adagrad-family state adds the
                    # square of what it is given: the sum would add (sum g_i)^2 ~ k^2 g^2 where k
                    # separate steps add k g^2, and the row would learn ever slower. Sending
                    # sum / sqrt(k) adds exactly k g^2 when the parts are equal; k = 1 is unchanged.
                    step = step / updates[in_module].clamp(min=1).double().sqrt().to(step.dtype).unsqueeze(1)
                table_index = torch.tensor([t.table_index for t in g.tables])[tables[in_module]]
                apply_row_grads(self._emb_modules[module_index].emb_module, table_index, rows[in_module], step)
        g.versions.index_add_(0, g.local_index(ids), updates)
        g.stats.add_mass("grad_applied", tables, grads)


class _HetPooling(torch.autograd.Function):
    """Pools the bags from the rows read this step; its backward runs the write path."""

    @staticmethod
    def forward(ctx, anchor, lookup, reads, batch):  # noqa: ARG004
        ctx.lookup, ctx.reads, ctx.batch = lookup, reads, batch
        blocks = {}
        for g, read in zip(lookup.groups, reads):
            pooled = _pool(g, read, batch)
            blocks.update(zip(g.features, pooled.unbind(0)))
        if not blocks:
            return torch.empty(batch, 0)
        return torch.cat([blocks[f] for f in lookup._features], dim=1)

    @staticmethod
    def backward(ctx, grad_output):
        lookup, reads = ctx.lookup, ctx.reads
        columns, start = {}, 0
        dims = {f: g.dim for g in lookup.groups for f in g.features}
        for feature in lookup._features:
            columns[feature] = grad_output[:, start : start + dims[feature]]
            start += dims[feature]
        row_grads = [
            _row_grads(g, read, torch.stack([columns[f] for f in g.features])) for g, read in zip(lookup.groups, reads)
        ]
        lookup.write_back(reads, row_grads)
        return None, None, None, None


def _pool(g: HetGroup, read: _Read, batch: int) -> torch.Tensor:
    """[F, B, dim] pooled bags of the group's features."""
    bags = torch.repeat_interleave(torch.arange(read.lengths.numel()), read.lengths)
    values = read.rows[read.inverse]
    if read.weights is not None:
        values = values * read.weights.unsqueeze(1)
    pooled = torch.zeros(read.lengths.numel(), g.dim).index_add_(0, bags, values)
    return (pooled / g.bag_divisors(read.lengths, batch)).view(len(g.features), batch, g.dim)


def _row_grads(g: HetGroup, read: _Read, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of every distinct row from the gradient [F, B, dim] of the group's pooled bags."""
    batch = grad.size(1)
    bag_grad = grad.reshape(-1, g.dim) / g.bag_divisors(read.lengths, batch)
    per_value = bag_grad[torch.repeat_interleave(torch.arange(read.lengths.numel()), read.lengths)]
    if read.weights is not None:
        per_value = per_value * read.weights.unsqueeze(1)
    return torch.zeros(read.uniq.numel(), g.dim).index_add_(0, read.inverse, per_value)

"""The lookup of ``het_cached_row_wise``: owned rows locally, remote rows from a stale-tolerant cache.

Each rank owns a row range of every table (TorchRec's row-wise shard, held by the
stock fused FBGEMM kernel this class extends) and caches rows of the other ranges.
A step, for the unique ids of the local batch:

forward (read path)
  owned rows come from the local shard; a remote row is served from the cache when
  the bound allows (``het``: the owner, asked with the cached version, sends the row
  only on a miss or when it is more than ``s_read`` updates ahead; ``lease``: no
  question at all until ``s_read`` steps after the row was last fetched or
  validated); missing rows are fetched and cached (evicting by LRU or LFU). The bags
  are pooled here, on the rank that owns the batch: nothing pooled crosses the wire.
backward (write path)
  gradients of owned rows, of rows that did not fit in the cache, of cached rows whose
  pending count exceeds ``s_write``, and of dirty rows evicted this step go to their
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
from torchrec_het.sharding.het_tables import CacheStats, HetTable, row_starts_from_shards


@dataclass
class _Read:
    """One table's read of one step, kept for the backward of that step."""

    uniq: torch.Tensor  # distinct ids of the batch, ascending
    inverse: torch.Tensor  # position in uniq of every id, the table's features concatenated
    uses: torch.Tensor  # how often each distinct id occurs in the batch
    local: torch.Tensor  # positions in uniq of owned ids
    remote: torch.Tensor  # positions in uniq of ids owned elsewhere
    slots: torch.Tensor  # cache slot of each remote id (-1: not cached this step)
    ask: torch.Tensor  # positions in remote of the ids sent to their owners
    uncached_rows: torch.Tensor | None = None  # fetched rows without a cache slot, for remote[slots < 0]
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
        self._tables: list[HetTable] = []
        self._table_of_feature: dict[str, HetTable] = {}
        self._outbox: dict[str, list[PendingRows]] = {}
        self._step = 0
        self._anchor = torch.zeros(1, requires_grad=True)  # lets backward reach the write path
        self._weights: list[list[torch.Tensor]] = []
        self.on_serve: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, int], None] | None = None

    # --- set-up -----------------------------------------------------------------------

    def attach_cache(self, config: HetCacheConfig, shards_by_table: dict[str, list]) -> None:
        """Creates the per-table state; called once by the sharded module after construction."""
        self._tables = []
        for module_index, (group, module) in enumerate(zip(self.grouped_configs, self._emb_modules)):
            lr = float((group.fused_params or {}).get("learning_rate", 0.01))
            for table_index, table in enumerate(group.embedding_tables):
                self._tables.append(
                    HetTable(
                        name=table.name,
                        features=list(table.feature_names),
                        dim=table.embedding_dim,
                        mean=table.pooling == PoolingType.MEAN,
                        num_rows=table.num_embeddings,
                        row_starts=row_starts_from_shards(shards_by_table[table.name], self._ws, table.name),
                        rank=self._rank,
                        module_index=module_index,
                        table_index=table_index,
                        learning_rate=lr,
                        settings=config.for_table(table.name),
                    )
                )
        self._table_of_feature = {f: t for t in self._tables for f in t.features}
        self._outbox = {t.name: [] for t in self._tables}

    @property
    def tables(self) -> list[HetTable]:
        return self._tables

    @property
    def feature_order(self) -> list[str]:
        return self._features

    def table_of(self, feature: str) -> HetTable:
        return self._table_of_feature[feature]

    def cache_stats(self) -> dict[str, dict]:
        """Counters per table (see :class:`CacheStats`)."""
        return {t.name: t.stats.as_dict() for t in self._tables}

    def reset_cache_stats(self) -> None:
        for t in self._tables:
            t.stats = CacheStats()

    # --- forward: the read path -------------------------------------------------------

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if sparse_features.variable_stride_per_key():
            raise NotImplementedError("het_cached_row_wise does not support variable batch sizes per feature")
        step = self._step
        self._step += 1
        self._weights = [m.split_embedding_weights() for m in self._emb_modules]  # views of the local shards
        by_feature = sparse_features.to_dict()
        reads = [self._plan_read(t, by_feature, step) for t in self._tables]
        self._fetch(reads, step)
        for t, read in zip(self._tables, reads):
            read.rows = self._gather_rows(t, read)
        return pool_with_write_back(self, reads, by_feature, sparse_features.stride())

    def _plan_read(self, t: HetTable, by_feature, step: int) -> _Read:
        values = torch.cat([by_feature[f].values() for f in t.features]).long()
        uniq, inverse, uses = torch.unique(values, return_inverse=True, return_counts=True)
        owned = t.owner_of(uniq) == self._rank
        local, remote = owned.nonzero().flatten(), (~owned).nonzero().flatten()
        slots = t.cache.slots_of(uniq[remote])
        if t.settings.protocol == "lease":
            leased = (slots >= 0) & (step <= t.cache.validated_step[slots.clamp(min=0)] + t.settings.s_read)
            ask = (~leased).nonzero().flatten()
        else:
            ask = torch.arange(remote.numel())
        t.stats.lookups += values.numel()
        t.stats.unique_lookups += uniq.numel()
        t.stats.remote_unique += remote.numel()
        t.stats.remote_lookups += int(uses[remote].sum())
        t.stats.requests += ask.numel()
        return _Read(uniq, inverse, uses, local, remote, slots, ask)

    def _read_bound(self, t: HetTable) -> int:
        # lease: a renewal brings the row whenever the owner has moved on at all
        return t.settings.s_read if t.settings.protocol == "het" else 0

    def _fetch(self, reads: list[_Read], step: int) -> None:
        """Asks owners about the rows the bounds do not cover; settles the answers into the caches."""
        T, ws = len(self._tables), self._ws
        dest, table, ids, held = [], [], [], []
        for i, (t, read) in enumerate(zip(self._tables, reads)):
            asked_ids = read.uniq[read.remote[read.ask]]
            slots = read.slots[read.ask]
            dest.append(t.owner_of(asked_ids))
            table.append(torch.full_like(asked_ids, i))
            ids.append(asked_ids)
            held.append(torch.where(slots >= 0, t.cache.versions[slots.clamp(min=0)], -1))
        dest, table, ids, held = (torch.cat(x) for x in (dest, table, ids, held))
        order = torch.sort(dest * T + table, stable=True).indices
        dest, table, ids, held = dest[order], table[order], ids[order], held[order]
        counts = torch.bincount(dest * T + table, minlength=ws * T).view(ws, T)
        recv_counts = exchange_counts(counts, self._pg)
        requests = exchange_flat(
            torch.stack([ids, held], 1).view(-1), (counts.sum(1) * 2).tolist(), (recv_counts.sum(1) * 2).tolist(), self._pg
        ).view(-1, 2)
        source = torch.repeat_interleave(torch.arange(ws), recv_counts.sum(1))
        req_table = torch.repeat_interleave(torch.arange(T).repeat(ws), recv_counts.view(-1))
        current = self._owner_versions(requests, req_table)
        replies = exchange_flat(current, recv_counts.sum(1).tolist(), counts.sum(1).tolist(), self._pg)
        # Both sides apply the same rule to (held version, owner version) to know which requests bring a row.
        bounds = torch.tensor([self._read_bound(t) for t in self._tables], dtype=torch.int64)
        sends = (requests[:, 1] < 0) | (current - requests[:, 1] > bounds[req_table])
        brings = (held < 0) | (replies - held > bounds[table])
        dims = torch.tensor([t.dim for t in self._tables], dtype=torch.int64)
        rows_out = torch.bincount(source[sends] * T + req_table[sends], minlength=ws * T).view(ws, T)
        rows_in = torch.bincount(dest[brings] * T + table[brings], minlength=ws * T).view(ws, T)
        rows_flat = exchange_flat(
            self._rows_to_send(requests, req_table, sends, rows_out),
            (rows_out * dims).sum(1).tolist(),
            (rows_in * dims).sum(1).tolist(),
            self._pg,
        )
        rows_by_table = _split_by_table(rows_flat, rows_in, [t.dim for t in self._tables])
        for i, (t, read) in enumerate(zip(self._tables, reads)):
            mine = table == i
            # this table's requests in exchange order: by owner, then as asked
            positions = read.ask[torch.sort(t.owner_of(read.uniq[read.remote[read.ask]]), stable=True).indices]
            self._settle(t, read, positions, replies[mine], brings[mine], rows_by_table[i], step)

    def _owner_versions(self, requests: torch.Tensor, req_table: torch.Tensor) -> torch.Tensor:
        versions = torch.empty(requests.size(0), dtype=torch.int64)
        for i, t in enumerate(self._tables):
            mine = req_table == i
            local = requests[mine, 0] - t.local_start
            if local.numel() and (local.min() < 0 or local.max() >= t.local_rows):
                raise RuntimeError(f"table {t.name!r}: a rank asked rank {self._rank} for a row it does not own")
            versions[mine] = t.versions[local]
        return versions

    def _rows_to_send(self, requests, req_table, sends, rows_out) -> torch.Tensor:
        """Owner side: requested rows, ordered by requesting rank, then table, then request."""
        per_table = []
        for i, t in enumerate(self._tables):
            pick = (req_table == i) & sends
            weight = self._local_weight(t)
            per_table.append(weight[requests[pick, 0] - t.local_start].float().split(rows_out[:, i].tolist()))
        parts = [per_table[i][s].reshape(-1) for s in range(self._ws) for i in range(len(self._tables))]
        return torch.cat(parts) if parts else torch.empty(0)

    def _local_weight(self, t: HetTable) -> torch.Tensor:
        return self._weights[t.module_index][t.table_index]

    def _settle(self, t: HetTable, read: _Read, positions, versions, brings, rows, step: int) -> None:
        """Requester side: refresh stale copies, cache new rows, renew leases, count."""
        cache = t.cache
        asked_slots = read.slots[positions]
        fresh = ~brings  # the owner kept the row: the cached copy is within the bound
        if t.settings.protocol == "lease":
            # how far behind each leased copy fell while it was served unasked
            held = asked_slots >= 0
            t.stats.add_staleness(versions[held] - cache.versions[asked_slots[held]])
            cache.mark_validated(asked_slots[fresh], step)
        else:
            t.stats.add_staleness(versions[fresh] - cache.versions[asked_slots[fresh]])
        row_of = torch.cumsum(brings.long(), 0) - 1  # index into rows of each request that brought one
        stale = brings & (asked_slots >= 0)
        cache.refresh(asked_slots[stale], rows[row_of[stale]], versions[stale], step)
        missing = brings & (asked_slots < 0)
        in_use = read.slots[read.slots >= 0]
        new_slots, dirty, evicted = cache.insert(
            read.uniq[read.remote[positions[missing]]], rows[row_of[missing]], versions[missing], step, protect=in_use
        )
        read.slots[positions[missing]] = new_slots
        read.uncached_rows = rows[row_of[missing]][new_slots < 0]
        if len(dirty):
            self._outbox[t.name].append(dirty)
        served = torch.ones(read.remote.numel(), dtype=torch.bool)
        served[positions[brings]] = False
        t.stats.rows_fetched += rows.size(0)
        t.stats.evictions += evicted
        t.stats.dirty_evictions += len(dirty)
        t.stats.hits_unique += int(served.sum())
        t.stats.hits_lookups += int(read.uses[read.remote[served]].sum())
        cached = read.slots >= 0
        cache.touch(read.slots[cached], step, read.uses[read.remote[cached]])
        if self.on_serve is not None:
            hit = read.slots[served]
            self.on_serve(t.name, read.uniq[read.remote[served]], cache.versions[hit], cache.validated_step[hit], step)

    def _gather_rows(self, t: HetTable, read: _Read) -> torch.Tensor:
        rows = torch.empty(read.uniq.numel(), t.dim)
        rows[read.local] = self._local_weight(t)[read.uniq[read.local] - t.local_start].float()
        cached = read.slots >= 0
        rows[read.remote[cached]] = t.cache.values[read.slots[cached]]
        rows[read.remote[~cached]] = read.uncached_rows
        return rows

    # --- backward: the write path -----------------------------------------------------

    def write_back(self, reads: list[_Read], row_grads: list[torch.Tensor]) -> None:
        """Called by the backward of a step with the gradient of every distinct row it read."""
        scale = 1.0 / self._ws if get_gradient_division() else 1.0  # as TorchRec's row-wise backward
        pushes = []
        for t, read, grad in zip(self._tables, reads, row_grads):
            grad = grad * scale
            t.stats.add_mass("grad_produced", grad)
            parts = [PendingRows(read.uniq[read.local], grad[read.local], torch.ones_like(read.local))]
            cached = read.slots >= 0
            slots = read.slots[cached]
            cached_grad = grad[read.remote[cached]]
            t.cache.accumulate(slots, cached_grad, -t.learning_rate * cached_grad)
            uncached = read.remote[~cached]
            parts.append(PendingRows(read.uniq[uncached], grad[uncached], torch.ones_like(uncached)))
            parts.append(t.cache.take_due(t.settings.s_write))
            parts.extend(self._outbox[t.name])
            self._outbox[t.name] = []
            pushes.append(PendingRows.concat(parts))
        self._push(pushes)

    @torch.no_grad()
    def flush(self) -> None:
        """Pushes every pending gradient to its owner (a collective: every rank calls it)."""
        if self._tables:
            pushes = []
            for t in self._tables:
                pushes.append(PendingRows.concat([t.cache.take_all(), *self._outbox[t.name]]))
                self._outbox[t.name] = []
            self._push(pushes)
        super().flush()

    def purge(self) -> None:
        """Forgets cached rows, pending gradients and versions (before a load)."""
        for t in self._tables:
            t.reset()
            self._outbox[t.name] = []
        super().purge()

    def _push(self, pushes: list[PendingRows]) -> None:
        T, ws = len(self._tables), self._ws
        dest = torch.cat([t.owner_of(p.ids) for t, p in zip(self._tables, pushes)])
        table = torch.cat([torch.full_like(p.ids, i) for i, p in enumerate(pushes)])
        order = torch.sort(dest * T + table, stable=True).indices
        counts = torch.bincount((dest * T + table)[order], minlength=ws * T).view(ws, T)
        recv_counts = exchange_counts(counts, self._pg)
        ids = torch.cat([p.ids for p in pushes])[order]
        updates = torch.cat([p.counts for p in pushes])[order]
        headers = exchange_flat(
            torch.stack([ids, updates], 1).view(-1), (counts.sum(1) * 2).tolist(), (recv_counts.sum(1) * 2).tolist(), self._pg
        ).view(-1, 2)
        dims = torch.tensor([t.dim for t in self._tables], dtype=torch.int64)
        chunks = [g.split(counts[:, i].tolist()) for i, g in enumerate(self._grads_by_dest(pushes))]
        flat = torch.cat([chunks[i][d].reshape(-1) for d in range(ws) for i in range(T)] or [torch.empty(0)])
        grads_flat = exchange_flat(flat, (counts * dims).sum(1).tolist(), (recv_counts * dims).sum(1).tolist(), self._pg)
        received = _split_by_table(grads_flat, recv_counts, [t.dim for t in self._tables])
        req_table = torch.repeat_interleave(torch.arange(T).repeat(ws), recv_counts.view(-1))
        self._apply(
            [headers[req_table == i, 0] for i in range(T)],
            received,
            [headers[req_table == i, 1] for i in range(T)],
        )
        for i, t in enumerate(self._tables):
            t.stats.rows_pushed += int(counts[:, i].sum() - counts[self._rank, i])

    def _grads_by_dest(self, pushes: list[PendingRows]) -> list[torch.Tensor]:
        return [p.grads[torch.sort(t.owner_of(p.ids), stable=True).indices] for t, p in zip(self._tables, pushes)]

    @torch.no_grad()
    def _apply(self, ids: list[torch.Tensor], grads: list[torch.Tensor], updates: list[torch.Tensor]) -> None:
        """Owner side: one fused-optimizer step per owned row with the summed gradient; versions move on.

        The local shard's fused kernel does the update: every (row, gradient) pair becomes
        a bag of one row whose pooled output gets that gradient; the kernel sums the
        gradients of a row and applies the table's optimizer once, as in stock row-wise.
        """
        for module_index, module in enumerate(self._emb_modules):
            tables = [(i, t) for i, t in enumerate(self._tables) if t.module_index == module_index]
            if not any(ids[i].numel() for i, _ in tables):
                continue
            features = module.config.feature_names()
            stride = max(ids[i].numel() for i, _ in tables)
            lengths, values, col = [], [], 0
            first_feature = {t.features[0]: (i, t) for i, t in tables}
            feature_dims = _feature_dims(module.config)
            out_grad = torch.zeros(stride, sum(feature_dims))
            for feature, dim in zip(features, feature_dims):
                n = 0
                if feature in first_feature:
                    i, t = first_feature[feature]
                    n = ids[i].numel()
                    values.append(ids[i] - t.local_start)
                    out_grad[:n, col : col + dim] = grads[i]
                lengths.append(torch.cat([torch.ones(n, dtype=torch.int64), torch.zeros(stride - n, dtype=torch.int64)]))
                col += dim
            value_tensor = torch.cat(values)
            kjt = KeyedJaggedTensor(
                keys=features,
                values=value_tensor,
                lengths=torch.cat(lengths),
                weights=torch.ones(value_tensor.numel()) if module.config.is_weighted else None,
            )
            with torch.enable_grad():
                pooled = module(kjt)
            pooled.backward(out_grad.to(pooled.dtype))
            for i, t in tables:
                t.versions.index_add_(0, ids[i] - t.local_start, updates[i])
                t.stats.add_mass("grad_applied", grads[i])


def _feature_dims(config) -> list[int]:
    return [table.embedding_dim for table in config.embedding_tables for _ in table.feature_names]


def _split_by_table(flat: torch.Tensor, counts: torch.Tensor, dims: list[int]) -> list[torch.Tensor]:
    """Rows of ``flat`` (ordered by rank, then table) regrouped per table, in rank order."""
    ws, T = counts.shape
    sizes = (counts * torch.tensor(dims, dtype=torch.int64)).view(-1).tolist()
    pieces = flat.split(sizes)
    return [
        torch.cat([pieces[r * T + i].view(-1, dims[i]) for r in range(ws)]) if ws else flat.new_empty(0, dims[i])
        for i in range(T)
    ]


class _HetPooling(torch.autograd.Function):
    """Pools the bags from the rows read this step; its backward runs the write path."""

    @staticmethod
    def forward(ctx, anchor, lookup, reads, by_feature, batch):  # noqa: ARG004
        ctx.lookup, ctx.reads, ctx.by_feature = lookup, reads, by_feature
        return _pool(lookup, reads, by_feature, batch)

    @staticmethod
    def backward(ctx, grad_output):
        lookup, reads = ctx.lookup, ctx.reads
        row_grads = _row_grads(lookup, reads, ctx.by_feature, grad_output)
        lookup.write_back(reads, row_grads)
        return None, None, None, None, None


def _feature_segments(t: HetTable, read: _Read, by_feature):
    """(feature, jagged tensor, positions in uniq of its ids) for each feature of a table."""
    start = 0
    for feature in t.features:
        jt = by_feature[feature]
        n = jt.values().numel()
        yield feature, jt, read.inverse[start : start + n]
        start += n


def _pool(lookup, reads, by_feature, batch: int) -> torch.Tensor:
    pooled = {}
    for t, read in zip(lookup.tables, reads):
        for feature, jt, rows_of in _feature_segments(t, read, by_feature):
            lengths = jt.lengths().long()
            bags = torch.repeat_interleave(torch.arange(batch), lengths)
            values = read.rows[rows_of]
            if jt.weights_or_none() is not None:
                values = values * jt.weights().unsqueeze(1)
            out = torch.zeros(batch, t.dim).index_add_(0, bags, values)
            if t.mean:
                out = out / lengths.clamp(min=1).unsqueeze(1)
            pooled[feature] = out
    return torch.cat([pooled[f] for f in lookup.feature_order], dim=1) if pooled else torch.empty(batch, 0)


def _row_grads(lookup, reads, by_feature, grad_output: torch.Tensor) -> list[torch.Tensor]:
    columns, col = {}, 0
    for feature in lookup.feature_order:
        dim = lookup.table_of(feature).dim
        columns[feature] = grad_output[:, col : col + dim]
        col += dim
    grads = []
    for t, read in zip(lookup.tables, reads):
        grad = torch.zeros(read.uniq.numel(), t.dim)
        for feature, jt, rows_of in _feature_segments(t, read, by_feature):
            lengths = jt.lengths().long()
            bag_grad = columns[feature]
            if t.mean:
                bag_grad = bag_grad / lengths.clamp(min=1).unsqueeze(1)
            per_value = bag_grad[torch.repeat_interleave(torch.arange(bag_grad.size(0)), lengths)]
            if jt.weights_or_none() is not None:
                per_value = per_value * jt.weights().unsqueeze(1)
            grad.index_add_(0, rows_of, per_value)
        grads.append(grad)
    return grads


def pool_with_write_back(lookup, reads, by_feature, batch: int) -> torch.Tensor:
    """The pooled output [batch, sum of feature dims] whose backward pushes gradients to owners."""
    return _HetPooling.apply(lookup._anchor, lookup, reads, by_feature, batch)

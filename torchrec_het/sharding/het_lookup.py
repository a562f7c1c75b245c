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
  pooled here, on the rank that holds the batch (one ``embedding_bag`` per group):
  nothing pooled crosses the wire.
backward (write path)
  gradients of owned rows, of rows that found no cache slot, of cached rows with more
  than ``s_write`` pending updates, and of dirty rows evicted this step go to their
  owners, which apply the table's fused optimizer (one update per row per step with
  the summed gradient, as stock row-wise does; :func:`~torchrec_het.sharding.row_optim.apply_rows`)
  and bump the row's version by the number of updates received. Other cached rows keep
  their gradient pending and get a local SGD step so later reads see this rank's own writes.

Exchanges per group and step (all-to-alls; the splits of each are read to the host once):
request counts, requests (id, cached version), owner versions, then the rows, which
also carry how many gradients each rank will push to each owner in the backward, so
the backward sends its pushes in a single all-to-all. That needs each forward's
backward to come before the next forward (a forward without backward, as in eval, is
fine).

With ``s_read = s_write = 0`` every remote row is fetched fresh and every gradient is
applied at its owner in the step it is produced: the same training as stock row-wise.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import lookup_kernels
from torchrec_het.cache import PendingRows
from torchrec_het.config import HetCacheConfig
from torchrec_het.sharding.exchange import exchange_counts, exchange_flat
from torchrec_het.sharding.het_group import HetGroup
from torchrec_het.sharding.id_space import TableInfo, row_starts_from_shards
from torchrec_het.sharding.row_optim import _buffer, apply_rows, optimizer_kind


@dataclass
class _Read:
    """One group's read of one step, kept for the backward of that step."""

    step: int
    lengths: torch.Tensor  # [F, B] bag lengths of the group's features
    weights: torch.Tensor | None  # per-id weights, or None
    uniq: torch.Tensor  # distinct fused ids of the batch, ascending
    inverse: torch.Tensor  # position in uniq of every id
    by_row: torch.Tensor  # positions of the ids sorted by row (stable): the backward's bags
    uses: torch.Tensor  # occurrences of each distinct id
    tables: torch.Tensor  # group table index of each distinct id
    local: torch.Tensor  # positions in uniq of owned ids
    remote: torch.Tensor  # positions in uniq of ids owned elsewhere
    slots: torch.Tensor  # cache slot of each remote id (-1: none this step)
    rows: torch.Tensor | None = None  # [len(uniq), dim] values used this step
    bags: torch.Tensor | None = None  # bag of every id, bags ordered sample by sample
    by_bag: torch.Tensor | None = None  # the ids in that bag order
    bag_offsets: torch.Tensor | None = None  # [bags + 1] where each bag starts in that order
    uncached: torch.Tensor | None = None  # positions in uniq of fetched rows that found no slot
    due: torch.Tensor | None = None  # cache slots whose pending gradients go out in this step's backward
    outbox: list[PendingRows] = field(default_factory=list)  # evicted dirty rows that go out with them
    push_counts: torch.Tensor | None = None  # rows this rank pushes to each rank in the backward
    pull_counts: torch.Tensor | None = None  # rows each rank pushes to this one


class HetCachedEmbeddingLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's row-wise fused lookup plus the HET read and write protocol.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: input feature order (the sharding's ``feature_names()``; a
            feature that feeds two tables appears twice).
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
        self._step = 0
        self._pending: list[_Read] | None = None  # the last forward's reads while its backward is due
        self._anchor = torch.zeros(1, requires_grad=True)  # lets backward reach the write path
        self._views: dict[tuple, tuple] = {}  # (module, group) -> (buffer attribute, its data_ptr, (view, first rows))
        self.on_serve: Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor, int], None] | None = None

    # --- set-up and inspection --------------------------------------------------------

    def attach_cache(self, config: HetCacheConfig, shards_by_table: dict[str, list]) -> None:
        """Creates the per-group state; called once by the sharded module after construction."""
        by_key: dict[tuple, list[TableInfo]] = {}
        positions: dict[str, list[int]] = {}
        position = 0
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
                positions[table.name] = list(range(position, position + len(table.feature_names)))
                for feature, at in zip(table.feature_names, positions[table.name]):
                    if at >= len(self._features) or self._features[at] != feature:
                        raise ValueError(f"table {table.name!r}: feature {feature!r} is not input {at} of the lookup")
                position += len(table.feature_names)
        if position != len(self._features):
            raise ValueError(f"the lookup's tables read {position} features, its input has {len(self._features)}")
        self._groups = [HetGroup(tables, dim, settings, self._rank, self._ws) for (dim, settings), tables in by_key.items()]
        self._outbox = [[] for _ in self._groups]
        self._build_layout(positions)
        for m in lookup_kernels(self):
            optimizer_kind(m.emb_module)  # a clear error now for an optimizer the write path cannot step

    def _build_layout(self, positions: dict[str, list[int]]) -> None:
        """Static indexes: each group's input positions and output columns, and each input's group."""
        dims = [0] * len(self._features)
        for g in self._groups:
            for t in g.tables:
                for at in positions[t.name]:
                    dims[at] = g.dim
        starts = torch.cumsum(torch.tensor([0] + dims), 0).tolist()
        self._width = starts[-1]
        for g in self._groups:
            at = [a for t in g.tables for a in positions[t.name]]
            g.set_layout(at, [starts[a] for a in at], len(self._features), self._width)
        self._single = len(self._groups) == 1 and self._groups[0].all_features
        self._value_group = torch.full((len(self._features),), -1, dtype=torch.int64)
        for index, g in enumerate(self._groups):
            self._value_group[g.positions] = index
        self._views = {}

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

    # --- the local shards, as one [rows, dim] view per kernel -------------------------------

    def _owned_view(self, module_index: int, g: HetGroup) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(``[rows, dim]`` view of a kernel's flat weights, first row there of each of its tables) for
        the group's tables in that kernel, or None (then they are read table by table)."""
        tbe = lookup_kernels(self)[module_index].emb_module
        key = (module_index, id(g))
        cached = self._views.get(key)
        if cached is not None:
            attr, pointer, view = cached
            if getattr(tbe, attr).data_ptr() == pointer:  # the kernel kept its buffer
                return view
        found = _buffer(tbe, "weights")
        if found is None:
            return None
        attr, offsets = found
        mine = g.kernel_table[g.table_module == module_index]
        phases = torch.unique(offsets[mine] % g.dim)  # tables of other widths may shift the rows
        if phases.numel() != 1:
            return None
        phase = int(phases)
        flat = getattr(tbe, attr).detach().view(-1)
        rows = (flat.numel() - phase) // g.dim
        view = (flat[phase : phase + rows * g.dim].view(rows, g.dim), (offsets - phase) // g.dim)
        self._views[key] = (attr, flat.data_ptr(), view)
        return view

    def _read_owned(self, g: HetGroup, ids: torch.Tensor) -> torch.Tensor:
        """Rows of owned fused ids from the local shards."""
        tables = g.table_of(ids)
        rows = g.local_rows(ids, tables)
        out = None
        for module_index in g.modules:
            view = self._owned_view(module_index, g)
            if view is None:
                weights = [m.split_embedding_weights() for m in lookup_kernels(self)]
                return g.read_owned(ids, [weights[t.module_index][t.table_index] for t in g.tables])
            shard, first_row = view
            at = first_row.index_select(0, g.kernel_table.index_select(0, tables)) + rows
            if len(g.modules) == 1:
                return shard.index_select(0, at).float()
            out = torch.empty(ids.numel(), g.dim) if out is None else out
            mine = (g.table_module.index_select(0, tables) == module_index).nonzero().flatten()
            out.index_copy_(0, mine, shard.index_select(0, at.index_select(0, mine)).float())
        return out if out is not None else torch.empty(0, g.dim)

    # --- forward: the read path -------------------------------------------------------

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if sparse_features.variable_stride_per_key():
            raise NotImplementedError("het_cached_row_wise does not support variable batch sizes per feature")
        if sparse_features.keys() != self._features:
            raise ValueError(f"het_cached_row_wise lookup expects features {self._features}, got {sparse_features.keys()}")
        step = self._step
        self._step += 1
        if self._pending is not None:  # the last forward had no backward (eval): its pushes stay queued
            for index, read in enumerate(self._pending):
                self._outbox[index] = read.outbox + self._outbox[index]
        batch = sparse_features.stride()
        lengths = sparse_features.lengths().view(len(self._features), batch)
        values, weights = sparse_features.values(), sparse_features.weights_or_none()
        per_feature = lengths.sum(1)
        value_group = None
        if not self._single and self._groups:
            value_group = torch.repeat_interleave(self._value_group, per_feature, output_size=values.numel())
        writes = torch.is_grad_enabled()
        reads = []
        for index, g in enumerate(self._groups):
            if self._single:
                ids, w, lens, counts = values, weights, lengths, per_feature
            else:
                chosen = (value_group == index).nonzero().flatten()
                ids = values.index_select(0, chosen)
                w = weights.index_select(0, chosen) if weights is not None else None
                lens, counts = lengths.index_select(0, g.positions), per_feature.index_select(0, g.positions)
            read = self._plan_read(g, ids, w, lens, counts, step)
            self._fetch(index, g, read, step, writes)
            reads.append(read)
        self._pending = reads if writes else None
        return _HetPooling.apply(self._anchor, self, reads, batch)

    def _plan_read(self, g: HetGroup, values, weights, lengths, counts, step: int) -> _Read:
        ids = values.long() + torch.repeat_interleave(g.feature_offset, counts, output_size=values.numel())
        sorted_ids, by_row = torch.sort(ids, stable=True)
        uniq, sorted_inverse, uses = torch.unique_consecutive(sorted_ids, return_inverse=True, return_counts=True)
        inverse = torch.empty_like(sorted_inverse).index_copy_(0, by_row, sorted_inverse)
        owned = g.owner_of(uniq) == self._rank
        local, remote = owned.nonzero().flatten(), (~owned).nonzero().flatten()
        tables = g.table_of(uniq)
        slots = g.cache.slots_of(uniq.index_select(0, remote), check=False)
        read = _Read(step, lengths, weights, uniq, inverse, by_row, uses, tables, local, remote, slots)
        remote_tables = tables.index_select(0, remote)
        g.stats.add_per_table("lookups", torch.zeros(len(g.tables), dtype=torch.int64).index_add_(0, g.feature_table, counts))
        g.stats.add("unique_lookups", tables)
        g.stats.add("remote_unique", remote_tables)
        g.stats.add("remote_lookups", remote_tables, uses.index_select(0, remote))
        return read

    def _asked(self, g: HetGroup, read: _Read, step: int) -> torch.Tensor:
        """Positions in ``read.remote`` of the ids to ask their owners about."""
        if g.settings.protocol == "het":
            return torch.arange(read.remote.numel())
        slots = read.slots
        validated = g.cache.validated_step.index_select(0, slots.clamp(min=0))
        leased = (slots >= 0) & (step <= validated + g.settings.s_read)
        return (~leased).nonzero().flatten()

    def _read_bound(self, g: HetGroup) -> int:
        # lease: a renewal brings the row whenever the owner has moved on at all
        return g.settings.s_read if g.settings.protocol == "het" else 0

    def _fetch(self, index: int, g: HetGroup, read: _Read, step: int, writes: bool) -> None:
        """Asks owners about the rows the bound does not cover; settles the answers into the cache."""
        ws, dim, cache = self._ws, g.dim, g.cache
        asked = self._asked(g, read, step)
        ids = read.uniq.index_select(0, read.remote.index_select(0, asked))
        dest = g.owner_of(ids)
        order = torch.sort(dest, stable=True).indices  # exchange order: by owner, then ascending id
        asked, ids, dest = asked.index_select(0, order), ids.index_select(0, order), dest.index_select(0, order)
        slots = read.slots.index_select(0, asked)
        held = torch.where(slots >= 0, cache.versions.index_select(0, slots.clamp(min=0)), -1)
        asked_tables = read.tables.index_select(0, read.remote.index_select(0, asked))
        g.stats.add("requests", asked_tables)
        counts = torch.bincount(dest, minlength=ws)
        recv_counts = exchange_counts(counts.view(ws, 1), self._pg).view(ws)
        send, recv = torch.stack([counts, recv_counts]).tolist()
        requests = exchange_flat(torch.stack([ids, held], 1).view(-1), [2 * c for c in send], [2 * c for c in recv],
                                 self._pg).view(-1, 2)
        current = g.versions.index_select(0, g.local_index_of(requests[:, 0]))
        replies = exchange_flat(current, recv, send, self._pg)
        # Both sides apply the same rule to (held version, owner version): which requests bring a row.
        bound = self._read_bound(g)
        sends = (requests[:, 1] < 0) | (current - requests[:, 1] > bound)
        brings = (held < 0) | (replies - held > bound)
        source = torch.repeat_interleave(torch.arange(ws), recv_counts, output_size=requests.size(0))
        rows_out = torch.bincount(source[sends], minlength=ws)
        rows_in = torch.bincount(dest[brings], minlength=ws)
        # Slots for the missing rows are taken now, so this step's pushes are known before the rows come.
        missing = (brings & (slots < 0)).nonzero().flatten()
        missing_ids, in_use = ids.index_select(0, missing), read.slots[read.slots >= 0]
        shortfall = cache.shortfall(missing_ids, in_use)
        *splits, rescan = torch.cat([rows_out, rows_in, shortfall.view(1)]).tolist()  # one host sync
        send_rows, recv_rows = splits[:ws], splits[ws:]
        new_slots, dirty, evicted = cache.reserve(
            missing_ids, replies.index_select(0, missing), step, protect=in_use, check=False, rescan=bool(rescan)
        )
        read.slots.index_copy_(0, asked.index_select(0, missing), new_slots)
        read.uncached = read.remote.index_select(0, asked.index_select(0, missing[new_slots < 0]))
        if len(dirty):
            self._outbox[index].append(dirty)
            g.stats.add("dirty_evictions", g.table_of(dirty.ids))
        g.stats.add("evictions", g.table_of(evicted))
        self._plan_push(index, g, read, writes)
        # To each rank: a header row (how many gradients this rank will push to it), then its rows.
        payload = _with_headers(self._read_owned(g, requests[sends, 0]), rows_out, read.push_counts)
        received = exchange_flat(
            payload.view(-1), [(1 + r) * dim for r in send_rows], [(1 + r) * dim for r in recv_rows], self._pg
        ).view(-1, dim)
        read.pull_counts = _headers(received, rows_in)
        self._settle(g, read, asked, slots, replies, brings, dest, received, new_slots, missing, step)

    def _plan_push(self, index: int, g: HetGroup, read: _Read, writes: bool) -> None:
        """What this step's backward will push to each owner: owned and uncached rows, cached rows
        that pass the write bound with this step's update, and dirty evicted rows."""
        if not writes:  # no backward will come: nothing pushed, evicted rows stay queued
            read.push_counts = torch.zeros(self._ws, dtype=torch.int64)
            return
        cached = read.slots[read.slots >= 0]
        read.due = cached[g.cache.pending_count.index_select(0, cached) + 1 > g.settings.s_write]
        read.outbox, self._outbox[index] = self._outbox[index], []
        ids = [
            read.uniq.index_select(0, read.local),
            read.uniq.index_select(0, read.uncached),
            g.cache.slot_ids.index_select(0, read.due),
            *[p.ids for p in read.outbox],
        ]
        read.push_counts = torch.bincount(g.owner_of(torch.cat(ids)), minlength=self._ws)

    def _settle(self, g: HetGroup, read: _Read, asked, held_slots, versions, brings, dest, rows, new_slots, missing,
                step: int) -> None:
        """Requester side: refresh stale copies, fill new rows, renew leases, count, and gather the rows.

        ``rows``: what arrived, each source's header row first (see :func:`_with_headers`)."""
        cache, stats = g.cache, g.stats
        asked_tables = read.tables.index_select(0, read.remote.index_select(0, asked))
        fresh = ~brings  # the owner kept the row: the cached copy is within the bound
        if g.settings.protocol == "lease":
            held = held_slots >= 0  # how far each leased copy fell behind while served unasked
            stats.add_staleness(asked_tables[held], versions[held] - cache.versions[held_slots[held]])
            cache.mark_validated(held_slots[fresh], step)
        else:
            stats.add_staleness(asked_tables[fresh], versions[fresh] - cache.versions[held_slots[fresh]])
        row_of = torch.cumsum(brings.long(), 0) + dest  # row in ``rows`` of each request that brought one
        stale = (brings & (held_slots >= 0)).nonzero().flatten()
        cache.refresh(held_slots.index_select(0, stale), rows.index_select(0, row_of.index_select(0, stale)),
                      versions.index_select(0, stale), step)
        fetched = rows.index_select(0, row_of.index_select(0, missing))
        cache.fill(new_slots, fetched)
        stats.add("rows_fetched", asked_tables[brings])
        served = torch.ones(read.remote.numel(), dtype=torch.bool)
        served[asked[brings]] = False
        remote_tables = read.tables.index_select(0, read.remote)
        stats.add("hits_unique", remote_tables[served])
        stats.add("hits_lookups", remote_tables[served], read.uses.index_select(0, read.remote)[served])
        cached = (read.slots >= 0).nonzero().flatten()
        cached_slots = read.slots.index_select(0, cached)
        cache.touch(cached_slots, step, read.uses.index_select(0, read.remote.index_select(0, cached)))
        # the rows of this step: owned from the shards, remote from the cache or as fetched
        out = torch.empty(read.uniq.numel(), g.dim)
        out.index_copy_(0, read.local, self._read_owned(g, read.uniq.index_select(0, read.local)))
        out.index_copy_(0, read.remote.index_select(0, cached), cache.values.index_select(0, cached_slots))
        out.index_copy_(0, read.uncached, fetched[new_slots < 0])
        read.rows = out
        if self.on_serve is not None:  # an opt-in hook (tests): one call per table
            hit = read.slots[served]
            ids, tables = read.uniq[read.remote[served]], remote_tables[served]
            for i, t in enumerate(g.tables):
                mine = tables == i
                self.on_serve(t.name, ids[mine] - g.offsets[i], cache.versions[hit[mine]], cache.validated_step[hit[mine]], step)

    # --- backward: the write path -----------------------------------------------------

    def write_back(self, reads: list[_Read], row_grads: list[torch.Tensor]) -> None:
        """Called by the backward of a step with the gradient of every distinct row it read."""
        if self._pending is not reads:
            raise RuntimeError(
                "het_cached_row_wise: a backward must follow its own forward before the next forward runs"
            )
        self._pending = None
        scale = 1.0 / self._ws if get_gradient_division() else 1.0  # as TorchRec's row-wise backward
        for g, read, grad in zip(self._groups, reads, row_grads):
            grad = grad * scale
            g.stats.add_mass("grad_produced", read.tables, grad)
            cached = (read.slots >= 0).nonzero().flatten()
            slots = read.slots.index_select(0, cached)
            cached_grad = grad.index_select(0, read.remote.index_select(0, cached))
            lr = self._learning_rates(g).index_select(0, read.tables.index_select(0, read.remote.index_select(0, cached)))
            g.cache.accumulate(slots, cached_grad, -lr.unsqueeze(1) * cached_grad)
            due = g.cache.take(read.due)
            parts = [
                PendingRows(read.uniq.index_select(0, read.local), grad.index_select(0, read.local),
                            torch.ones_like(read.local)),
                PendingRows(read.uniq.index_select(0, read.uncached), grad.index_select(0, read.uncached),
                            torch.ones_like(read.uncached)),
                due,
                *read.outbox,
            ]
            self._push(g, PendingRows.concat(parts), read.push_counts, read.pull_counts)

    def _learning_rates(self, g: HetGroup) -> torch.Tensor:
        """Each table's current learning rate (its kernel's, so schedules apply; no host sync)."""
        rates = torch.stack([m.emb_module.learning_rate_tensor for m in lookup_kernels(self)])
        return rates.index_select(0, g.table_module)

    @torch.no_grad()
    def flush(self) -> None:
        """Pushes every pending gradient to its owner (a collective: every rank calls it)."""
        if self._pending is not None:  # a forward without backward: its queued evictions go too
            for index, read in enumerate(self._pending):
                self._outbox[index] = read.outbox + self._outbox[index]
            self._pending = None
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
        self._pending = None
        self._views = {}
        super().purge()

    def _push(self, g: HetGroup, pending: PendingRows, counts=None, recv_counts=None) -> None:
        """Sends pending gradients to their owners (one all-to-all when both sides' counts are known)."""
        ws, dim = self._ws, g.dim
        dest = g.owner_of(pending.ids)
        order = torch.sort(dest, stable=True).indices
        if counts is None:
            counts = torch.bincount(dest, minlength=ws)
            recv_counts = exchange_counts(counts.view(ws, 1), self._pg).view(ws)
        send, recv = torch.stack([counts, recv_counts]).tolist()
        width = 4 + dim  # id and update count as int64 bit patterns, then the gradient
        packed = torch.cat(
            [pending.ids.view(torch.float32).view(-1, 2), pending.counts.view(torch.float32).view(-1, 2),
             pending.grads.float()], 1
        ).index_select(0, order)
        received = exchange_flat(packed.view(-1), [c * width for c in send], [c * width for c in recv], self._pg)
        received = received.view(-1, width)
        ids = received[:, :2].contiguous().view(torch.int64).view(-1)
        updates = received[:, 2:4].contiguous().view(torch.int64).view(-1)
        g.stats.add("rows_pushed", g.table_of(pending.ids[dest != self._rank]))
        self._apply(g, ids, received[:, 4:], updates)

    @torch.no_grad()
    def _apply(self, g: HetGroup, ids: torch.Tensor, grads: torch.Tensor, updates: torch.Tensor) -> None:
        """Owner side: one fused-optimizer step per owned row with the summed gradient; versions move on.

        A pushed sum of k > 1 held-back gradients is scaled by 1/sqrt(k) for Adagrad-family
        optimizers so their squared-gradient state grows as it would over k steps.
        """
        if ids.numel() == 0:
            return
        tables = g.table_of(ids)
        rows = g.local_rows(ids, tables)
        for module_index in g.modules:
            tbe = lookup_kernels(self)[module_index].emb_module
            step, mine_rows, mine_tables = grads, rows, tables
            mine_updates = updates
            if len(g.modules) > 1:
                mine = (g.table_module.index_select(0, tables) == module_index).nonzero().flatten()
                step, mine_rows = grads.index_select(0, mine), rows.index_select(0, mine)
                mine_tables, mine_updates = tables.index_select(0, mine), updates.index_select(0, mine)
            if optimizer_kind(tbe) != "sgd":
                # k held-back gradients g_i arrive as their sum. Adagrad-family state adds the
                # square of what it is given: the sum would add (sum g_i)^2 ~ k^2 g^2 where k
                # separate steps add k g^2, and the row would learn ever slower. Sending
                # sum / sqrt(k) adds exactly k g^2 when the parts are equal; k = 1 is unchanged.
                step = step / mine_updates.clamp(min=1).double().sqrt().to(step.dtype).unsqueeze(1)
            apply_rows(tbe, g.kernel_table.index_select(0, mine_tables), mine_rows, step)
        g.versions.index_add_(0, g.local_index_of(ids), updates)
        g.stats.add_mass("grad_applied", tables, grads)


class _HetPooling(torch.autograd.Function):
    """Pools the bags from the rows read this step (one ``embedding_bag`` per group) into the
    lookup's output; its backward turns the output's gradient into row gradients (one more
    ``embedding_bag``, over the bags' gradients) and runs the write path."""

    @staticmethod
    def forward(ctx, anchor, lookup, reads, batch):  # noqa: ARG004
        ctx.lookup, ctx.reads, ctx.batch = lookup, reads, batch
        if lookup._single:
            return _pool(lookup.groups[0], reads[0], batch)
        out = torch.empty(batch, lookup._width)
        for g, read in zip(lookup.groups, reads):
            out.index_copy_(1, g.columns, _pool(g, read, batch))
        return out

    @staticmethod
    def backward(ctx, grad_output):
        lookup, reads, batch = ctx.lookup, ctx.reads, ctx.batch
        grads = []
        for g, read in zip(lookup.groups, reads):
            block = grad_output if lookup._single else grad_output.index_select(1, g.columns)
            grads.append(_row_grads(g, read, block, batch))
        lookup.write_back(reads, grads)
        return None, None, None, None


def _bag_offsets(lengths: torch.Tensor) -> torch.Tensor:
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths.reshape(-1), 0, out=offsets[1:])
    return offsets


def _sample_major(read: _Read) -> None:
    """Orders the bags sample by sample (the output's layout, so pooling writes it in place):
    ``read.bags`` is each id's bag in that order, ``read.by_bag`` the ids in that order."""
    features, batch = read.lengths.shape
    n = read.inverse.numel()
    lengths = read.lengths.reshape(-1)
    by_feature = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=n)  # feature-major bag
    bags = by_feature % batch * features + by_feature // batch
    starts = _bag_offsets(read.lengths.t())  # of the sample-major bags
    position = starts.index_select(0, bags) + torch.arange(n) - _bag_offsets(lengths).index_select(0, by_feature)
    read.bags = bags
    read.by_bag = torch.empty_like(position).index_copy_(0, position, torch.arange(n))
    read.bag_offsets = starts


def _pool(g: HetGroup, read: _Read, batch: int) -> torch.Tensor:
    """``[batch, features * dim]`` pooled bags of the group's features."""
    _sample_major(read)
    weights = read.weights.index_select(0, read.by_bag) if read.weights is not None else None
    pooled = F.embedding_bag(
        read.inverse.index_select(0, read.by_bag), read.rows, read.bag_offsets, mode="sum",
        per_sample_weights=weights, include_last_offset=True,
    )
    if g.has_mean:
        pooled = pooled / g.bag_divisors_of(read.lengths).transpose(0, 1).reshape(-1, 1)
    return pooled.view(batch, -1)


def _row_grads(g: HetGroup, read: _Read, grad: torch.Tensor, batch: int) -> torch.Tensor:
    """Gradient of every distinct row from the ``[batch, features * dim]`` gradient of the group's
    pooled bags: each row sums the (weighted) gradients of the bags it was read into."""
    bag_grads = grad.reshape(-1, g.dim)  # sample-major bags, as pooled
    if g.has_mean:
        bag_grads = bag_grads / g.bag_divisors_of(read.lengths).transpose(0, 1).reshape(-1, 1)
    weights = read.weights.index_select(0, read.by_row) if read.weights is not None else None
    return F.embedding_bag(
        read.bags.index_select(0, read.by_row), bag_grads, _bag_offsets(read.uses), mode="sum",
        per_sample_weights=weights, include_last_offset=True,
    )


def _with_headers(rows: torch.Tensor, per_rank: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
    """``[rank 0's header row, its rows..., rank 1's header row, its rows..., ...]``: ``rows`` are
    grouped by rank; rank r's header row holds ``header[r]`` (int32 bits) in its first column."""
    ranks, dim = per_rank.numel(), rows.size(1)
    heads = torch.cumsum(per_rank + 1, 0) - per_rank - 1  # row of each header
    out = torch.empty(rows.size(0) + ranks, dim)
    out.index_copy_(0, torch.arange(rows.size(0)) + torch.repeat_interleave(torch.arange(1, ranks + 1), per_rank,
                                                                           output_size=rows.size(0)), rows.float())
    head_rows = torch.zeros(ranks, dim)
    head_rows[:, 0] = header.to(torch.int32).view(torch.float32)
    return out.index_copy_(0, heads, head_rows)


def _headers(received: torch.Tensor, per_rank: torch.Tensor) -> torch.Tensor:
    """The header of each source in what :func:`_with_headers` sent (int64)."""
    heads = torch.cumsum(per_rank + 1, 0) - per_rank - 1
    return received.index_select(0, heads)[:, 0].contiguous().view(torch.int32).long()

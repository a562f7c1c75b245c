"""The lookup of ``het_cached_row_wise``: owned rows locally, remote rows from a stale-tolerant cache.

Each rank owns a row range of every table (TorchRec's row-wise shard, held by the
stock fused FBGEMM kernel this class extends) and caches rows of the other ranges.
Tables of one dim and one cache setting share a fused id space and a cache
(:mod:`torchrec_het.sharding.het_group`); all groups of a lookup travel in the same
exchanges (a request is a *global* id: the group's base plus its fused id), so the
number of collectives per step does not grow with the groups.

A step in TorchRec's three stages (the dists are in :mod:`torchrec_het.sharding.het_dists`):

input dist (:meth:`plan_requests`, then the requests' two awaitables)
  the requester dedupes its batch's ids per group and, for the remote ids the bound
  does not cover without asking (``het``: all of them; ``lease``: those whose lease
  ran out), sends (id, cached version *now*, -1 if none) to their owners: every rank's
  counts by one all-gather, then one int64 all-to-all. The cache slots the batch
  refers to are pinned: no eviction may take them until this batch has settled, or
  an owner could decide "the requester holds a copy" of a row that is gone.
lookup (:meth:`forward`, local compute)
  first the previous backward's gradient pushes are waited for and applied (so the
  owner's versions and rows include them); then the owner reads the current version
  of every requested row and decides which rows to send: those the requester does
  not hold (``held < 0``) or holds more than the bound behind
  (``current - held > bound``; ``bound`` is ``s_read`` for ``het``, 0 for ``lease``
  renewals). It reads those rows from its shards; the rows are what it returns.
output dist (:meth:`finish`, from the output dist's awaitable)
  the owners' versions go back (one int64 all-to-all, sizes known from the input
  dist); both sides apply the same rule to (held as sent, current), so the requester
  knows which rows come and sizes the rows' all-to-all with one host sync (which
  also carries the cache's rescan decision). Slots for rows it lacks are taken
  before the rows come, so the gradient pushes of this step's backward are known
  and travel as a header in the rows' all-to-all. Then the requester settles the
  cache (refresh stale copies, fill new ones, renew leases, count) and pools its
  bags locally (one ``embedding_bag`` per group) with the shared output layout
  (:mod:`~torchrec_het.sharding.output_layout`), whose backward produces the row gradients.
backward (:meth:`write_back`, in :mod:`torchrec_het.sharding.het_writes`)
  gradients of owned rows, of rows that found no cache slot, of cached rows with more
  than ``s_write`` pending updates and of dirty rows evicted this step go to their
  owners in one all-to-all that is *started* here (its sizes are known from the
  header) and waited for at the next lookup, at :meth:`flush` (and so before
  ``state_dict``) or at :meth:`purge`. The owner applies the table's fused optimizer
  (one update per row with the summed gradient, as stock row-wise does;
  :func:`~torchrec_het.sharding.row_optim.apply_rows`) and bumps the row's version by
  the number of updates received. Other cached rows keep their gradient pending and
  get a local SGD step so later reads see this rank's own writes.

Fetching ahead (``ahead``, where one step of lag fits every group's read bound; see
:meth:`fetch_ahead` and the margin rule in ``_build_groups``): the owners answer in the input
dist's first awaitable (under ``TrainPipelineSparseDist``, between the previous batch's
forward and backward) with the bound less the margin, versions and rows come back there,
and the forward only settles and pools. The backward's push counts then travel in a small
all-to-all of their own before the pushes.

``prefetch`` (called by ``PrefetchTrainPipelineSparseDist`` after the previous batch's
forward, before its backward) builds the pooling's bag order ahead; it reads nothing that
backward changes.

Why a copy refreshed in between is still within the bound: under
``TrainPipelineSparseDist`` the input dist of batch i+1 runs before batch i settles,
so batch i's settle may refresh a copy that batch i+1 reported as ``held`` (a version
``h``) to ``h' >= h`` (a slot never goes back: versions only grow, and the pin keeps
the slot from being evicted and refilled). If the owner then keeps the row
(``current - h <= bound``), the copy batch i+1 is served is at least as new:
``current - h' <= current - h <= bound``. If the owner sends the row, the copy is
replaced by the current one. Either way no read is more than the bound behind the
owner's version at the time the owner answers, which is after every push of every
earlier backward was applied. The staleness histogram records ``current - h'``.

Ordering this needs: each forward's backward comes before the next forward's lookup
(a forward without backward, as in eval, is fine: its planned pushes stay queued).
TorchRec's pipelines keep it: ``TrainPipelineSparseDist`` runs the input dist of
i+1 early, but the lookup of i+1 after the backward of i.

With ``s_read = s_write = 0`` every remote row is fetched fresh (the owner read its
version after applying every earlier push) and every gradient is applied at its owner
before the next read: the same training as stock row-wise, also under the pipeline.
"""

from dataclasses import dataclass, field

from collections import deque

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import lookup_kernels, process_group_timeout
from torchrec_het.cache import PendingRows
from torchrec_het.config import HetCacheConfig
from torchrec_het.sharding.exchange import exchange_flat
from torchrec_het.sharding.het_group import HetGroup
from torchrec_het.sharding.het_writes import HetWrites, _flatten_rows
from torchrec_het.sharding.id_space import TableInfo, bag_divisors, flatten_batch
from torchrec_het.sharding.output_layout import OutputPlan, Part, Source, bag_offsets, output_layout
from torchrec_het.sharding.row_apply import row_state
from torchrec_het.sharding.row_optim import _buffer, optimizer_kind

STEP_ATTR = "_het_cached_step"  # where the input dist leaves a batch's bookkeeping on its KJT


@dataclass
class _Read:
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
class _Batch:
    """One batch's bookkeeping, from the input dist to its backward (it rides the KJT, see ``STEP_ATTR``).

    Requests are merged over the groups: ordered by owner, then group, then id.
    """

    step: int
    batch: int
    reads: list[_Read]
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
    payload: torch.Tensor | None = None  # owner: those rows, flat, in request order
    writes: bool = False  # a backward is expected
    pull_counts: torch.Tensor | None = None  # [ws, groups] rows each rank pushes to this one in the backward
    push_counts: torch.Tensor | None = None  # [ws, groups] rows this rank pushes to each rank in the backward
    replies: torch.Tensor | None = None  # fetched ahead: the owners' versions
    brings: torch.Tensor | None = None  # fetched ahead: which requests brought a row
    rows_received: torch.Tensor | None = None  # fetched ahead: the rows, flat, by source
    rows_work: object = None  # fetched ahead: the rows' all-to-all in flight


class HetCachedEmbeddingLookup(HetWrites, GroupedPooledEmbeddingsLookup):
    """TorchRec's row-wise fused lookup plus the HET read and write protocol.

    Built complete by the sharding's ``create_lookup`` (settings from the plan).

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: input feature order (the sharding's ``feature_names()``; a
            feature that feeds two tables appears twice).
        pg: the process group of the sharding.
        config: the HET cache settings (per table).
        shards_by_table: each table's shard metadata (row ranges per rank).
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names: list[str], pg, config: HetCacheConfig, shards_by_table,
                 device=None, env=None) -> None:
        super().__init__(
            grouped_configs=grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env
        )
        self._pg = pg
        self._rank = dist.get_rank(pg)
        self._ws = dist.get_world_size(pg)
        self._compute_device = torch.device(device) if device is not None else torch.device("cpu")
        ranks = dist.get_process_group_ranks(pg) if pg is not None else list(range(self._ws))
        # the cache's exchanges and pushes run on a group of their own, so they neither wait behind
        # nor hold up the model's other collectives (DDP's dense all-reduce) on the default group
        self._exchange_pg = dist.new_group(ranks, backend=dist.get_backend(pg), use_local_synchronization=True,
                                           timeout=process_group_timeout(pg))
        self._features = list(feature_names)
        self._config = config
        self._step = 0
        self._awaiting: deque[_Batch] = deque()  # settled batches whose backward is due, oldest first
        self.batches_ahead = False  # see :meth:`allow_batches_ahead`
        self._inflight = None  # (work, received, pull counts) of the last backward's pushes
        self.last_batch: _Batch | None = None  # the batch the output dist finishes next
        self.prefetched: _Batch | None = None  # the last batch ``prefetch`` prepared
        self._anchor = torch.zeros(1, device=self._compute_device, requires_grad=True)  # lets backward reach the write path
        self._views: dict[tuple, tuple] = {}  # (module, group) -> (buffer attribute, its data_ptr, (view, first rows))
        self._build_groups(config, shards_by_table)

    # --- set-up and inspection --------------------------------------------------------

    def _build_groups(self, config: HetCacheConfig, shards_by_table: dict[str, list]) -> None:
        """Creates the per-group state and the static indexes (once, at construction)."""
        by_key: dict[tuple, list[TableInfo]] = {}
        positions: dict[str, list[int]] = {}
        position = 0
        for module_index, group in enumerate(self.grouped_configs):
            lr = float((group.fused_params or {}).get("learning_rate", 0.01))
            for table_index, table in enumerate(group.embedding_tables):
                info = TableInfo.of(table, module_index, table_index, shards_by_table[table.name], self._ws, lr)
                by_key.setdefault((table.embedding_dim, config.for_table(table.name)), []).append(info)
                positions[table.name] = list(range(position, position + len(table.feature_names)))
                for feature, at in zip(table.feature_names, positions[table.name]):
                    if at >= len(self._features) or self._features[at] != feature:
                        raise ValueError(f"table {table.name!r}: feature {feature!r} is not input {at} of the lookup")
                position += len(table.feature_names)
        if position != len(self._features):
            raise ValueError(f"the lookup's tables read {position} features, its input has {len(self._features)}")
        self._groups = [
            HetGroup(tables, dim, settings, self._rank, self._ws, self._compute_device) for (dim, settings), tables in by_key.items()
        ]
        self._outbox: list[list[PendingRows]] = [[] for _ in self._groups]
        sizes = [int(g.offsets[-1]) for g in self._groups]
        device = self._compute_device
        self._group_base = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))], dtype=torch.int64, device=device)
        self._group_ends = torch.tensor([sum(sizes[: i + 1]) for i in range(len(sizes))], dtype=torch.int64, device=device)
        # lease: a renewal brings the row whenever the owner has moved on at all
        self._bounds = torch.tensor(
            [g.settings.s_read if g.settings.protocol == "het" else 0 for g in self._groups], dtype=torch.int64,
            device=device,
        )
        # Fetching ahead (the whole exchange in the input dist, values one step old) where one step
        # of lag fits every group's bound. A version counts updates: in one step each rank pushes a
        # row at most once, with at most s_write + 1 updates (its pending count passes s_write, or
        # fewer at an eviction or flush), so one step adds at most margin = ws * (s_write + 1). het:
        # the owner keeps a copy when current - held <= s_read - margin, so at the read it is at
        # most s_read behind; a row it sends is at most margin behind. lease (bound in steps): the
        # owner's answer counts as given at the step before, so a lease never outlives s_read.
        margins = [self._ws * (g.settings.s_write + 1) if g.settings.protocol == "het" else 1 for g in self._groups]
        self.ahead = bool(self._groups) and all(g.settings.s_read >= m for g, m in zip(self._groups, margins))
        self._bounds_ahead = torch.tensor(
            [g.settings.s_read - m if g.settings.protocol == "het" else 0 for g, m in zip(self._groups, margins)],
            dtype=torch.int64, device=device,
        )
        self._build_layout(positions)
        for m in lookup_kernels(self):
            optimizer_kind(m.emb_module)  # a clear error now for an optimizer the write path cannot step
        self._keep_optimizer_state()
        self._fetch_widths = torch.tensor([g.fetch_width for g in self._groups], dtype=torch.int64, device=device)

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
        device = self._compute_device
        self._value_group = torch.full((len(self._features),), -1, dtype=torch.int64, device=device)
        self._position_base = torch.zeros(len(self._features), dtype=torch.int64, device=device)  # in its group
        self._position_local = torch.zeros(len(self._features), dtype=torch.int64, device=device)  # feature of its group
        for index, g in enumerate(self._groups):
            self._value_group[g.positions] = index
            self._position_base[g.positions] = g.feature_offset
            self._position_local[g.positions] = torch.arange(g.positions.numel(), device=device)
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
            g.stats = type(g.stats)(len(g.tables), g.dim, self._compute_device)

    # --- the local shards, as one [rows, dim] view per kernel -------------------------------

    def _owned_view(self, module_index: int, g: HetGroup, prefix: str = "weights") -> tuple[torch.Tensor, torch.Tensor] | None:
        """(``[rows, width]`` view of a kernel's flat ``prefix`` buffer (``weights``: width ``dim``;
        ``momentum1``: the optimizer state's width), first row there of each of its tables) for the
        group's tables in that kernel, or None (then they are read table by table)."""
        tbe = lookup_kernels(self)[module_index].emb_module
        key = (module_index, id(g), prefix)
        cached = self._views.get(key)
        if cached is not None:
            attr, pointer, view = cached
            if getattr(tbe, attr).data_ptr() == pointer:  # the kernel kept its buffer
                return view
        found = _buffer(tbe, prefix)
        if found is None:
            return None
        width = g.dim if prefix == "weights" else g.state_width
        attr, offsets = found
        offsets = offsets.to(self._compute_device)
        mine = g.kernel_table[g.table_module == module_index]
        phases = torch.unique(offsets[mine] % width)  # tables of other widths may shift the rows
        if phases.numel() != 1:
            return None
        phase = int(phases)
        flat = getattr(tbe, attr).detach().view(-1)
        rows = (flat.numel() - phase) // width
        view = (flat[phase : phase + rows * width].view(rows, width), (offsets - phase) // width)
        self._views[key] = (attr, flat.data_ptr(), view)
        return view

    def _read_owned(self, g: HetGroup, ids: torch.Tensor, prefix: str = "weights") -> torch.Tensor:
        """Rows of owned fused ids from the local shards (``prefix="momentum1"``: their optimizer state)."""
        width = g.dim if prefix == "weights" else g.state_width
        tables = g.table_of(ids)
        rows = g.local_rows(ids, tables)
        out = None
        for module_index in g.modules:
            view = self._owned_view(module_index, g, prefix)
            if view is None:
                return self._read_owned_by_table(g, ids, prefix)
            shard, first_row = view
            at = first_row.index_select(0, g.kernel_table.index_select(0, tables)) + rows
            if len(g.modules) == 1:
                return shard.index_select(0, at).float()
            out = torch.empty(ids.numel(), width, device=self._compute_device) if out is None else out
            mine = (g.table_module.index_select(0, tables) == module_index).nonzero().flatten()
            out.index_copy_(0, mine, shard.index_select(0, at.index_select(0, mine)).float())
        return out if out is not None else torch.empty(0, width, device=self._compute_device)

    def _read_owned_by_table(self, g: HetGroup, ids: torch.Tensor, prefix: str) -> torch.Tensor:
        """:meth:`_read_owned` for kernels whose buffers are not one flat tensor (mixed placements)."""
        kernels = lookup_kernels(self)
        if prefix == "weights":
            weights = [m.split_embedding_weights() for m in kernels]
            return g.read_owned(ids, [weights[t.module_index][t.table_index] for t in g.tables])
        tables = g.table_of(ids)
        rows = g.local_rows(ids, tables)
        out = torch.empty(ids.numel(), g.state_width, device=self._compute_device)
        for i in torch.unique(tables).tolist():
            t, mine = g.tables[i], tables == i
            out[mine] = row_state(kernels[t.module_index].emb_module, t.table_index)[1][rows[mine]].float()
        return out

    def _read_fetched(self, g: HetGroup, ids: torch.Tensor) -> torch.Tensor:
        """What an owner sends for each requested row: the row, then its optimizer state where the
        requester's cache keeps one (``g.fetch_width`` floats)."""
        rows = self._read_owned(g, ids)
        if not g.state_width:
            return rows
        return torch.cat([rows, self._read_owned(g, ids, "momentum1")], 1)

    # --- input dist: what to ask the owners ---------------------------------------------

    def plan_requests(self, sparse_features: KeyedJaggedTensor) -> _Batch:
        """Requester side of the input dist: the batch's reads, the requests, slots pinned."""
        if sparse_features.keys() != self._features:
            raise ValueError(f"het_cached_row_wise lookup expects features {self._features}, got {sparse_features.keys()}")
        # every group's fused ids at once (each position's base is its table's in its group)
        bags, values = flatten_batch(sparse_features, self._position_base, "het_cached_row_wise")
        step = self._step
        self._step += 1
        batch = sparse_features.stride()
        lengths = sparse_features.lengths().view(len(self._features), batch)
        weights = sparse_features.weights_or_none()
        per_feature = lengths.sum(1)
        value_group = None
        if not self._single and self._groups:
            value_group = torch.repeat_interleave(self._value_group, per_feature, output_size=values.numel())
        reads, ids, held, dest, group, at = [], [], [], [], [], []
        for index, g in enumerate(self._groups):
            if self._single:
                gids, gbags, w, lens, counts = values, bags, weights, lengths, per_feature
            else:
                chosen = (value_group == index).nonzero().flatten()
                gids, gbags = values.index_select(0, chosen), bags.index_select(0, chosen)
                gbags = self._position_local.index_select(0, gbags // batch) * batch + gbags % batch
                w = weights.index_select(0, chosen) if weights is not None else None
                lens, counts = lengths.index_select(0, g.positions), per_feature.index_select(0, g.positions)
            read = self._plan_read(g, gids, gbags, w, lens, counts, step)
            slots = g.cache.slots_of(read.uniq.index_select(0, read.remote), check=False)
            read.asked = self._asked(g, slots, step)
            asked_slots = slots.index_select(0, read.asked)
            read.pinned = slots[slots >= 0]
            g.pins.index_add_(0, read.pinned, torch.ones_like(read.pinned, dtype=g.pins.dtype))
            asked_ids = read.uniq.index_select(0, read.remote.index_select(0, read.asked))
            g.stats.add("requests", read.tables.index_select(0, read.remote.index_select(0, read.asked)))
            ids.append(asked_ids + self._group_base[index])
            held.append(torch.where(asked_slots >= 0, g.cache.versions.index_select(0, asked_slots.clamp(min=0)), -1))
            dest.append(g.owner_of(asked_ids))
            group.append(torch.full_like(asked_ids, index))
            at.append(torch.arange(asked_ids.numel(), device=self._compute_device))
            reads.append(read)
        empty = torch.zeros(0, dtype=torch.int64, device=self._compute_device)
        dest_all = torch.cat([empty] + dest)
        order = torch.sort(dest_all, stable=True).indices  # by owner, then group, then id
        pick = lambda parts: torch.cat([empty] + parts).index_select(0, order)  # noqa: E731
        return _Batch(step, batch, reads, pick(ids), pick(held), dest_all.index_select(0, order), pick(group), pick(at))

    def _plan_read(self, g: HetGroup, ids, bags, weights, lengths, counts, step: int) -> _Read:
        sorted_ids, by_row = torch.sort(ids, stable=True)
        uniq, sorted_inverse, uses = torch.unique_consecutive(sorted_ids, return_inverse=True, return_counts=True)
        inverse = torch.empty_like(sorted_inverse).index_copy_(0, by_row, sorted_inverse)
        owned = g.owner_of(uniq) == self._rank
        local, remote = owned.nonzero().flatten(), (~owned).nonzero().flatten()
        tables = g.table_of(uniq)
        read = _Read(step, lengths, weights, bags, uniq, inverse, by_row, uses, tables, local, remote)
        remote_tables = tables.index_select(0, remote)
        g.stats.add_per_table("lookups", torch.zeros(len(g.tables), dtype=torch.int64, device=self._compute_device).index_add_(
            0, g.feature_table, counts))
        g.stats.add("unique_lookups", tables)
        g.stats.add("remote_unique", remote_tables)
        g.stats.add("remote_lookups", remote_tables, uses.index_select(0, remote))
        return read

    def _asked(self, g: HetGroup, slots: torch.Tensor, step: int) -> torch.Tensor:
        """Positions in the remote ids of those to ask their owners about."""
        if g.settings.protocol == "het":
            return torch.arange(slots.numel(), device=self._compute_device)
        validated = g.cache.validated_step.index_select(0, slots.clamp(min=0))
        leased = (slots >= 0) & (step <= validated + g.settings.s_read)
        return (~leased).nonzero().flatten()

    def allow_batches_ahead(self) -> None:
        """Lets later batches run their forward before this batch's backward (a pipeline that looks
        batches up ahead, :class:`~torchrec_het.pipeline.HybridTrainPipeline`).

        A settled batch's cache slots stay pinned until its backward, so no later batch evicts a
        row it will add its gradient to; rows evicted dirty meanwhile, and the rows a backward
        pushes, go out with the next backward, whose push counts travel just before it (one
        small all-to-all more per step). Every rank must call it (a collective protocol).
        """
        self.batches_ahead = True

    # --- prefetch: batch-static work ahead of the forward ----------------------------------

    def prefetch(self, sparse_features: KeyedJaggedTensor, forward_stream=None) -> None:  # noqa: ARG002
        """What ``PrefetchTrainPipelineSparseDist`` calls for batch i+1 after the forward of batch i
        and before its backward: the requests have arrived (the input dist's second awaitable was
        waited), and the bag orders the pooling needs (a pure function of the batch) are built
        here, off the forward's path. Nothing that batch i's backward changes is read: its pushes
        move owners' versions and rows, its write path moves pending counts and may not find
        its slots evicted, so versions, rows and slots are left to the lookup and the output dist.
        """
        step = getattr(sparse_features, STEP_ATTR, None)
        if step is None:
            return
        for read in step.reads:
            if read.bags is None:
                _sample_major(read)
        self.prefetched = step

    # --- lookup: the owner's answer (local compute) -----------------------------------------

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """Owner side: the current version of every requested row, and the rows the rule sends
        (flat, in request order), which the output dist carries back. Fetching ahead, the input
        dist has done all of it: nothing is left here but the previous backward's pushes."""
        step: _Batch = getattr(sparse_features, STEP_ATTR)
        self.wait_pushes()  # the previous backward's pushes: versions and rows below include them
        while self._awaiting and not self.batches_ahead:  # a batch that got no backward: its pushes stay queued
            self._requeue(self._awaiting.popleft())
        if not self.ahead:
            self._answer(step, self._bounds)
        self.last_batch = step
        return step.payload

    def _answer(self, step: _Batch, bounds: torch.Tensor) -> None:
        """Owner side: ``step.current`` (version of each request), ``step.payload`` (the rows the
        rule sends, flat, in request order) and ``step.rows_out`` (their elements per requester)."""
        received = step.received
        gid, held = received[:, 0].contiguous(), received[:, 1]  # bucketize wants contiguous ids
        group = torch.bucketize(gid, self._group_ends, right=True)
        source = torch.repeat_interleave(
            torch.arange(self._ws, device=self._compute_device), torch.tensor(step.recv_splits, device=self._compute_device),
            output_size=gid.numel(),
        )
        current = torch.empty_like(held)
        parts = []
        for index, g in enumerate(self._groups):
            mine = (group == index).nonzero().flatten()
            fused = gid.index_select(0, mine) - self._group_base[index]
            current.index_copy_(0, mine, g.versions.index_select(0, g.local_index_of(fused)))
            parts.append((mine, fused))
        sends = (held < 0) | (current - held > bounds.index_select(0, group))
        widths = self._fetch_widths.index_select(0, group)
        step.current = current
        step.rows_out = torch.bincount(source[sends], widths[sends], minlength=self._ws).long()
        if len(self._groups) == 1:
            step.payload = self._read_fetched(self._groups[0], parts[0][1][sends]).reshape(-1)
        else:  # rows of every group, read group by group, then placed in request order
            sent = sends.nonzero().flatten()
            sent_group = group.index_select(0, sent)
            by_group = torch.sort(sent_group, stable=True).indices  # group-major position -> request order
            rows = [
                self._read_fetched(g, gid.index_select(0, sent[sent_group == index]) - self._group_base[index])
                for index, g in enumerate(self._groups)
            ]
            place = torch.empty_like(by_group).index_copy_(0, by_group, torch.arange(by_group.numel(), device=self._compute_device))
            step.payload = _flatten_rows(rows, place, widths.index_select(0, sent).index_select(0, by_group))

    # --- fetching ahead: the whole exchange in the input dist ------------------------------

    def fetch_ahead(self, step: _Batch) -> None:
        """From the input dist's first awaitable, once the requests arrived: the owners answer
        with the margin rule (:data:`ahead`), versions come back, and the rows' all-to-all is
        started (``step.rows_work``; the second awaitable waits for it).

        Under ``TrainPipelineSparseDist`` this runs after the forward of the previous batch and
        before its backward, so the owner's versions and rows miss that backward's pushes: the
        values served are one step old, and the margin covers what one step can add.
        """
        self.wait_pushes()  # a plain loop: the previous backward's pushes (pipelined: already applied)
        ws = self._ws
        self._answer(step, self._bounds_ahead)
        widths = self._fetch_widths.index_select(0, step.group)
        if step.local_only:
            replies = step.held.new_empty(0)
        else:
            replies = exchange_flat(step.current, step.recv_splits, step.send_splits, self._exchange_pg)
        brings = (step.held < 0) | (replies - step.held > self._bounds_ahead.index_select(0, step.group))
        rows_in = torch.bincount(step.dest[brings], widths[brings], minlength=ws).long()
        send, recv = torch.stack([step.rows_out, rows_in]).tolist()  # the fetch's second host sync
        received = step.payload.new_empty(sum(recv))
        step.rows_work = None
        if any(send) or any(recv):
            step.rows_work = dist.all_to_all_single(
                received, step.payload, recv, send, group=self._exchange_pg, async_op=True
            )
        step.replies, step.brings, step.rows_received = replies, brings, received
        step.payload = step.payload.new_empty(0)  # nothing left for the output dist to carry

    def finish_ahead(self, step: _Batch) -> torch.Tensor:
        """Requester side of a batch fetched ahead: slots for the rows it lacks, the settle, the
        pooled bags (no exchange; the backward's push counts go out with the pushes)."""
        groups, device = len(self._groups), self._compute_device
        step.writes = torch.is_grad_enabled()
        brings, replies = step.brings, step.replies
        plans = self._plan_slots(step, brings)
        rescans = torch.cat([plan[-1] for plan in plans]).tolist() if plans else []  # the settle's host sync
        step.push_counts = self._reserve(step, plans, rescans)
        widths = torch.where(brings, self._fetch_widths.index_select(0, step.group), 0)
        starts = torch.cumsum(widths, 0) - widths
        validated = step.step - 1  # the owners answered before the previous backward's pushes
        for g, read, plan in zip(self._groups, step.reads, plans):
            mine, asked, held_slots, group_brings, missing, missing_ids, protect, _ = plan
            at = starts.index_select(0, mine[group_brings]).unsqueeze(1) + torch.arange(g.fetch_width, device=device)
            rows = step.rows_received.index_select(0, at.reshape(-1)).view(-1, g.fetch_width)
            self._settle(g, read, asked, held_slots, replies.index_select(0, mine), group_brings, rows, missing,
                         step.step, validated)
        step.pull_counts = None  # exchanged with the pushes
        step.rows_received = None
        return self._pooled(step, groups)

    # --- output dist: versions back, rows back, settle, pool -------------------------------

    def _plan_slots(self, step: _Batch, brings: torch.Tensor) -> list[tuple]:
        """Per group: where its requests are, their slots now, which lack a slot, what to protect,
        and whether the cache must rescan to find room (a 1-element tensor, read with other data)."""
        plans = []
        for index, (g, read) in enumerate(zip(self._groups, step.reads)):
            mine = (step.group == index).nonzero().flatten()
            asked = read.asked.index_select(0, step.at.index_select(0, mine))  # positions in read.remote
            read.slots = g.cache.slots_of(read.uniq.index_select(0, read.remote), check=False)
            held_slots = read.slots.index_select(0, asked)
            group_brings = brings.index_select(0, mine)
            missing = (group_brings & (held_slots < 0)).nonzero().flatten()
            missing_ids = read.uniq.index_select(0, read.remote.index_select(0, asked.index_select(0, missing)))
            protect = torch.cat([read.slots[read.slots >= 0], (g.pins > 0).nonzero().flatten()])
            shortfall = g.cache.shortfall(missing_ids, protect).view(1).long()
            plans.append((mine, asked, held_slots, group_brings, missing, missing_ids, protect, shortfall))
        return plans

    def _reserve(self, step: _Batch, plans: list[tuple], rescans: list[int]) -> torch.Tensor:
        """Slots for the rows each group lacks (evicting by the policy), and the backward's plan:
        returns ``[ws, groups]`` rows this rank will push to each rank."""
        push_counts = torch.zeros(self._ws, max(len(self._groups), 1), dtype=torch.int64, device=self._compute_device)
        for index, (g, read, plan) in enumerate(zip(self._groups, step.reads, plans)):
            mine, asked, held_slots, group_brings, missing, missing_ids, protect, _ = plan
            new_slots, dirty, evicted = g.cache.reserve(
                missing_ids, step.held.index_select(0, mine.index_select(0, missing)),
                step.step - (1 if self.ahead else 0), protect=protect, check=False, rescan=bool(rescans[index]),
            )
            read.slots.index_copy_(0, asked.index_select(0, missing), new_slots)
            read.uncached = read.remote.index_select(0, asked.index_select(0, missing[new_slots < 0]))
            if len(dirty):
                self._outbox[index].append(dirty)
                g.stats.add("dirty_evictions", g.table_of(dirty.ids))
            g.stats.add("evictions", g.table_of(evicted))
            self._plan_push(index, g, read, step.writes)
            push_counts[:, index] = read.push_counts
        return push_counts

    def _pooled(self, step: _Batch, groups: int) -> torch.Tensor:
        if step.writes:
            self._awaiting.append(step)
        else:  # no backward will come: evicted dirty rows stay queued
            for read in step.reads:
                read.outbox = []
        return output_layout(self._output_plan(step), self._anchor)

    def _output_plan(self, step: _Batch) -> OutputPlan:
        """The ``[batch, width]`` output: per group, its bags pooled from the rows read this step
        (one ``embedding_bag``, columns ``g.columns``); the backward's row gradients (one more)
        go to the write path (:meth:`write_back`, which scales them)."""
        grads: list = [None] * len(self._groups)
        parts = []
        for index, (g, read) in enumerate(zip(self._groups, step.reads)):
            if read.bags is None:  # else ``prefetch`` built the bag order
                _sample_major(read)
            source = Source(
                read.rows, read.bags, read.inverse, read.weights, sink=lambda _, grad, i=index: grads.__setitem__(i, grad),
                bag_order=(read.by_bag, read.bag_offsets), row_order=(read.by_row, bag_offsets(read.uses)),
            )
            divisors = bag_divisors(read.lengths, g.feature_is_mean).t().reshape(-1, 1) if g.has_mean else None
            columns = None if self._single else g.columns
            parts.append(Part([source], read.lengths.numel(), g.dim, divisors, columns))
        return OutputPlan(parts, (step.batch, self._width), after_backward=lambda: self.write_back(step, grads))

    # --- output dist: versions back, rows back, settle, pool -------------------------------

    def finish(self, step: _Batch, replies: torch.Tensor) -> torch.Tensor:
        """Requester side, once the owners' versions arrived: which rows come, slots for them, the
        rows' all-to-all (with the backward's push counts as a header), the settle, the pooled bags."""
        ws, groups, device = self._ws, len(self._groups), self._compute_device
        brings = (step.held < 0) | (replies - step.held > self._bounds.index_select(0, step.group))
        widths = self._fetch_widths.index_select(0, step.group)
        rows_in = torch.bincount(step.dest[brings], widths[brings], minlength=ws).long()
        step.writes = torch.is_grad_enabled()
        plans = self._plan_slots(step, brings)
        splits = torch.cat([step.rows_out, rows_in] + [plan[-1] for plan in plans]).tolist()  # the output dist's one host sync
        rows_out, rows_in_list, rescans = splits[:ws], splits[ws : 2 * ws], splits[2 * ws :]
        push_counts = self._reserve(step, plans, rescans)
        # to each rank: a header (how many gradients this rank will push to it, per group), then its rows
        heads = max(groups, 1)
        header = push_counts.to(torch.int32).view(torch.float32)  # [ws, heads]
        out_total = step.payload.numel() + heads * ws
        payload_rank = torch.repeat_interleave(
            torch.arange(ws, device=device), step.rows_out, output_size=step.payload.numel()
        )
        send = torch.empty(out_total, device=device)
        send.index_copy_(0, torch.arange(step.payload.numel(), device=device) + heads * (payload_rank + 1), step.payload)
        head_at = (torch.cumsum(step.rows_out + heads, 0) - step.rows_out - heads).unsqueeze(1) + torch.arange(
            heads, device=device)
        send.index_copy_(0, head_at.reshape(-1), header.reshape(-1))
        received = exchange_flat(
            send, [heads + r for r in rows_out], [heads + r for r in rows_in_list], self._exchange_pg
        )
        head_in = (torch.cumsum(rows_in + heads, 0) - rows_in - heads).unsqueeze(1) + torch.arange(heads, device=device)
        pull_counts = received.index_select(0, head_in.reshape(-1)).view(torch.int32).long().view(ws, heads)
        # where each brought row starts in what arrived
        brought_width = torch.where(brings, widths, 0)
        starts = torch.cumsum(brought_width, 0) - brought_width + heads * (step.dest + 1)
        for g, read, plan in zip(self._groups, step.reads, plans):
            mine, asked, held_slots, group_brings, missing, missing_ids, protect, _ = plan
            brought = mine[group_brings]
            at = starts.index_select(0, brought).unsqueeze(1) + torch.arange(g.fetch_width, device=device)
            rows = received.index_select(0, at.reshape(-1)).view(-1, g.fetch_width)
            self._settle(g, read, asked, held_slots, replies.index_select(0, mine), group_brings, rows, missing,
                         step.step, step.step)
        step.pull_counts = pull_counts[:, :groups]
        return self._pooled(step, groups)

    def _plan_push(self, index: int, g: HetGroup, read: _Read, writes: bool) -> None:
        """What this batch's backward will push to each owner: owned and uncached rows, cached rows
        that pass the write bound with this step's update, and dirty evicted rows."""
        if not writes or self.batches_ahead:  # no backward will come, or its counts go out with it
            read.push_counts = torch.zeros(self._ws, dtype=torch.int64, device=self._compute_device)
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

    def _settle(self, g: HetGroup, read: _Read, asked, held_slots, versions, brings, rows, missing, step: int,
                validated: int) -> None:
        """Requester side: refresh stale copies, fill new rows, renew leases, count, and gather the rows.

        ``held_slots``: the slot of each asked id before this settle's reservation; ``rows``: the
        rows that came, in request order (each followed by its owner's optimizer state where the
        cache keeps one); ``validated``: the step the owners' answer counts as (the batch's own, or
        the one before when fetched ahead)."""
        cache, stats, device = g.cache, g.stats, self._compute_device
        rows, states = rows[:, : g.dim], rows[:, g.dim :]
        asked_tables = read.tables.index_select(0, read.remote.index_select(0, asked))
        fresh = ~brings  # the owner kept the row: the cached copy is within the bound
        if g.settings.protocol == "lease":
            held = held_slots >= 0  # how far each leased copy fell behind while served unasked
            stats.add_staleness(asked_tables[held], versions[held] - cache.versions[held_slots[held]])
            cache.mark_validated(held_slots[fresh], validated)
        else:
            stats.add_staleness(asked_tables[fresh], versions[fresh] - cache.versions[held_slots[fresh]])
        row_of = torch.cumsum(brings.long(), 0) - 1  # row in ``rows`` of each request that brought one
        stale = (brings & (held_slots >= 0)).nonzero().flatten()
        stale_rows = row_of.index_select(0, stale)
        cache.refresh(held_slots.index_select(0, stale), rows.index_select(0, stale_rows),
                      versions.index_select(0, stale), validated, states.index_select(0, stale_rows))
        new_slots = read.slots.index_select(0, asked.index_select(0, missing))
        missing_rows = row_of.index_select(0, missing)
        fetched = rows.index_select(0, missing_rows)
        cache.fill(new_slots, fetched, states.index_select(0, missing_rows))
        cache.versions.index_copy_(0, new_slots[new_slots >= 0], versions.index_select(0, missing)[new_slots >= 0])
        stats.add("rows_fetched", asked_tables[brings])
        served = torch.ones(read.remote.numel(), dtype=torch.bool, device=device)
        served[asked[brings]] = False
        remote_tables = read.tables.index_select(0, read.remote)
        stats.add("hits_unique", remote_tables[served])
        stats.add("hits_lookups", remote_tables[served], read.uses.index_select(0, read.remote)[served])
        cached = (read.slots >= 0).nonzero().flatten()
        cached_slots = read.slots.index_select(0, cached)
        cache.touch(cached_slots, step, read.uses.index_select(0, read.remote.index_select(0, cached)))
        # the rows of this step: owned from the shards, remote from the cache or as fetched
        out = torch.empty(read.uniq.numel(), g.dim, device=device)
        out.index_copy_(0, read.local, self._read_owned(g, read.uniq.index_select(0, read.local)))
        out.index_copy_(0, read.remote.index_select(0, cached), cache.values.index_select(0, cached_slots))
        out.index_copy_(0, read.uncached, fetched[new_slots < 0])
        read.rows = out
        g.pins.index_add_(0, read.pinned, torch.full_like(read.pinned, -1, dtype=g.pins.dtype))  # settled
        read.pinned = read.pinned[:0]
        if self.batches_ahead and torch.is_grad_enabled():  # later batches settle before this backward
            read.pinned = cached_slots
            g.pins.index_add_(0, read.pinned, torch.ones_like(read.pinned, dtype=g.pins.dtype))


def _sample_major(read: _Read) -> None:
    """Orders the bags sample by sample (the output's layout, so pooling writes it in place):
    ``read.bags`` is each id's bag in that order, ``read.by_bag`` the ids in that order."""
    features, batch = read.lengths.shape
    n = read.inverse.numel()
    device = read.inverse.device
    by_feature = read.value_bags
    bags = by_feature % batch * features + by_feature // batch
    starts = bag_offsets(read.lengths.t())  # of the sample-major bags
    position = starts.index_select(0, bags) + torch.arange(n, device=device) - bag_offsets(read.lengths).index_select(
        0, by_feature)
    read.bags = bags
    read.by_bag = torch.empty_like(position).index_copy_(0, position, torch.arange(n, device=device))
    read.bag_offsets = starts

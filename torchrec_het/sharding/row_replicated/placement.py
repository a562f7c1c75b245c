"""Who holds every row of a ``het_row_replicated`` sharding: its tables, their tiers and the id layout the
dists route with, and the online profile that may choose the hot rows after the first steps.

:class:`ReplicaGroup`: tables of one lookup that share a dimension, with their tiers and the
per-host rows each local rank holds. :class:`IdLayout`: one id space over every table of a
sharding (static indexes, built once), with which the input dists route a batch's ids
(:meth:`IdLayout.split`).

:class:`ReplicaPlacement` is built once per sharding, before its stages (a collective: it creates the
exchanges' group), and handed to each: the input dist routes with it and is the one stage that
changes it (the online profile's end sets new hot rows, a new ``layout.hot_version``); the lookup
builds its replica blocks from it and rebuilds them at the first batch routed with a newer version;
the output dist reads its layout. Per batch, the stages share only the batch in the sharding context.

Design: docs/internals.md#row-replicated-routing
"""

import torch
import torch.distributed as dist

from torchrec_het.plan_options import ReplicaOptions
from torchrec_het.replication.hot_rows import hottest_rows, replication_threshold
from torchrec_het.sharding.common.feature_layout import FeatureLayout
from torchrec_het.sharding.common.groups import dedicated_group
from torchrec_het.sharding.common.id_space import FusedIdSpace, TableInfo
from torchrec_het.sharding.common.wire_codec import WireCodecs


class ReplicaGroup(FusedIdSpace):
    """Fused id space of same-dimension tables plus their hot tiers.

    Args:
        tables: the tables, in the lookup's order.
        tiers: per table, (replicated, per_host) sorted row ids.
        dim: their embedding dimension.
        rank: this rank.
        world_size: ranks in the sharding's process group.
        local_world_size: ranks per host (a host's ranks are consecutive).
    """

    def __init__(
        self,
        tables: list[TableInfo],
        tiers: list[tuple[torch.Tensor, torch.Tensor]],
        dim: int,
        rank: int,
        world_size: int,
        local_world_size: int,
    ) -> None:
        super().__init__(tables, dim, rank, world_size)
        self.local_world_size = local_world_size
        empty = torch.zeros(0, dtype=torch.int64)
        self.hot = torch.cat([empty] + [self.offsets[i] + rep for i, (rep, _) in enumerate(tiers)])
        self.host = torch.cat([empty] + [self.offsets[i] + per for i, (_, per) in enumerate(tiers)])
        self.host_block = self.holder_rows(rank % local_world_size)  # per-host rows this rank holds

    def holder_rows(self, local_rank: int) -> torch.Tensor:
        """The per-host rows the ranks of ``local_rank`` hold (those their owners' local rank is), sorted."""
        return self.host[self.owner_of(self.host) % self.local_world_size == local_rank]


class IdLayout(FeatureLayout):
    """Static indexes of a sharding's features, built once: one id space over every table.

    A :class:`~torchrec_het.sharding.common.feature_layout.FeatureLayout` whose ids are the
    sharding's (table t's row r of group g is id ``group_base[g] + offsets[t] + r``), plus the
    tiers and owners every id is routed by (:meth:`split`). The output's bags of one group are
    one part of it (:meth:`group_part`, :meth:`group_bags`).
    """

    sharding_type = "het_row_replicated"

    def __init__(
        self, groups: list[ReplicaGroup], positions: list[tuple[int, int]], world_size: int, rank: int = 0,
        local_world_size: int | None = None, cold_rows: list[bool] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(groups, positions, end_to_end=True)
        # per position: its table's cold ids fetch rows (the reader pools them) rather than partial sums
        self.cold_rows = torch.tensor(cold_rows or [False] * len(positions), dtype=torch.bool)
        self.fetches_rows = bool(self.cold_rows.any())
        self.world_size, self.local_world_size = world_size, local_world_size or world_size
        self.host_first = rank - rank % self.local_world_size  # the first rank of this rank's host
        widths = set(self.dims.tolist())
        self.uniform_dim = widths.pop() if len(widths) == 1 else None
        self.mean = torch.tensor([groups[g].tables[t].mean for g, t in positions], dtype=torch.bool)
        self.has_mean = bool(self.mean.any())
        self.owner_ends = torch.cat([self.group_base[i] + g.owner_ends for i, g in enumerate(groups)])
        self.bucket_start = torch.cat([torch.zeros(1, dtype=torch.int64), self.owner_ends[:-1]])
        self.total_rows = int(self.group_ends[-1])
        self.set_hot(groups)

    def set_hot(self, groups: list[ReplicaGroup]) -> None:
        """Takes the hot rows of ``groups`` (same tables and widths; after an online profile)."""
        self.groups = groups
        self.hot_version = getattr(self, "hot_version", -1) + 1
        hot = [self.group_base[i] + g.hot for i, g in enumerate(groups)]
        self.hot_ids = torch.cat([torch.zeros(0, dtype=torch.int64)] + hot)
        counts = torch.tensor([h.numel() for h in hot], dtype=torch.int64)
        self.hot_start = torch.cumsum(counts, 0) - counts
        self.hot_group_ends = torch.cumsum(counts, 0)
        self._set_host(groups)
        self._set_route_map()
        if getattr(self, "device", None) is not None:
            self.to(self.device)

    def _set_host(self, groups: list[ReplicaGroup]) -> None:
        """Per-host rows (global ids, sorted): the local rank of their holders and their slot in the
        holders' blocks (one block per group, laid end to end); this rank's blocks' ends."""
        ids, local, slot = (
            [torch.zeros(0, dtype=torch.int64)],
            [torch.zeros(0, dtype=torch.int64)],
            [torch.zeros(0, dtype=torch.int64)],
        )
        for local_rank in range(self.local_world_size):  # once, at build
            base = 0
            for index, g in enumerate(groups):
                rows = g.holder_rows(local_rank)
                ids.append(self.group_base[index] + rows)
                local.append(torch.full_like(rows, local_rank))
                slot.append(base + torch.arange(rows.numel()))
                base += rows.numel()
        self.host_ids, order = torch.sort(torch.cat(ids))
        self.host_local, self.host_slot = torch.cat(local)[order], torch.cat(slot)[order]
        sizes = torch.tensor([g.host_block.numel() for g in groups], dtype=torch.int64)
        self.host_block_ends = torch.cumsum(sizes, 0)
        self.host_block_starts = self.host_block_ends - sizes

    def _set_route_map(self) -> None:
        """One code per row of the id space (built once per hot set), so that :meth:`split` reads an
        id's tier and owner with one gather: its hot position (``>= 0``); ``-1 - bucket`` for a cold
        row, ``bucket`` indexing ``owner_ends`` (owner ``bucket % world_size``); ``-1 - buckets - h``
        for entry ``h`` of the per-host tier. int16 where every code fits, else int32: 2 or 4 bytes a
        row (``nbytes``). Why a map: docs/internals.md#row-replicated-routing."""
        buckets, hosts = self.owner_ends.numel(), self.host_ids.numel()
        fits16 = max(self.hot_ids.numel(), buckets + hosts) < 2**15
        dtype = torch.int16 if fits16 else torch.int32
        sizes = self.owner_ends.cpu() - self.bucket_start.cpu()
        codes = torch.repeat_interleave(-1 - torch.arange(buckets, dtype=torch.int32), sizes.to(torch.int64))
        codes = codes.to(dtype)
        codes[self.hot_ids.cpu()] = torch.arange(self.hot_ids.numel(), dtype=dtype)
        codes[self.host_ids.cpu()] = (-1 - buckets - torch.arange(hosts, dtype=torch.int64)).to(dtype)
        self.route_map = codes
        self.num_buckets = buckets
        self.bucket_dest = torch.arange(buckets, dtype=torch.int64) % self.world_size

    def split(self, ids: torch.Tensor):
        """A batch's global ids split by where they are read: (indexes of the hot ids, their positions
        in ``hot_ids``; indexes of the others, the rank each is sent to, its row there).

        A cold id goes to its owner, as the row of the owner's shard; an id of the per-host tier to
        its holder on this rank's host, as ``-1 - slot`` (its slot in the holder's blocks)."""
        code = self.route_map.index_select(0, ids)  # the one gather
        hot = code >= 0
        hot_at, cold_at = hot.nonzero().flatten(), (~hot).nonzero().flatten()
        cold_code = -1 - code.index_select(0, cold_at).to(torch.int64)  # bucket, or buckets + per-host index
        dest, row = self._cold_route(ids.index_select(0, cold_at), cold_code)
        return hot_at, code.index_select(0, hot_at).to(torch.int64), cold_at, dest, row

    def _cold_route(self, ids: torch.Tensor, cold_code: torch.Tensor):
        if not self.host_ids.numel():
            return self.bucket_dest.index_select(0, cold_code), ids - self.bucket_start.index_select(0, cold_code)
        bucket = cold_code.clamp(max=self.num_buckets - 1)
        dest, row = self.bucket_dest.index_select(0, bucket), ids - self.bucket_start.index_select(0, bucket)
        at = cold_code - self.num_buckets
        is_host, at = at >= 0, at.clamp(min=0)
        dest = torch.where(is_host, self.host_first + self.host_local.index_select(0, at), dest)
        row = torch.where(is_host, -1 - self.host_slot.index_select(0, at), row)
        return dest, row

    def distinct(self, dest: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The distinct (owner, id) pairs of values sent to ``dest``, by owner then id, as the rows
        fetched are asked: (each pair's owner, the pair of every value, a value of each pair)."""
        need, pair_of = torch.unique(dest * self.total_rows + ids, return_inverse=True)
        first = torch.empty_like(need).scatter_(0, pair_of, torch.arange(ids.numel(), device=ids.device))
        return need // self.total_rows, pair_of, first

    @property
    def nbytes(self) -> int:
        """Bytes of the route map (the layout's one index that grows with the tables' rows)."""
        return self.route_map.numel() * self.route_map.element_size()

    def host_block_of(self, slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per group: (indexes of the ``slots`` (of this rank's per-host blocks) that are its, their rows in its block)."""
        block_of = torch.bucketize(slots, self.host_block_ends, right=True)
        out = []
        for index in range(len(self.groups)):
            mine = (block_of == index).nonzero().flatten()
            out.append((mine, slots.index_select(0, mine) - self.host_block_starts[index]))
        return out

    def hot_of(self, hot_at: torch.Tensor, hot_pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per replica block: (indexes of the values it serves, their rows in the block), from the hot
        values' indexes and positions in ``hot_ids`` (:meth:`split`)."""
        if len(self.groups) == 1:
            return [(hot_at, hot_pos)]
        block_of = torch.bucketize(hot_pos, self.hot_group_ends, right=True)
        out = []
        for index in range(len(self.groups)):  # one per width, as TorchRec's lookup groups tables
            mine = (block_of == index).nonzero().flatten()
            out.append((hot_at.index_select(0, mine), hot_pos.index_select(0, mine) - self.hot_start[index]))
        return out

    def group_bags(self, bags: torch.Tensor, batch: int, group: int) -> torch.Tensor:
        """Bags (``position * batch + sample``) of ``group``'s positions as bags of its output part,
        sample by sample: ``sample * its positions + the position's index among them``."""
        if self.single:
            return bags % batch * self.num_positions + bags // batch
        return bags % batch * self.group_sizes[group] + self.position_local.index_select(0, bags // batch)

    def elements(self, rows: torch.Tensor, positions: torch.Tensor, row_width: int) -> torch.Tensor:
        """Flat indexes of the blocks (row, position) in a ``[*, width]`` matrix, for mixed widths."""
        widths = self.dims[positions]
        start = rows * row_width + self.columns[positions]
        first = torch.repeat_interleave(torch.cumsum(widths, 0) - widths, widths)
        base = torch.repeat_interleave(start, widths)
        return base + torch.arange(base.numel(), device=base.device) - first


class ReplicaPlacement:
    """A sharding's tables, tiers and id layout (see the module docstring).

    Args:
        grouped_configs: the lookup's grouped configs (TorchRec's row-wise grouping).
        pg: the sharding's process group.
        settings: the plan options these tables share (:func:`~torchrec_het.plan_options.shared_options`:
            sync interval, skip-all-hot, ranks per host, online counting).
        hot_rows: name -> (replicated, per_host) sorted int64 row ids of the tables with hot rows
            (the others have none, or choose them online).
        shards_by_table: each table's shard metadata.
        device: where the batches arrive.
        codecs: the quantized-comms codecs of the partial sums or rows sent (TorchRec's, from the
            sharder's ``qcomm_codecs_registry``; None: fp32).
        sync_dtype: the dtype the replica syncs sum gradients in
            (:func:`~torchrec_het.sharding.common.wire_codec.summing_dtype`).
        cold_rows: bags: the tables whose cold ids fetch their rows (``ReplicaOptions.cold_rows``).

    Attributes:
        settings: the plan options the tables share.
        rank, world_size, local_world_size: this rank, the group's size, ranks per host.
        groups: one :class:`ReplicaGroup` per width.
        layout: the :class:`IdLayout` the dists route with.
        tables: per width, its tables (``TableInfo``), in the sharding's order.
        positions: (width, table name) of each of the sharding's features, in order.
        exchange_pg: the group of the dists' exchanges.
        codecs: the cold traffic's codecs (:class:`~torchrec_het.sharding.common.wire_codec.WireCodecs`).
        online_hot_rows: hot rows the online profile chose (0 before its end, or without one).
        training: the sharded module's mode when its input dist last ran.
        early_partials: lookahead (bags): what the input dist calls with a batch that has reached its
            owners, set by the lookup that owns the rows (None: off); returns the partials sent early.
    """

    def __init__(
        self, grouped_configs, pg, settings: ReplicaOptions, hot_rows: dict[str, tuple], shards_by_table,
        device=None, codecs: WireCodecs | None = None, sync_dtype: torch.dtype = torch.float32,
        cold_rows: set[str] = frozenset(),
    ) -> None:  # fmt: skip
        self.settings, self._pg, self.cold_rows = settings, pg, set(cold_rows)
        self.rank, self.world_size = dist.get_rank(pg), dist.get_world_size(pg)
        self.local_world_size = settings.ranks_per_host(self.world_size)
        self.device = device if device is not None else torch.device("cpu")
        self.codecs = codecs if codecs is not None else WireCodecs()
        self.sync_dtype = sync_dtype
        self.exchange_pg = dedicated_group(pg)  # the dists' exchanges
        self.tables: dict[int, list[TableInfo]] = {}  # per width: its tables, in the sharding's order
        self.positions: list[tuple[int, str]] = []
        for module_index, group in enumerate(grouped_configs):
            for table_index, table in enumerate(group.embedding_tables):
                info = TableInfo.of(table, module_index, table_index, shards_by_table[table.name], self.world_size)
                self.tables.setdefault(table.embedding_dim, []).append(info)
                self.positions += [(table.embedding_dim, table.name)] * len(table.feature_names)
        empty = (torch.zeros(0, dtype=torch.int64),) * 2
        tiers = {t.name: hot_rows.get(t.name, empty) for infos in self.tables.values() for t in infos}
        self.groups = self._replica_groups(tiers)
        self.layout = self._id_layout().to(self.device)
        online = settings.counted_online
        self._online_left = settings.online_profile_steps if online else 0
        self._online_counts = (
            torch.zeros(self.layout.total_rows, dtype=torch.int64, device=self.device) if online else None
        )
        self.online_hot_rows = 0
        self.training = True  # the sharded module's mode at the last input dist (set by it)
        self.early_partials = None  # lookahead: set by the bag lookup that owns the rows

    @property
    def hosts(self) -> int:
        return self.world_size // self.local_world_size

    def _replica_groups(self, tiers: dict[str, tuple]) -> list[ReplicaGroup]:
        if self.hosts == 1:  # one host: per-host rows are read from their owners, as cold ones
            tiers = {name: (replicated, per_host[:0]) for name, (replicated, per_host) in tiers.items()}
        return [
            ReplicaGroup(infos, [tiers[t.name] for t in infos], dim, self.rank, self.world_size, self.local_world_size)
            for dim, infos in self.tables.items()
        ]

    def _id_layout(self) -> IdLayout:
        table_pos = {t.name: (gi, ti) for gi, g in enumerate(self.groups) for ti, t in enumerate(g.tables)}
        positions = [table_pos[name] for _, name in self.positions]
        rows = [name in self.cold_rows for _, name in self.positions]
        return IdLayout(self.groups, positions, self.world_size, self.rank, self.local_world_size, rows)

    def observe(self, ids: torch.Tensor, training: bool) -> None:
        """From the input dist: while the online profile runs, counts training batches' ids; after the
        last counted batch the hot rows are chosen from every rank's counts (one all-reduce) and the
        layout routes later batches with them (a new ``hot_version``)."""
        if self._online_counts is None or not training:  # evaluation batches are not counted
            return
        if self._online_left > 0:
            self._online_counts.index_add_(0, ids, torch.ones_like(ids))
            self._online_left -= 1
            return
        counts, self._online_counts = self._online_counts, None
        dist.all_reduce(counts, group=self._pg)
        settings, tiers = self.settings, {}
        steps = settings.online_profile_steps
        empty = torch.zeros(0, dtype=torch.int64)
        threshold = replication_threshold(self.world_size, settings.replica_sync_every)
        for g, base in zip(self.groups, self.layout.group_base.tolist()):  # once, at the end of the profile
            for i, t in enumerate(g.tables):
                reads = counts[base + int(g.offsets[i]) : base + int(g.offsets[i + 1])].double().cpu() / steps
                tiers[t.name] = (hottest_rows(reads, threshold, settings.online_max_hot_fraction), empty)
        self.groups = self._replica_groups(tiers)
        self.layout.set_hot(self.groups)
        self.online_hot_rows += sum(g.hot.numel() for g in self.groups)

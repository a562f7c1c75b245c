"""Who holds every row of a ``het_row_replicated`` sharding: its tables, their tiers and the id layout the
dists route with, and the online profile that may choose the hot rows after the first steps.

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
from torchrec_het.sharding.common.groups import dedicated_group
from torchrec_het.sharding.common.id_space import TableInfo
from torchrec_het.sharding.common.wire_codec import WireCodecs
from torchrec_het.sharding.row_replicated.routing import IdLayout, ReplicaGroup


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

    Attributes:
        settings: the plan options the tables share.
        rank, world_size, local_world_size: this rank, the group's size, ranks per host.
        groups: one :class:`~torchrec_het.sharding.row_replicated.routing.ReplicaGroup` per width.
        layout: the :class:`~torchrec_het.sharding.row_replicated.routing.IdLayout` the dists route with.
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
    ) -> None:  # fmt: skip
        self.settings, self._pg = settings, pg
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
        mean = [self.groups[g].tables[t].mean for g, t in positions]
        dims = [d for d, _ in self.positions]
        return IdLayout(self.groups, positions, dims, mean, self.world_size, self.rank, self.local_world_size)

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

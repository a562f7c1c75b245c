"""``het_cached_row_wise`` with both bounds 0: ``het_row_replicated``'s fetched-rows tier.

An exact cache serves nothing it holds: a rank pushes every row it reads in training, so the
owner's version moves past the copy before the next read. What is left of HET's protocol is
"fetch each step's distinct remote rows once, send their gradients back", and that is the
``cold_rows`` tier of ``het_row_replicated`` with no hot rows: one all-to-all each way, in
TorchRec's stages. A sharding whose ``het_cached_row_wise`` tables are all exact runs as that
tier (:class:`CachedTierPooledEmbeddingSharding`), with HET's counters (:class:`CacheCounters`);
one with a bounded table runs HET's cache (:mod:`torchrec_het.sharding.het_cache`).

Design: docs/internals.md#the-exact-cached-tier
"""

import torch

from torchrec_het.plan_options import ReplicaOptions, options_of
from torchrec_het.sharding.common.cache_stats import GroupStats
from torchrec_het.sharding.common.context import HetShardingContext
from torchrec_het.sharding.row_replicated.batch import ReplicatedBagBatch
from torchrec_het.sharding.row_replicated.lookup import ReplicatedBagLookup
from torchrec_het.sharding.row_replicated.placement import ReplicaPlacement
from torchrec_het.sharding.row_replicated.sharding import RowReplicatedPooledEmbeddingSharding
from torchrec_het.types import HET_CACHED_ROW_WISE

FETCHED_ROWS = ReplicaOptions(replicated_rows=0, per_host_rows=0, cold_rows=True)  # no hot rows, every row fetched


def served_exactly(sharding_infos) -> bool:
    """Whether every table of a ``het_cached_row_wise`` sharding has both bounds 0 (its plan options)."""
    options = [options_of(info.param_sharding) for info in sharding_infos]
    return all(o is not None and o.exact for o in options)


class CacheCounters:
    """HET's per-table counters (:class:`~torchrec_het.sharding.common.cache_stats.GroupStats`, one per
    width) kept by the exact cached tier: lookups, distinct and remote reads, requests and rows
    fetched (every distinct remote row, each step), rows pushed and the gradient mass produced
    (the reader's backward) and applied (the owner's). Nothing is held, so hits, evictions and
    staleness stay 0. Counted with tensor ops, read back only when asked."""

    def __init__(self, placement: ReplicaPlacement) -> None:
        self.layout, self.rank, self.device = placement.layout, placement.rank, placement.device
        self.names = [[t.name for t in g.tables] for g in self.layout.groups]
        index = {name: i for names in self.names for i, name in enumerate(names)}
        self.position_table = torch.tensor([index[name] for _, name in placement.positions], device=self.device)
        self.group_of_dim = {g.dim: i for i, g in enumerate(self.layout.groups)}  # one group per width
        self.reset()
        every = torch.arange(self.layout.num_positions, device=self.device)
        self.position_split = [(mine, tables) for _, mine, tables in self._by_group(every)]  # static: once

    def reset(self) -> None:
        self.groups = [GroupStats(len(g.tables), g.dim, self.device) for g in self.layout.groups]

    def table_stats(self) -> dict[str, dict]:
        return {name: stats.table(i) for stats, names in zip(self.groups, self.names) for i, name in enumerate(names)}

    def _by_group(self, positions: torch.Tensor):
        """Per group: (its stats, indexes of ``positions`` that are its, their tables in it)."""
        if len(self.groups) == 1:
            yield self.groups[0], None, self.position_table.index_select(0, positions)
            return
        group = self.layout.position_group.index_select(0, positions)
        for index, stats in enumerate(self.groups):
            mine = (group == index).nonzero().flatten()
            yield stats, mine, self.position_table.index_select(0, positions.index_select(0, mine))

    def read(self, step: ReplicatedBagBatch) -> None:
        """Reader: a batch's lookups and the rows it fetches (the input dist's ``step.fetched``)."""
        fetched = step.fetched
        per_position = step.lengths.view(self.layout.num_positions, step.batch).sum(1)
        for stats, (mine, tables) in zip(self.groups, self.position_split):
            counts = per_position if mine is None else per_position.index_select(0, mine)
            stats.add_per_table("lookups", torch.zeros_like(stats.counters["lookups"]).index_add_(0, tables, counts))
        if fetched is None:
            return
        remote = fetched.owners != self.rank
        uses = torch.bincount(fetched.entry_of, minlength=remote.numel())
        for stats, mine, tables in self._by_group(fetched.position):
            far = remote if mine is None else remote.index_select(0, mine)
            used = uses if mine is None else uses.index_select(0, mine)
            stats.add("unique_lookups", tables)
            for name in ("remote_unique", "requests", "rows_fetched"):
                stats.add(name, tables[far])
            stats.add("remote_lookups", tables[far], used[far])

    def produced(self, grads: torch.Tensor, positions: torch.Tensor, owners: torch.Tensor) -> None:
        """Reader's backward: the (scaled) gradients of rows it fetched of one width (one group's),
        going back to their owners."""
        stats = self.groups[self.group_of_dim[grads.size(1)]]
        tables = self.position_table.index_select(0, positions)
        stats.add_mass("grad_produced", tables, grads)
        stats.add("rows_pushed", tables[owners != self.rank])

    def applied(self, grads: torch.Tensor, entry_position: torch.Tensor) -> None:
        """Owner's backward: the flat gradients of the entries it served (each a row), in arrival order."""
        widths = self.layout.dims.index_select(0, entry_position)
        starts = torch.cumsum(widths, 0) - widths
        for (stats, mine, tables), g in zip(self._by_group(entry_position), self.layout.groups):
            at = starts if mine is None else starts.index_select(0, mine)
            rows = grads.index_select(0, (at.unsqueeze(1) + torch.arange(g.dim, device=at.device)).view(-1))
            stats.add_mass("grad_applied", tables, rows.view(-1, g.dim))


class CachedTierBagLookup(ReplicatedBagLookup):
    """The fetched-rows lookup, counting as HET's cache counts (``cache_stats``)."""

    def __init__(self, grouped_configs, feature_names, pg, placement, device=None, env=None):
        super().__init__(grouped_configs, feature_names, pg, placement, device, env)
        self.counters = CacheCounters(placement)

    def forward(self, sparse_features, sharding_ctx: HetShardingContext[ReplicatedBagBatch]) -> torch.Tensor:
        step, counters = sharding_ctx.batch, self.counters
        counters.read(step)
        if step.fetched is not None:  # the reader's pooling calls it with the rows' gradients
            step.fetched.on_grad = counters.produced
        partials = super().forward(sparse_features, sharding_ctx)
        if partials.requires_grad and step.received is not None:
            entry_position = step.received.entry_position
            partials.register_hook(lambda grads: counters.applied(grads, entry_position))
        return partials

    def cache_stats(self) -> dict[str, dict]:
        """HET's counters per table (:meth:`HetCachedEmbeddingLookup.cache_stats`'s keys)."""
        return self.counters.table_stats()

    def reset_cache_stats(self) -> None:
        self.counters.reset()


class CachedTierPooledEmbeddingSharding(RowReplicatedPooledEmbeddingSharding):
    """``het_cached_row_wise`` bags whose tables are all exact: TorchRec's row-wise shards, every
    remote row fetched once a step (:data:`FETCHED_ROWS`), in ``het_row_replicated``'s stages."""

    lookup_class = CachedTierBagLookup
    sharding_type = HET_CACHED_ROW_WISE

    def lookup_config(self, options_by_table: dict, hot_rows) -> dict:
        return {"settings": FETCHED_ROWS, "hot_rows": {}, "cold_rows": set(options_by_table)}

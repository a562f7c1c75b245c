"""Tables of one ``het_cached_row_wise`` lookup that share a dimension and cache settings.

They share one fused id space (:mod:`torchrec_het.sharding.id_space`), so every step
runs one unique, one cache probe and one exchange for all of them. Capacity stays
per table: the cache is partitioned by table.

Everything a step needs to find its features, tables, kernels and output columns is
built here once (:meth:`HetGroup.set_layout`, at attach time and again after a load),
as small index tensors: a step runs no Python loop over tables or features.
"""

import torch

from torchrec_het.cache import RowCache
from torchrec_het.config import CacheSettings
from torchrec_het.sharding.id_space import FusedIdSpace, TableInfo, tensors_to
from torchrec_het.sharding.row_optim import square_width

STALENESS_BUCKETS = 65  # observed staleness 0..63, and 64 for "64 or more"
COUNTERS = (
    "lookups", "unique_lookups", "remote_unique", "remote_lookups", "hits_unique", "hits_lookups",
    "requests", "rows_fetched", "rows_pushed", "evictions", "dirty_evictions",
)


class GroupStats:
    """Per-table counters of a group (see ``HetCachedEmbeddingLookup.cache_stats``).

    Every update is one vectorized op over the step's ids (a ``bincount`` or an
    ``index_add_``); nothing is read back to the host until :meth:`table` is asked.
    """

    def __init__(self, num_tables: int, dim: int, device: torch.device | None = None) -> None:
        self.counters = {name: torch.zeros(num_tables, dtype=torch.int64, device=device) for name in COUNTERS}
        self.staleness = torch.zeros(num_tables, STALENESS_BUCKETS, dtype=torch.int64, device=device)
        self.grad_produced = torch.zeros(num_tables, dim, dtype=torch.float64, device=device)
        self.grad_applied = torch.zeros(num_tables, dim, dtype=torch.float64, device=device)

    def add(self, name: str, tables: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        n = self.counters[name].numel()
        self.counters[name] += torch.bincount(tables, weights, minlength=n).to(torch.int64)

    def add_per_table(self, name: str, counts: torch.Tensor) -> None:
        """Adds ``counts[t]`` (one entry per table) to counter ``name``."""
        self.counters[name] += counts.to(torch.int64)

    def add_staleness(self, tables: torch.Tensor, lags: torch.Tensor) -> None:
        cells = tables * STALENESS_BUCKETS + lags.clamp(0, STALENESS_BUCKETS - 1)
        self.staleness += torch.bincount(cells, minlength=self.staleness.numel()).view_as(self.staleness)

    def add_mass(self, name: str, tables: torch.Tensor, grads: torch.Tensor) -> None:
        """Adds each table's gradient sum of this step (summed in float32, the totals kept in float64:
        a float64 copy of every row's gradient cost 6% of a step)."""
        total = getattr(self, name)
        step = torch.zeros(total.shape, dtype=torch.float32, device=total.device)
        total += step.index_add_(0, tables, grads.float())

    def table(self, index: int) -> dict:
        """Table ``index``'s counters as plain Python numbers (ints, floats, lists of them)."""
        out = {name: int(values[index]) for name, values in self.counters.items()}
        remote, remote_lookups = out["remote_unique"], out["remote_lookups"]
        out["hit_rate_unique"] = out["hits_unique"] / remote if remote else 0.0
        out["hit_rate_lookups"] = out["hits_lookups"] / remote_lookups if remote_lookups else 0.0
        hist = self.staleness[index]
        out["staleness"] = hist.tolist()
        out["max_staleness"] = int(hist.nonzero().max()) if hist.any() else 0
        out["grad_produced"] = self.grad_produced[index].tolist()  # per dimension: the gradient mass made here
        out["grad_applied"] = self.grad_applied[index].tolist()  # and applied by the owners
        return out


class HetGroup(FusedIdSpace):
    """Fused id space plus the versions, cache and counters of tables that share dim and cache settings.

    Args:
        tables: the tables, in the lookup's order.
        dim: their embedding dimension.
        settings: their cache settings.
        rank: this rank.
        world_size: ranks in the sharding's process group.
        device: where every index, the cache and the counters live.
    """

    def __init__(self, tables: list[TableInfo], dim: int, settings: CacheSettings, rank: int, world_size: int,
                 device: torch.device | None = None):
        super().__init__(tables, dim, rank, world_size)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.settings = settings
        local_rows = self.local_offsets[1:] - self.local_offsets[:-1]
        capacities = [
            min(settings.capacity_rows(t.num_rows), t.num_rows - int(n)) for t, n in zip(tables, local_rows)
        ]
        self.cache = RowCache(
            int(self.offsets[-1]), dim, capacities, policy=settings.policy, partition_ends=self.offsets[1:].tolist(),
            device=self.device,
        )
        self.versions = torch.zeros(int(self.local_offsets[-1]), dtype=torch.int64)
        # per cache slot: batches in flight (input dist done, not settled) that count on the slot's row
        self.pins = torch.zeros(self.cache.capacity, dtype=torch.int32)
        self.stats = GroupStats(len(tables), dim, self.device)
        self.table_module = torch.tensor([t.module_index for t in tables], dtype=torch.int64)
        self.kernel_table = torch.tensor([t.table_index for t in tables], dtype=torch.int64)
        self.modules = sorted({t.module_index for t in tables})
        self.has_mean = any(t.mean for t in tables)
        # the optimizer state the cache keeps per row (see :meth:`keep_optimizer_state`)
        self.held_kind: str | None = None  # Adagrad-family kind, or None (SGD, mixed kernels)
        self.eps: torch.Tensor | None = None  # float64 epsilon of each table, where a state is kept
        tensors_to(self, self.device)  # the static indexes, built on the host (the cache and counters are made there)

    def set_layout(self, positions: list[int], columns: list[int], num_features: int, width: int) -> None:
        """Where the group's features sit in the lookup's input and output.

        Args:
            positions: input position of each of the group's features (ascending, the
                order of ``self.features``).
            columns: first output column of each of those features.
            num_features: features of the lookup's input.
            width: columns of the lookup's output.
        """
        self.positions = torch.tensor(positions, dtype=torch.int64)
        self.feature_offset = self.offsets[self.feature_table]  # fused id of row 0 of each feature's table
        self.all_features = positions == list(range(num_features))
        self.columns = (
            torch.tensor(columns, dtype=torch.int64).unsqueeze(1) + torch.arange(self.dim)
        ).view(-1)  # [features * dim] output columns, feature-major
        self.contiguous = bool(columns) and self.columns.tolist() == list(
            range(columns[0], columns[0] + len(columns) * self.dim)
        )
        tensors_to(self, self.device)

    def keep_optimizer_state(self, kind: str | None, eps: torch.Tensor | None = None) -> None:
        """With an Adagrad-family ``kind``, the cache keeps each row's optimizer state (owners send
        it with the row) and ``eps`` (float64, one per table) is the tables' epsilon; None keeps none."""
        self.held_kind = kind
        if self.state_width:
            self.cache.hold_optimizer_state(self.state_width)
            self.eps = eps.to(device=self.device, dtype=torch.float64)

    @property
    def state_width(self) -> int:
        """Floats of optimizer state kept per cached row."""
        return square_width(self.held_kind, self.dim)

    @property
    def fetch_width(self) -> int:
        """Floats an owner sends per fetched row: the row, then its optimizer state."""
        return self.dim + self.state_width

    def local_index_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Index of each owned id among this rank's owned rows, without the ownership check."""
        tables = self.table_of(ids)
        return ids - self.offsets[tables] - self.local_starts[tables] + self.local_offsets[tables]

    def reset(self) -> None:
        """Forgets the cache and the versions (after a load: every rank does the same)."""
        self.cache.clear()
        self.versions.zero_()
        self.pins.zero_()

"""Tables of one ``het_cached_row_wise`` lookup that share a dimension and cache settings.

They share one fused id space (:mod:`torchrec_het.sharding.common.id_space`), so every step
runs one unique, one cache probe and one exchange for all of them. Capacity stays
per table: the cache is partitioned by table.

Everything a step needs to find its tables and kernels is built here once, as small index
tensors (where its features and output columns sit: :mod:`~torchrec_het.sharding.het_cache.layout`):
a step runs no Python loop over tables or features.
"""

import torch

from torchrec_het._tbe import square_width
from torchrec_het.cache import RowCache
from torchrec_het.config import CacheSettings
from torchrec_het.sharding.common.cache_stats import GroupStats
from torchrec_het.sharding.common.id_space import FusedIdSpace, TableInfo, tensors_to


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

    def __init__(
        self,
        tables: list[TableInfo],
        dim: int,
        settings: CacheSettings,
        rank: int,
        world_size: int,
        device: torch.device | None = None,
    ):
        super().__init__(tables, dim, rank, world_size)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.settings = settings
        local_rows = self.local_offsets[1:] - self.local_offsets[:-1]
        # an exact cache holds nothing: a copy this rank read in training is stale at its next read
        # (its own push moves the owner's version on), so every read fetches the row
        capacities = [
            0 if settings.exact else min(settings.capacity_rows(t.num_rows), t.num_rows - int(n))
            for t, n in zip(tables, local_rows)
        ]
        self.cache = RowCache(
            int(self.offsets[-1]),
            dim,
            capacities,
            policy=settings.policy,
            partition_ends=self.offsets[1:].tolist(),
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

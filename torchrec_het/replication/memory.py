"""The memory model of the hot-row tiers: ranks and bandwidths, table rows and their bytes."""

from dataclasses import dataclass

import torch

from torchrec_het import _compat
from torchrec_het._tbe import EmbOptimType

_ALIASES = {  # common spellings -> fbgemm's names
    "adagrad": "exact_adagrad",
    "rowwise_adagrad": "row_wise_adagrad",
    "partial_rowwise_adam": "partial_row_wise_adam",
    "exact_rowwise_adagrad": "exact_row_wise_adagrad",
    "partial_rowwise_lamb": "partial_row_wise_lamb",
}
_UNSUPPORTED = {"shampoo", "shampoo_v2", "madgrad", "exact_row_wise_weighted_adagrad"}  # no TBE training kernel


@dataclass(frozen=True)
class TierTopology:
    """Ranks, hosts and bandwidths (bytes/s); a host's ranks are consecutive."""

    world_size: int
    local_world_size: int
    intra_host_bandwidth: float
    inter_host_bandwidth: float

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.local_world_size < 1 or self.world_size % self.local_world_size:
            raise ValueError(f"world_size {self.world_size} is not a positive multiple of {self.local_world_size}")
        if not (self.intra_host_bandwidth > 0 and self.inter_host_bandwidth > 0):
            raise ValueError("bandwidths must be positive")

    @property
    def num_hosts(self) -> int:
        return self.world_size // self.local_world_size

    def host_of(self, rank: int) -> int:
        return rank // self.local_world_size

    @classmethod
    def from_torchrec(cls, topology) -> "TierTopology":
        """From a planner ``Topology`` (whose bandwidths are in bytes/ms)."""
        per_s = 1000.0  # ms per s
        intra, inter = topology.intra_host_bw * per_s, topology.inter_host_bw * per_s
        return cls(topology.world_size, topology.local_world_size, intra, inter)


@dataclass(frozen=True)
class TableMemory:
    """One table as the memory model sees it (``bytes_per_row``: weights plus optimizer state).

    ``replica_copies``: copies a rank holds of each row replicated to it (2 for replicas synced
    every s > 1 steps: the agreed rows and the rank's own steps since the last sync).
    """

    name: str
    num_rows: int
    dim: int
    bytes_per_row: int
    replica_copies: int = 1

    def __post_init__(self) -> None:
        if self.num_rows < 1 or self.dim < 1 or self.bytes_per_row < 1:
            raise ValueError(f"table {self.name!r}: num_rows, dim and bytes_per_row must be positive")

    @property
    def replica_bytes_per_row(self) -> int:
        return self.bytes_per_row * self.replica_copies


ROUTE_MAP_BYTES_PER_ROW = 2  # het_row_replicated's route map: one int16 code per row (int32 past 32k codes)


def replica_copies(sync_every: int) -> int:
    """Copies a rank holds of a row replicated to it: 2 when replicas sync every s > 1 steps (the
    agreed rows, and the rank's own steps since the last sync: ``ReplicaBlock.steps_locally``), else 1."""
    return 2 if sync_every > 1 else 1


def bytes_per_row(dim: int, optimizer: "EmbOptimType | str", weight_bytes: int = 4) -> int:
    """Weights plus fused-optimizer state of one row, as fbgemm's TBE keeps it (fp32 state)."""
    value = optimizer.value if isinstance(optimizer, EmbOptimType) else str(optimizer).lower()
    try:
        opt = EmbOptimType(_ALIASES.get(value, value))
    except ValueError:
        raise ValueError(f"unknown optimizer {optimizer!r}") from None
    if opt.value in _UNSUPPORTED:
        raise ValueError(f"optimizer {opt.value!r} is not supported by fbgemm's training kernel")
    full, rowwise = 4 * dim, 4  # fp32 momentum per element, or one per row
    state = {  # sgd, exact_sgd, none: no state
        "exact_adagrad": full,
        "lars_sgd": full,
        "adam": 2 * full,
        "lamb": 2 * full,
        "exact_row_wise_adagrad": rowwise,
        "row_wise_adagrad": rowwise,
        "ema_in_place_row_wise_adagrad": rowwise,
        "ensemble_row_wise_adagrad": full + rowwise,
        "partial_row_wise_adam": full + rowwise,
        "partial_row_wise_lamb": full + rowwise,
    }.get(opt.value, 0)
    return dim * weight_bytes + state


def row_wise_sizes(num_rows: int, world_size: int) -> list[int]:
    """Rows of each rank's shard under TorchRec's ``row_wise`` (its own helper)."""
    return _compat.row_wise_shard_rows(num_rows, world_size)


def row_owner(ids: torch.Tensor, num_rows: int, world_size: int) -> torch.Tensor:
    """Row-wise owner rank of each row id."""
    ends = torch.tensor(row_wise_sizes(num_rows, world_size), dtype=torch.int64).cumsum(0)
    return torch.searchsorted(ends, ids.to(torch.int64), right=True)


def plan_peak_bytes(tables: list[TableMemory], plan: dict, world_size: int) -> int:
    """Per-rank peak bytes of a TorchRec module plan (name -> ``ParameterSharding``).

    Shards count on their placement rank, column shards as ``ceil(bytes_per_row * cols / dim)``
    per row; data-parallel tables (no sharding spec) count whole on every rank.
    """
    per_rank = [0] * world_size
    for table in tables:
        if table.name not in plan:
            raise ValueError(f"the plan has no table {table.name!r}")
        spec = plan[table.name].sharding_spec
        if spec is None:
            per_rank = [b + table.num_rows * table.bytes_per_row for b in per_rank]
            continue
        for shard in spec.shards:
            rows, cols = shard.shard_sizes
            per_rank[shard.placement.rank()] += -(-rows * table.bytes_per_row * cols // table.dim)
    return max(per_rank)

"""Expected embedding bytes per step of the plugin's sharding types (pure).

Every figure is bytes per training step summed over ranks (what the benchmark counts),
for one table, from its rows' reads per step (:mod:`torchrec_het.planner.access`).

``het_row_replicated`` (hot rows replicated, the rest row-wise, partial sums on the wire)
  forward: each cold id read from another rank goes as (id, bag) = 16 bytes; each bag
  gets one partial (dim floats) back from every remote server its cold ids live on.
  backward: one gradient per partial, and the replicated rows' gradients combined over
  ranks every ``sync_every`` steps: a sparse all-gather of the touched rows or a dense
  all-reduce of the hot block, whichever is smaller.
``het_row_replicated`` for sequences (EmbeddingCollection, unpooled)
  each rank asks every remote server once per distinct cold row it needs (id, 8 bytes)
  and gets the row back; the backward sends one summed gradient per such row; replicated
  rows sync as for bags.
``het_cached_row_wise`` (HET cache of remote rows)
  a remote read that finds its row in the cache within the read bound costs the id and
  version (16 bytes, ``het`` protocol) or nothing (``lease``); a miss also brings the
  row. Cached rows are the hottest ``capacity`` rows; with ``s_read = 0`` a cached copy of
  a row that is written every step is never valid, so only ``s_read >= 1`` earns hits.
  Gradients of remote rows go to their owners once per ``s_write + 1`` steps.
``row_wise`` / ``table_wise`` (for comparison; the planner prices them with TorchRec's model)
  ids to owners; pooled rows back (table_wise) or per-rank partials of every bag
  (row_wise's reduce-scatter), and the same bytes back as gradients.
"""

import math
from dataclasses import dataclass

import torch

FLOAT, ID = 4, 8


@dataclass(frozen=True)
class TableLoad:
    """One table's traffic inputs.

    Attributes:
        reads: float64 reads per step of its rows, hottest first (all rows, or the read ones).
        bags: bags per step over all ranks (batch size x world size x features of the table).
        dim: embedding dimension.
        world_size: ranks.
    """

    reads: torch.Tensor
    bags: float
    dim: int
    world_size: int

    @property
    def ids(self) -> float:
        return float(self.reads.sum())

    @property
    def remote(self) -> float:
        """Share of a row-wise table's reads that another rank owns."""
        return (self.world_size - 1) / self.world_size


@dataclass(frozen=True)
class Bytes:
    """Bytes per step summed over ranks, by phase."""

    forward: float
    backward: float
    sync: float = 0.0

    @property
    def total(self) -> float:
        return self.forward + self.backward + self.sync


def row_replicated_bytes(load: TableLoad, hot_rows: int, sync_every: int = 1) -> Bytes:
    """``het_row_replicated`` with the ``hot_rows`` hottest rows on every rank."""
    ws, dim = load.world_size, load.dim
    hot = load.reads[:hot_rows]
    cold_ids = max(load.ids - float(hot.sum()), 0.0)
    remote_cold = cold_ids * load.remote
    partials = _distinct_servers(load, remote_cold)
    forward = remote_cold * 2 * ID + partials * dim * FLOAT
    backward = partials * dim * FLOAT
    if hot_rows == 0 or ws == 1:
        return Bytes(forward, backward)
    window = float(sync_every)
    touched = float((1.0 - torch.exp(-hot * window / ws)).sum())  # distinct hot rows one rank touches per sync
    sparse = ws * touched * (dim * FLOAT + FLOAT + ID) * (ws - 1)
    dense = ws * hot_rows * (dim + 1) * FLOAT * 2 * (ws - 1) / ws
    return Bytes(forward, backward, min(sparse, dense) / window)


def sequence_replicated_bytes(load: TableLoad, hot_rows: int, sync_every: int = 1) -> Bytes:
    """``het_row_replicated`` for an EmbeddingCollection: distinct cold rows fetched, not partials."""
    ws, dim = load.world_size, load.dim
    cold = load.reads[hot_rows:]
    fetched = float((1.0 - torch.exp(-cold / ws)).sum()) * ws * load.remote  # distinct rows per rank, summed
    pooled = row_replicated_bytes(load, hot_rows, sync_every)  # for its sync term
    return Bytes(fetched * (ID + dim * FLOAT), fetched * (ID + dim * FLOAT), pooled.sync)


def cached_bytes(load: TableLoad, capacity_rows: int, s_read: int, s_write: int, protocol: str = "het") -> Bytes:
    """``het_cached_row_wise`` with ``capacity_rows`` cached rows per rank."""
    remote_ids = load.ids * load.remote
    cached = load.reads[:capacity_rows]
    hit = float(cached.sum()) / load.ids if load.ids and s_read >= 1 else 0.0
    misses = remote_ids * (1.0 - hit)
    check = remote_ids * 2 * ID if protocol == "het" else misses * 2 * ID
    forward = check + misses * (load.dim * FLOAT + ID)
    # distinct remote rows a rank writes per step, pushed every s_write + 1 steps
    ws = load.world_size
    touched = float((1.0 - torch.exp(-load.reads / ws)).sum()) * ws * load.remote
    backward = touched * (load.dim * FLOAT + ID) / (s_write + 1)
    return Bytes(forward, backward)


def row_wise_bytes(load: TableLoad) -> Bytes:
    """Stock row_wise: ids to owners, every rank's partial of every bag reduce-scattered, gradients all-gathered."""
    ids = load.ids * load.remote * ID
    outputs = load.bags * load.dim * FLOAT * (load.world_size - 1)
    return Bytes(ids + outputs, outputs)


def table_wise_bytes(load: TableLoad) -> Bytes:
    """Stock table_wise: ids to the table's rank, pooled bags back, their gradients to it."""
    ids = load.ids * load.remote * ID
    outputs = load.bags * load.dim * FLOAT * load.remote
    return Bytes(ids + outputs, outputs)


def _distinct_servers(load: TableLoad, remote_cold: float) -> float:
    """Expected (bag, remote server) pairs: partials per step."""
    if remote_cold <= 0 or load.bags <= 0:
        return 0.0
    servers = load.world_size - 1
    per_bag = remote_cold / load.bags  # remote cold ids in a bag
    return load.bags * servers * (1.0 - math.exp(-per_bag / servers))

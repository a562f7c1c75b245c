"""The one adapter between a plan and the step model: a table, its sharding type and its plan
options, as the :class:`~torchrec_het.planner.step_model.PlannedTable` the model prices.

Three callers hand it what they know: the planner an option TorchRec's search enumerates
(:func:`~torchrec_het.planner.cost_model.option_table`: tier sizes from the pricing), the what-if
a table shape (:mod:`torchrec_het.planner.whatif`), the benchmark a plan that was built (its tiers as the
module holds them). Which option means what to the model is said here only.
"""

import torch

from torchrec_het.planner.step_model import PlannedTable
from torchrec_het.planner.traffic import FP32, WirePrecision
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED


def planned_table(
    name: str, rows: int, dim: int, features: int, ids_per_sample: float, sharding_type: str, options=None, *,
    reads: torch.Tensor | None = None, hot: torch.Tensor | None = None, per_host: torch.Tensor | None = None,
    owners: tuple[int, ...] = (), shard_dims: tuple[int, ...] = (), pooled: bool = True, weighted: bool = False,
    wire: WirePrecision = FP32,
) -> PlannedTable:  # fmt: skip
    """The table as the model sees it.

    Args:
        options: the table's plan options (:class:`~torchrec_het.plan_options.ReplicaOptions`,
            :class:`~torchrec_het.config.CacheSettings`); ignored for stock types.
        reads: reads per step over all ranks of its rows (plugin types).
        hot, per_host: ``het_row_replicated``: the reads of its replicated and per-host rows;
            ``het_cached_row_wise``: ``hot`` the reads of its cached rows (default: the hottest
            ``options.capacity_rows`` of ``reads``).
        owners, shard_dims: placed types: each shard's rank and (column-wise) width.
        wire: its embeddings' wire bytes per element (its sharder's codecs).
    """
    settings: dict = {}
    if sharding_type == HET_ROW_REPLICATED:
        settings = dict(
            hot=hot,
            per_host=per_host,
            sync_every=options.replica_sync_every,
            lookahead=bool(options.lookahead and pooled),
            cold_rows=bool(options.cold_rows and pooled),
        )
    elif sharding_type == HET_CACHED_ROW_WISE:
        if hot is None and reads is not None:
            hot = torch.sort(reads, descending=True).values[: options.capacity_rows(rows)]
        settings = dict(hot=hot, s_read=options.s_read, s_write=options.s_write)
    return PlannedTable(
        name, rows, dim, features, ids_per_sample, sharding_type, reads=reads, owners=owners, shard_dims=shard_dims,
        pooled=pooled, weighted=weighted, wire=wire, **settings,
    )  # fmt: skip

"""``stats_by_table(model)``: the plugin's counters of every plugin-sharded table of a model, on this rank."""

import torch
from torchrec.distributed.model_parallel import get_unwrapped_module

from torchrec_het.sharders import HetShardedEmbeddingBagCollection, HetShardedEmbeddingCollection
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED


def stats_by_table(model: torch.nn.Module) -> dict[str, dict]:
    """The counters of every table planned ``het_cached_row_wise`` or ``het_row_replicated`` in
    ``model`` (a ``DistributedModelParallel`` or any module holding the plugin's sharded modules),
    counted on this rank since they were last reset; plain Python numbers only.

    Each table gives ``module`` (its sharded module's name in the unwrapped model), ``sharding_type``
    and either ``cache`` (het_cached_row_wise: lookups, hits and hit rates, requests, rows fetched and
    pushed, evictions, the staleness histogram, the gradient mass produced and applied per
    dimension) or ``replication`` (het_row_replicated: steps, all-hot steps that skipped the cold
    exchange, sparse and dense replica syncs; these count the module's steps, so every
    replicated table of one module shows the same).
    """
    out: dict[str, dict] = {}
    for name, module in get_unwrapped_module(model).named_modules():
        if not isinstance(module, (HetShardedEmbeddingBagCollection, HetShardedEmbeddingCollection)):
            continue
        cache = module.cache_stats() if isinstance(module, HetShardedEmbeddingBagCollection) else {}
        replication = {key: int(value) for key, value in module.replication_stats().items()}
        for table, sharding in module.module_sharding_plan.items():
            kind = sharding.sharding_type
            if kind == HET_CACHED_ROW_WISE:
                out[table] = {"module": name, "sharding_type": kind, "cache": cache[table]}
            elif kind == HET_ROW_REPLICATED:
                out[table] = {"module": name, "sharding_type": kind, "replication": dict(replication)}
    return out


__all__ = ["stats_by_table"]

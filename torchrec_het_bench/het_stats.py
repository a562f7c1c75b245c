"""The HET cache's counters in the benchmark: read on each rank, summed into results.json."""

import torch

from torchrec_het.sharding.common.cache_stats import COUNTERS
from torchrec_het_bench.ideal_cache import lru_hits

_COUNTERS = (*COUNTERS, "ideal_lru_hits", "ideal_lru_lookups")  # the cache's own, then the ideal LRU's


def ideal_lru(het_module, batches: list, counted_from: int, memo: dict) -> dict[str, tuple[int, int]]:
    """Per table: (hits, lookups) of an ideal LRU of the HET cache's size on this rank's remote ids
    (none for an exact cache's tables: they hold no rows, and run as the fetched-rows tier)."""
    result = {}
    for lookup in het_module.het_lookups():
        for g in lookup.groups:
            if getattr(g, "cache", None) is None:
                continue
            for i, t in enumerate(g.tables):
                capacity = int(g.cache.partition_capacity[i])
                key = (t.name, capacity)
                if key not in memo:
                    stream = []
                    for kjt in batches:
                        ids = torch.unique(torch.cat([kjt[f].values() for f in t.features])) + g.offsets[i]
                        stream.append(ids[g.owner_of(ids) != g.rank])
                    memo[key] = lru_hits(stream, capacity, counted_from)
                result[t.name] = memo[key]
    return result


def rank_cache_stats(het_module, ideal: dict[str, tuple[int, int]]) -> dict[str, dict]:
    stats = het_module.cache_stats()
    for name, (hits, lookups) in ideal.items():
        stats[name]["ideal_lru_hits"], stats[name]["ideal_lru_lookups"] = hits, lookups
    return stats


def summarize_cache(per_rank_stats: list[dict[str, dict]], steps: int) -> dict:
    """Totals over ranks and tables, per measured step, with hit rates beside the ideal LRU's."""
    totals = dict.fromkeys(_COUNTERS, 0)
    staleness = None
    for stats in per_rank_stats:
        for table in stats.values():
            for key in _COUNTERS:
                totals[key] += table.get(key, 0)
            hist = torch.tensor(table["staleness"])
            staleness = hist if staleness is None else staleness + hist
    hist = staleness.tolist() if staleness is not None else []
    while hist and hist[-1] == 0:
        hist.pop()

    def rate(hits: str, total: str) -> float:
        return totals[hits] / totals[total] if totals[total] else 0.0

    return {
        "hit_rate_unique": rate("hits_unique", "remote_unique"),
        "hit_rate_lookups": rate("hits_lookups", "remote_lookups"),
        "ideal_lru_hit_rate_unique": rate("ideal_lru_hits", "ideal_lru_lookups"),
        "remote_share_unique": rate("remote_unique", "unique_lookups"),
        "per_step": {
            k: totals[k] / steps for k in ("requests", "rows_fetched", "rows_pushed", "evictions", "dirty_evictions")
        },
        "staleness_histogram": hist,
        "max_staleness": len(hist) - 1 if hist else 0,
    }

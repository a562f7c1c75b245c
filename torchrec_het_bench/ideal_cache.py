"""The hit rate of an ideal LRU cache on an id stream: the yardstick for the HET cache's own hit rate."""

from collections import OrderedDict
from collections.abc import Iterable

import torch


def lru_hits(steps: Iterable[torch.Tensor], capacity: int, counted_from: int = 0) -> tuple[int, int]:
    """Hits and lookups of an LRU cache of ``capacity`` rows that is never invalidated.

    Args:
        steps: per step, the distinct remote ids a rank reads (a hit is an id already cached).
        capacity: rows the cache holds.
        counted_from: steps before this one warm the cache but are not counted.

    Returns:
        (hits, lookups) over distinct ids per step.
    """
    cache: OrderedDict[int, None] = OrderedDict()
    hits = lookups = 0
    for step, ids in enumerate(steps):
        counted = step >= counted_from
        for row in ids.tolist():
            lookups += counted
            if row in cache:
                hits += counted
                cache.move_to_end(row)
            elif capacity > 0:
                cache[row] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits, lookups

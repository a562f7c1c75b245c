"""Per-table counters of a cache of remote rows (HET's, and the exact cached tier's): hits, requests, pushes, evictions, staleness, gradient mass."""

import torch

STALENESS_BUCKETS = 65  # observed staleness 0..63, and 64 for "64 or more"
COUNTERS = (
    "lookups",
    "unique_lookups",
    "remote_unique",
    "remote_lookups",
    "hits_unique",
    "hits_lookups",
    "requests",
    "rows_fetched",
    "rows_pushed",
    "evictions",
    "dirty_evictions",
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

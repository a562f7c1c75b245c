"""Zipf-distributed row ids for many tables at once, with hot rows scattered by permutation.

Row rank k of an n-row table is drawn with probability p_k ∝ (k+1)^-alpha, then mapped
to row id ``perm[k]`` of a fixed per-table permutation, as hashing raw ids would scatter
hot ids over the table. Sampling is by inverse CDF: the CDF of the first ``head_size``
ranks is stored exactly (float64); ranks beyond are drawn from the continuous
approximation of the tail, whose total mass is exact. The midpoint approximation of a
rank's mass by an integral is off by a relative alpha (alpha + 1) / (24 rank^2), below
1e-7 past the head for alpha <= 2. Memory is 4 bytes per row (the int32 permutations)
plus 8 * head_size bytes per table.
"""

import torch

DEFAULT_HEAD_SIZE = 2048
_SUM_CHUNK = 1 << 20


def zipf_mass(num_rows: int, alpha: float, first: int = 0, last: int | None = None) -> float:
    """Unnormalized Zipf mass Σ (k+1)^-alpha over ranks k in [first, last).

    Args:
        num_rows: rows of the table (the default ``last``).
        alpha: Zipf exponent.
        first: first rank.
        last: one past the last rank; None means ``num_rows``.
    """
    last = num_rows if last is None else last
    total = 0.0
    for start in range(first, last, _SUM_CHUNK):
        stop = min(start + _SUM_CHUNK, last)
        total += torch.arange(start + 1, stop + 1, dtype=torch.float64).pow_(-alpha).sum().item()
    return total


def zipf_top_share(num_rows: int, alpha: float, k: int) -> float:
    """Share of all draws that land on the ``k`` most frequent of ``num_rows`` rows.

    Args:
        num_rows: rows of the table.
        alpha: Zipf exponent.
        k: how many of the most frequent rows.
    """
    k = min(k, num_rows)
    head = zipf_mass(num_rows, alpha, 0, k)
    return head / (head + zipf_mass(num_rows, alpha, k, num_rows))


class ZipfTables:
    """Samples Zipf(alpha) row ids of several tables in one vectorized pass.

    Args:
        table_sizes: rows of each table.
        alpha: Zipf exponent (0 = uniform).
        generator: source of the permutations.
        head_size: ranks per table whose CDF is stored exactly.
    """

    def __init__(
        self,
        table_sizes: list[int],
        alpha: float,
        generator: torch.Generator,
        head_size: int = DEFAULT_HEAD_SIZE,
    ) -> None:
        self.table_sizes = list(table_sizes)
        self.alpha = alpha
        self.head_size = head_size
        num_tables = len(table_sizes)
        self._rows = torch.tensor(table_sizes, dtype=torch.int64)
        self._perm_offsets = torch.tensor([0, *table_sizes[:-1]], dtype=torch.int64).cumsum(0)
        self._perms = torch.empty(sum(table_sizes), dtype=torch.int32)
        for table, rows in enumerate(table_sizes):
            start = int(self._perm_offsets[table])
            self._perms[start : start + rows] = torch.randperm(rows, generator=generator, dtype=torch.int32)

        # Flat search keys: table t's head CDF shifted by t, so one searchsorted call
        # serves every table (query t + u, u in [0, 1)). Short tables pad with t + 1.
        self._head_keys = torch.empty(num_tables * head_size, dtype=torch.float64)
        head_mass = torch.ones(num_tables, dtype=torch.float64)
        for table, rows in enumerate(table_sizes):
            head_rows = min(rows, head_size)
            weights = torch.arange(1, head_rows + 1, dtype=torch.float64).pow_(-alpha)
            total = weights.sum().item() + zipf_mass(rows, alpha, head_rows, rows)
            cdf = torch.ones(head_size, dtype=torch.float64)
            cdf[:head_rows] = weights.cumsum(0) / total
            if head_rows == rows:
                cdf[rows - 1 :] = 1.0
            else:
                head_mass[table] = cdf[head_rows - 1]
            self._head_keys[table * head_size : (table + 1) * head_size] = cdf + table
        self._head_mass = head_mass
        # Continuous tail on x in [head + 1/2, rows + 1/2): x = rank + 1, rounded. The
        # inverse CDF is x = (lo^e + v (hi^e - lo^e))^(1/e), e = 1 - alpha (log form at e = 0).
        lo = torch.full((num_tables,), head_size + 0.5, dtype=torch.float64)
        hi = torch.maximum(self._rows.to(torch.float64) + 0.5, lo)
        self._exponent = 1.0 - alpha
        if abs(self._exponent) < 1e-9:
            self._tail_base, self._tail_span = lo.log(), (hi / lo).log()
        else:
            self._tail_base = lo.pow(self._exponent)
            self._tail_span = hi.pow(self._exponent) - self._tail_base

    @property
    def nbytes(self) -> int:
        """Bytes held by the permutations and the head CDFs."""
        return sum(t.numel() * t.element_size() for t in (self._perms, self._head_keys))

    def hot_rows(self, table: int, k: int) -> torch.Tensor:
        """The ``k`` most frequent row ids of ``table``, most frequent first (int64).

        Args:
            table: table index.
            k: how many rows.
        """
        if not 0 <= table < len(self.table_sizes):
            raise IndexError(f"table index {table} out of range for {len(self.table_sizes)} tables")
        start = int(self._perm_offsets[table])
        k = min(k, self.table_sizes[table])
        return self._perms[start : start + k].to(torch.int64)

    def sample(self, tables: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """Row ids (int64) for draws ``uniforms`` in [0, 1) of the given tables.

        Args:
            tables: int64 table index of every draw.
            uniforms: float64 uniform in [0, 1) of every draw.
        """
        keys = tables.to(torch.float64) + uniforms
        ranks = torch.searchsorted(self._head_keys, keys, right=True) - tables * self.head_size
        head_mass = self._head_mass.index_select(0, tables)
        tail_share = ((uniforms - head_mass) / (1.0 - head_mass).clamp_min(1e-300)).clamp_(0.0, 1.0)
        y = self._tail_base.index_select(0, tables) + tail_share * self._tail_span.index_select(0, tables)
        x = y.exp() if abs(self._exponent) < 1e-9 else y.pow(1.0 / self._exponent)
        tail_ranks = torch.floor(x + 0.5).to(torch.int64) - 1
        ranks = torch.where(ranks >= self.head_size, tail_ranks.clamp_min(self.head_size), ranks)
        ranks = torch.minimum(ranks, self._rows.index_select(0, tables) - 1)
        return self._perms.index_select(0, self._perm_offsets.index_select(0, tables) + ranks).to(torch.int64)


def splitmix64(*parts: int) -> int:
    """A 64-bit hash of a tuple of ints, for seeding generators from (seed, rank, step, ...)."""
    mask = (1 << 64) - 1
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (part & mask)) + 0x9E3779B97F4A7C15 & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        state = z ^ (z >> 31)
    return state

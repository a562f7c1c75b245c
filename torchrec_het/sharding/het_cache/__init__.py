"""``het_cached_row_wise``: row-wise owners and a stale-tolerant cache of remote rows on every rank (HET)."""

"""The strings torchrec_het adds to TorchRec's sharding-type space (all prefixed ``het_``)."""

HET_CACHED_ROW_WISE = "het_cached_row_wise"
"""Row-wise owners plus a per-rank, bounded-staleness cache of remote rows (HET)."""

HET_ROW_REPLICATED = "het_row_replicated"
"""Row-wise owners plus hot rows replicated on every rank or once per host (FlexShard, FAE, DES)."""

HET_SHARDING_TYPES = (HET_CACHED_ROW_WISE, HET_ROW_REPLICATED)

__all__ = ["HET_CACHED_ROW_WISE", "HET_ROW_REPLICATED", "HET_SHARDING_TYPES"]

"""HET's per-rank cache of remote embedding rows: pure tensor code, no torch.distributed."""

from torchrec_het.cache.pending import PendingRows
from torchrec_het.cache.row_cache import POLICIES, RowCache

__all__ = ["POLICIES", "PendingRows", "RowCache"]

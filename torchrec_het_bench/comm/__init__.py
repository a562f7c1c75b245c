"""Counting the bytes of every collective a training step issues, split by phase.

See :mod:`torchrec_het_bench.comm.accounting` for what is counted and how.
"""

from torchrec_het_bench.comm.accounting import CommAccountant, sum_over_ranks
from torchrec_het_bench.comm.ddp import attach_ddp_hooks
from torchrec_het_bench.comm.phases import phase
from torchrec_het_bench.comm.totals import COLLECTIVE_FAMILIES, EMBEDDING_PHASES, PHASES, CommTotals, sum_totals

__all__ = [
    "COLLECTIVE_FAMILIES",
    "EMBEDDING_PHASES",
    "PHASES",
    "CommAccountant",
    "CommTotals",
    "attach_ddp_hooks",
    "phase",
    "sum_over_ranks",
    "sum_totals",
]

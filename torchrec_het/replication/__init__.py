"""Row replication: access profiles, hot-row tiers within a memory budget, the settings of
``het_row_replicated``, and FAE's loader wrapper that groups hot samples into whole batches."""

from torchrec_het.replication.all_hot import AllHotBatches, read_here_of
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.memory import TableMemory, TierTopology, bytes_per_row, plan_peak_bytes
from torchrec_het.replication.profile import AccessProfile, AccessProfiler, count_accesses, load_profile, save_profile
from torchrec_het.replication.tier_selection import select_tiers
from torchrec_het.replication.tiers import TableTiers, TierPlan

__all__ = [
    "AccessProfile",
    "AccessProfiler",
    "AllHotBatches",
    "ReplicationConfig",
    "TableMemory",
    "TableTiers",
    "TierPlan",
    "TierTopology",
    "bytes_per_row",
    "count_accesses",
    "load_profile",
    "plan_peak_bytes",
    "read_here_of",
    "save_profile",
    "select_tiers",
]

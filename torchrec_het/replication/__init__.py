"""Row replication: access profiles (and, next, hot sets and tiers), as pure tensor code."""

from torchrec_het.replication.profile import AccessProfile, count_accesses, load_profile, save_profile

__all__ = ["AccessProfile", "count_accesses", "load_profile", "save_profile"]

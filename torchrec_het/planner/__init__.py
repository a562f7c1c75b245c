"""Planner components that enumerate, size, price and print the plugin's sharding types.

Pass them to a stock ``EmbeddingShardingPlanner`` (``enumerator=HetEmbeddingEnumerator(...)``,
``stats=HetEmbeddingStats()``), use :class:`HetEmbeddingShardingPlanner`, or let
``torchrec_het.install()`` make them the defaults.
"""

from torchrec_het.planner.access import AccessModel, ProfileTiers, zipf_shares
from torchrec_het.planner.enumerator import HetEmbeddingEnumerator
from torchrec_het.planner.estimators import HetPerfEstimator, HetStorageEstimator
from torchrec_het.planner.planner import HetEmbeddingShardingPlanner
from torchrec_het.planner.pricing import PLUGIN_TYPES, PluginPricing
from torchrec_het.planner.stats import HetEmbeddingStats

__all__ = [
    "PLUGIN_TYPES",
    "AccessModel",
    "HetEmbeddingEnumerator",
    "HetEmbeddingShardingPlanner",
    "HetEmbeddingStats",
    "HetPerfEstimator",
    "HetStorageEstimator",
    "PluginPricing",
    "ProfileTiers",
    "zipf_shares",
]

"""``EmbeddingShardingPlanner`` with the plugin's enumerator and stats as defaults."""

from torchrec.distributed.planner import EmbeddingShardingPlanner

from torchrec_het.planner.enumerator import HetEmbeddingEnumerator
from torchrec_het.planner.pricing import PluginPricing
from torchrec_het.planner.stats import HetEmbeddingStats


class HetEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's planner; unless given their own, it enumerates and prices the plugin's types
    (:class:`HetEmbeddingEnumerator`) and prints them (:class:`HetEmbeddingStats`).

    Args:
        pricing: the plugin's settings and reads per row (default: ``PluginPricing()``).
        *args, **kwargs: as ``EmbeddingShardingPlanner``.
    """

    def __init__(self, *args, pricing: PluginPricing | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if kwargs.get("enumerator") is None and (len(args) < 3 or args[2] is None):
            self._enumerator = HetEmbeddingEnumerator(
                topology=self._topology, batch_size=self._batch_size, constraints=self._constraints,
                pricing=pricing or default_pricing(),
            )
        if kwargs.get("stats") is None and (len(args) < 6 or args[5] is None):
            self._stats = [HetEmbeddingStats()]


def default_pricing() -> PluginPricing:
    """The pricing ``torchrec_het.install()`` was given, else ``PluginPricing()``."""
    from torchrec_het.registration import installed_pricing

    return installed_pricing() or PluginPricing()

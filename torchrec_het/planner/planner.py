"""``EmbeddingShardingPlanner`` with the plugin's enumerator and stats as defaults."""

import inspect
from typing import ClassVar

from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

from torchrec_het import _compat
from torchrec_het.planner.enumerator import HetEmbeddingEnumerator, table_rows
from torchrec_het.planner.network import CPU_INTER_HOST_BW, CPU_INTRA_HOST_BW, cpu_network  # noqa: F401 (re-exported)
from torchrec_het.planner.pricing import PluginPricing
from torchrec_het.planner.stats import HetEmbeddingStats



class HetEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's planner; unless given their own, it enumerates and prices the plugin's types
    (:class:`HetEmbeddingEnumerator`) and prints them (:class:`HetEmbeddingStats`).

    Args:
        pricing: the plugin's settings and reads per row (default: what ``torchrec_het.install()``
            was given, else ``PluginPricing()``).
        cpu_bandwidths: on a CPU topology that carries TorchRec's default bandwidths (which
            describe GPU interconnects), price communication at gloo-over-TCP speeds
            (:func:`cpu_network`) instead.
        *args, **kwargs: as ``EmbeddingShardingPlanner``.
    """

    # The pricing ``torchrec_het.install()`` was given: set (and put back) by
    # ``torchrec_het.registration``, which imports this module; this module never imports it.
    installed_pricing: ClassVar[PluginPricing | None] = None

    def __init__(self, *args, pricing: PluginPricing | None = None, cpu_bandwidths: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        given = inspect.signature(EmbeddingShardingPlanner.__init__).bind(self, *args, **kwargs).arguments
        topology, batch_size, constraints = _compat.planner_settings(self)
        if cpu_bandwidths:
            topology = cpu_network(topology)
        enumerator = given.get("enumerator")
        if enumerator is None:
            enumerator = HetEmbeddingEnumerator(
                topology=topology, batch_size=batch_size, constraints=constraints, pricing=pricing or default_pricing()
            )
            _compat.set_planner_parts(self, enumerator=enumerator)
        self.het_pricing: PluginPricing | None = getattr(enumerator, "pricing", None)  # None: not the plugin's enumerator
        stats = [HetEmbeddingStats()] if given.get("stats") is None else None
        _compat.set_planner_parts(self, topology=topology, stats=stats)

    def collective_plan(self, module, sharders=None, pg=None):
        """TorchRec's ``collective_plan`` (rank 0 plans, every rank gets the plan), after every rank
        has checked that the access profile fits the model: a profile of other tables (or other
        row counts) raises :class:`~torchrec_het.errors.ConfigurationError` on every rank at
        once, before any collective, rather than on rank 0 only while the others wait."""
        if self.het_pricing is not None:
            self.het_pricing.access.check_matches(table_rows(module))
        return super().collective_plan(module, sharders, pg)


def default_pricing() -> PluginPricing:
    """The pricing ``torchrec_het.install()`` was given, else ``PluginPricing()``."""
    return HetEmbeddingShardingPlanner.installed_pricing or PluginPricing()

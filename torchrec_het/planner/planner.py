"""``EmbeddingShardingPlanner`` with the plugin's enumerator and stats as defaults, pricing links it measured;
its plans carry each plugin table's options (:mod:`torchrec_het.plan_options`)."""

import dataclasses
import inspect
import os
import sys
from typing import ClassVar

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.types import ShardingPlan

from torchrec_het import _compat
from torchrec_het.plan_options import with_plan_options
from torchrec_het.planner.enumerator import HetEmbeddingEnumerator, table_rows
from torchrec_het.planner.link_probe import ProbeBudget, ProbeResult, probe_device, probe_links
from torchrec_het.planner.network import (  # noqa: F401 (CPU_* and cpu_network re-exported)
    CPU_INTER_HOST_BW,
    CPU_INTRA_HOST_BW,
    LinkFigures,
    LinkSettings,
    cpu_network,
    kinds_to_probe,
    link_figures,
    with_links,
)
from torchrec_het.planner.pricing import PluginPricing
from torchrec_het.planner.stats import HetEmbeddingStats


class HetEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's planner; unless given their own, it enumerates and prices the plugin's types
    (:class:`HetEmbeddingEnumerator`) and prints them (:class:`HetEmbeddingStats`).

    Links: ``collective_plan(module, sharders, pg)`` first measures, on ``pg``, the bandwidth
    within a host and between hosts that nothing states (:mod:`~torchrec_het.planner.link_probe`:
    a collective of about 2 s at most, so every rank plans with the same figures), then plans with
    them. ``plan()`` has no group: it prices stated figures, else assumed ones
    (:mod:`~torchrec_het.planner.network`). :attr:`links` holds the figures and their sources;
    the stats table prints them, and under ``torchrec_het.install()`` rank 0 prints them on stderr.

    Args:
        pricing: the plugin's settings and reads per row (default: what ``torchrec_het.install()``
            was given, else ``PluginPricing()``).
        cpu_bandwidths: on a CPU topology that carries TorchRec's default bandwidths (which
            describe GPU interconnects), assume gloo-over-TCP speeds for what is not measured or stated.
        link_gbit: ``(intra, inter)`` Gbit/s per rank, every rank sending at once, that you state
            instead of measuring (either may be None); default: what ``install()`` was given.
        link_probe: measure the links in ``collective_plan`` (default True, or what ``install()`` was
            given); not with an ``enumerator`` of your own (its estimators price with its own topology).
        link_budget: what the probe may spend (default ``ProbeBudget()``).
        *args, **kwargs: as ``EmbeddingShardingPlanner``.
    """

    # What ``torchrec_het.install()`` was given: set (and put back) by ``torchrec_het.registration``,
    # which imports this module; this module never imports it. ``installed_links`` set also means
    # "installed": rank 0 then prints the link figures on stderr when it plans.
    installed_pricing: ClassVar[PluginPricing | None] = None
    installed_links: ClassVar[LinkSettings | None] = None

    def __init__(
        self,
        *args,
        pricing: PluginPricing | None = None,
        cpu_bandwidths: bool = True,
        link_gbit: tuple[float | None, float | None] | None = None,
        link_probe: bool | None = None,
        link_budget: ProbeBudget | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        given = inspect.signature(EmbeddingShardingPlanner.__init__).bind(self, *args, **kwargs).arguments
        topology, _, _ = _compat.planner_settings(self)
        self.link_settings = link_settings(link_gbit, link_probe, self.installed_links)
        self._het_topology = topology  # as given: the figures replace its bandwidths
        self._het_cpu_bandwidths = cpu_bandwidths
        self._het_pricing = pricing or default_pricing()
        self._het_own_enumerator = given.get("enumerator") is None
        self._het_enumerator = given.get(
            "enumerator"
        )  # the plugin's, set by _use_links: its plan options go in the plan
        # the plugin's pricing, or None when the enumerator given is not the plugin's
        self.het_pricing: PluginPricing | None = (
            self._het_pricing if self._het_own_enumerator else getattr(given.get("enumerator"), "pricing", None)
        )
        self._het_budget = link_budget or ProbeBudget()
        self._het_probed: tuple[dist.ProcessGroup, ProbeResult] | None = None
        self._het_announced = False
        if given.get("stats") is None:
            _compat.set_planner_parts(self, stats=[HetEmbeddingStats()])
        why = "plan() has no process group" if self.link_settings.probe else "probe off"
        if not self._het_own_enumerator:
            why = "not measured: the enumerator given prices with its own topology"
        self._use_links(link_figures(topology, self.link_settings, None, cpu_bandwidths, why))

    @property
    def priced_options(self) -> dict[tuple[str, str, str], object]:
        """The plan options the last enumeration priced: (module path, table, sharding type) -> options
        (the sharders' settings; the plan carries those of the types chosen). Empty with an enumerator
        that is not the plugin's."""
        return dict(getattr(self._het_enumerator, "plan_options", None) or {})

    @property
    def links(self) -> LinkFigures:
        """The link figures the planner prices with now, and where each came from."""
        return self._het_links

    def collective_plan(
        self, module: nn.Module, sharders: list | None = None, pg: dist.ProcessGroup | None = None
    ) -> ShardingPlan:
        """Measures the links on ``pg`` (default: the world), then TorchRec's ``collective_plan``:
        rank 0 plans and broadcasts the plan. Every rank of ``pg`` must call it.

        First every rank checks that the access profile fits the model: a profile of other tables
        (or other row counts) raises :class:`~torchrec_het.errors.ConfigurationError` on every rank
        at once, before any collective, rather than on rank 0 only while the others wait."""
        if self.het_pricing is not None:
            self.het_pricing.access.check_matches(table_rows(module))
        if pg is None and dist.is_initialized():
            pg = dist.GroupMember.WORLD
        if pg is not None:
            self.measure_links(pg)
        return super().collective_plan(module, sharders, pg)

    def measure_links(self, pg: dist.ProcessGroup) -> LinkFigures:
        """Probes on ``pg`` the figures nothing states (a collective: every rank of ``pg`` calls it;
        once per group) and prices with them; returns the figures. Only what it prices: the
        exchanges within and between hosts (not ``inter_one_way``)."""
        topology = self._het_topology
        kinds = kinds_to_probe(topology, self.link_settings)
        if not kinds or not self._het_own_enumerator:  # a given enumerator would not price what it measured
            return self.links
        if dist.get_world_size(pg) != topology.world_size:
            why = f"the Topology's world size {topology.world_size} is not the group's {dist.get_world_size(pg)}"
            self._use_links(link_figures(topology, self.link_settings, None, self._het_cpu_bandwidths, why))
            return self.links
        if self._het_probed is None or self._het_probed[0] is not pg:
            device = probe_device(pg, topology.compute_device)
            self._het_probed = pg, probe_links(pg, topology.local_world_size, device, self._het_budget, kinds)
        self._use_links(link_figures(topology, self.link_settings, self._het_probed[1], self._het_cpu_bandwidths))
        return self.links

    def plan(self, module: nn.Module, sharders: list) -> ShardingPlan:
        if self.installed_links is not None and not self._het_announced and _rank() == 0:
            print(f"torchrec_het: {self.links.describe()}", file=sys.stderr, flush=True)
            self._het_announced = True
        plan = super().plan(module, sharders)
        options = self.priced_options
        return with_plan_options(plan, options) if options else plan

    def _use_links(self, figures: LinkFigures) -> None:
        topology = with_links(self._het_topology, figures, self.link_settings)
        enumerator = None
        if self._het_own_enumerator:
            _, batch_size, constraints = _compat.planner_settings(self)
            enumerator = HetEmbeddingEnumerator(
                topology=topology, batch_size=batch_size, constraints=constraints, pricing=self._het_pricing
            )
        _compat.set_planner_parts(self, topology=topology, enumerator=enumerator)
        if enumerator is not None:
            self._het_enumerator = enumerator
        self._het_links = figures
        self._het_announced = False


def link_settings(
    link_gbit: tuple[float | None, float | None] | None, link_probe: bool | None, installed: LinkSettings | None
) -> LinkSettings:
    """The planner's link settings: its own arguments where given, else what ``install()`` was given."""
    settings = installed or LinkSettings()
    if link_gbit is not None:
        if not isinstance(link_gbit, tuple | list) or len(link_gbit) != 2:
            raise ValueError(
                f"link_gbit must be (intra, inter) in Gbit/s per rank (either may be None), got {link_gbit!r}"
            )
        settings = dataclasses.replace(settings, intra_gbit=link_gbit[0], inter_gbit=link_gbit[1], origin="link_gbit")
    if link_probe is not None:
        settings = dataclasses.replace(settings, probe=link_probe)
    return settings


def default_pricing() -> PluginPricing:
    """The pricing ``torchrec_het.install()`` was given, else ``PluginPricing()``."""
    return HetEmbeddingShardingPlanner.installed_pricing or PluginPricing()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))

"""``EmbeddingShardingPlanner`` with the plugin's enumerator and stats as defaults, pricing links it measured;
its plans carry each plugin table's options (:mod:`torchrec_het.plan_options`)."""

import dataclasses
import inspect
import logging
import os
import sys
from typing import ClassVar

import torch.distributed as dist
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.stats import logger as stats_logger
from torchrec.distributed.planner.types import ShardingOption
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.types import ShardingPlan

from torchrec_het import _compat
from torchrec_het.plan_options import with_plan_options
from torchrec_het.planner.compute_probe import ComputeProbe, agree, dense_parameters, measure_compute
from torchrec_het.planner.cost_model import (
    DEFAULT_MARGIN,
    CostInputs,
    Decision,
    compute_from_probe,
    decide,
    enough_link_speed,
    option_table,
    plan_prediction,
    plan_step,
)
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
from torchrec_het.planner.plan_prediction import PlanPrediction, attach_prediction, table_lines
from torchrec_het.planner.pricing import PLUGIN_TYPES, PluginPricing
from torchrec_het.planner.stats import HetEmbeddingStats, shown
from torchrec_het.planner.step_model import Cluster, Compute, Links, StepPrediction
from torchrec_het.planner.torchrec_peer import torchrec_plan
from torchrec_het.replication.memory import TierTopology

NONE_OFFERED = "no table may take a plugin type (no profile or stated skew names one, no constraint names one)"
ENOUGH_SHARE = 0.01  # links faster than what makes TorchRec's plan's bytes this share of its compute decide nothing


class HetEmbeddingShardingPlanner(EmbeddingShardingPlanner):
    """TorchRec's planner; unless given their own, it enumerates the plugin's types
    (:class:`HetEmbeddingEnumerator`), prices every option with the step model
    (:mod:`~torchrec_het.planner.cost_model`), keeps its plan only where it beats TorchRec's own by more
    than ``margin`` and prints the types (:class:`HetEmbeddingStats`).

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
        pipeline: the trainer's pipeline the plan is priced for (``sparse_dist``, ``plain``, ``hybrid``).
        margin: the plugin's plan must be predicted faster than TorchRec's own by more than this share.
        compute: the lookups' and dense part's compute to price with (default: measured at plan time,
            :mod:`~torchrec_het.planner.compute_probe`).
        *args, **kwargs: as ``EmbeddingShardingPlanner``.
    """

    # What ``torchrec_het.install()`` was given: set (and put back) by ``torchrec_het.integration.registration``,
    # which imports this module; this module never imports it. ``installed_links`` set also means
    # "installed": rank 0 then prints the link figures on stderr when it plans.
    installed_pricing: ClassVar[PluginPricing | None] = None
    installed_links: ClassVar[LinkSettings | None] = None
    installed_compute: ClassVar[Compute | None] = None  # install(step_compute=...) / $TORCHREC_HET_STEP_COMPUTE

    def __init__(
        self,
        *args,
        pricing: PluginPricing | None = None,
        cpu_bandwidths: bool = True,
        link_gbit: tuple[float | None, float | None] | None = None,
        link_probe: bool | None = None,
        link_budget: ProbeBudget | None = None,
        pipeline: str = "sparse_dist",
        margin: float = DEFAULT_MARGIN,
        compute: Compute | None = None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        given = inspect.signature(EmbeddingShardingPlanner.__init__).bind(self, *args, **kwargs).arguments
        topology, _, _ = _compat.planner_settings(self)
        self.link_settings = link_settings(link_gbit, link_probe, self.installed_links)
        self.pipeline, self.margin = pipeline, margin
        self.stated_compute = compute if compute is not None else self.installed_compute
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
        self._het_compute: tuple[int, ComputeProbe] | None = None  # (batch it was measured at, the probe)
        self._het_announced = False
        self.decision: Decision | None = None  # the last plan's: the plugin's plan or TorchRec's, and why
        self.cost_inputs: CostInputs | None = None  # what the last plan was priced with
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
        """Measures the compute and the links on ``pg`` (default: the world), then TorchRec's
        ``collective_plan``: rank 0 plans and broadcasts the plan. Every rank of ``pg`` must call it.

        First every rank checks that the access profile fits the model: a profile of other tables
        (or other row counts) raises :class:`~torchrec_het.errors.ConfigurationError` on every rank
        at once, before any collective, rather than on rank 0 only while the others wait. The links
        are probed only where a decision depends on them: where a table may take a plugin type."""
        if self.het_pricing is not None:
            self.het_pricing.access.check_matches(table_rows(module))
        if pg is None and dist.is_initialized():
            pg = dist.GroupMember.WORLD
        if pg is not None and self._het_own_enumerator and not self._types_fixed(module):
            if self.stated_compute is None:
                self.measure_compute(module, pg)
            if self._plugin_may_decide(module):
                self.measure_links(pg, module)
            else:
                why = f"not measured: {NONE_OFFERED}"
                self._use_links(
                    link_figures(self._het_topology, self.link_settings, None, self._het_cpu_bandwidths, why)
                )
        return super().collective_plan(module, sharders, pg)

    def measure_compute(self, module: nn.Module, pg: dist.ProcessGroup | None = None) -> ComputeProbe:
        """Measures the lookups' and the dense part's compute for ``module`` (on ``pg``: every rank,
        the slowest rank's figures; a collective) and prices with it."""
        _, batch, _ = _compat.planner_settings(self)
        probe = measure_compute(module, batch)
        if pg is not None:
            probe = agree(probe, pg)
        self._het_compute = (batch, probe)
        return probe

    def measure_links(self, pg: dist.ProcessGroup, module: nn.Module | None = None) -> LinkFigures:
        """Probes on ``pg`` the figures nothing states (a collective: every rank of ``pg`` calls it;
        once per group) and prices with them; returns the figures. Only what it prices: the
        exchanges within and between hosts (not ``inter_one_way``). With ``module`` (and the compute
        measured), the probe stops at a speed above which no choice depends on it."""
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
            budget = self._het_budget
            enough = self._enough_bytes_per_ms(module) if module is not None else None
            if enough is not None and budget.enough_bytes_per_ms is None:
                budget = dataclasses.replace(budget, enough_bytes_per_ms=enough)
            self._het_probed = pg, probe_links(pg, topology.local_world_size, device, budget, kinds)
        self._use_links(link_figures(topology, self.link_settings, self._het_probed[1], self._het_cpu_bandwidths))
        return self.links

    def plan(self, module: nn.Module, sharders: list) -> ShardingPlan:
        """TorchRec's search over every type, each option priced by the step model; then the plugin's
        plan is kept only where the step model predicts it faster than TorchRec's own plan (what the
        same planner gives without the plugin's types) by more than ``margin``. The plan carries the
        prediction (:mod:`torchrec_het.planner.plan_prediction`) and each plugin table's options."""
        if self.installed_links is not None and not self._het_announced and _rank() == 0:
            print(f"torchrec_het: {self.links.describe()}", file=sys.stderr, flush=True)
            self._het_announced = True
        self.decision = None
        estimator = getattr(self._het_enumerator, "perf_estimator", None)
        if not self._het_own_enumerator or estimator is None or self._types_fixed(module):
            # nothing to decide (or not the plugin's enumerator): no probes, no comparison, no prediction
            plan = super().plan(module, sharders)
            options = self.priced_options
            return with_plan_options(plan, options) if options else plan
        inputs = self.cost_inputs = self._cost_inputs(module)
        estimator.costs, estimator.shares, estimator.rank_costs = inputs, {}, {}
        stock, no_stock = self._torchrec_plan(module, sharders)
        none_offered = "" if self._plugin_may_decide(module) else NONE_OFFERED
        by_key = {sharder_name(s.module_type): s for s in sharders}
        if stock is not None:
            estimator.estimate(stock, by_key)  # its shards priced by the same model, for the stats

        def choose(best: list[ShardingOption]) -> list[ShardingOption]:
            plugin_step = self._plan_step(best, by_key, inputs)
            stock_step = self._plan_step(stock, by_key, inputs) if stock is not None else None
            uses_plugin = any(o.sharding_type in PLUGIN_TYPES for o in best)
            corners = []
            if stock is not None and uses_plugin:
                for corner in inputs.at_corners():
                    corners.append((self._plan_step(best, by_key, corner), self._plan_step(stock, by_key, corner)))
            self.decision = decide(plugin_step, stock_step, inputs, uses_plugin, none_offered, corners, no_stock)
            return best if self.decision.chosen == "plugin" else stock

        with _compat.planner_callback_first(self, choose):
            plan = super().plan(module, sharders)
        options = self.priced_options
        plan = with_plan_options(plan, options) if options else plan
        prediction = self._prediction(estimator.shares, estimator.rank_costs)
        self._log_decision(prediction)
        return attach_prediction(plan, prediction) if prediction is not None else plan

    def _cost_inputs(self, module: nn.Module) -> CostInputs:
        """The links and compute the plan is priced with (the compute measured now when no group measured it)."""
        topology, batch, _ = _compat.planner_settings(self)
        if self.stated_compute is not None:
            probe = ComputeProbe(
                self.stated_compute.lookup_s_per_id,
                self.stated_compute.dense_s_per_sample,
                dense_parameters(module),
                0.0,
                stated=True,
            )
        elif self._het_compute is None or self._het_compute[0] != batch:
            probe = self.measure_compute(module)  # plan() without a group: this rank's figures
        else:
            probe = self._het_compute[1]
        figures = self.links
        latencies = [m.latency_ms for m in figures.probe.measurements().values()] if figures.probe else []
        links = Links(
            figures.intra_host_bw * 1e3, figures.inter_host_bw * 1e3, max(latencies, default=0.0) / 1e3,
            f"within a host {figures.intra_source}, between hosts {figures.inter_source}",
        )  # fmt: skip
        refused = [] if probe.steady else [probe.why]
        if figures.probe is not None and not figures.probe.steady:
            refused.append("the link probe's rounds spread (a disturbed link or machine)")
        compute = compute_from_probe(probe, topology.compute_device, self._het_pricing.compute)
        if self.stated_compute is not None:
            compute = dataclasses.replace(self.stated_compute, extra_s_per_id=compute.extra_s_per_id)
        elif topology.compute_device != "cpu":  # the probe runs on CPU: it says nothing of a GPU's kernels
            compute = dataclasses.replace(
                compute,
                lookup_s_per_id=0.0,
                dense_s_per_sample=0.0,
                source=f"not measured on {topology.compute_device}",
            )
        corners = _corners(links, compute, probe, figures.probe) if refused else ()
        return CostInputs(
            links, compute, self.pipeline, probe.dense_params, self.margin, "; ".join(refused),
            f"{figures.describe()}; {probe.describe()}", corners,
        )  # fmt: skip

    def _plan_step(self, options: list[ShardingOption], by_key: dict, inputs: CostInputs) -> StepPrediction:
        topology, batch, _ = _compat.planner_settings(self)
        ws, local = topology.world_size, topology.local_world_size
        tiers = TierTopology.from_torchrec(topology) if ws > local > 1 else None
        tables = [
            option_table(o, self._het_pricing, ws, tiers, getattr(by_key.get(o.module_type_key), "qcomm_codecs_registry", None))
            for o in options
        ]  # fmt: skip
        return plan_step(tables, Cluster(ws, local, batch), inputs)

    def _torchrec_plan(self, module: nn.Module, sharders: list) -> tuple[list[ShardingOption] | None, str]:
        _, batch, constraints = _compat.planner_settings(self)
        reservation = _compat.planner_storage_reservation(self)
        return torchrec_plan(module, sharders, self._het_topology, batch, constraints, reservation)

    def _prediction(self, shares: dict[str, dict[str, float]], rank_costs: dict[str, dict[str, float]]):
        source = self.cost_inputs.source if self.cost_inputs else ""
        return plan_prediction(self.decision, _compat.planner_best_plan(self) or [], shares, source, rank_costs)

    def _log_decision(self, prediction: PlanPrediction | None) -> None:
        """The decision and each table's predicted share (chosen type, runner-up) in the planner's log;
        under ``install()`` rank 0 also prints the decision on stderr, unless that log shows it already."""
        if self.decision is None:
            return
        line = self.decision.why
        if prediction is not None:
            line += f"; the plan's predicted step: {prediction.step_ms:.1f} ms ({prediction.pipeline})"
        stats_logger.info("torchrec_het plan: %s", line)
        if prediction is not None:
            world_size = _compat.planner_settings(self)[0].world_size
            for table_line in table_lines(prediction, world_size, self.margin):
                stats_logger.info("torchrec_het tables: %s", table_line)
        if self.installed_links is not None and _rank() == 0 and not shown(stats_logger, logging.INFO):
            print(f"torchrec_het: plan: {line}", file=sys.stderr, flush=True)

    def _types_fixed(self, module: nn.Module) -> bool:
        """Whether constraints give every table of ``module`` exactly one sharding type (nothing to decide)."""
        _, _, constraints = _compat.planner_settings(self)
        return all(
            constraints and name in constraints and len(constraints[name].sharding_types or ()) == 1
            for name in table_rows(module)
        )

    def _plugin_may_decide(self, module: nn.Module) -> bool:
        """Whether a table may take a plugin type (its reads are known, or constraints name one)."""
        _, _, constraints = _compat.planner_settings(self)
        for name in table_rows(module):
            named = (
                constraints
                and name in constraints
                and any(t in PLUGIN_TYPES for t in constraints[name].sharding_types or ())
            )
            if named or self._het_pricing.access.has_evidence(name):
                return True
        return False

    def _enough_bytes_per_ms(self, module: nn.Module) -> float | None:
        if self._het_compute is None:
            return None
        return enough_link_speed(module, _compat.planner_settings(self)[1], self._het_compute[1], ENOUGH_SHARE)

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


def _corners(links: Links, compute: Compute, probe: ComputeProbe, link_probe) -> tuple[tuple[Links, Compute], ...]:
    """The links and compute at the ends of the probes' rounds: the slow and the fast link (each
    measured kind scaled by its rounds' range) by the fast and the slow compute."""

    def scaled(figure: float, kind: str, end: int) -> float:
        measured = link_probe.measurements().get(kind) if link_probe is not None else None
        if measured is None or measured.bounds is None or not measured.bytes_per_ms > 0:
            return figure
        return figure * measured.bounds[end] / measured.bytes_per_ms

    link_ends = [
        dataclasses.replace(links, intra=scaled(links.intra, "intra", end), inter=scaled(links.inter, "inter", end))
        for end in (0, 1)
    ]
    lookup = probe.lookup_bounds or (compute.lookup_s_per_id,) * 2
    dense = probe.dense_bounds or (compute.dense_s_per_sample,) * 2
    compute_ends = [
        dataclasses.replace(compute, lookup_s_per_id=lookup[end], dense_s_per_sample=dense[end]) for end in (0, 1)
    ]
    if compute.source.startswith("not measured"):  # the probe's figures were not priced at all
        compute_ends = [compute]
    return tuple((link, work) for link in link_ends for work in compute_ends)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))

"""The planner's one cost model: the step model (:mod:`~torchrec_het.planner.step_model`) prices
every option TorchRec's search compares and every whole plan the planner chooses between.

- An option (one table, one sharding type) is priced as the step model prices that table alone:
  its bytes per phase under its sharder's codecs over the measured links, its lookups on the rank
  that pools them (table_wise: the owner pools every rank's ids), the plugin types' calibrated extra
  compute per id, and what the pipeline hides (:func:`option_perf`). TorchRec's search balances
  these per-shard figures over the ranks, as it balances its own estimator's.
- A whole plan is priced by :func:`~torchrec_het.planner.step_model.predict_step`: the collectives
  of each type's group and their latency, the dense part and the pipeline's overlap
  (:func:`plan_step`). The planner keeps the plugin's plan only where it is predicted faster than
  TorchRec's own plan by more than the model's error (:attr:`CostInputs.margin`).

Types the step model has no bytes for (``table_row_wise``, ``grid_shard``) are priced as
``row_wise`` (their traffic within a host is not modelled).
"""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, replace

from torch import nn
from torchrec.distributed.planner.types import Perf, ShardingOption

from torchrec_het.planner.compute_costs import ComputeCosts, default_compute_costs
from torchrec_het.planner.compute_probe import ComputeProbe, table_configs
from torchrec_het.planner.plan_prediction import PlanPrediction
from torchrec_het.planner.plan_tables import planned_table
from torchrec_het.planner.pricing import PLUGIN_TYPES, PluginPricing, priced_options, priced_wire
from torchrec_het.planner.qcomms import wire_precision
from torchrec_het.planner.step_model import (
    Cluster,
    Compute,
    Links,
    PlannedTable,
    StepPrediction,
    predict_step,
)
from torchrec_het.replication.memory import TierTopology
from torchrec_het.types import HET_ROW_REPLICATED

MODELLED = ("table_wise", "column_wise", "table_column_wise", "row_wise", "data_parallel", *PLUGIN_TYPES)
PLACED = ("table_wise", "column_wise", "table_column_wise")  # a shard on one rank pools every rank's ids
DEFAULT_MARGIN = 0.10  # the step model's error the plugin's plan must beat TorchRec's by (its median target)


@dataclass(frozen=True)
class CostInputs:
    """What the cost model prices with.

    Attributes:
        links: the links (bytes/s per rank within and between hosts, latency per collective).
        compute: the lookups' and the dense part's compute.
        pipeline: the trainer's pipeline the plan is for (``plain``, ``sparse_dist``, ``hybrid``).
        dense_params: parameters the dense all-reduce sums.
        margin: the plugin's plan must be predicted faster than TorchRec's by more than this share.
        refused: why the figures must not decide alone (a probe was not steady); empty when they may.
        corners: with ``refused``, the (links, compute) at the ends of the unsteady probes' rounds:
            the plugin's plan is kept only where it wins at each (:func:`decide`).
        source: where the figures came from (one line).
    """

    links: Links
    compute: Compute
    pipeline: str = "sparse_dist"
    dense_params: int = 0
    margin: float = DEFAULT_MARGIN
    refused: str = ""
    source: str = ""
    corners: tuple[tuple[Links, Compute], ...] = ()

    def at_corners(self) -> list["CostInputs"]:
        """These inputs at each of ``corners`` (none when the figures were steady)."""
        return [dataclasses.replace(self, links=links, compute=compute, corners=()) for links, compute in self.corners]


def compute_from_probe(probe: ComputeProbe, compute_device: str = "cpu", costs: ComputeCosts | None = None) -> Compute:
    """The step model's compute from the plan-time probe, with the plugin types' calibrated extras
    (``costs``, default ``compute_costs.json``, on the device they were measured on)."""
    costs = costs or default_compute_costs()
    extras = costs.extras_on(compute_device)
    return Compute(
        lookup_s_per_id=probe.lookup_s_per_id,
        dense_s_per_sample=probe.dense_s_per_sample,
        extra_s_per_id=extras,
        source="measured at plan time; plugin extras from compute_costs.json",
    )


def option_table(
    option: ShardingOption, pricing: PluginPricing, world_size: int, topology: TierTopology | None, registry
) -> PlannedTable:
    """``option``'s table as the step model sees it: its type, settings, reads and codecs;
    placed shards on the ranks the partitioner gave them (rank 0 before it has)."""
    rows, dim = (int(s) for s in option.tensor.shape)
    kind = option.sharding_type if option.sharding_type in MODELLED else "row_wise"
    pooled = bool(option.is_pooled)
    owners, widths = (), ()
    if kind in PLACED:
        owners = tuple(s.rank if s.rank is not None else 0 for s in option.shards)
        widths = tuple(int(s.size[1]) for s in option.shards) if kind != "table_wise" else ()
    options, reads, hot, host = None, None, None, None
    if kind in PLUGIN_TYPES:
        load = pricing.load(option, world_size, topology)
        options, reads = priced_options(option), load.reads
        if kind == HET_ROW_REPLICATED:
            count = pricing.hot_rows(load, options)
            hot, host = reads[:count], reads[count : count + pricing.host_rows(load, options, option.name)]
        wire = priced_wire(option)
    else:
        wire = wire_precision(registry, kind, pooled)
    return planned_table(
        option.name, rows, dim, max(len(option.input_lengths), 1), float(sum(option.input_lengths)), kind, options,
        reads=reads, hot=hot, per_host=host, owners=owners, shard_dims=widths, pooled=pooled, wire=wire,
    )  # fmt: skip


def option_seconds(table: PlannedTable, cluster: Cluster, inputs: CostInputs) -> StepPrediction:
    """``table`` alone as a plan: its compute and what its traffic makes a rank wait, under the
    pipeline, with the dense part's compute there to hide behind (and not counted); no collective
    latency (a group's, counted once per plan) and no module cost (likewise)."""
    links = replace(inputs.links, latency=0.0)
    compute = replace(inputs.compute, module_s_per_step=0.0)
    step = predict_step([table], cluster, links, compute, inputs.pipeline, 0)
    return replace(step, dense=0.0)


def option_perf(option: ShardingOption, table: PlannedTable, cluster: Cluster, inputs: CostInputs) -> float:
    """Sets every shard's perf (ms) of ``option`` from the step model; returns the table's share of
    the step (seconds).

    TorchRec's search sums each rank's shards and minimises the busiest rank. A sharded type's every
    shard costs its rank the table's per-rank time. A placed shard (table_wise, column_wise) costs
    its owner its width's share of the table's lookups (the owner pools every rank's ids) and of its
    traffic times the ranks: every rank waits for that collective, and placements spread over the
    ranks, so a balanced plan's busiest rank sums what each rank waits for."""
    step = option_seconds(table, cluster, inputs)
    traffic = step.bytes
    fwd_share = (traffic.ids + traffic.emb_fwd) / traffic.total if traffic.total > 0 else 0.5
    fwd_comms, bwd_comms = step.comm_wait * fwd_share, step.comm_wait * (1 - fwd_share)
    placed = table.sharding_type in PLACED
    waited = cluster.world_size if placed else 1
    for shard in option.shards:
        share = int(shard.size[1]) / table.dim if placed and table.sharding_type != "table_wise" else 1.0
        shard.perf = Perf(
            fwd_compute=1e3 * share * step.emb_fwd,
            fwd_comms=1e3 * share * waited * fwd_comms,
            bwd_compute=1e3 * share * step.emb_bwd,
            bwd_comms=1e3 * share * waited * bwd_comms,
        )
    return step.total


def plan_step(tables: list[PlannedTable], cluster: Cluster, inputs: CostInputs) -> StepPrediction:
    """A whole plan's predicted step (its groups' collectives and latency, the dense part, the overlap)."""
    return predict_step(tables, cluster, inputs.links, inputs.compute, inputs.pipeline, inputs.dense_params)


@dataclass(frozen=True)
class Decision:
    """The planner's choice between the plugin's plan and TorchRec's.

    Attributes:
        chosen: "plugin" or "stock".
        plugin: the plugin plan's predicted step (None: it was not priced).
        stock: TorchRec's plan's predicted step (None: TorchRec found no plan, or it was not asked).
        why: one line: the figures and the rule.
    """

    chosen: str
    plugin: StepPrediction | None
    stock: StepPrediction | None
    why: str

    @property
    def prediction(self) -> StepPrediction | None:
        return self.plugin if self.chosen == "plugin" else self.stock


def _ratio(plugin: StepPrediction, stock: StepPrediction) -> float:
    return stock.total / plugin.total if plugin.total > 0 else float("inf")


def decide(
    plugin: StepPrediction,
    stock: StepPrediction | None,
    inputs: CostInputs,
    uses_plugin: bool,
    none_offered: str = "",
    corners: Sequence[tuple[StepPrediction, StepPrediction]] = (),
    no_stock: str = "",
) -> Decision:
    """The plugin's plan where it holds plugin types and is predicted faster than TorchRec's by more
    than the margin; else TorchRec's. Figures a probe could not measure steadily (``inputs.refused``)
    decide only through ``corners``, both plans priced at each end of the probes' rounds: the
    plugin's plan must win by the margin at every one (none given: TorchRec's plan).
    ``none_offered``: why no table could take a plugin type, if none could; ``no_stock``: why
    TorchRec's planner gave no plan (``stock`` None)."""
    if stock is None:
        why = "TorchRec's planner found no plan to compare with" + (f": {no_stock}" if no_stock else "")
        return Decision("plugin", plugin, None, why)
    if not uses_plugin:
        why = none_offered or "no table is predicted faster with a plugin type"
        return Decision("stock", plugin, stock, f"TorchRec's plan: {why}")
    ratio = _ratio(plugin, stock)
    figures = f"predicted {plugin.total * 1e3:.1f} ms/step against TorchRec's plan's {stock.total * 1e3:.1f} ms"
    if inputs.refused:
        if not corners:
            return Decision("stock", plugin, stock, f"TorchRec's plan kept: {inputs.refused}")
        worst = min(ratio, *(_ratio(p, s) for p, s in corners))
        if worst > 1.0 + inputs.margin:
            why = f"plugin types {figures} ({ratio:.2f}x; at least {worst:.2f}x across the unsteady figures' range)"
            return Decision("plugin", plugin, stock, why)
        return Decision(
            "stock", plugin, stock,
            f"TorchRec's plan kept: {inputs.refused}, and across their range the plugin's plan is as little as "
            f"{worst:.2f}x TorchRec's (needs more than {1.0 + inputs.margin:.2f}x)",
        )  # fmt: skip
    if ratio > 1.0 + inputs.margin:
        return Decision("plugin", plugin, stock, f"plugin types {figures} ({ratio:.2f}x)")
    return Decision(
        "stock",
        plugin,
        stock,
        f"TorchRec's plan kept: the plugin's {figures} ({ratio:.2f}x), not faster by more than the model's error "
        f"({inputs.margin:.0%})",
    )


def plan_prediction(
    decision: Decision | None,
    best: list[ShardingOption],
    shares: dict[str, dict[str, float]],
    source: str,
    rank_costs: dict[str, dict[str, float]] | None = None,
) -> PlanPrediction | None:
    """What the plan carries: the chosen plan's predicted step and parts, and per table the chosen
    type's share of the step and cost to a rank, and the runner-up's: the other type cheapest to a rank
    (``shares``, ``rank_costs``: table -> type -> seconds; without ``rank_costs``, by share)."""
    if decision is None or decision.prediction is None:
        return None
    tables = {}
    for option in best:
        kinds = shares.get(option.name, {})
        costs = (rank_costs or {}).get(option.name) or kinds
        others = {k: v for k, v in costs.items() if k != option.sharding_type}
        runner = min(others, key=others.get) if others else None
        chosen = kinds.get(option.sharding_type)

        def ms(table: dict[str, float], kind: str | None) -> float | None:
            return None if kind is None or kind not in table else round(table[kind] * 1e3, 3)

        tables[option.name] = {
            "sharding_type": option.sharding_type,
            "share_ms": None if chosen is None else round(chosen * 1e3, 3),
            "runner_up": runner,
            "runner_up_share_ms": ms(kinds, runner),
            "rank_ms": ms(costs, option.sharding_type),
            "runner_up_rank_ms": ms(costs, runner),
        }
    step = decision.prediction
    return PlanPrediction(
        step_ms=step.total * 1e3,
        pipeline=step.pipeline,
        parts_ms={k: round(v, 3) for k, v in step.step_ms().items() if k != "total"},
        tables=tables,
        source=source,
        stock_step_ms=None if decision.stock is None else decision.stock.total * 1e3,
        chosen=decision.chosen,
    )


def enough_link_speed(module: nn.Module, batch: int, probe: ComputeProbe, share: float) -> float | None:
    """A link speed (bytes/ms per rank) above which TorchRec's table_wise bytes of ``module``'s tables
    (ids and lengths; pooled bags both ways) cost under ``share`` of the measured compute: faster
    links change no choice."""
    shapes = [(len(t.feature_names), t.embedding_dim) for t in table_configs(module).values()]
    ids = batch * sum(features for features, _ in shapes)
    per_rank = sum(batch * features * (12 + 2 * 4 * dim) for features, dim in shapes)
    compute_s = ids * probe.lookup_s_per_id + batch * probe.dense_s_per_sample
    if compute_s <= 0 or per_rank <= 0:
        return None
    return per_rank / (share * compute_s) / 1e3

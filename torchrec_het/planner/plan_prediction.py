"""What the planner predicts for its plan, carried on the ``ShardingPlan`` it returns (it survives
the pickling of ``collective_plan``'s broadcast); :mod:`torchrec_het.integration.plan_check` compares it with
the measured step."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torchrec_het.types import HET_SHARDING_TYPES

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

PREDICTION_ATTR = "het_prediction"  # the ShardingPlan attribute holding its PlanPrediction


@dataclass(frozen=True)
class PlanPrediction:
    """What the planner predicted for its plan (plain values: it travels with the plan).

    Attributes:
        step_ms: the predicted step of the whole plan, in ms.
        pipeline: the pipeline the prediction assumed: ``"plain"``, ``"sparse_dist"`` or ``"hybrid"``.
        parts_ms: the step's parts in ms: ``emb_fwd``, ``emb_bwd``, ``dense``, ``comm_wait``.
        tables: table name -> ``{"sharding_type", "share_ms", "runner_up", "runner_up_share_ms", "rank_ms",
            "runner_up_rank_ms"}``: the chosen type's predicted share of the step and its cost to a rank
            (its shards' perf shared over the ranks, what TorchRec's search balances), and the runner-up's:
            the other type cheapest to a rank (None without one).
        source: what the figures came from (links, compute), free text.
        stock_step_ms: the predicted step of TorchRec's own plan, when the planner compared.
        chosen: ``"plugin"`` or ``"stock"``: whose plan this is.
    """

    step_ms: float
    pipeline: str = "plain"
    parts_ms: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)
    source: str = ""
    stock_step_ms: float | None = None
    chosen: str = "plugin"


def table_lines(prediction: PlanPrediction, world_size: int, margin: float) -> list[str]:
    """The planner log's lines on the tables: one per group of tables with the same type and runner-up,
    and one per table where a plugin type was chosen or was runner-up within ``margin`` of the other
    (a close call). Figures are costs to a rank (``rank_ms``), which compare across types; a runner-up
    cheaper than the choice says why it lost."""
    kept = "TorchRec's plan kept" if prediction.chosen == "stock" else "the plugin's plan"
    alone, groups = [], {}
    for name, t in prediction.tables.items():
        cost, other = t.get("rank_ms"), t.get("runner_up_rank_ms")
        plugin = t["sharding_type"] in HET_SHARDING_TYPES or t["runner_up"] in HET_SHARDING_TYPES
        if plugin and None not in (cost, other) and other <= cost * (1 + margin):
            alone.append((name, t))
        else:
            groups.setdefault((t["sharding_type"], t["runner_up"]), []).append((name, t))
    lines = []
    for (kind, _), members in groups.items():
        names = [name for name, _ in members]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        head = f"{len(names)} tables {kind}, {kept} ({shown})" if len(names) > 1 else f"{names[0]}: {kind}, {kept}"
        lines.append(f"{head}: " + _figures([t for _, t in members], world_size, prediction.chosen, margin))
    for name, t in alone:
        lines.append(
            f"{name}: {t['sharding_type']}, {kept}, a close call: "
            + _figures([t], world_size, prediction.chosen, margin)
        )
    if lines:
        lines.append(
            f"(ms a rank: a table's shards' predicted perf shared over the {world_size} ranks, what TorchRec's "
            "search balances)"
        )
    return lines


def _span(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "not priced"
    low, high = min(known), max(known)
    return f"{low:.3f} ms" if round(low, 3) == round(high, 3) else f"{low:.3f}-{high:.3f} ms"


def _figures(tables: list[dict], world_size: int, chosen: str, margin: float) -> str:
    """``<cost> a rank[ (its owner's ...)]; runner-up <type> <cost> a rank[: why it lost]`` of tables of
    one type and runner-up."""
    kind, runner = tables[0]["sharding_type"], tables[0]["runner_up"]
    costs, others = [t.get("rank_ms") for t in tables], [t.get("runner_up_rank_ms") for t in tables]

    def owner(values: list[float | None]) -> str:
        return _span([None if v is None else v * world_size for v in values])

    text = f"{_span(costs)} a rank" + (" each" if len(tables) > 1 else "")
    if kind == "table_wise" and world_size > 1:
        text += f" (its owner's {owner(costs)})"
    if runner is None:
        return text + "; no other type priced for it"
    text += f"; runner-up {runner} {_span(others)} a rank"
    if not any(None not in (c, o) and o < c for c, o in zip(costs, others, strict=True)):
        return text
    if chosen == "stock":
        return text + (
            f": TorchRec's own planner chose {kind} (by its estimator); the plugin replaces TorchRec's plan only "
            f"with plugin types predicted faster by more than {margin:.0%}"
        )
    text += ": the search keeps the plan whose busiest rank costs least"
    return text + (f", and {runner} loads its owner alone ({owner(others)})" if runner == "table_wise" else "")


def attach_prediction(plan: "ShardingPlan", prediction: PlanPrediction) -> "ShardingPlan":
    """Sets ``plan.het_prediction`` (it survives pickling, so ``collective_plan``'s broadcast); returns ``plan``."""
    setattr(plan, PREDICTION_ATTR, prediction)
    return plan


def prediction_of(plan: object) -> PlanPrediction | None:
    """The prediction ``plan`` carries (a ``PlanPrediction`` itself is returned as is), else None."""
    if isinstance(plan, PlanPrediction):
        return plan
    prediction = getattr(plan, PREDICTION_ATTR, None)
    return prediction if isinstance(prediction, PlanPrediction) else None

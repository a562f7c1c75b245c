"""What the planner predicts for its plan, carried on the ``ShardingPlan`` it returns (it survives
the pickling of ``collective_plan``'s broadcast); :mod:`torchrec_het.integration.plan_check` compares it with
the measured step."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

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
        tables: table name -> ``{"sharding_type", "share_ms", "runner_up", "runner_up_share_ms"}``:
            the chosen type's predicted share of the step and the runner-up's (None without one).
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

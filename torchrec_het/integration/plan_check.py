"""A run-time check of the plan: the plan's predicted step (:class:`PlanPrediction`, carried on the
``ShardingPlan``) against the step time measured after warm-up (:class:`StepWatch`).

Each rank measures its own step (the median interval between training forwards; no host syncs, no
collectives); rank 0 logs one line (logger ``torchrec_het``, WARNING; on stderr where no logging handler shows it) when the two
differ by more than 25%, saying what to do. ``stats_by_table(model)`` carries both figures.
"""

import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

# the prediction a plan carries (the planner's; re-exported here, where the check reads it)
from torchrec_het.planner.plan_prediction import PREDICTION_ATTR, PlanPrediction, attach_prediction, prediction_of

if TYPE_CHECKING:
    from torchrec.distributed.types import ShardingPlan

WATCH_ATTR = "_het_step_watch"  # the model attribute holding its StepWatch
TOLERANCE = 0.25  # |measured / predicted - 1| above this is logged

logger = logging.getLogger("torchrec_het")
logger.addHandler(logging.NullHandler())  # the line goes to stderr by print; no second copy via lastResort


def table_modules(plan: object) -> dict[str, str]:
    """Table name -> its module's path, from a ``ShardingPlan`` (empty for anything else)."""
    modules = getattr(plan, "plan", None)
    if not isinstance(modules, dict):
        return {}
    return {
        table: path for path, module_plan in modules.items() if isinstance(module_plan, dict) for table in module_plan
    }


class _StepHook:
    """The forward pre-hook: hands each forward to its watch. A copy (``deepcopy`` or pickle of the
    model) is inert: the copied model's forwards are not timed and no hook of the original is removed."""

    def __init__(self, watch: "StepWatch") -> None:
        self.watch = watch

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        self.watch._forward(module.training)

    def __reduce__(self):
        return (_InertHook, ())


class _InertHook:
    """What a copied :class:`_StepHook` becomes: does nothing."""

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        return None


class StepWatch:
    """Times a model's training steps once, after warm-up, and compares them with the plan's prediction.

    Skips the first ``warmup`` training steps, then takes ``window`` intervals between consecutive
    training forwards (the steps after them) (an eval forward breaks the series: the interval across it is not counted); their
    median is the measured step. Then it removes its hook and, on rank 0, logs one line when the
    measured step is more than 25% off the prediction. Copies of a watch (with a copied model) keep
    the figures and time nothing.

    Attributes:
        prediction: the plan's prediction.
        predicted_step_ms: ``prediction.step_ms``.
        measured_step_ms: the measured step in ms; None until the window is full.
        steps_seen: training forwards seen while watching.
        table_modules: table -> module path, from the plan (empty when given only a prediction).
    """

    def __init__(
        self,
        prediction: PlanPrediction,
        warmup: int = 20,
        window: int = 50,
        clock: Callable[[], float] = time.perf_counter,
        table_modules: dict[str, str] | None = None,
    ) -> None:
        if warmup < 0 or window < 1:
            raise ValueError(f"a step watch needs warmup >= 0 and window >= 1, got warmup={warmup}, window={window}")
        self.prediction = prediction
        self.predicted_step_ms = float(prediction.step_ms)
        self.measured_step_ms: float | None = None
        self.steps_seen = 0
        self.table_modules = dict(table_modules or {})
        self.warmup, self.window, self.clock = warmup, window, clock
        self._intervals: list[float] = []
        self._previous: float | None = None
        self._handle: torch.utils.hooks.RemovableHandle | None = None

    @property
    def watching(self) -> bool:
        """Whether the hook is still in place."""
        return self._handle is not None

    def attach(self, model: torch.nn.Module) -> "StepWatch":
        """Registers the forward pre-hook on ``model``; returns self."""
        self.detach()
        self._handle = model.register_forward_pre_hook(_StepHook(self))
        return self

    def detach(self) -> None:
        """Removes the hook (no cost afterwards); the figures stay."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._previous = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.update(_handle=None, _previous=None, clock=time.perf_counter)  # a copy watches nothing
        return state

    def as_dict(self) -> dict:
        """The figures as plain values (``stats_by_table``'s ``plan_check``)."""
        return {
            "predicted_step_ms": self.predicted_step_ms,
            "measured_step_ms": self.measured_step_ms,
            "steps": self.steps_seen,
        }

    def _forward(self, training: bool) -> None:
        if self._handle is None:
            return
        if not training:
            self._previous = None  # the interval across an eval forward is not a step
            return
        now = self.clock()
        self.steps_seen += 1
        if self.steps_seen > self.warmup + 1 and self._previous is not None:  # the step since the last forward
            self._intervals.append(now - self._previous)  # was no warm-up step
        self._previous = now
        if len(self._intervals) >= self.window:
            self.measured_step_ms = statistics.median(self._intervals) * 1e3
            self._intervals = []
            self.detach()
            self._report()

    def _report(self) -> None:
        line = check_line(self.measured_step_ms, self.prediction)
        if line is None:
            logger.debug(
                "torchrec_het: plan check: measured %.1f ms/step, the plan predicted %.1f ms: within 25%%",
                self.measured_step_ms,
                self.predicted_step_ms,
            )
        elif _rank() == 0:
            from torchrec_het.planner.stats import shown  # the planner's rule for its own log lines

            logger.warning(line)
            if not shown(logger, logging.WARNING):  # no handler shows it: say it on stderr, once
                print(line, file=sys.stderr, flush=True)


def check_line(measured_ms: float, prediction: PlanPrediction) -> str | None:
    """The line rank 0 logs when ``measured_ms`` is more than 25% off the prediction, else None."""
    predicted = float(prediction.step_ms)
    if not predicted > 0 or not measured_ms > 0:
        return None
    ratio = measured_ms / predicted
    if abs(ratio - 1) <= TOLERANCE:
        return None
    head = (
        f"torchrec_het: plan check: measured {measured_ms:.1f} ms/step, the plan predicted {predicted:.1f} ms "
        f"({prediction.pipeline})"
    )
    if ratio > 1:
        return f"{head}, {(ratio - 1) * 100:.0f}% slower: {_advice(prediction, slower=True)}"
    return f"{head}, {(1 - ratio) * 100:.0f}% faster: {_advice(prediction, slower=False)}"


def _advice(prediction: PlanPrediction, slower: bool) -> str:
    from torchrec_het.integration.env_settings import ENV_COMPUTE, ENV_LINK_GBIT, ENV_RANKS_ON_MACHINE

    try:
        from torchrec_het.integration.cpu_budget import current_budget

        budget = current_budget()
        cores = f"{budget.describe()}{', oversubscribed' if budget.oversubscribed else ''}"
    except ValueError:  # a bad $TORCHREC_HET_RANKS_ON_MACHINE: the launcher names it
        cores = "unknown"
    source = f" (figures: {prediction.source})" if prediction.source else ""
    if slower:
        why = (
            f"the planner's figures{source} overrate this machine: its links or compute were measured on a "
            f"disturbed machine, or the ranks share cores (here {cores}: ranks x threads must not exceed the cores; "
            f"set OMP_NUM_THREADS, or ${ENV_RANKS_ON_MACHINE} with python -m torchrec_het.launch)"
        )
    else:
        why = (
            f"the plan was priced pessimistically{source}: its links or compute were measured while the machine "
            f"was busy, or assumed (here {cores})"
        )
    return (
        f"{why}; state the link speed (${ENV_LINK_GBIT}=INTRA,INTER in Gbit/s per rank, or install(link_gbit=...) / "
        f"the planner's link_gbit=...) and this machine's compute costs (${ENV_COMPUTE}, from python -m "
        "torchrec_het_bench.calibrate), or re-plan on a quiet machine"
    )


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK", "0").strip()
    return int(rank) if rank.isdigit() else 0


def watch_plan(
    model: torch.nn.Module,
    plan_or_prediction: "ShardingPlan | PlanPrediction",
    warmup: int = 20,
    window: int = 50,
    clock: Callable[[], float] = time.perf_counter,
) -> StepWatch:
    """Watches ``model``'s training steps against the prediction ``plan_or_prediction`` is or carries
    (see :class:`StepWatch`); the watch is also kept as ``model._het_step_watch`` (replacing an
    earlier one), where ``stats_by_table`` finds it.

    Raises:
        ValueError: when the plan carries no prediction (it was not made by the plugin's planner).
    """
    prediction = prediction_of(plan_or_prediction)
    if prediction is None:
        raise ValueError(
            f"the plan carries no prediction (no {PREDICTION_ATTR!r}): only a plan of torchrec_het's planner can be "
            "checked at run time"
        )
    previous = getattr(model, WATCH_ATTR, None)
    if isinstance(previous, StepWatch):
        previous.detach()
    watch = StepWatch(prediction, warmup, window, clock, table_modules(plan_or_prediction)).attach(model)
    setattr(model, WATCH_ATTR, watch)
    return watch


def watch_of(model: torch.nn.Module) -> StepWatch | None:
    """The watch ``model`` (or the module a ``DistributedModelParallel`` wraps) carries, else None."""
    for candidate in (model, getattr(model, "module", None)):
        watch = getattr(candidate, WATCH_ATTR, None) if candidate is not None else None
        if isinstance(watch, StepWatch):
            return watch
    return None


__all__ = [
    "PREDICTION_ATTR",
    "PlanPrediction",
    "StepWatch",
    "attach_prediction",
    "check_line",
    "prediction_of",
    "watch_of",
    "watch_plan",
]

"""Speed ratios with their 95% intervals, paired round by round, and the run's own noise floor.

Every round of a run trains every entry ``steps_per_round`` steps, one entry after the other (the
order rotated by one each round). An entry's speed in a round is the median samples/s of that
round's steps, its first :func:`rewarm_steps` left out: each entry starts its window on a machine
the previous entry has just used (other caches, another allocator state), and gets the same
re-warm as every other. A ratio of two entries is the geometric mean of their per-round ratios,
with a t interval over the rounds (:func:`paired_ratio`): both entries met the same machine in
each round, so a slow phase of the machine moves both.

An A/A pair is an entry and its twin (the same configuration under a second name, ``_aa``): their
ratio is the run's noise floor. Verdicts read an interval as the AUC line does: ``faster`` or
``slower`` when it lies on one side of 1, else ``equal``.
"""

import math
import statistics
from dataclasses import dataclass

from torchrec_het_bench.auc_intervals import CONFIDENCE, t_quantile

TWIN_SUFFIX = "_aa"


def rewarm_steps(steps_per_round: int) -> int:
    """Steps at the start of every entry's window that no speed figure counts (5, or a quarter of a short window)."""
    return min(5, steps_per_round // 4)


def round_rates(step_seconds: list[float], steps_per_round: int, samples_per_step: int) -> list[float]:
    """Median samples/s of each round's steps after its re-warm (rounds in order; a short last one kept)."""
    skip = rewarm_steps(steps_per_round)
    out = []
    for start in range(0, len(step_seconds), steps_per_round):
        window = step_seconds[start + skip : start + steps_per_round]
        if window:
            out.append(samples_per_step / statistics.median(window))
    return out


def counted_steps(step_seconds: list[float], steps_per_round: int) -> list[float]:
    """The steps the speed figures count: every round's, its re-warm left out."""
    skip = rewarm_steps(steps_per_round)
    return [s for i, s in enumerate(step_seconds) if i % steps_per_round >= skip]


@dataclass(frozen=True)
class SpeedRatio:
    """``ratio`` (geometric mean of the per-round ratios) and its 95% interval ``[low, high]`` over ``rounds``."""

    ratio: float
    low: float
    high: float
    rounds: int

    def word(self) -> str:
        """``faster`` / ``slower`` when the interval lies above / below 1, else ``equal``."""
        if self.low > 1.0:
            return "faster"
        if self.high < 1.0:
            return "slower"
        return "equal"

    def text(self) -> str:
        """``1.31× [1.25, 1.38]``."""
        return f"{self.ratio:.2f}× [{self.low:.2f}, {self.high:.2f}]"

    def as_dict(self) -> dict:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "rounds": self.rounds, "word": self.word()}


def paired_ratio(rates: list[float], reference_rates: list[float]) -> SpeedRatio | None:
    """``rates`` over ``reference_rates``, paired round by round; None with fewer than 2 rounds in common."""
    logs = [math.log(a / b) for a, b in zip(rates, reference_rates) if a > 0 and b > 0]
    n = len(logs)
    if n < 2:
        return None
    mean = statistics.fmean(logs)
    half = t_quantile(0.5 + CONFIDENCE / 2, n - 1) * statistics.stdev(logs) / math.sqrt(n)
    return SpeedRatio(math.exp(mean), math.exp(mean - half), math.exp(mean + half), n)


def ratio_of(entry: dict, reference: dict) -> SpeedRatio | None:
    """The paired speed ratio of two results.json entries (None: no per-round speeds recorded)."""
    a, b = entry["samples_per_s"].get("rounds"), reference["samples_per_s"].get("rounds")
    if not a or not b:
        return None
    return paired_ratio(a, b)


def speed_over(entry: dict, reference: dict) -> tuple[float | None, SpeedRatio | None]:
    """``entry``'s speed over ``reference``'s: the paired ratio (and its :class:`SpeedRatio`) where both
    recorded their rounds, else the medians' ratio and None (None, None: the reference has no speed)."""
    paired = ratio_of(entry, reference)
    if paired is not None:
        return paired.ratio, paired
    base = reference["samples_per_s"]["median"]
    return (entry["samples_per_s"]["median"] / base if base else None), None


def twin_of(name: str) -> str:
    """The name of ``name``'s A/A twin."""
    return name + TWIN_SUFFIX


def is_twin(name: str) -> bool:
    return name.endswith(TWIN_SUFFIX)


def noise_floor(entries: list[dict]) -> list[dict]:
    """Every A/A pair of the run that ran: ``{"entry", "twin", "ratio", "low", "high", "rounds", "word"}``."""
    by_name = {e["name"]: e for e in entries if "not_run" not in e}
    out = []
    for name, entry in by_name.items():
        if is_twin(entry["config"]):
            continue
        twin = by_name.get(twin_of(entry["config"]) + name[len(entry["config"]) :])
        if twin is None:
            continue
        ratio = ratio_of(twin, entry)
        if ratio is not None:
            out.append({"entry": name, "twin": twin["name"], **ratio.as_dict()})
    return out

"""95% intervals for AUC differences between two configurations, and what they say.

Two sources of spread, two intervals:

* **One run** (:func:`paired_delong`): both configurations scored the same held-out samples, so
  the difference of their AUCs is paired per sample. DeLong's method (DeLong, DeLong and
  Clarke-Pearson, 1988) gives the variance of that difference from each sample's placement
  among the other class; the interval is the difference ± 1.96 standard errors. It covers the
  evaluation noise only: another held-out sample of the same data would move the difference
  that much. It says nothing about how the difference varies from one training run to another.
* **Several seeds** (:func:`paired_t`): each seed is another data stream, planted model,
  held-out set and initialization; stock and the configuration train on the same seed, and the
  per-seed differences get a Student t interval (n - 1 degrees of freedom). It covers training
  and evaluation noise together.

:func:`verdict_word` reads an interval: ``equal`` when it holds 0, ``higher`` or ``lower``
when it lies on one side. A difference inside the interval is not evidence of any difference.
"""

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

CONFIDENCE = 0.95
_NORMAL_975 = 1.959963984540054  # the standard normal's 97.5% quantile


@dataclass(frozen=True)
class AucDifference:
    """An AUC difference (configuration minus reference) with its 95% interval.

    Attributes:
        difference: the point estimate (the mean difference over seeds for ``paired_t``).
        half_width: half the interval's width: it is ``difference ± half_width``.
        method: how the interval was made, in words (for the report).
        samples: held-out samples (DeLong) or seeds (t) behind it.
    """

    difference: float
    half_width: float
    method: str
    samples: int

    @property
    def low(self) -> float:
        return self.difference - self.half_width

    @property
    def high(self) -> float:
        return self.difference + self.half_width

    def as_dict(self) -> dict:
        """For results.json: the fields and the interval's ends."""
        return dict(asdict(self), low=self.low, high=self.high, confidence=CONFIDENCE)


def midranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks of ``values`` in their own order, ties given their mean rank (float64)."""
    order = torch.argsort(values)
    _, counts = torch.unique_consecutive(values[order], return_counts=True)
    ends = counts.cumsum(0).to(torch.float64)
    mean_ranks = torch.repeat_interleave(ends - (counts.to(torch.float64) - 1) / 2, counts)
    ranks = torch.empty_like(mean_ranks)
    ranks[order] = mean_ranks
    return ranks


def placements(scores: torch.Tensor, positive: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeLong's structural components: per positive, the share of negatives it outscores; per
    negative, the share of positives that outscore it (ties count one half). Their means are the AUC."""
    pos, neg = scores[positive], scores[~positive]
    m, n = pos.numel(), neg.numel()
    joint = midranks(torch.cat([pos, neg]))
    per_positive = (joint[:m] - midranks(pos)) / n
    per_negative = 1.0 - (joint[m:] - midranks(neg)) / m
    return per_positive, per_negative


def paired_delong(scores: torch.Tensor, reference_scores: torch.Tensor, labels: torch.Tensor) -> AucDifference:
    """AUC(``scores``) - AUC(``reference_scores``) on the same held-out samples, with DeLong's 95% interval.

    Args:
        scores: the configuration's scores, one per held-out sample.
        reference_scores: the reference's scores of the same samples, in the same order.
        labels: the samples' 0/1 labels.

    Raises:
        ValueError: lengths differ, or the labels hold one class only.
    """
    a = torch.as_tensor(scores).detach().reshape(-1).to(torch.float64)
    b = torch.as_tensor(reference_scores).detach().reshape(-1).to(torch.float64)
    positive = torch.as_tensor(labels).detach().reshape(-1) > 0.5
    if not a.numel() == b.numel() == positive.numel():
        raise ValueError(
            f"scores, reference scores and labels differ in length: {a.numel()}, {b.numel()}, {positive.numel()}"
        )
    m = int(positive.sum())
    n = positive.numel() - m
    if m < 2 or n < 2:
        raise ValueError(
            f"held-out labels need at least 2 of each class for an interval, got {m} positive and {n} negative"
        )
    pos_a, neg_a = placements(a, positive)
    pos_b, neg_b = placements(b, positive)
    d_pos, d_neg = pos_a - pos_b, neg_a - neg_b
    variance = float(d_pos.var()) / m + float(d_neg.var()) / n
    return AucDifference(
        difference=float(pos_a.mean() - pos_b.mean()),
        half_width=_NORMAL_975 * math.sqrt(max(variance, 0.0)),
        method=f"DeLong, paired on the same {m + n} held-out samples (evaluation noise only)",
        samples=m + n,
    )


def paired_t(differences: Sequence[float], seeds: Sequence[int] | None = None) -> AucDifference:
    """The mean of per-seed AUC differences with a Student t 95% interval (n - 1 degrees of freedom).

    Args:
        differences: per seed, the configuration's AUC minus the reference's of the same seed.
        seeds: the seeds, for the method's words.

    Raises:
        ValueError: fewer than 2 differences, or one is not finite.
    """
    values = [float(d) for d in differences]
    if len(values) < 2:
        raise ValueError(f"a t interval needs at least 2 seeds, got {len(values)}")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"AUC differences must be finite, got {values}")
    n = len(values)
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    named = f"seeds {','.join(str(s) for s in seeds)}" if seeds is not None else f"{n} seeds"
    return AucDifference(
        difference=mean,
        half_width=t_quantile(0.5 + CONFIDENCE / 2, n - 1) * sd / math.sqrt(n),
        method=f"paired t over {named} (same seed for both; training and evaluation noise)",
        samples=n,
    )


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 <= p < 1) of Student's t with ``df`` degrees of freedom.

    Bisection on the CDF, whose central part is Simpson's rule over the density (within 1e-4 of
    tabulated values for df >= 1; no scipy in the stack).
    """
    if not 0.5 <= p < 1.0 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))

    def central(x: float, steps: int = 512) -> float:  # P(0 <= T <= x)
        h = x / steps
        inner = math.fsum(density(i * h) * (4 if i % 2 else 2) for i in range(1, steps))
        return h / 3 * (density(0.0) + inner + density(x))

    target, low, high = p - 0.5, 0.0, 1.0
    while central(high) < target:
        high *= 2
    for _ in range(50):
        mid = (low + high) / 2
        low, high = (mid, high) if central(mid) < target else (low, mid)
    return (low + high) / 2


def verdict_word(difference: AucDifference) -> str:
    """``equal`` when the interval holds 0, else ``higher`` or ``lower``."""
    if difference.low <= 0.0 <= difference.high:
        return "equal"
    return "higher" if difference.difference > 0 else "lower"

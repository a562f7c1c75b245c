"""Intervals for AUC differences (DeLong on one run's held-out samples, paired t over seeds); no ranks."""

import math

import pytest
import torch

from torchrec_het_bench.auc_intervals import (
    AucDifference,
    midranks,
    paired_delong,
    paired_t,
    placements,
    t_quantile,
    verdict_word,
)
from torchrec_het_bench.data import binary_auc


def _two_models(n: int = 8_000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Labels and two correlated scorers that share most of their signal (like two trainings of one model)."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.rand(n, generator=g) < 0.25).float()
    shared = torch.randn(n, generator=g) + 1.2 * labels
    return (
        labels,
        shared + 0.3 * torch.randn(n, generator=g),
        shared + 0.3 * torch.randn(n, generator=g) + 0.05 * labels,
    )


def test_midranks_give_ties_their_mean_rank():
    assert midranks(torch.tensor([3.0, 1.0, 3.0, 2.0])).tolist() == [3.5, 1.0, 3.5, 2.0]


def test_placements_average_to_the_auc():
    labels, a, _ = _two_models(2000)
    positive = labels > 0.5
    per_positive, per_negative = placements(a.double(), positive)
    assert float(per_positive.mean()) == pytest.approx(binary_auc(a, labels), abs=1e-12)
    assert float(per_negative.mean()) == pytest.approx(binary_auc(a, labels), abs=1e-12)


def test_delong_difference_is_the_auc_difference_and_its_interval_matches_a_bootstrap():
    labels, a, b = _two_models()
    diff = paired_delong(a, b, labels)
    assert diff.difference == pytest.approx(binary_auc(a, labels) - binary_auc(b, labels), abs=1e-12)
    assert diff.samples == labels.numel() and "DeLong" in diff.method
    g = torch.Generator().manual_seed(1)
    boot = []
    for _ in range(120):  # resample the held-out samples, both scorers together (paired)
        idx = torch.randint(0, labels.numel(), (labels.numel(),), generator=g)
        boot.append(binary_auc(a[idx], labels[idx]) - binary_auc(b[idx], labels[idx]))
    assert diff.half_width == pytest.approx(1.96 * float(torch.tensor(boot).std()), rel=0.25)


def test_delong_of_a_model_with_itself_is_zero_with_no_width():
    labels, a, _ = _two_models(1000)
    diff = paired_delong(a, a.clone(), labels)
    assert (diff.difference, diff.half_width) == (0.0, 0.0)


def test_delong_refuses_what_it_cannot_pair():
    labels, a, b = _two_models(100)
    with pytest.raises(ValueError, match="differ in length"):
        paired_delong(a, b[:-1], labels)
    with pytest.raises(ValueError, match="2 of each class"):
        paired_delong(a, b, torch.zeros(100))


def test_paired_t_over_seeds():
    diff = paired_t([0.001, 0.002, 0.003], seeds=[0, 1, 2])
    assert diff.difference == pytest.approx(0.002)
    assert diff.half_width == pytest.approx(4.3027 * 0.001 / math.sqrt(3), rel=1e-4)  # t(0.975, 2 df) = 4.3027
    assert "seeds 0,1,2" in diff.method and diff.samples == 3
    assert paired_t([0.004, 0.004]).half_width == 0.0
    with pytest.raises(ValueError, match="at least 2 seeds"):
        paired_t([0.001])
    with pytest.raises(ValueError, match="finite"):
        paired_t([0.001, math.nan])


@pytest.mark.parametrize("df, tabulated", [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (10, 2.228), (30, 2.042)])
def test_t_quantiles_match_the_tables(df, tabulated):
    assert t_quantile(0.975, df) == pytest.approx(tabulated, abs=1e-3)


def test_t_quantile_checks_its_arguments():
    assert t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError):
        t_quantile(0.3, 3)
    with pytest.raises(ValueError):
        t_quantile(0.975, 0)


def test_equal_means_the_interval_holds_zero():
    assert verdict_word(AucDifference(-0.0003, 0.0008, "m", 3)) == "equal"
    assert verdict_word(AucDifference(0.0008, 0.0008, "m", 3)) == "equal"  # 0 on the interval's edge
    assert verdict_word(AucDifference(0.0009, 0.0008, "m", 3)) == "higher"
    assert verdict_word(AucDifference(-0.0021, 0.0008, "m", 3)) == "lower"
    assert AucDifference(-0.0021, 0.0008, "m", 3).as_dict()["low"] == pytest.approx(-0.0029)

"""The plan-time compute probe: what it measures from a model, and the rule that refuses rounds that spread."""

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from torchrec_het.planner import compute_probe
from torchrec_het.planner.compute_probe import (
    ComputeProbe,
    dense_parameters,
    embedding_shape,
    linear_shapes,
    measure_compute,
)


class _Model(nn.Module):
    def __init__(self, dims=(6, 6, 10)) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], embedding_dim=d, num_embeddings=100 * (i + 1))
            for i, d in enumerate(dims)
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.bottom = nn.Sequential(nn.Linear(13, 32), nn.ReLU(), nn.Linear(32, 8))
        self.top = nn.Linear(8 + sum(dims), 1)


def test_the_model_gives_its_dense_layers_parameters_and_a_kernel_width() -> None:
    model = _Model()
    assert linear_shapes(model) == [(13, 32), (32, 8), (30, 1)]
    assert dense_parameters(model) == sum(p.numel() for n, p in model.named_parameters() if not n.startswith("ebc"))
    assert embedding_shape(model) == (8, 300)  # median width 6, rounded to FBGEMM's multiple of 4; the most rows
    assert embedding_shape(nn.Linear(2, 2)) == (16, 1000)  # no table: a small default


def test_a_probe_measures_positive_figures_in_well_under_the_budget() -> None:
    probe = measure_compute(_Model(), batch=64, rounds=3)
    assert probe.lookup_s_per_id > 0 and probe.dense_s_per_sample > 0
    assert probe.dense_params == dense_parameters(_Model())
    assert probe.seconds < 3.0  # the plan-time budget
    assert "lookup" in probe.describe() and "dense" in probe.describe()


def test_rounds_that_spread_are_measured_again_and_bounded_if_they_still_spread(monkeypatch) -> None:
    series = iter([[1.0, 5.0, 1.0], [1.0, 1.1, 1.0]])  # spread once, then steady: the second is used
    assert compute_probe._steady(lambda: next(series), "lookup") == (1.0, "", (1.0, 1.1))
    series = iter([[1.0, 5.0, 1.0], [1.0, 3.0, 1.0]])  # spread twice: not steady, said why, both bounded
    figure, why, bounds = compute_probe._steady(lambda: next(series), "lookup")
    assert figure == 1.0 and "lookup probe's rounds spread 3.0x twice" in why and bounds == (1.0, 5.0)
    monkeypatch.setattr(compute_probe, "_lookup_rounds", lambda *args: [1e-7, 9e-7, 1e-7])
    probe = measure_compute(_Model(), batch=64, rounds=3)
    assert not probe.steady and "lookup" in probe.why and "NOT STEADY" in probe.describe()
    assert probe.lookup_bounds == (1e-7, 9e-7)
    low, high = probe.dense_bounds
    assert low <= probe.dense_s_per_sample <= high


def test_a_probe_says_what_it_measured() -> None:
    probe = ComputeProbe(2e-7, 3e-5, 1000, 0.25)
    assert probe.describe() == (
        "compute (measured at plan time, 0.25 s): lookup 200 ns/id, dense 30.0 us/sample (1000 parameters)"
    )
    assert pytest.approx(probe.dense_s_per_sample) == 3e-5
    stated = ComputeProbe(2e-7, 3e-5, 1000, 0.0, stated=True)
    assert stated.describe() == "compute (stated): lookup 200 ns/id, dense 30.0 us/sample (1000 parameters)"

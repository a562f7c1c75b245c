"""The plugin's types on TorchRec's own model-parallel test tables: a feature feeding two tables,
weighted tables, mixed widths and mean pooling, exact against the unsharded model and stock
row_wise on 2 and 3 gloo ranks (rank bodies: :mod:`torchrec_het_testing.shared_feature_ranks`)."""

import pytest

from torchrec_het_testing.shared_feature_ranks import OPTIMIZERS, PLUGINS, POOLINGS, run_world
from torchrec_het_testing.spawn import spawn_world

TOLERANCE = 1e-4


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"shared_ws{request.param}"))


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", sorted(PLUGINS))
def test_plugin_matches_unsharded_and_row_wise(world: list[dict], kind: str, optimizer: str, pooling: str) -> None:
    for rank, results in enumerate(world):
        errors = results[f"{pooling}/{optimizer}"]
        assert errors[f"out/{kind}_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors[f"out/{kind}_vs_row_wise"] < TOLERANCE, (rank, errors)
        assert errors[f"weights/{kind}"] < TOLERANCE, (rank, errors)


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_stock_row_wise_is_the_control(world: list[dict], optimizer: str, pooling: str) -> None:
    # the harness itself: stock row_wise trains as the unsharded model on these tables
    for rank, results in enumerate(world):
        errors = results[f"{pooling}/{optimizer}"]
        assert errors["out/row_wise_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["weights/row_wise"] < TOLERANCE, (rank, errors)

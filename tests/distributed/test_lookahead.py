"""Lookahead (``ReplicationConfig(lookahead=True)``) under TorchRec's ``TrainPipelineSparseDist``: the
same losses and tables as without it, bit for bit, also when a checkpoint is loaded while a batch's
early partial sums are in flight (rank bodies: :mod:`torchrec_het_testing.lookahead_ranks`). Against
the unsharded model: tests/distributed/test_sharded_vs_unsharded.py (``lookahead_cases``)."""

import pytest

from torchrec_het_testing.lookahead_ranks import run_world
from torchrec_het_testing.spawn import spawn_world


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"lookahead_ws{request.param}"))


def test_lookahead_trains_bit_for_bit_as_without_it(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        off, on = results["off"], results["on"]
        assert on["losses"] == off["losses"] and on["pooled"] == off["pooled"], rank
        stats = on["stats"]
        assert stats["lookahead_early"] > 0 and stats["lookahead_late"] > 0 and stats["lookahead_void"] == 0, stats
        assert "lookahead_early" not in off["stats"]


def test_a_checkpoint_loaded_mid_run_voids_the_partials_in_flight_and_changes_nothing(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        reloaded, off = results["reloaded"], results["off"]
        assert reloaded["losses"] == off["losses"] and reloaded["pooled"] == off["pooled"], rank
        assert reloaded["stats"]["lookahead_void"] == 1, reloaded["stats"]

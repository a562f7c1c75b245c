"""Stale replicas keep the optimizer honest: a ReplicaBlock synced every k steps grows the Adagrad
state by the steps' squares (exactly where one rank held them, or in one step), not by the square
of their sum; between syncs a rank's copy takes its own steps at once."""

import pytest

from torchrec_het_testing.replica_held_ranks import run_world
from torchrec_het_testing.spawn import spawn_world


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"held_ws{request.param}"))


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_held_steps_grow_the_state_as_synchronous_steps(world: list[dict], optimizer: str) -> None:
    for rank, results in enumerate(world):
        r = results[optimizer]
        assert r["local_weights"] < 1e-6 and r["local_state"] < 1e-6, (rank, r)  # own steps at once, no one else's
        assert r["one_rank_state"] < 1e-5, (rank, r)  # k steps of one rank: exact
        assert r["one_step_state"] < 1e-6 and r["one_step_weights"] < 1e-6, (rank, r)  # one step: the sync step
        # rows every rank reads every step: the estimate is nearer the k steps than the square of the sum
        assert r["shared_vs_steps"] < r["square_of_sum_vs_steps"], (rank, r)

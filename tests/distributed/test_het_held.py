"""HET pushes of k held updates keep Adagrad honest: the owner's state grows as k steps would, and a
cached copy steps with the state its owner sent."""

import pytest

from torchrec_het_testing.het_held_ranks import run_world
from torchrec_het_testing.spawn import spawn_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, 2, tmp_path_factory.mktemp("het_held"))


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_a_push_of_k_held_updates_grows_the_owner_state_as_k_steps(world: list[dict], optimizer: str) -> None:
    r = world[0][optimizer]
    assert r["state_vs_steps"] < 1e-5, r
    assert r["square_of_sum_vs_steps"] > 1e-2, r  # the rule it replaces is measurably off here


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_a_cached_copy_steps_as_k_synchronous_steps_with_the_state_it_was_sent(
    world: list[dict], optimizer: str
) -> None:
    r = world[1][optimizer]
    assert r["cached_vs_steps"] < 1e-5, r  # rank 1 is the row's only writer: its local steps are the steps
    assert r["local_sgd_vs_steps"] > 0.5, r  # the local SGD step it replaces is far off under Adagrad

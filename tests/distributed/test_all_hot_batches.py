"""FAE's loader wrapper on a het_row_replicated EmbeddingBagCollection, 2 and 3 gloo ranks."""

import pytest

from torchrec_het_testing.all_hot_ranks import run_world
from torchrec_het_testing.spawn import spawn_world

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"all_hot_ws{request.param}"))


def test_windows_keep_their_samples_and_batch_sizes(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        r = results["regrouping"]
        assert r["sizes_kept"] and r["same_samples_per_window"], (rank, r)
        assert r["stats"]["windows"] == 2 and r["stats"]["batches"] == 12, (rank, r["stats"])


def test_all_hot_batches_are_agreed_and_skip_the_cold_exchange(world: list[dict]) -> None:
    counts = {results["regrouping"]["stats"]["all_hot_batches"] for results in world}
    assert len(counts) == 1 and counts.pop() > 0, [results["regrouping"]["stats"] for results in world]
    flags = [results["regrouping"]["all_read_here"] for results in world]
    agreed = [all(column) for column in zip(*flags)]  # steps at which every rank's batch is all-hot
    for rank, results in enumerate(world):
        r = results["regrouping"]
        assert sum(agreed) >= r["stats"]["all_hot_batches"], (rank, flags, r["stats"])
        assert r["replication"]["skipped_steps"] == sum(agreed), (rank, r["replication"], flags)
        assert r["replication"]["steps"] == 12


def test_training_on_regrouped_batches_stays_exact(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        errors = results["regrouping"]["errors"]
        assert errors["out_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        for key, value in errors.items():
            if key.startswith("weights_"):
                assert value < TOLERANCE, (rank, key, errors)


def test_ranks_with_different_batch_counts_get_a_clear_error(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        assert "different numbers of batches" in results["uneven"], (rank, results["uneven"])

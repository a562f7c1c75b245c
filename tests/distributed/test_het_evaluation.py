"""Evaluation forwards of ``het_cached_row_wise`` tables (the module in ``eval()`` mode) read under the
cache's bounds but advance no clock and admit no row: training with evaluations mid-run is bitwise
the training without them, in a plain loop and under ``TrainPipelineSparseDist``, read in the lookup
and fetched ahead (rank bodies: :mod:`torchrec_het_testing.het_eval_ranks`)."""

import pytest

from torchrec_het_testing.het_eval_ranks import EVALUATE_AFTER, run_world
from torchrec_het_testing.spawn import spawn_world

RUNS = [f"{reads}/{loop}" for reads in ("in_lookup", "ahead") for loop in ("plain", "pipeline")]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, 2, tmp_path_factory.mktemp("het_evaluation"))


@pytest.mark.parametrize("run", RUNS)
def test_evaluations_mid_run_leave_training_unchanged(world: list[dict], run: str) -> None:
    for rank, results in enumerate(world):
        r = results[run]
        assert r["ahead"] == run.startswith("ahead"), (rank, r)
        assert r["evaluations"] == 2 * len(EVALUATE_AFTER) and r["eval_losses_finite"], (rank, r)
        assert r["changed_by_evaluation"] == [], (rank, r)  # no slot, pin, version or clock moved
        assert r["differ"] == [], (rank, r)  # caches, versions and shards bitwise as without evaluations
    # the evaluations read rows the caches lacked (or held too stale): they had rows to admit
    assert sum(results[run]["eval_fetched"] for results in world) > 0, [results[run] for results in world]

"""het_row_replicated's per-host tier on 4 ranks as 2 hosts x 2, bags and sequences, under every pipeline:
exact against the unsharded module (plain loop, TrainPipelineSparseDist) and against stock row_wise
under the hybrid pipeline at k = 2; every copy of a row agrees with its owner's."""

import pytest

from torchrec_het_testing.per_host_pipeline_ranks import run_world
from torchrec_het_testing.spawn import spawn_world

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, 4, tmp_path_factory.mktemp("per_host"))


def _copies_agree_and_some_are_held_away(world: list[dict], case: str) -> None:
    for rank, results in enumerate(world):
        assert results[case]["replica_disagreement"] == 0.0, (rank, case, results[case])
    assert sum(results[case]["per_host_held"] for results in world) > 0, case  # rows held away from their owners


@pytest.mark.parametrize(
    "case", ["bags/unweighted/sparse_dist", "bags/weighted/sparse_dist", "sequences/plain", "sequences/sparse_dist"]
)
def test_matches_the_unsharded_module(world: list[dict], case: str) -> None:
    for rank, results in enumerate(world):
        r = results[case]
        for what in ("loss", "weights"):
            drift = r[f"{what}/row_wise"]  # stock row_wise's own distance from exact
            assert drift < 1e-4, (rank, case, what, r)
            assert r[f"{what}/replicated"] <= max(TOLERANCE, drift + TOLERANCE), (rank, case, what, r)
        assert r["replica_disagreement"] == 0.0, (rank, case, r)
    if case.startswith("sequences"):
        _copies_agree_and_some_are_held_away(world, case)
        assert all(results[case]["stats"]["host_syncs"] > 0 for results in world), case


@pytest.mark.parametrize("case", ["bags/hybrid_k2", "sequences/hybrid_k2"])
def test_hybrid_k2_trains_as_row_wise(world: list[dict], case: str) -> None:
    for rank, results in enumerate(world):
        r = results[case]
        assert r["weights/replicated_vs_row_wise"] <= TOLERANCE, (rank, case, r)
        assert r["loss/replicated_vs_row_wise"] <= 1e-4, (rank, case, r)
        assert r["stats"]["host_syncs"] > 0, (rank, case, r["stats"])
    _copies_agree_and_some_are_held_away(world, case)

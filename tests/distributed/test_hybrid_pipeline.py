"""The hybrid pipeline (Persia): k >= 1 keeps its staleness bound and loses no gradient, on 2 and 3
gloo ranks, over stock and plugin sharding types; where the embedding backward runs changes no
weight; bad settings. k = 0 training as the unsharded model, and replicas synced every step
training as stock row_wise under every k: tests/distributed/test_sharded_vs_unsharded.py."""

import pytest

from torchrec_het_testing.hybrid_ranks import run_world
from torchrec_het_testing.spawn import spawn_world


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"hybrid_ws{request.param}"))


def test_staleness_stays_within_k_and_reaches_it(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        for case, r in results["stale"].items():
            if r["gauge"] is None:
                continue
            k = int(case.split("/k")[1])
            assert r["gauge"]["max"] == k, (rank, case, r["gauge"])
            assert r["finite"], (rank, case, r)


def test_gradient_mass_is_conserved_through_the_drain(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        assert {c.split("/")[0] for c in results["stale"]} == {"table_wise", "row_wise", "het", "replicated"}
        for case, r in results["stale"].items():
            assert r["batches"] == 7, (rank, case, r)  # every batch trained
            assert r["mass_error"] <= 1e-4, (rank, case, r)


def test_bad_settings_raise_clear_errors(world: list[dict]) -> None:
    errors = world[0]["errors"]
    for bad in ("k=-1", "k=1.5", "k=True"):
        assert "embedding_staleness must be an int >= 0" in errors[bad], errors
    assert "no sharded embedding module" in errors["no_embeddings"], errors
    assert "backward_on_worker must be True, False or None" in errors["backward_on_worker"], errors


def test_where_the_embedding_backward_runs_changes_no_weight_and_the_measured_choice_is_agreed(
    world: list[dict],
) -> None:
    for kind in ("row_wise", "het"):
        chosen = {results["placement"][kind]["chosen"] for results in world}
        assert len(chosen) == 1 and chosen <= {True, False}, (kind, chosen)  # one choice, every rank
        for rank, results in enumerate(world):
            r = results["placement"][kind]
            assert r["inline_vs_worker"] <= 1e-6 and r["measured_vs_worker"] <= 1e-6, (rank, kind, r)

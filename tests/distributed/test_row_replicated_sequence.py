"""het_row_replicated for EmbeddingCollection beyond exactness, which
tests/distributed/test_sharded_vs_unsharded.py checks: held replica gradients, bad batches and
settings, tiers carried by the modules (rank bodies: :mod:`torchrec_het_testing.replicated_sequence_ranks`)."""

import pytest

from torchrec_het_testing.replicated_sequence_ranks import run_world
from torchrec_het_testing.spawn import spawn_world

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"rep_seq_ws{request.param}"))


def test_held_replica_gradients_are_applied_whole_at_flush(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        held = results["held"]
        assert held["held_rows"] > 0, (rank, held)
        assert held["moved_beyond_own_steps"] < TOLERANCE, (rank, held)
        assert held["flushed_vs_sum"] < TOLERANCE, (rank, held)
        assert held["replica_disagreement"] == 0.0, (rank, held)


def test_bad_batches_raise_naming_the_feature_and_leave_weights_unchanged(world: list[dict]) -> None:
    for results in world:
        messages = results["bad_input"]
        assert "'f3'" in messages["bad_id"] and "101" in messages["bad_id"], messages
        assert "'f9'" in messages["unknown_feature"], messages
        assert messages["unchanged"] is True, messages
        assert messages["replica_disagreement"] == 0.0, messages


def test_bad_tier_plans_and_plans_raise_naming_the_table(world: list[dict]) -> None:
    for messages in (results["bad_input"] for results in world):
        for how in ("module", "sharder"):
            assert "'t0'" in messages[f"wrong_rows/{how}"] and "49" in messages[f"wrong_rows/{how}"], messages
        assert "'t1'" in messages["dense_kernel"] and "fused" in messages["dense_kernel"], messages


def test_tiers_carried_by_the_modules_train_as_tiers_given_to_the_sharder(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        r = results["carried"]
        assert r["difference"] == 0.0 and r["trained"] > 1e-3, (rank, r)
        assert all(syncs >= 5 for syncs in r["syncs"]), (rank, r)  # replicated rows synced every step

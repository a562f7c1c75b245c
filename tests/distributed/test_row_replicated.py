"""het_row_replicated (bags) beyond exactness, which tests/distributed/test_sharded_vs_unsharded.py
checks: hot rows chosen online, held replica gradients, bad tier plans and batches, tiers carried
by the module, checkpoints across world sizes (rank bodies: :mod:`torchrec_het_testing.replicated_ranks`)."""

from pathlib import Path

import pytest

from torchrec_het_testing.replicated_ranks import run_load, run_save, run_world
from torchrec_het_testing.spawn import spawn_world

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"rep_ws{request.param}"))


def test_online_profile_replicates_the_rows_all_ranks_counted_once(world: list[dict]) -> None:
    hot_sets = {str(results["online"]["hot_rows"]) for results in world}
    assert len(hot_sets) == 1, "every rank must choose the same hot rows"
    for rank, results in enumerate(world):
        online = results["online"]
        hot = online["hot_after_step"]
        assert hot[:3] == [0, 0, 0] and hot[3] > 0 and len(set(hot[3:])) == 1, (rank, hot)  # chosen once, at step 4
        assert online["stats"]["online_hot_rows"] == hot[3], (rank, online["stats"])
        assert online["replica_disagreement"] == 0.0, (rank, online)


def test_online_profile_does_not_count_evaluation_batches(world: list[dict]) -> None:
    """An evaluation forward before every training step changes neither when the hot rows are
    chosen nor which (the batches evaluated read other rows)."""
    for rank, results in enumerate(world):
        plain, evaluated = results["online"], results["online_evaluated"]
        assert evaluated["hot_after_step"] == plain["hot_after_step"], (rank, evaluated, plain)
        assert evaluated["hot_rows"] == plain["hot_rows"], rank
        assert evaluated["replica_disagreement"] == 0.0, (rank, evaluated)


@pytest.mark.parametrize("case,sync", [("held", "sparse_syncs"), ("held_sparse", "sparse_syncs")])
def test_held_replica_gradients_are_applied_whole_at_flush(world: list[dict], case: str, sync: str) -> None:
    for rank, results in enumerate(world):
        held = results[case]
        assert held["stats"][sync] > 0, (rank, held["stats"])
        assert held["held_rows"] > 0, (rank, held)
        assert held["moved_beyond_own_steps"] < TOLERANCE, (rank, held)
        assert held["flushed_vs_sum"] < TOLERANCE, (rank, held)
        assert held["replica_disagreement"] == 0.0, (rank, held)


def test_bad_tier_plans_and_batches_raise_naming_the_table_or_feature(world: list[dict]) -> None:
    for results in world:
        messages = results["bad_input"]
        for how in ("module", "sharder"):
            assert "'t1'" in messages[f"wrong_rows/{how}"] and "36" in messages[f"wrong_rows/{how}"], messages
            assert "'t9'" in messages[f"unknown_table/{how}"], messages
            assert "'t2'" in messages[f"row_outside/{how}"], messages
        assert "'f3'" in messages["bad_id"] and "101" in messages["bad_id"], messages
        assert messages["unchanged"] is True, messages
        assert messages["replica_disagreement"] == 0.0, messages


def test_tiers_carried_by_the_module_train_as_tiers_given_to_the_sharder(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        r = results["carried"]
        assert r["difference"] == 0.0 and r["trained"] > 1e-3, (rank, r)
        assert all(syncs >= 5 for syncs in r["syncs"]), (rank, r)  # replicated rows synced every step


@pytest.mark.parametrize("saved_world,loaded_world", [(2, 3), (3, 2)])
def test_checkpoint_holds_each_table_once_and_loads_into_another_world_size(tmp_path, saved_world, loaded_world):
    spawn_world(run_save, saved_world, tmp_path)
    Path(tmp_path, "saved_world").write_text(str(saved_world))
    world = spawn_world(run_load, loaded_world, tmp_path)
    for rank, errors in enumerate(world):
        assert errors["loaded_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["out_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["replica_disagreement"] == 0.0, (rank, errors)
        # one entry per table, of the table's full size: replicas are not exported
        assert errors["state_rows"] == {
            "embedding_bags.t0.weight": [50, 8],
            "embedding_bags.t1.weight": [37, 4],
            "embedding_bags.t2.weight": [101, 8],
        }, errors["state_rows"]

"""het_row_replicated trains like the unsharded model and stock row_wise, with and without hot rows."""

import pytest

from torchrec_het_testing.het_ranks import OPTIMIZERS
from torchrec_het_testing.replicated_ranks import run_world
from torchrec_het_testing.spawn import spawn_world

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"rep_ws{request.param}"))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("hot", [0, 8], ids=["no_hot_rows", "hot_rows"])
def test_matches_unsharded_and_row_wise(world: list[dict], optimizer: str, weighted: bool, hot: int) -> None:
    case = f"{optimizer}/{'weighted' if weighted else 'unweighted'}/hot{hot}"
    for rank, results in enumerate(world):
        errors = results[case]
        for pooling in ["sum"] if weighted else ["sum", "mean"]:
            assert errors[f"out_rep_vs_unsharded/{pooling}"] < TOLERANCE, (rank, pooling, errors)
            assert errors[f"weights_rep_vs_unsharded/{pooling}"] < TOLERANCE, (rank, pooling, errors)
            drift = errors[f"out_row_wise_vs_unsharded/{pooling}"]  # stock row_wise's own distance from exact
            assert errors[f"out_rep_vs_row_wise/{pooling}"] <= drift + TOLERANCE, (rank, pooling, errors)
        assert errors["replica_disagreement"] == 0.0, (rank, errors)
        stats = errors["stats"]
        if hot:  # replicated rows were combined every step, sparse or dense
            assert stats["sparse_syncs"] + stats["dense_syncs"] >= 5, (rank, stats)
        else:
            assert stats["sparse_syncs"] + stats["dense_syncs"] == 0, (rank, stats)


def test_per_host_tier_on_one_host_reads_from_owners_and_stays_exact(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        errors = results["per_host/one_host"]
        assert errors["out_rep_vs_unsharded/sum"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded/sum"] < TOLERANCE, (rank, errors)
        assert errors["replica_disagreement"] == 0.0, (rank, errors)
        assert errors["stats"]["sparse_syncs"] + errors["stats"]["dense_syncs"] >= 5, (rank, errors["stats"])


def test_all_hot_steps_skip_the_cold_exchange_and_stay_exact(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        errors = results["all_hot"]
        assert errors["stats"]["skipped_steps"] == errors["stats"]["steps"] == 5, (rank, errors)
        assert errors["out_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded/sum"] < TOLERANCE, (rank, errors)
        off = results["all_hot/not_skipped"]  # skip_all_hot=False: the exchanges run, with nothing in them
        assert off["stats"]["skipped_steps"] == 0 and off["stats"]["steps"] == 5, (rank, off)
        assert off["out_rep_vs_unsharded"] < TOLERANCE and off["weights_rep_vs_unsharded/sum"] < TOLERANCE, (rank, off)


def test_online_profile_replicates_the_rows_all_ranks_counted_and_stays_exact(world: list[dict]) -> None:
    hot_sets = {str(results["online"]["hot_rows"]) for results in world}
    assert len(hot_sets) == 1, "every rank must choose the same hot rows"
    for rank, results in enumerate(world):
        online = results["online"]
        hot = online["hot_after_step"]
        assert hot[:3] == [0, 0, 0] and hot[3] > 0 and len(set(hot[3:])) == 1, (rank, hot)  # chosen once, at step 4
        assert online["stats"]["online_hot_rows"] == hot[3], (rank, online["stats"])
        assert online["out_vs_unsharded"] < TOLERANCE and online["weights_vs_unsharded"] < TOLERANCE, (rank, online)
        assert online["replica_disagreement"] == 0.0, (rank, online)


def test_online_profile_does_not_count_evaluation_batches(world: list[dict]) -> None:
    """An evaluation forward before every training step changes neither when the hot rows are
    chosen nor which (the batches evaluated read other rows), and training stays exact."""
    for rank, results in enumerate(world):
        plain, evaluated = results["online"], results["online_evaluated"]
        assert evaluated["hot_after_step"] == plain["hot_after_step"], (rank, evaluated, plain)
        assert evaluated["hot_rows"] == plain["hot_rows"], rank
        assert evaluated["out_vs_unsharded"] < TOLERANCE and evaluated["weights_vs_unsharded"] < TOLERANCE, (rank, evaluated)
        assert evaluated["replica_disagreement"] == 0.0, (rank, evaluated)


def test_bf16_wire_halves_cold_bytes_and_keeps_replicas_identical(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        wire = results["wire"]
        assert wire["out_vs_unsharded/fp32"] < TOLERANCE and wire["weights_vs_unsharded/fp32"] < TOLERANCE, (rank, wire)
        assert wire["out_vs_unsharded/bf16"] < 2e-2 and wire["weights_vs_unsharded/bf16"] < 2e-2, (rank, wire)
        assert wire["out_vs_unsharded/bf16"] > 0  # values really were rounded on the wire
        assert wire["replica_disagreement/bf16"] == 0.0, (rank, wire)
        assert wire["a2a_bytes/bf16"] < 0.8 * wire["a2a_bytes/fp32"], (rank, wire)


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
    for rank, results in enumerate(world):
        messages = results["bad_input"]
        for how in ("module", "sharder"):
            assert "'t1'" in messages[f"wrong_rows/{how}"] and "36" in messages[f"wrong_rows/{how}"], messages
            assert "'t9'" in messages[f"unknown_table/{how}"], messages
            assert "'t2'" in messages[f"row_outside/{how}"], messages
        assert "'f3'" in messages["bad_id"] and "101" in messages["bad_id"], messages
        assert messages["unchanged"] is True, messages
        assert messages["replica_disagreement"] == 0.0, messages

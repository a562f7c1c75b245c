"""het_row_replicated for EmbeddingCollection trains like the unsharded EC and stock row_wise, with and without hot rows."""

import pytest

from torchrec_het_testing.het_ranks import OPTIMIZERS
from torchrec_het_testing.replicated_sequence_ranks import run_world
from torchrec_het_testing.spawn import spawn_world

TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"rep_seq_ws{request.param}"))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_without_hot_rows_matches_row_wise_and_unsharded(world: list[dict], optimizer: str) -> None:
    for rank, errors in enumerate(world):
        errors = errors[f"{optimizer}/hot0"]
        assert errors["out_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        drift = errors["out_row_wise_vs_unsharded"]  # stock row_wise's own distance from exact
        assert errors["out_rep_vs_row_wise"] <= drift + TOLERANCE, (rank, errors)
        assert errors["stats"]["sparse_syncs"] + errors["stats"]["dense_syncs"] == 0, (rank, errors)
        # every distinct remote row crosses the wire once per step, not once per position
        assert errors["fetched"] == errors["distinct_remote"], (rank, errors)


@pytest.mark.parametrize("case", [f"{o}/hot8" for o in sorted(OPTIMIZERS)])
def test_with_hot_rows_matches_unsharded_and_replicas_agree(world: list[dict], case: str) -> None:
    for rank, errors in enumerate(world):
        errors = errors[case]
        assert errors["out_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["replica_disagreement"] == 0.0, (rank, errors)
        stats = errors["stats"]
        assert stats["sparse_syncs"] + stats["dense_syncs"] >= 5, (rank, stats)  # replicated rows combined every step
        assert errors["fetched"] <= errors["distinct_remote"], (rank, errors)  # held rows are read locally
    assert sum(r[case]["fetched"] for r in world) < sum(r[case]["distinct_remote"] for r in world)
    assert sum(r[case]["per_host_held"] for r in world) > 0  # one rank per host: held away from their owners


@pytest.mark.parametrize("case", [f"{o}/replicated8" for o in sorted(OPTIMIZERS)])
def test_the_pipelined_lookup_matches_unsharded_and_replicas_agree(world: list[dict], case: str) -> None:
    for rank, errors in enumerate(world):
        errors = errors[case]
        assert errors["out_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["replica_disagreement"] == 0.0, (rank, errors)
        assert errors["stats"]["sparse_syncs"] >= 5, (rank, errors["stats"])  # replicated rows combined every step
        assert errors["fetched"] <= errors["distinct_remote"], (rank, errors)  # replicated rows are read locally
    assert sum(r[case]["fetched"] for r in world) < sum(r[case]["distinct_remote"] for r in world)


def test_a_stock_row_wise_table_in_the_same_ec_trains_exactly_too(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        errors = results["mixed"]
        assert errors["sharding_types"] == ["het_row_replicated", "row_wise"], errors
        assert errors["out_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["replica_disagreement"] == 0.0, (rank, errors)


def test_all_hot_steps_skip_the_cold_exchange_and_stay_exact(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        errors = results["all_hot"]
        assert errors["stats"]["skipped_steps"] == errors["stats"]["steps"] == 10, (rank, errors)  # 2 ECs x 5 steps
        assert errors["stats"]["rows_fetched"] == 0, (rank, errors)
        assert errors["out_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["replica_disagreement"] == 0.0, (rank, errors)


def test_held_replica_gradients_are_applied_whole_at_flush(world: list[dict]) -> None:
    for rank, results in enumerate(world):
        held = results["held"]
        assert held["held_rows"] > 0, (rank, held)
        assert held["moved_beyond_own_steps"] < TOLERANCE, (rank, held)
        assert held["flushed_vs_sum"] < TOLERANCE, (rank, held)
        assert held["replica_disagreement"] == 0.0, (rank, held)


def test_bad_batches_raise_naming_the_feature_and_leave_weights_unchanged(world: list[dict]) -> None:
    for rank, results in enumerate(world):
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

"""Issue 19's "Failures that mislead", the cases that need ranks (2 gloo ranks, one process group;
rank bodies: :mod:`torchrec_het_testing.failure_ranks`): each works as TorchRec does, or fails at
once with one message naming the feature or table, what is unsupported and what to do."""

import pytest

from torchrec_het_testing.failure_ranks import run_world
from torchrec_het_testing.spawn import spawn_world

EXACT = 1e-5


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, 2, tmp_path_factory.mktemp("failures"))


def test_modules_sharing_one_batch_ignore_each_others_keys_and_train_as_stock(world) -> None:
    for rank, results in enumerate(world):
        r = results["shared_batch"]["sparse_dist"]
        assert r["trained"] > 1e-3 and r["plugin_trained"] > 1e-3 and r["finite"], (rank, r)  # both did train
        assert r["losses"] <= EXACT and r["weights"] <= EXACT, (rank, r)


def test_the_hybrid_pipeline_takes_modules_sharing_one_batch(world) -> None:
    for rank, results in enumerate(world):
        r = results["shared_batch"]["hybrid_k2"]
        assert r["plugin_trained"] > 1e-3 and r["finite"] and r["gauge_max"] == 2, (rank, r)


def test_stats_by_table_are_plain_numbers_per_plugin_table(world) -> None:
    for results in world:
        stats = results["shared_batch"]["stats"]
        assert isinstance(stats, dict), stats  # a repr: something in it was not a plain number
        assert set(stats) == {"t_user", "t_item"}, stats
        user, item = stats["t_user"], stats["t_item"]
        assert (user["module"], user["sharding_type"]) == ("ebc", "het_cached_row_wise"), user
        assert (item["module"], item["sharding_type"]) == ("ec", "het_row_replicated"), item
        cache = user["cache"]
        assert cache["lookups"] > 0 and 0 <= cache["hit_rate_lookups"] <= 1, cache
        assert len(cache["grad_produced"]) == 8 and all(isinstance(x, float) for x in cache["grad_produced"]), cache
        assert item["replication"]["steps"] > 0, item


def test_a_variable_batch_per_feature_is_refused_naming_the_feature_table_and_type(world) -> None:
    for rank, results in enumerate(world):
        r = results["variable_batch"]
        assert r["row_wise"] == {"trained": [8, 16]}, (rank, r)  # stock takes the VBE batch
        message = r["het_cached_row_wise"]["error"]
        for needed in (
            "['item']",
            "VBE",
            "stride_per_key_per_rank",
            "table 't_item' (het_cached_row_wise)",
            "row_wise",
        ):
            assert needed in message, (rank, needed, message)


def test_hybrid_pipeline_with_a_feature_processor_trains_and_k0_is_sparse_dist(world) -> None:
    for rank, results in enumerate(world):
        r = results["feature_processor"]
        assert r["sparse_dist"]["positions_moved"] > 1e-4, (rank, r)  # the position weights do train
        k0 = r["hybrid_k0"]
        assert k0["positions_vs_sparse_dist"] <= 1e-6 and k0["tables_vs_sparse_dist"] <= 1e-6, (rank, k0)
        assert k0["losses_vs_sparse_dist"] <= EXACT, (rank, k0)
        default = r["hybrid_default"]
        assert r["default_k"] == 1 and r["default_on_worker"] is False, (rank, r)
        assert default["finite"] and default["positions_moved"] > 1e-4 and default["positions_equal_on_ranks"], (
            rank,
            default,
        )

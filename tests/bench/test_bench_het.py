"""A 2-rank smoke run of HET's configurations beside stock row_wise: an exact cache (the fetched-rows
tier) and a bounded one both report HET's counters in results.json."""

import pytest

from torchrec_het_testing.bench_runs import run_smoke_bench

RUN = ["stock_row_wise", "het_het_s0_c1", "het_het_s10_c1"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    data, _ = run_smoke_bench(tmp_path_factory.mktemp("bench_het"), RUN)
    return {c["name"]: c for c in data["configs"]}


def test_an_exact_cache_fetches_every_remote_row_and_trains_as_stock(results: dict) -> None:
    exact, stock = results["het_het_s0_c1"], results["stock_row_wise"]
    assert exact["sharding_types"] == ["het_cached_row_wise"]
    cache = exact["cache"]
    assert cache["hit_rate_unique"] == 0.0 and cache["max_staleness"] == 0  # nothing held
    steps = cache["per_step"]
    assert steps["rows_fetched"] > 0 and steps["requests"] == steps["rows_fetched"], steps
    assert 0 < steps["rows_pushed"] <= steps["rows_fetched"], steps  # the rows read in training go back
    assert exact["loss"] == pytest.approx(stock["loss"], rel=1e-3)  # exact: the same training, float sums reordered
    moved = (c["bytes_per_step"]["embedding_cross_rank"] for c in (exact, stock))
    assert next(moved) < next(moved)


def test_a_bounded_cache_hits_within_its_bounds(results: dict) -> None:
    cache = results["het_het_s10_c1"]["cache"]
    assert 0.0 < cache["hit_rate_unique"] <= 1.0 and 0 <= cache["max_staleness"] <= 10, cache
    assert cache["ideal_lru_hit_rate_unique"] > 0.0, cache

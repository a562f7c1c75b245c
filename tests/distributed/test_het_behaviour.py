"""What het_cached_row_wise promises, observed on 2 and 3 gloo ranks (one spawned world per size).

Read bounds (the harness's ``ServeRecorder`` wrapped around each lookup's settle step, against the
all-gathered owner versions) and write bounds, no gradient lost at ``flush_cache()`` or
``state_dict()``, ``s_write`` holding gradients back until the flush, malformed
batches rejected before anything changes, and the checkpoint round trip. The rank
bodies are in :mod:`torchrec_het_testing.het_behaviour_ranks`.
"""

import numpy as np
import pytest

from torchrec_het_testing.het_behaviour_ranks import (
    BAD_FEATURES,
    BOUND_CASES,
    BOUND_STEPS,
    LR,
    PRESSURE_ROWS,
    case_name,
    run_world,
)
from torchrec_het_testing.spawn import spawn_world

CASES = {case_name(settings): settings for settings in BOUND_CASES}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, request.param, tmp_path_factory.mktemp(f"het_behaviour_ws{request.param}"))


def _observed(world: list[dict], check: str) -> list[dict]:
    """Every rank's observation of ``check``; fails with a rank's traceback if the check raised."""
    for rank, results in enumerate(world):
        if "error" in results[check]:
            pytest.fail(f"rank {rank} of {len(world)}, check {check}:\n{results[check]['error']}")
    return [results[check] for results in world]


def _case_tables(ranks: list[dict], case: str) -> list[dict]:
    """Per rank and table of the case, the recorded serving and cache counters."""
    return [r["tables"][f"{case}_{t}"] for r in ranks for t in ("a", "b")]


# --- 1. read bounds ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_read_bound_is_never_exceeded(world: list[dict], case: str) -> None:
    settings = CASES[case]
    records = _case_tables(_observed(world, "bounds"), case)
    for record in records:
        assert record["wrong_step"] == 0, record  # the settle step served the forward's step
        assert record["not_remote"] == 0, record  # only rows owned elsewhere are served from the cache
        assert record["min_lag"] >= 0, record  # a cached copy is never ahead of its owner
        assert record["min_age"] >= 0, record
        assert record["max_pending"] <= settings.s_write, record  # the write bound
        if settings.protocol == "het":
            assert record["max_lag"] <= settings.s_read, record
        else:
            assert record["max_age"] <= settings.s_read, record
    # the bound was approached: copies that are actually stale (het) or actually leased (lease) were served
    if settings.protocol == "het":
        assert max(r["max_lag"] for r in records) >= 1, records
    else:
        assert max(r["max_age"] for r in records) >= 1, records


@pytest.mark.parametrize("case", sorted(CASES))
def test_cache_is_exercised(world: list[dict], case: str) -> None:
    settings = CASES[case]
    records = _case_tables(_observed(world, "bounds"), case)
    for record in records:
        assert record["calls"] == BOUND_STEPS, record  # every forward settled once per table
        assert record["served"] == record["hits_unique"], record  # the recorder sees every hit, nothing else
    assert sum(r["served"] for r in records) > 0, records
    if settings.capacity == PRESSURE_ROWS:
        for record in records:
            assert record["max_remote_ids"] > PRESSURE_ROWS, record  # batches do not fit in the cache
        assert sum(r["evictions"] for r in records) > 0, records
        if settings.s_write > 0:
            assert sum(r["dirty_evictions"] for r in records) > 0, records
    else:
        assert sum(r["evictions"] for r in records) == 0, records  # every remote row has a slot
    if settings.s_write == 0:
        assert sum(r["dirty_evictions"] for r in records) == 0, records  # nothing is ever pending
    else:
        assert max(r["max_pending"] for r in records) == settings.s_write, records  # held back up to the bound


# --- 2. nothing lost ----------------------------------------------------------------------------


def _sum_over_ranks(ranks: list[dict], stage: str, table: str, key: str) -> np.ndarray:
    return np.sum([r[stage][table][key] for r in ranks], axis=0)


def _scale(ranks: list[dict], stage: str, table: str) -> float:
    return max(np.abs(r[stage][table]["produced"]).max() for r in ranks) + 1e-12


def _assert_mass_conserved(ranks: list[dict], stage: str) -> None:
    for table in ranks[0][stage]:
        produced = _sum_over_ranks(ranks, stage, table, "produced")
        applied = _sum_over_ranks(ranks, stage, table, "applied")
        moved = _sum_over_ranks(ranks, stage, table, "moved")
        scale = _scale(ranks, stage, table)
        np.testing.assert_allclose(applied, produced, rtol=1e-5, atol=1e-6 * scale, err_msg=f"{stage} {table}")
        # SGD: the owners' weights moved by -lr times the gradient mass they applied (float32 weights:
        # ~1e-7 absolute; one lost row gradient would be ~LR = 2e-3)
        np.testing.assert_allclose(moved, -LR * applied, rtol=1e-4, atol=1e-6, err_msg=f"{stage} {table}")


def test_flush_cache_loses_no_gradient(world: list[dict]) -> None:
    ranks = _observed(world, "nothing_lost")
    assert sum(r["dirty_evictions"] for r in ranks) > 0  # the eviction path carried gradients too
    assert all(r["pending_after_flush"] == 0 for r in ranks)
    _assert_mass_conserved(ranks, "flushed")


def test_state_dict_flushes_pending_gradients(world: list[dict]) -> None:
    ranks = _observed(world, "nothing_lost")
    assert sum(r["pending_before_state_dict"] for r in ranks) > 0
    balanced = [
        np.allclose(*(_sum_over_ranks(ranks, "unflushed", table, key) for key in ("produced", "applied")))
        for table in ranks[0]["unflushed"]
    ]
    assert not all(balanced)  # gradients were held back before state_dict()
    assert all(r["pending_after_state_dict"] == 0 for r in ranks)
    _assert_mass_conserved(ranks, "state_dict")


def test_an_exact_cache_is_the_fetched_rows_tier_and_counts_as_hets_cache(world: list[dict]) -> None:
    ranks = _observed(world, "exact_counters")
    for r in ranks:
        assert r["lookups"] == ["CachedTierBagLookup"], r["lookups"]
        for table, want in r["expected"].items():
            got = r["stats"][table]
            assert {k: got[k] for k in want} == want, (table, got, want)
            # every distinct remote row is asked and fetched once a step, its gradient sent back;
            # nothing is held, so nothing hits, is evicted or is served stale
            assert got["requests"] == got["rows_fetched"] == got["rows_pushed"] == want["remote_unique"] > 0, got
            assert got["hits_unique"] == got["hits_lookups"] == got["evictions"] == got["dirty_evictions"] == 0, got
            assert sum(got["staleness"]) == 0, got
    _assert_mass_conserved(ranks, "mass")


# --- 3. s_write ------------------------------------------------------------------------------------


def test_large_s_write_holds_gradients_back_until_the_flush(world: list[dict]) -> None:
    for rank, observed in enumerate(_observed(world, "write_bound")):
        assert observed["pushed_before_flush"] == 0, (rank, observed)
        assert observed["evictions"] == 0, (rank, observed)
        assert observed["owned_cached"] == 0, (rank, observed)
        assert observed["untouched_moved"] == 0.0, (rank, observed)  # rows only others read: not moved yet
        assert observed["held_rows"] > 0, (rank, observed)
        assert observed["flush_scale"] > 1e-3, (rank, observed)
        # after the flush: before - LR * (sum of the gradients every other rank held back)
        assert observed["flush_error"] <= 1e-5 * observed["flush_scale"], (rank, observed)
        assert observed["version_errors"] == 0, (rank, observed)  # a version counts every update


# --- 4. bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(BAD_FEATURES))
def test_bad_input_raises_naming_the_feature_and_changes_nothing(world: list[dict], case: str) -> None:
    for rank, observed in enumerate(_observed(world, "bad_input")):
        assert observed["pending"] > 0 and observed["cache_rows"] > 0, (rank, observed)  # state worth keeping
        result = observed[case]
        assert result["raised"] == "ValueError", (rank, result)
        assert repr(BAD_FEATURES[case]) in result["message"], (rank, result)
        assert result["changed"] == [], (rank, result)


def test_model_trains_after_bad_input(world: list[dict]) -> None:
    for rank, observed in enumerate(_observed(world, "bad_input")):
        assert np.isfinite(observed["after"]) and observed["after"] > 0, (rank, observed)


# --- 5. checkpoint --------------------------------------------------------------------------------


def test_checkpoint_round_trip(world: list[dict]) -> None:
    for rank, observed in enumerate(_observed(world, "checkpoint")):
        before, saved = observed["a_before_save"], observed["a_after_save"]
        assert before["cache_rows"] > 0 and before["pending"] > 0, (rank, observed)
        assert saved["pending"] == 0, (rank, observed)  # state_dict() flushed
        assert observed["saved_vs_initial"] > 0, (rank, observed)
        b = observed["b_before_load"]
        assert b["cache_rows"] > 0 and b["versions_nonzero"] > 0, (rank, observed)  # B had trained
        for key in ("b_after_load", "a_after_load"):
            assert observed[key] == {"cache_rows": 0, "versions_nonzero": 0, "pending": 0}, (rank, key, observed)
        assert observed["b_weights_err"] == 0.0, (rank, observed)
        assert observed["a_weights_err"] == 0.0, (rank, observed)
        # A (reloaded from itself) and B (loaded from A) then train identically
        assert observed["continued_out_err"] < 1e-6, (rank, observed)
        assert observed["continued_weights_err"] < 1e-6, (rank, observed)

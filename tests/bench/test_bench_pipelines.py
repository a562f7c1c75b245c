"""A 2-rank smoke run of the benchmark under three pipelines side by side.

``--pipeline sparse_dist,hybrid,semi_sync`` trains stock table_wise and a HET-cache
configuration under each pipeline, evaluating held-out AUC every 5 steps. TorchRec's
semi-sync cannot train a model with ``het_cached_row_wise`` tables: that entry is reported as
not run, with the reason (the hybrid pipeline trains it, its gauge within k). A
second run trains stock table_wise under hybrid and semi-sync without evaluating mid-run:
the same losses show the evaluations (with the pipelines' batches in flight) change nothing.
"""

import re

import pytest

from torchrec_het_bench.report import markdown_table
from torchrec_het_testing.bench_runs import run_smoke_bench

PIPELINES = ["sparse_dist", "hybrid", "semi_sync"]
LABELS = ["sparse_dist", "hybrid_k2", "semi_sync"]
CONFIGS = ["stock_table_wise", "het_het_s2_c1"]
EVAL_EVERY = 5  # smoke: 3 warm-up steps and 3 rounds of 5: 18 steps


def _bench(out, configs: list[str], *extra: str) -> tuple[dict, str]:
    results, run = run_smoke_bench(out, configs, *extra)
    return results, run.stdout


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory) -> tuple[dict, str, object]:
    out = tmp_path_factory.mktemp("bench_pipelines")
    results, stdout = _bench(out, CONFIGS, "--pipeline", ",".join(PIPELINES), "--eval-every", str(EVAL_EVERY))
    return results, stdout, out


def test_every_configuration_is_an_entry_under_every_pipeline(side_by_side) -> None:
    results, stdout, out = side_by_side
    assert results["pipeline"] == "sparse_dist,hybrid,semi_sync" and results["pipelines"] == LABELS
    assert results["embedding_staleness"] == 2 and results["eval_every"] == EVAL_EVERY
    entries = results["configs"]
    # Configuration by configuration, each under every pipeline, in the order given.
    assert [e["name"] for e in entries] == [f"{c}@{label}" for c in CONFIGS for label in LABELS]
    for e in entries:
        config, label = e["name"].split("@")
        pipeline = PIPELINES[LABELS.index(label)]
        k = {"sparse_dist": 0, "hybrid": 2, "semi_sync": 1}[pipeline]
        assert (e["config"], e["pipeline"], e["pipeline_label"], e["embedding_staleness"]) == (
            config,
            pipeline,
            label,
            k,
        )
        assert e["params"]["pipeline"] == pipeline and e["params"]["embedding_staleness"] == k
    for name in ("results.json", "results.md", "results.png", "auc_curve.png"):
        assert (out / name).stat().st_size > 0, name
    assert "| stock_table_wise@hybrid_k2 |" in stdout


def test_a_pipeline_that_cannot_train_the_het_cache_leaves_it_not_run_with_the_reason(side_by_side) -> None:
    results, stdout, _ = side_by_side
    by_name = {e["name"]: e for e in results["configs"]}
    assert "not_run" not in by_name["het_het_s2_c1@sparse_dist"]
    semi = by_name["het_het_s2_c1@semi_sync"]
    assert "het_cached_row_wise" in semi["not_run"] and "TrainPipelineSemiSync" in semi["not_run"]
    assert "\n" not in semi["not_run"] and "samples_per_s" not in semi and "auc_curve" not in semi
    assert semi["sharding_types"] == ["het_cached_row_wise"]
    assert f"not run: {semi['name']}: {semi['not_run']}" in stdout
    assert "not_run" not in by_name["het_het_s2_c1@hybrid_k2"]  # the hybrid pipeline trains the HET cache
    assert markdown_table(results) in stdout
    # The HET entries that ran show their hit rate in the printed table, stock ones a blank cell.
    header = next(line for line in stdout.splitlines() if line.startswith("| workload | config |"))
    column = [cell.strip() for cell in header.split("|")].index("HET hit rate (ideal LRU)")
    cells = {
        line.split("|")[2].strip(): line.split("|")[column].strip()
        for line in stdout.splitlines()
        if line.startswith("| dlrm |") and line.count("|") == header.count("|")
    }
    assert re.fullmatch(r"\d+\.\d% \(\d+\.\d%\)", cells["het_het_s2_c1@sparse_dist"]), cells
    assert cells["stock_table_wise@sparse_dist"] == ""


def test_the_hybrid_entries_record_the_staleness_gauge(side_by_side) -> None:
    results, _, _ = side_by_side
    for e in results["configs"]:
        if "not_run" in e:
            continue
        gauge = e.get("staleness_gauge")
        if e["pipeline"] != "hybrid":
            assert gauge is None, e["name"]
            continue
        # No read missed more than k updates, and in steady state every read missed exactly k.
        assert gauge["max"] == 2 and gauge["per_rank_max"] == [2, 2], e["name"]
        assert sum(gauge["histogram"].values()) == 18 and gauge["histogram"]["2"] == 16, e["name"]
        assert 0 < gauge["mean"] <= 2


def test_every_entry_has_its_auc_curve_and_convergence_against_stock(side_by_side) -> None:
    results, stdout, _ = side_by_side
    ran = [e for e in results["configs"] if "not_run" not in e]
    assert {e["name"] for e in ran} == {f"stock_table_wise@{label}" for label in LABELS} | {
        "het_het_s2_c1@sparse_dist",
        "het_het_s2_c1@hybrid_k2",
    }
    for e in ran:
        assert [step for step, _ in e["auc_curve"]] == [5, 10, 15, 18]
        assert all(0.0 <= auc <= 1.0 for _, auc in e["auc_curve"]) and e["auc_curve"][-1][1] == e["auc"]
        conv = e["convergence"]
        expected = f"stock_table_wise@{e['pipeline_label']}"  # every pipeline ran stock table_wise
        assert conv["reference"] == expected
        reference = next(r for r in ran if r["name"] == expected)
        assert conv["auc_minus_reference"] == pytest.approx(e["auc"] - reference["auc"])
        assert conv["plateau_auc"] == max(auc for _, auc in reference["auc_curve"])
        assert conv["target_auc"] == pytest.approx(0.995 * conv["plateau_auc"])
        assert conv["steps_to_target"] in (None, 5, 10, 15, 18)
        sync = e.get("convergence_vs_sparse_dist")
        assert (sync is not None) == (e["pipeline"] != "sparse_dist")
        if sync is not None:
            assert sync["reference"] == "stock_table_wise@sparse_dist"
        # The HET cache counts evaluation forwards as steps: its curve says its training was not left alone.
        assert ("auc_curve_caveat" in e) == (e["config"] == "het_het_s2_c1"), e["name"]
    hybrid_row = next(
        line for line in stdout.splitlines() if line.startswith("| dlrm | stock_table_wise@hybrid_k2 | hybrid |")
    )
    assert hybrid_row.split("|")[5].strip() == "2"  # the gauge's max in the convergence table
    assert (
        "| dlrm | het_het_s2_c1@sparse_dist * |" in stdout
        and "* het_het_s2_c1@sparse_dist: het_cached_row_wise" in stdout
    )


@pytest.fixture(scope="module")
def without_evaluation(tmp_path_factory) -> dict:
    results, _ = _bench(
        tmp_path_factory.mktemp("bench_pipelines_no_eval"),
        ["stock_table_wise"],
        "--pipeline",
        "hybrid,semi_sync",
        "--eval-every",
        "0",
    )
    return results


def test_evaluating_mid_run_changes_nothing_the_pipelines_train(side_by_side, without_evaluation) -> None:
    results, _, _ = side_by_side
    by_name = {e["name"]: e for e in results["configs"]}
    for e in without_evaluation["configs"]:
        assert [step for step, _ in e["auc_curve"]] == [18]
        evaluated = by_name[e["name"]]
        assert evaluated["losses"] == e["losses"], e["name"]
        assert evaluated["auc"] == e["auc"] and evaluated["bytes_per_step"] == e["bytes_per_step"]
        assert evaluated.get("staleness_gauge") == e.get("staleness_gauge")


def test_semi_sync_leaves_data_parallel_tables_not_run_with_the_reason(tmp_path) -> None:
    """TorchRec's semi-sync steps the data_parallel tables' weights (dense parameters) after it has
    started the next batch's lookup: autograd fails, after TorchRec warns that the pipelined module
    and the optimizer share parameters. The entry is not run, with the reason, and nothing warns."""
    results, run = run_smoke_bench(tmp_path, ["stock_dp_small"], "--pipeline", "semi_sync")
    (entry,) = results["configs"]
    assert entry["name"] == "stock_dp_small" and "data_parallel" in entry["sharding_types"]
    assert "TrainPipelineSemiSync cannot train data_parallel tables" in entry["not_run"]
    assert f"not run: stock_dp_small: {entry['not_run']}" in run.stdout
    assert "share parameters" not in run.stderr and "inplace operation" not in run.stderr

"""Merging the runs of several seeds: AUC means, paired t intervals, convergence on the mean curves; no ranks."""

import copy
import json
import math

import pytest

from torchrec_het_bench import seeds
from torchrec_het_bench.auc_intervals import t_quantile
from torchrec_het_bench.results import convergence
from torchrec_het_bench.seeds import merge, seed_dir


def _entry(config: str, curve: list, stock: bool = False) -> dict:
    return {
        "name": config,
        "config": config,
        "pipeline": "sparse_dist",
        "pipeline_label": "sparse_dist",
        "embedding_staleness": 0,
        "workload": "dlrm",
        "stock": stock,
        "auc": curve[-1][1],
        "auc_curve": curve,
        "loss": 0.5,
        "samples_per_s": {"median": 1000.0},
        "bytes_per_step": {"embedding_cross_rank": 100},
    }


def _run(seed: int, stock_auc: float, plugin_auc: float) -> dict:
    entries = [
        _entry("stock_table_wise", [[100, stock_auc - 0.01], [200, stock_auc]], stock=True),
        _entry("het_het_s10_c10", [[100, plugin_auc - 0.02], [200, plugin_auc]]),
        {"name": "refused", "config": "refused", "pipeline_label": "sparse_dist", "workload": "dlrm", "not_run": "no"},
    ]
    convergence(entries)
    return {
        "preset": "converge",
        "world_size": 2,
        "alpha": 1.1,
        "table_sizes": [5, 6],
        "pipeline": "sparse_dist",
        "embedding_staleness": 2,
        "rounds": 3,
        "steps_per_round": 10,
        "warmup_steps": 1,
        "eval_every": 100,
        "data": "synthetic",
        "seed": seed,
        "configs": entries,
    }


RUNS = [_run(0, 0.80, 0.801), _run(1, 0.81, 0.809), _run(2, 0.79, 0.7935)]


def test_auc_is_the_mean_over_seeds_and_the_difference_a_paired_t_interval():
    merged = merge(copy.deepcopy(RUNS))
    assert merged["seeds"] == [0, 1, 2] and merged["measured_seed"] == 0
    stock, het, refused = merged["configs"]
    assert het["auc_by_seed"] == [0.801, 0.809, 0.7935]
    assert het["auc"] == pytest.approx((0.801 + 0.809 + 0.7935) / 3)
    assert het["auc_curve"][0] == [100, pytest.approx((0.781 + 0.789 + 0.7735) / 3)]
    diffs = [0.001, -0.001, 0.0035]
    vs = het["auc_vs_stock"]
    assert vs["reference"] == "stock_table_wise" and vs["by_seed"] == pytest.approx(diffs)
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    assert vs["difference"] == pytest.approx(mean)
    assert vs["half_width"] == pytest.approx(t_quantile(0.975, 2) * sd / math.sqrt(3))
    assert "paired t over seeds 0,1,2" in vs["method"]
    assert "auc_vs_stock" not in stock  # the reference itself
    assert het["convergence"]["plateau_auc"] == pytest.approx(0.80)  # recomputed on stock's mean curve
    assert het["convergence"]["auc_half_width"] == pytest.approx(vs["half_width"])  # the same reference here
    assert "auc_half_width" not in stock["convergence"]
    assert refused == RUNS[0]["configs"][2]
    assert merged["configs"][1]["samples_per_s"] == RUNS[0]["configs"][1]["samples_per_s"]  # the first seed's


def test_merge_refuses_runs_that_differ_in_more_than_the_seed():
    with pytest.raises(ValueError, match="at least 2 runs"):
        merge(RUNS[:1])
    with pytest.raises(ValueError, match="share a seed"):
        merge([RUNS[0], copy.deepcopy(RUNS[0])])
    other = copy.deepcopy(RUNS[1])
    other["preset"] = "smoke"
    with pytest.raises(ValueError, match="'preset'"):
        merge([RUNS[0], other])
    fewer = copy.deepcopy(RUNS[1])
    fewer["configs"] = fewer["configs"][:1]
    with pytest.raises(ValueError, match="differ in their entries"):
        merge([RUNS[0], fewer])
    shifted = copy.deepcopy(RUNS[1])
    shifted["configs"][1]["auc_curve"][0][0] = 150
    with pytest.raises(ValueError, match="different steps"):
        merge([RUNS[0], shifted])


def test_each_seed_has_its_own_folder(tmp_path):
    assert seed_dir(tmp_path, 3) == tmp_path / "seed_3"


def test_the_seeds_of_a_run_merge_again_from_their_folders(tmp_path, monkeypatch):
    for run in RUNS:
        (tmp_path / f"seed_{run['seed']}").mkdir()
        (tmp_path / f"seed_{run['seed']}" / "results.json").write_text(json.dumps(run))
    written = []
    monkeypatch.setattr(seeds, "write_results", lambda results, out: written.append((results, out)))
    assert seeds.main([str(tmp_path)]) == 0
    ((merged, out),) = written
    assert out == tmp_path and merged["seeds"] == [0, 1, 2] and "auc_vs_stock" in merged["configs"][1]
    with pytest.raises(SystemExit):
        seeds.main([str(tmp_path / "seed_0")])  # no seed folders in there

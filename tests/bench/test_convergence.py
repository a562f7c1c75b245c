"""Convergence against stock table_wise (results.convergence) and how the report shows it; no ranks."""

import pytest

from torchrec_het_bench import report
from torchrec_het_bench.presets import get_preset
from torchrec_het_bench.results import PLATEAU_FRACTION, convergence, steps_to_reach


def _entry(config: str, label: str, curve: list, workload: str = "dlrm", **extra) -> dict:
    pipeline = label.split("_k")[0] if label.startswith("hybrid") else label
    return {
        "name": f"{config}@{label}",
        "config": config,
        "pipeline": pipeline,
        "pipeline_label": label,
        "embedding_staleness": int(label.split("_k")[1]) if "_k" in label else 0,
        "workload": workload,
        "auc": curve[-1][1],
        "auc_curve": curve,
        **extra,
    }


STOCK_SYNC = [[100, 0.70], [200, 0.78], [300, 0.80], [400, 0.799]]  # plateau 0.80 (its max, not its final point)
STOCK_HYBRID = [[100, 0.69], [200, 0.77], [300, 0.79], [400, 0.795]]
PLUGIN = [[100, 0.60], [200, 0.70], [300, 0.7961], [400, 0.797]]


def test_steps_to_reach_is_the_first_evaluated_step_at_or_above_the_target():
    assert steps_to_reach(STOCK_SYNC, 0.78) == 200
    assert steps_to_reach(STOCK_SYNC, 0.81) is None


def test_each_entry_is_compared_with_stock_table_wise_of_its_pipeline_else_sparse_dist():
    entries = [
        _entry("stock_table_wise", "sparse_dist", STOCK_SYNC),
        _entry("stock_table_wise", "hybrid_k2", STOCK_HYBRID),
        _entry("planned_s10", "sparse_dist", PLUGIN),
        _entry("planned_s10", "semi_sync", PLUGIN),  # no stock entry under semi_sync: sparse_dist's
        {"name": "het@hybrid_k2", "config": "het", "pipeline_label": "hybrid_k2", "workload": "dlrm", "not_run": "no"},
        _entry("seq_x", "sparse_dist", PLUGIN, workload="sequence"),  # no stock of its workload: none
    ]
    convergence(entries)
    sync, hybrid, plugin, semi, refused, sequence = entries
    target = PLATEAU_FRACTION * 0.80
    assert sync["convergence"] == {
        "reference": "stock_table_wise@sparse_dist",
        "reference_pipeline": "sparse_dist",
        "auc_minus_reference": 0.0,
        "plateau_auc": 0.80,
        "target_auc": target,
        "steps_to_target": 300,
        "reference_steps_to_target": 300,
    }
    assert "convergence_vs_sparse_dist" not in sync
    assert plugin["convergence"]["auc_minus_reference"] == pytest.approx(0.797 - 0.799)
    assert plugin["convergence"]["steps_to_target"] == 300  # 0.7961 >= 0.796
    assert semi["convergence"]["reference"] == "stock_table_wise@sparse_dist"
    assert "convergence_vs_sparse_dist" not in semi  # its reference already is sparse_dist's
    # Under hybrid: against hybrid's own stock, and against synchronous stock beside it.
    assert hybrid["convergence"]["reference"] == "stock_table_wise@hybrid_k2"
    assert hybrid["convergence"]["plateau_auc"] == 0.795 and hybrid["convergence"]["steps_to_target"] == 400
    assert hybrid["convergence_vs_sparse_dist"]["reference"] == "stock_table_wise@sparse_dist"
    assert hybrid["convergence_vs_sparse_dist"]["auc_minus_reference"] == pytest.approx(0.795 - 0.799)
    assert hybrid["convergence_vs_sparse_dist"]["steps_to_target"] is None  # 0.795 never reaches 0.796
    assert "convergence" not in refused and "convergence" not in sequence


def test_the_convergence_table_and_the_curve_plot(tmp_path):
    entries = [
        _entry("stock_table_wise", "sparse_dist", STOCK_SYNC, stock=True),
        _entry(
            "stock_table_wise",
            "hybrid_k2",
            STOCK_HYBRID,
            stock=True,
            staleness_gauge={"max": 2, "mean": 1.9, "histogram": {"0": 1, "1": 1, "2": 20}},
        ),
        {
            "name": "het@hybrid_k2",
            "config": "het",
            "pipeline_label": "hybrid_k2",
            "workload": "dlrm",
            "not_run": "the pipeline's one-line reason",
        },
    ]
    convergence(entries)
    results = {"preset": "converge", "eval_every": 100, "configs": entries}
    lines = report.convergence_table(results)
    assert "every 100 trained steps" in lines[0] and "plateau = the largest AUC on stock table_wise's curve" in lines[0]
    rows = [line for line in lines if line.startswith("| dlrm")]
    assert len(rows) == 2
    assert rows[0] == (
        "| dlrm | stock_table_wise@sparse_dist | sparse_dist | 0 | - | 0.7990 | stock_table_wise@sparse_dist "
        "| +0.0000 | 300 (300) | - | - |"
    )
    assert rows[1] == (
        "| dlrm | stock_table_wise@hybrid_k2 | hybrid | 2 | 2 | 0.7950 | stock_table_wise@hybrid_k2 "
        "| +0.0000 | 400 (400) | -0.0040 | never (300) |"
    )
    assert report.plot_auc_curves(results, tmp_path / "auc_curve.png")
    assert (tmp_path / "auc_curve.png").stat().st_size > 0
    assert not report.plot_auc_curves(
        {"preset": "x", "configs": [_entry("a", "plain", [[5, 0.5]])]}, tmp_path / "no.png"
    )
    assert not (tmp_path / "no.png").exists()  # one point is no curve


def test_only_the_het_cache_has_a_caveat_and_only_when_evaluated_mid_run():
    from torchrec_het_bench.results import evaluation_caveat

    assert evaluation_caveat(["table_wise", "het_row_replicated"], [[5, 0.6], [9, 0.7]]) is None
    assert evaluation_caveat(["het_cached_row_wise"], [[9, 0.7]]) is None  # the final evaluation only
    assert "clock" in evaluation_caveat(["het_cached_row_wise", "het_row_replicated"], [[5, 0.6], [9, 0.7]])


def test_presets_say_how_often_they_evaluate():
    assert get_preset("smoke").eval_every == get_preset("default").eval_every == 0  # the final AUC only
    converge = get_preset("converge")
    assert 0 < converge.eval_every < converge.total_steps
    assert get_preset("smoke", eval_every=6).eval_every == 6
    with pytest.raises(ValueError, match="eval_every"):
        get_preset("smoke", eval_every=-1)

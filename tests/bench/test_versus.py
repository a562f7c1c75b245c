"""Every entry against stock: the table, the verdict lines, and the files the printed report cites; no ranks."""

import json
import re
from pathlib import Path

import pytest
import torch

from torchrec_het_bench import versus
from torchrec_het_bench.auc_intervals import AucDifference
from torchrec_het_bench.results import convergence, write_results

ROOT = Path(__file__).resolve().parents[2]


def _entry(
    name: str, sps: float, emb: int, auc: float, stock: bool = False, pipeline: str = "sparse_dist", **extra
) -> dict:
    return {
        "name": name,
        "config": name.split("@")[0],
        "pipeline": pipeline.split("_k")[0],
        "pipeline_label": pipeline,
        "embedding_staleness": 0,
        "workload": "dlrm",
        "stock": stock,
        "sharding_types": ["table_wise"],
        "params": {"sharding": "table_wise"},
        "samples_per_s": {"median": sps, "p10": sps, "p90": sps},
        "bytes_per_step": {"embedding_cross_rank": emb},
        "inter_host_bytes": None,
        "auc": auc,
        "auc_curve": [[10, auc]],
        **extra,
    }


def _interval(difference: float, half_width: float) -> dict:
    return dict(
        AucDifference(difference, half_width, "DeLong, paired on the same 8 held-out samples", 8).as_dict(),
        reference="stock_table_wise",
    )


def _results() -> dict:
    entries = [
        _entry("stock_table_wise", 1000.0, 2**20, 0.8000, stock=True),
        _entry("planned", 1310.0, 0.53 * 2**20, 0.7997, auc_vs_stock=_interval(-0.0003, 0.0008)),
        _entry("planned_s10", 1500.0, 0.25 * 2**20, 0.7979, auc_vs_stock=_interval(-0.0021, 0.0008)),
    ]
    convergence(entries)
    return {"configs": entries}


def test_the_verdict_line_gives_ratios_and_the_auc_difference_with_its_interval():
    results = _results()
    stock, planned, stale = results["configs"]
    assert versus.verdict(planned, stock) == (
        "planned: 1.31× stock_table_wise at 0.53× its bytes, AUC equal (−0.0003 ± 0.0008); tables: table_wise"
    )
    stale["sharding_types"] = ["het_row_replicated", "table_wise"]
    assert versus.verdict(stale, stock) == (
        "planned_s10: 1.50× stock_table_wise at 0.25× its bytes, AUC lower "
        "(−0.0021 ± 0.0008); tables: het_row_replicated+table_wise"
    )
    stock_row_wise = dict(_entry("stock_row_wise", 800.0, 2 * 2**20, 0.8, stock=True), auc_vs_stock=_interval(0.0, 0.0))
    assert (
        versus.verdict(stock_row_wise, stock)
        == "stock_row_wise: 0.80× stock_table_wise at 2.00× its bytes, AUC equal (+0.0000 ± 0.0000)"
    )
    lines = versus.verdicts(results)
    assert lines[0] == "verdicts against stock:" and len([line for line in lines if line.startswith("- ")]) == 2
    assert "DeLong" in lines[-2] and "equal: the interval holds 0" in lines[-2]
    assert "paired round by round" in lines[-1]


def test_the_table_names_the_reference_and_shows_each_ratio():
    rows = versus.table(_results())
    assert rows[0].startswith("| entry | sharding | samples/s | × stock | embedding MiB/step (× stock)")
    assert "| AUC (by seed) | AUC − stock (95%) | stock |" in rows[0]
    assert rows[2] == (
        "| stock_table_wise | table_wise | 1000 | 1.00× | 1.00 (1.00×) | - |  |  | 0.8000 | 0 (reference) "
        "| stock_table_wise |"
    )
    assert "| planned | table_wise | 1310 | 1.31× | 0.53 (0.53×) | - |" in rows[3]
    assert rows[3].endswith("| 0.7997 | −0.0003 ± 0.0008 | stock_table_wise |")


def test_results_without_intervals_say_so_and_a_run_without_stock_has_no_section():
    results = _results()
    del results["configs"][1]["auc_vs_stock"]
    stock, planned, _ = results["configs"]
    assert versus.verdict(planned, stock).endswith("AUC −0.0003 (no interval recorded); tables: table_wise")
    assert "−0.0003 (no interval recorded)" in versus.table(results)[3]
    alone = {"configs": [_entry("planned", 1.0, 1, 0.7)]}
    convergence(alone["configs"])
    assert versus.section(alone) == "" and versus.verdicts(alone) == []


def test_hybrid_entries_are_compared_with_synchronous_stock():
    entries = [
        _entry("stock_table_wise@sparse_dist", 1000.0, 100, 0.80, stock=True),
        _entry("stock_table_wise@hybrid_k2", 1100.0, 100, 0.79, stock=True, pipeline="hybrid_k2"),
    ]
    for entry, config in zip(entries, ("stock_table_wise", "stock_table_wise")):
        entry["config"] = config
    convergence(entries)
    assert versus.reference_name(entries[1]) == "stock_table_wise@sparse_dist"


def test_auc_vs_stock_pairs_the_held_out_samples_of_entry_and_reference():
    entries = _results()["configs"]
    for entry in entries:
        entry.pop("auc_vs_stock", None)
    labels = torch.tensor([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0])
    stock_scores = torch.tensor([0.1, 0.9, 0.4, 0.6, 0.3, 0.2, 0.7, 0.8])
    scores = {
        "stock_table_wise": (stock_scores, labels),
        "planned": (stock_scores, labels),
        "planned_s10": (stock_scores.flip(0), labels),
    }
    versus.add_auc_vs_stock(entries, scores)
    assert "auc_vs_stock" not in entries[0]
    assert entries[1]["auc_vs_stock"]["difference"] == 0.0 and entries[1]["auc_vs_stock"]["half_width"] == 0.0
    assert (
        entries[2]["auc_vs_stock"]["reference"] == "stock_table_wise" and entries[2]["auc_vs_stock"]["difference"] < 0
    )
    assert entries[2]["convergence"]["auc_half_width"] == entries[2]["auc_vs_stock"]["half_width"] > 0
    assert "auc_half_width" not in entries[0]["convergence"]
    scores["planned"] = (stock_scores, labels.flip(0))
    with pytest.raises(ValueError, match="different held-out samples"):
        versus.add_auc_vs_stock(entries, scores)


def _cited_files(text: str) -> set[str]:
    return set(re.findall(r"\b([a-z_]+\.(?:png|json|md))\b", text))


@pytest.mark.parametrize("name", ["04_converge_het_cache.json", "05_converge_row_replication.json"])
def test_every_file_the_report_cites_is_written(tmp_path, capsys, name):
    results = json.loads((ROOT / "docs" / "results" / name).read_text())
    write_results(results, tmp_path)
    printed = capsys.readouterr().out
    assert printed.index("every entry against stock TorchRec") < printed.index("| workload | config |")  # first
    for cited in _cited_files((tmp_path / "results.md").read_text()) | _cited_files(printed):
        assert (tmp_path / cited).is_file(), f"{cited} is cited but not written"
    assert (tmp_path / "auc_curve.png").is_file()  # converge runs have curves


def test_a_run_without_curves_does_not_cite_the_curve_plot(tmp_path, capsys):
    results = json.loads(
        (ROOT / "docs" / "results" / "01_default_loopback_stock_and_replicated_pipelines.json").read_text()
    )
    write_results(results, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "auc_curve.png" not in text and not (tmp_path / "auc_curve.png").exists()
    for cited in _cited_files(text):
        assert (tmp_path / cited).is_file(), f"{cited} is cited but not written"


def test_over_seeds_the_auc_cell_shows_the_mean_and_each_seed():
    entry = _entry("planned", 1.0, 1, 0.8, auc_by_seed=[0.7991, 0.8012, 0.7997])
    assert versus.auc_text(entry) == "0.8000 (0.7991, 0.8012, 0.7997)"
    assert versus.auc_text(_entry("planned", 1.0, 1, 0.8)) == "0.8000"


def test_the_convergence_table_shows_the_interval_where_recorded():
    from torchrec_het_bench import report

    results = _results()
    results["configs"][1]["convergence"]["auc_half_width"] = 0.0008
    rows = [line for line in report.convergence_table(results) if line.startswith("| dlrm")]
    assert "| -0.0003 ± 0.0008 |" in rows[1]
    assert "±" not in rows[2]  # none recorded for planned_s10's convergence here


def test_a_plugin_verdict_also_meets_the_fastest_stock_entry_of_its_pipeline():
    results = _results()
    quantized = _entry("stock_table_wise_fp16", 1200.0, 0.5 * 2**20, 0.8001, stock=True)
    hybrid_stock = _entry("stock_table_wise@hybrid_k2", 1400.0, 2**20, 0.8, stock=True, pipeline="hybrid_k2")
    results["configs"] += [quantized, hybrid_stock]
    stock, planned = results["configs"][:2]
    assert versus.fastest_stock(results, planned) is quantized  # the hybrid stock entry runs another pipeline
    line = versus.verdict(planned, stock, versus.fastest_stock(results, planned))
    assert line.endswith("; 1.09× the fastest stock, stock_table_wise_fp16 (1.06× its bytes); tables: table_wise"), line
    assert "fastest stock" not in versus.verdict(planned, stock, stock)  # the reference is the fastest
    assert "fastest stock" not in versus.verdict(quantized, stock, quantized)  # stock entries: no peer clause
    assert any("the fastest stock, stock_table_wise_fp16" in line for line in versus.verdicts(results))


def test_with_rounds_recorded_the_speed_is_paired_with_its_interval_and_a_word():
    results = _results()
    stock, planned, _ = results["configs"]
    stock["samples_per_s"]["rounds"] = [1000.0, 800.0, 1200.0, 900.0]
    planned["samples_per_s"]["rounds"] = [1310.0, 1050.0, 1570.0, 1180.0]
    line = versus.verdict(planned, stock)
    assert re.match(r"planned: 1\.31× \[1\.31, 1\.31\] \(faster\) stock_table_wise at 0\.53× its bytes", line), line
    planned["samples_per_s"]["rounds"] = [1100.0, 700.0, 1300.0, 850.0]
    assert "(equal) stock_table_wise" in versus.verdict(planned, stock)

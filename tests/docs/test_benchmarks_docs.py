"""docs/benchmarks.md is generated from docs/results/*.json by one command, and is up to date."""

import json
import re
from pathlib import Path

import pytest

from torchrec_het_bench import docs, docs_claims, docs_stacks, report
from torchrec_het_bench.speed_intervals import paired_ratio

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "docs" / "results").glob("*.json"))
PAGE = ROOT / "docs" / "benchmarks.md"


def _small_results(tmp_path: Path) -> Path:
    """A committed run cut down to its stock entry and one plugin entry under each pipeline."""
    results = json.loads(RESULTS[0].read_text())
    keep = [c for c in results["configs"] if c["config"] in {"stock_table_wise", results["configs"][-1]["config"]}]
    results["configs"] = keep[:4]
    results["commit"], results["date"] = "abc1234", "2026-11-24"
    path = tmp_path / "small.json"
    path.write_text(json.dumps(results))
    return path


def test_generator_renders_a_small_results_file(tmp_path, capsys):
    small = _small_results(tmp_path)
    out = tmp_path / "bench.md"
    assert docs.main([str(small), "--out", str(out)]) == 0
    assert out.read_text().startswith("# Benchmarks\n") and "benchmark_runs.md" in out.read_text()
    text = (tmp_path / "benchmark_runs.md").read_text()
    assert text.startswith("# Benchmark runs\n")
    assert "## small\n" in text
    for expected in (
        "commit abc1234; date 2026-11-24",
        "command: `python -m torchrec_het_bench --preset",
        "### Against stock TorchRec",
        "| stock_table_wise",
        "1.00×",
        "verdicts against stock:",
        "fwd ids",
        "emb fwd",
        "staleness max",
        "samples/s median",
    ):
        assert expected in text, expected
    names = [c["name"] for c in json.loads(small.read_text())["configs"]]
    assert all(f"| {name} |" in text for name in names)
    assert "wrote" in capsys.readouterr().out


def test_generator_names_a_missing_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        docs.main([str(tmp_path / "nope.json"), "--out", str(tmp_path / "x.md")])
    assert exit_.value.code == 2
    assert "nope.json" in capsys.readouterr().err


def test_benchmarks_page_is_up_to_date(monkeypatch):
    assert RESULTS, "docs/results/ holds no results.json"
    monkeypatch.chdir(ROOT)
    paths = [path.relative_to(ROOT) for path in RESULTS]
    command = docs.command_line(paths, Path("docs/benchmarks.md"))
    expected = docs.render(paths, command, PAGE.with_suffix(".png").name)
    assert PAGE.read_text() == expected, "docs/benchmarks.md is stale: run `make docs`"
    history = PAGE.parent / docs.HISTORY
    assert history.read_text() == docs.render_history(paths, command), f"{history} is stale: run `make docs`"


def test_the_claims_page_is_one_read():
    assert len(PAGE.read_text().splitlines()) <= 400


def test_the_page_opens_with_each_settings_current_claim_and_its_picture(tmp_path):
    """The latest run of a setting that measured its A/A pairs gives its claims: every entry but the
    reference and the twins, paired over rounds with the interval, and the A/A pairs beside them."""
    runs = [path for path in RESULTS if "noise_floor" in json.loads(path.read_text())]
    assert runs, "no committed run recorded its A/A pairs"
    claimed = [path for path in runs if not json.loads(path.read_text()).get("busy_share")]  # slowed: no claim
    latest = json.loads(claimed[-1].read_text())
    out = tmp_path / "bench.md"
    assert docs.main([*map(str, runs), "--out", str(out)]) == 0
    text = out.read_text()
    start = text.index("## Current claims")
    claims = text[start : text.index("\n## ", start)]  # up to the next section
    entries = {c["name"]: c for c in latest["configs"]}
    rates = {name: entries[name]["samples_per_s"]["rounds"] for name in ("planned", "stock_table_wise")}
    planned = paired_ratio(rates["planned"], rates["stock_table_wise"])
    assert f"| planned | {planned.text()} {planned.word()} |" in claims
    for pair in latest["noise_floor"]:
        assert f"{pair['twin']} {pair['ratio']:.2f}× [{pair['low']:.2f}, {pair['high']:.2f}]" in claims
        assert f"| {pair['twin']} |" not in claims
    assert "| stock_table_wise |" not in claims  # the reference is the column
    assert "![Current claims" in claims and (tmp_path / "bench.png").stat().st_size > 10_000


def test_runs_that_differ_only_in_their_stack_sit_side_by_side(tmp_path):
    small = json.loads(_small_results(tmp_path).read_text())
    other = json.loads(json.dumps(small))
    other["versions"] = dict(small["versions"], torchrec="9.9.9", torch="9.9")
    other["configs"][0]["samples_per_s"]["median"] *= 2  # stock twice as fast: every ratio halves
    paths = []
    for name, results in (("a", small), ("b", other)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(results))
    text = docs_stacks.render_stacks([small, other])
    assert text in docs.render(paths, "cmd")
    assert "## The supported TorchRec stacks side by side" in text
    assert f"torchrec {small['versions']['torchrec']}" in text and "torchrec 9.9.9, torch 9.9" in text
    stock, last = small["configs"][0], small["configs"][-1]
    ratio = last["samples_per_s"]["median"] / stock["samples_per_s"]["median"]
    row = next(line for line in text.splitlines() if line.startswith(f"| {last['name']} | "))
    assert f"| {ratio:.2f}x |" in row and f"| {ratio / 2:.2f}x |" in row
    # the same stack twice is not a comparison of stacks
    assert docs_stacks.render_stacks([small, small]) == ""


def test_benchmarks_page_cites_only_files_it_has():
    """A plot the page names (the convergence table's auc_curve.png, ...) must exist beside it: the page shows
    the curves as a table instead, so a bare plot name would send a reader to a file that is not there."""
    pages = PAGE.read_text() + (PAGE.parent / docs.HISTORY).read_text()
    cited = set(re.findall(r"[\w./-]+\.(?:png|svg|csv)\b", pages))
    missing = sorted(name for name in cited if not (PAGE.parent / name).is_file())
    assert not missing, f"docs/benchmarks.md cites files it does not have: {missing}"


def test_convergence_table_cites_the_plot_only_where_one_is_written():
    results = {
        "eval_every": 200,
        "configs": [
            {
                "name": "stock_table_wise",
                "config": "stock_table_wise",
                "auc": 0.8,
                "auc_curve": [[200, 0.7], [400, 0.8]],
            },
        ],
    }
    assert "auc_curve.png" in report.convergence_table(results)[0]
    assert "auc_curve.png" not in report.convergence_table(results, curve_plot=None)[0]


def test_the_page_says_what_each_entry_reaches_where_training_ends():
    """The latest converge run over several seeds: every entry's AUC and its difference from stock,
    with the interval over the seeds and the verdict it gives."""
    runs = [json.loads(path.read_text()) for path in RESULTS]
    trained = [r for r in runs if r.get("preset") == "converge" and len(r.get("seeds") or ()) > 1]
    assert trained, "no committed converge run over several seeds"
    text = docs_claims.render_trained_auc(runs)
    assert text.startswith("## AUC where training ends")
    for c in trained[-1]["configs"]:
        diff = c.get("auc_vs_stock")
        if diff is not None:
            word = "equal" if diff["low"] <= 0 <= diff["high"] else ("higher" if diff["low"] > 0 else "lower")
            number = f"{diff['difference']:+.4f}".replace("-", "−")  # the report's minus sign
            assert f"| {c['auc']:.4f} | {number} ± {diff['half_width']:.4f} {word} |" in text
    assert docs_claims.render_trained_auc([r for r in runs if r.get("preset") != "converge"]) == ""

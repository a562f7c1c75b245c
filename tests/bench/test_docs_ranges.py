"""The "claims as ranges" section of docs/benchmarks.md (torchrec_het_bench/docs_ranges.py)."""

from torchrec_het_bench import docs_ranges

BUDGET = {"cores": 2, "ranks_on_machine": 2, "threads_per_rank": 1, "oversubscribed": False}
NETWORK = {"mode": "emulated", "hosts": 2, "gbit": 1.25}


def _run(speeds: dict[str, float], busy: float = 0.0, budget: dict | None = BUDGET, commit: str = "c") -> dict:
    return {
        "preset": "default",
        "network": NETWORK,
        "pipelines": ["sparse_dist"],
        "cpu_budget": budget,
        "busy_share": busy,
        "commit": commit,
        "configs": [{"name": n, "samples_per_s": {"median": s}} for n, s in speeds.items()],
    }


def test_series_give_range_slowed_alone_and_gap():
    runs = [
        _run({"stock_table_wise": 100.0, "planned": 150.0}, commit="r1"),
        _run({"stock_table_wise": 100.0, "planned": 160.0}, commit="r2"),
        _run({"stock_table_wise": 100.0, "planned": 140.0}, busy=0.33),
        _run({"stock_table_wise": 100.0}),
        _run({"planned": 150.0}),
        _run({"planned": 170.0}),
        _run({"stock_table_wise": 100.0}),
    ]
    text = docs_ranges.render_ranges(runs)
    row = next(line for line in text.splitlines() if line.startswith("| planned |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["planned", "1.50×", "1.60×", "1.50–1.60×", "1.40×", "1.50–1.70×", "-3.1%"]
    assert "r1, r2" in text and "33%" in text


def test_runs_before_the_budget_and_single_runs_make_no_section():
    old = [_run({"stock_table_wise": 100.0, "planned": 150.0}, budget=None) for _ in range(3)]
    assert docs_ranges.render_ranges(old) == ""
    assert docs_ranges.render_ranges([_run({"stock_table_wise": 100.0, "planned": 150.0})]) == ""


def test_alone_runs_pair_with_the_nearest_stock_run():
    runs = [_run({"stock_table_wise": 100.0}), _run({"planned": 150.0}), _run({"planned": 200.0}),
            _run({"stock_table_wise": 200.0})]  # fmt: skip
    pairs = docs_ranges.alone_pairs(runs, docs_ranges.setting_of(runs[0]))
    assert pairs == {"planned": [1.5, 1.0]}


def test_runs_of_several_pipelines_are_taken_against_stock_table_wise_under_sparse_dist() -> None:
    from torchrec_het_bench.docs_ranges import stock_of

    def run(*names: str) -> dict:
        return {"configs": [{"name": n, "samples_per_s": {"median": 1.0}} for n in names]}

    assert stock_of(run("stock_table_wise", "planned")) == "stock_table_wise"
    several = run("stock_table_wise@hybrid_k2", "stock_table_wise@sparse_dist", "planned@sparse_dist")
    assert stock_of(several) == "stock_table_wise@sparse_dist"

"""A 2-rank smoke run of the benchmark writes results in the agreed shape."""

import json
import subprocess
import sys

import pytest

from torchrec_het.bench.presets import get_preset

PHASES = {"fwd_ids", "fwd_emb", "bwd_grad", "dense_allreduce", "other"}
COLLECTIVES = {"all_to_all", "reduce_scatter", "all_gather", "all_reduce", "broadcast"}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench")
    configs = "stock_table_wise,stock_row_wise,stock_dp_small"
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_het.bench", "--preset", "smoke", "--configs", configs,
         "--world-size", "2", "--out", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "| stock_table_wise |" in run.stdout
    for name in ("results.json", "results.md", "results.png"):
        assert (out / name).stat().st_size > 0, name
    return json.loads((out / "results.json").read_text())


def test_top_level_shape(results: dict) -> None:
    assert results["preset"] == "smoke"
    assert results["world_size"] == 2
    assert results["network"] == {
        "mode": "loopback",
        "gbit": None,
        "hosts": 1,
        "delay_ms": None,
        "delay_ms_effective": None,
    }
    assert set(results["versions"]) >= {"torch", "torchrec", "fbgemm_gpu", "torchrec_het"}
    assert [c["name"] for c in results["configs"]] == ["stock_table_wise", "stock_row_wise", "stock_dp_small"]


def test_each_configuration(results: dict) -> None:
    for c in results["configs"]:
        assert c["stock"] is True and c["workload"] == "dlrm"
        sps = c["samples_per_s"]
        assert 0 < sps["p10"] <= sps["median"] <= sps["p90"]
        b = c["bytes_per_step"]
        assert set(b) >= PHASES | {"embedding_total", "embedding_cross_rank"}
        assert all(isinstance(b[k], int) and b[k] >= 0 for k in b)
        assert b["embedding_cross_rank"] == sum(b[p] for p in PHASES - {"dense_allreduce"})
        assert b["embedding_total"] >= b["embedding_cross_rank"]
        assert b["dense_allreduce"] > 0  # the dense MLPs are always all-reduced
        assert set(c["embedding_cross_rank_by_collective"]) == COLLECTIVES
        assert sum(c["embedding_cross_rank_by_collective"].values()) == pytest.approx(b["embedding_cross_rank"], abs=8)
        assert c["inter_host_bytes"] is None
        assert 0.0 <= c["auc"] <= 1.0 and c["loss"] > 0
        assert len(c["peak_rss_mb"]) == 2 and all(m > 0 for m in c["peak_rss_mb"])


def test_sharding_types_show_in_bytes(results: dict) -> None:
    by_name = {c["name"]: c for c in results["configs"]}
    tw, rw, dp = by_name["stock_table_wise"], by_name["stock_row_wise"], by_name["stock_dp_small"]
    assert tw["sharding_types"] == ["table_wise"]
    assert rw["sharding_types"] == ["row_wise"]
    # Same data, same starting weights, same optimizer: the two plans train the same model.
    assert abs(tw["auc"] - rw["auc"]) < 2e-3 and abs(tw["loss"] - rw["loss"]) < 2e-3
    assert set(dp["sharding_types"]) == {"data_parallel", "table_wise"}
    # Table-wise pools on the owner and returns pooled rows with all_to_all; row-wise
    # returns partial pools with reduce_scatter.
    assert tw["embedding_cross_rank_by_collective"]["reduce_scatter"] == 0
    assert tw["bytes_per_step"]["fwd_emb"] > 0 and tw["bytes_per_step"]["bwd_grad"] > 0
    assert rw["embedding_cross_rank_by_collective"]["reduce_scatter"] > 0
    # Replicated small tables move no rows; their gradients are all-reduced whole every
    # step (DDP around their lookup), which counts as embedding traffic, not dense.
    assert dp["bytes_per_step"]["fwd_emb"] < tw["bytes_per_step"]["fwd_emb"]
    assert dp["bytes_per_step"]["dense_allreduce"] == tw["bytes_per_step"]["dense_allreduce"]
    preset = get_preset("smoke")
    dp_bytes = sum(rows * preset.embedding_dim * 4 for rows in preset.table_sizes if rows <= preset.dp_max_rows)
    ws = results["world_size"]
    # An all-reduce of N bytes sends 2N(ws-1)/ws to the other ranks from each rank.
    assert dp["embedding_cross_rank_by_collective"]["all_reduce"] == 2 * dp_bytes * (ws - 1)


def test_markdown_rows_have_every_column(results: dict) -> None:
    from torchrec_het.bench.report import markdown_table

    rows = [line for line in markdown_table(results).splitlines() if line.startswith("|")]
    assert len(rows) == 2 + len(results["configs"])
    assert {line.count("|") for line in rows} == {rows[0].count("|")}

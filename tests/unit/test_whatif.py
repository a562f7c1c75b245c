"""The what-if (torchrec_het.planner.whatif, python -m torchrec_het.plan): plans without a process group."""

import json

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_het import plan as plan_cli
from torchrec_het.planner.step_model import Cluster, Compute, Links
from torchrec_het.planner.svg_plot import line_plot
from torchrec_het.planner.whatif import coarse_tail, compare, tables_from_configs

COMPUTE = Compute(lookup_s_per_id=2e-7, dense_s_per_sample=1e-5, module_s_per_step=1e-3)


def _shapes(rows: int = 20_000, alpha: float = 1.2, count: int = 4, batch: int = 512):
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=32, num_embeddings=rows, feature_names=[f"f{i}"])
               for i in range(count)]  # fmt: skip
    return tables_from_configs(configs, batch, alpha)


def test_stock_comes_first_and_the_plugin_may_keep_stock_types() -> None:
    plans = compare(_shapes(), Cluster(8, 4, 512), Links(1e10, 1e8, 1e-4), COMPUTE, (0, 10))
    assert [p.label for p in plans] == ["stock", "plugin exact", "plugin s10"]
    assert set(plans[0].types) <= {"table_wise", "row_wise"}
    assert sum(plans[1].types.values()) == 4
    for p in plans:
        assert p.memory_per_rank > 0 and p.prediction.total > 0


def test_a_slow_link_and_skew_make_the_plugin_pay() -> None:
    """Skewed reads over a slow link between hosts: the plugin's plan replicates and is faster; on a
    fast link with uniform reads, where its lookups' extra compute buys nothing, it is stock's."""
    slow = compare(_shapes(alpha=1.2), Cluster(8, 1, 512), Links(1e9, 1.5e8, 1e-4), COMPUTE, (0,))
    assert "het_row_replicated" in slow[1].types and slow[1].prediction.total < slow[0].prediction.total
    extra = {
        "het_row_replicated": {"exact": 5e-7, "stale": 5e-7},
        "het_cached_row_wise": {"exact": 1.5e-6, "stale": 1.5e-6},
    }
    costly = Compute(2e-7, 1e-5, extra, module_s_per_step=1e-3)
    fast = compare(_shapes(alpha=0.0), Cluster(8, 8, 512), Links(1e11, 1e11, 1e-6), costly, (0,))
    assert fast[1].types == fast[0].types


def test_coarse_tail_keeps_the_head_and_the_sum() -> None:
    reads = torch.sort(torch.rand(1_000_000, dtype=torch.float64) ** 8 * 5, descending=True).values
    coarse = coarse_tail(reads, limit=50_000, small=4.0)
    head = int((reads >= 4.0).sum())
    assert coarse.numel() <= 50_000 + 1 and torch.equal(coarse[:head], reads[:head])
    assert float(coarse.sum()) == pytest.approx(float(reads.sum()))


def test_the_command_prints_the_plans(capsys) -> None:
    assert plan_cli.main(["--tables", "4x20000x32", "--alpha", "1.1", "--world-size", "4", "--batch", "256"]) == 0
    out = capsys.readouterr().out
    assert "| stock |" in out and "| plugin exact |" in out and "| plugin s10 |" in out


def test_the_sweep_writes_its_table_and_plot(tmp_path, capsys) -> None:
    argv = ["--tables", "2x5000x16", "--alpha", "1.1", "--batch", "128", "--sweep", "--sweep-gbit", "1,10", "--out",
            str(tmp_path)]  # fmt: skip
    assert plan_cli.main(argv) == 0
    result = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["world_size"] for r in result["rows"]][:10] == [2**k for k in range(1, 11)]
    assert {r["inter_gbit"] for r in result["rows"]} == {1.0, 10.0}
    assert "<polyline" in (tmp_path / "sweep.svg").read_text()
    assert "| 1024 |" in (tmp_path / "sweep.md").read_text()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tables", "26by100"], "COUNTxROWSxDIM"),
        (["--tables", "2x10x4", "--world-size", "6", "--ranks-per-host", "4"], "multiple of --ranks-per-host"),
    ],
)
def test_bad_arguments_say_what_is_wrong(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        plan_cli.main(argv)
    assert message in str(done.value) + capsys.readouterr().err


def test_a_tables_file_must_define_its_tables(tmp_path) -> None:
    bad = tmp_path / "model.py"
    bad.write_text("x = 1\n")
    with pytest.raises(SystemExit, match="must define `tables`"):
        plan_cli.main(["--tables", str(bad)])
    good = tmp_path / "tables.py"
    good.write_text(
        "from torchrec.modules.embedding_configs import EmbeddingBagConfig\n"
        "tables = [EmbeddingBagConfig(name='a', embedding_dim=8, num_embeddings=100, feature_names=['fa'])]\n"
    )
    assert plan_cli.main(["--tables", str(good), "--world-size", "2"]) == 0


def test_the_plot_draws_lines_and_measured_points() -> None:
    svg = line_plot({"a": [(2, 1.0), (4, 1.5)]}, [(2, 1.2, "measured")], log2_x=True)
    assert svg.startswith("<svg") and svg.count("<polyline") == 1 and "<circle" in svg

"""``python -m torchrec_het_bench.adoption --quick``: the unchanged trainer via torchrun and via the
launcher on uniform ids, summarized; without a profile the launched trainer plans TorchRec's types."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_het_bench.adoption import namespace_unavailable, parse_args

REPO = Path(__file__).resolve().parents[2]


def test_bad_flags_fail_in_the_parent_naming_the_flag(capsys) -> None:
    for argv in (["--steps", "1"], ["--alpha", "0"], ["--launcher-env", "PATH=/x"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", *argv])
        assert argv[0] in capsys.readouterr().err


def test_quick_uniform_run_reports_speed_bytes_plans_and_auc(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench.adoption", "--out", str(tmp_path), "--quick", "--cases", "uniform"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert "launcher / stock" in (tmp_path / "results.md").read_text().lower()
    assert list(results["cases"]) == ["uniform"] and results["repeats"] == 1
    case = results["cases"]["uniform"]
    for arm in ("stock", "launcher"):
        summary = case[arm]
        (record,) = summary["runs"]
        assert record["it_per_s"] > 0 and 0 < record["auc"] < 1
        assert sum(record["plan"].values()) == 26, record["plan"]  # one row per table of the printed plan
        assert not summary["plugin_types_planned"], summary["plan_types"]  # uniform ids, no profile: TorchRec's types
        if namespace_unavailable() is None:
            assert record["wire_bytes_run"] > 0 and record["wire_bytes_per_step"] > 0
    assert case["launcher"]["plan_types"] == case["stock"]["plan_types"]
    assert case["launcher_over_stock"]["it_per_s"] > 0
    assert case["launcher_over_stock"]["auc_difference"] == pytest.approx(0, abs=1e-3)  # same plan, same weights
    assert set(case["targets"]) == {"within_5pct_of_stock_speed", "no_more_wire_bytes"}
    assert any("no access profile" in note for note in case["launcher"]["runs"][0]["notes"])

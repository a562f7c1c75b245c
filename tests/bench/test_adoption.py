"""``python -m torchrec_het_bench.adoption --quick``: the unchanged trainer via torchrun and via the
launcher on uniform ids, summarized; without a profile the launched trainer plans TorchRec's types.
On 2 emulated hosts (root and iproute2), with a profile: the launched planner measures the link
and plans the plugin's types."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_het_bench.adoption import (
    case_named,
    command,
    markdown,
    namespace_unavailable,
    parse_args,
    run_env,
    summarize_case,
)
from torchrec_het_bench.adoption_hosts import host_command

REPO = Path(__file__).resolve().parents[2]


def test_bad_flags_fail_in_the_parent_naming_the_flag(capsys) -> None:
    for argv in (["--steps", "1"], ["--alpha", "0"], ["--launcher-env", "PATH=/x"], ["--hosts", "1"], ["--gbit", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", "x", *argv])
        assert argv[0] in capsys.readouterr().err


def test_bad_cases_are_refused_naming_the_flag(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--cases", "zipf_fp8"])
    assert "--cases" in capsys.readouterr().err


FP16_FLAGS = ["--fwd-comm-precision", "fp16", "--bwd-comm-precision", "bf16"]


def _has(argv: list[str], flags: list[str]) -> bool:
    return any(argv[i : i + len(flags)] == flags for i in range(len(argv)))


def test_a_codec_case_runs_both_arms_with_the_same_codec_flags() -> None:
    """``zipf_fp16``: stock (torchrun) and the launcher run the unchanged trainer with the same
    flags, on loopback and on emulated hosts; only the launcher gets the profile."""
    args = parse_args(["--out", "x", "--cases", "zipf_fp16", "zipf", "--quick"])
    case, plain = (case_named(name, args.alpha) for name in args.cases)
    assert (case.alpha, case.with_profile, case.qcomms) == (1.1, True, "fp16/bf16") and plain.qcomms is None
    for arm in ("stock", "launcher"):
        argv = command(arm, case, args)
        assert _has(argv, FP16_FLAGS), argv
        assert _has(argv, ["-m", "torchrec_het_bench.recipes.train_dlrm"]), argv
        assert _has(host_command(arm, case, args, 1, "10.0.0.1"), FP16_FLAGS)
        assert not _has(command(arm, plain, args), ["--fwd-comm-precision"])
    assert command("stock", case, args)[1:3] == ["-m", "torch.distributed.run"]
    assert command("launcher", case, args)[1:3] == ["-m", "torchrec_het.launch"]
    envs = {arm: run_env(arm, case, Path("p.pt"), False, [], 2) for arm in ("stock", "launcher")}
    assert "TORCHREC_HET_PROFILE" not in envs["stock"] and envs["launcher"]["TORCHREC_HET_PROFILE"] == "p.pt"


def _record(qcomms: str | None, kind: str) -> dict:
    return {"it_per_s": 10.0, "train_s": 2.0, "steady_it_per_s": None, "auc": 0.6, "plan": {kind: 26},
            "wire_bytes_run": None, "wire_bytes_per_step": None, "qcomms": qcomms, "notes": []}  # fmt: skip


def test_the_report_shows_a_cases_codecs() -> None:
    ran = "POOLED_EMBEDDINGS_ALL_TO_ALL fp16/fp16, POOLED_EMBEDDINGS_REDUCE_SCATTER fp16/fp16"
    case = summarize_case(
        case_named("zipf_fp16", 1.1),
        {"stock": [_record(ran, "table_wise")], "launcher": [_record(ran, "het_cached_row_wise")]},
    )
    assert case["qcomms"] == "fp16/bf16" and case["launcher"]["qcomms_ran"] == [ran]
    results = {
        "command": "python -m torchrec_het_bench.adoption --cases zipf_fp16", "steps": 20, "repeats": 1,
        "provenance": {"commit": "abc", "date": "today"}, "world_size": 2, "cpu_budget": None,
        "loadavg_start": 1.0, "loadavg_end": 1.0, "wire_bytes": "not measured", "launcher_env": [],
        "cases": {"zipf_fp16": case},
    }  # fmt: skip
    text = markdown(results)
    assert "| zipf_fp16 (alpha 1.1, qcomms fp16/bf16) | stock |" in text, text
    assert f"- zipf_fp16: both arms `{' '.join(FP16_FLAGS)}`; ran (stock: {ran}; launcher: {ran})" in text, text


def test_quick_uniform_run_reports_speed_bytes_plans_and_auc(tmp_path: Path) -> None:
    """The launcher alone changes no plan: with the link probe off (TorchRec's bandwidths, as stock's
    planner has) it plans what torchrun's run plans. With the probe on, the plan follows what the probe
    measured: on a loaded machine loopback measures slow, and TorchRec's own types change (data_parallel,
    row_wise) as they should; the emulated test below checks the measured path."""
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench.adoption", "--out", str(tmp_path), "--quick", "--cases", "uniform",
         "--launcher-env", "TORCHREC_HET_LINK_PROBE=0"],
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


@pytest.mark.skipif(namespace_unavailable() is not None, reason=f"no emulated hosts here: {namespace_unavailable()}")
def test_quick_zipf_run_on_two_emulated_hosts_plans_the_plugin_from_the_measured_link(tmp_path: Path) -> None:
    """At 0.5 Gbit/s the measured link makes table_wise clearly dearer than row replication (at 1.25 Gbit/s
    the two are priced within a few percent, so the choice there follows the probe's noise)."""
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench.adoption", "--out", str(tmp_path), "--quick", "--steps", "10",
         "--cases", "zipf", "--network", "emulated", "--hosts", "2", "--gbit", "0.5"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    network = results["network"]
    assert (network["mode"], network["hosts"], network["gbit"], results["world_size"]) == ("emulated", 2, 0.5, 2)
    assert 0 < network["tcp"]["one_way_gbit"] <= 0.55 and "bulk TCP" in (tmp_path / "results.md").read_text()
    case = results["cases"]["zipf"]
    for arm in ("stock", "launcher"):
        (record,) = case[arm]["runs"]
        assert sum(record["plan"].values()) == 26 and 0 < record["auc"] < 1
        assert record["wire_bytes_run"] > 0 and record["wire_bytes_per_step"] > 0  # the hosts' links carried them
    assert not case["stock"]["plugin_types_planned"] and case["launcher"]["plugin_types_planned"], case["launcher"][
        "plan_types"
    ]
    assert case["launcher_over_stock"]["wire_bytes_per_step"] < 1.0  # fewer bytes cross the link each step
    notes = case["launcher"]["runs"][0]["notes"]
    assert any("between hosts" in note and "(measured: probe" in note for note in notes), notes

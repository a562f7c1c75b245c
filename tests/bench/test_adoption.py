"""``python -m torchrec_het_bench.adoption --quick``: the unchanged trainer via torchrun and via the
launcher on uniform ids, summarized; without a profile the launched trainer plans TorchRec's types.
On 2 emulated hosts (root and iproute2), with a profile: the launched planner measures the link
and plans the plugin's types."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_het_bench import adoption
from torchrec_het_bench.adoption import (
    SIZES,
    case_named,
    command,
    markdown,
    namespace_unavailable,
    parse_args,
    run_env,
    summarize_case,
)
from torchrec_het_bench.adoption_hosts import host_command
from torchrec_het_testing.stated_plan_figures import STEP_COMPUTE

REPO = Path(__file__).resolve().parents[2]


def test_bad_flags_fail_in_the_parent_naming_the_flag(capsys) -> None:
    for argv in (["--steps", "1"], ["--alpha", "0"], ["--launcher-env", "PATH=/x"], ["--hosts", "1"], ["--gbit", "0"],
                 ["--sizes", "full"], ["--sizes", "default", "default"]):  # fmt: skip
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
        "sizes": {"smoke": adoption.sizes_of("smoke")}, "cases": {"zipf_fp16/smoke": case},
    }  # fmt: skip
    text = markdown(results)
    assert "| zipf_fp16 (alpha 1.1, qcomms fp16/bf16) | smoke | stock |" in text, text
    assert f"- zipf_fp16/smoke: both arms `{' '.join(FP16_FLAGS)}`; ran (stock: {ran}; launcher: {ran})" in text, text


def test_the_trainers_sizes_are_the_benchmark_presets_of_the_same_name() -> None:
    """``--sizes default`` runs the trainer's ``--preset default`` and profiles the benchmark's ``default``
    preset: both must be the same tables, dim, MLPs and batch, or the profile would not fit the model."""
    from torchrec_het_bench.presets import get_preset
    from torchrec_het_bench.recipes.train_dlrm import PRESETS

    assert SIZES == ("smoke", "default")
    for name in SIZES:
        trainer, bench = PRESETS[name](), get_preset(name)
        for field in ("table_sizes", "embedding_dim", "dense_arch", "over_arch", "batch_size"):
            assert getattr(trainer, field) == getattr(bench, field), (name, field)
    default = adoption.sizes_of("default")
    assert (default["tables"], default["rows_min"], default["rows_max"]) == (26, 100_000, 1_000_000), default
    assert (default["embedding_dim"], default["batch_size"], default["over_arch"]) == (64, 1024, [256, 128, 1])


def _preset(argv: list[str]) -> list[str]:
    return [argv[i + 1] for i, flag in enumerate(argv) if flag == "--preset"]


def test_the_default_sizes_reach_the_trainer_of_both_arms_on_loopback_and_hosts() -> None:
    assert parse_args(["--out", "x"]).sizes == ["smoke"]  # the tool's default is unchanged
    args = parse_args(["--out", "x", "--sizes", "default", "--cases", "zipf"])
    assert args.sizes == ["default"] and args.steps <= 200  # ~100-200 ms a step at these sizes
    for sizes in SIZES:
        case = case_named("zipf", args.alpha, sizes)
        assert case.key == f"zipf/{sizes}"
        for arm in ("stock", "launcher"):
            assert _preset(command(arm, case, args)) == [sizes], command(arm, case, args)
            assert _preset(host_command(arm, case, args, 1, "10.0.0.1")) == [sizes]


def test_main_runs_every_case_at_every_size_interleaved_and_keys_the_report_by_sizes(tmp_path, monkeypatch) -> None:
    """``--sizes smoke default``: each zipf case's profile is made at its sizes and reaches its launcher runs;
    runs interleave over cases and sizes; medians and ratios are per (case, sizes)."""
    profiled, ran, real_run = [], [], subprocess.run

    def fake_subprocess(argv, **kwargs):
        if "torchrec_het_bench.profile" not in argv:
            return real_run(argv, **kwargs)  # provenance's git
        profiled.append(argv)
        return subprocess.CompletedProcess(argv, 0, "profiled", "")

    def fake_run_once(arm, case, args, profile, log, in_netns):
        given = run_env(arm, case, profile, in_netns, args.launcher_env, 2).get("TORCHREC_HET_PROFILE")
        ran.append((case.key, arm, _preset(command(arm, case, args)), given))
        speed = {"smoke": 10.0, "default": 2.0}[case.sizes] * (
            1.5 if arm == "launcher" and case.sizes == "default" else 1
        )
        return dict(_record(None, "table_wise"), it_per_s=speed)

    monkeypatch.setattr(adoption, "namespace_unavailable", lambda: "not in this test")
    monkeypatch.setattr(adoption.subprocess, "run", fake_subprocess)
    monkeypatch.setattr(adoption, "run_once", fake_run_once)
    assert adoption.main(["--out", str(tmp_path), "--quick", "--repeats", "2", "--cases", "zipf", "uniform",
                          "--sizes", "smoke", "default"]) == 0  # fmt: skip
    assert [_preset(argv) for argv in profiled] == [["smoke"], ["default"]]
    paths = [argv[argv.index("--out") + 1] for argv in profiled]
    keys = ["zipf/smoke", "uniform/smoke", "zipf/default", "uniform/default"]
    assert [(key, arm) for key, arm, _, _ in ran] == [(k, a) for k in keys for a in ("stock", "launcher")] * 2
    for key, arm, preset, profile in ran:
        assert preset == [key.split("/")[1]], (key, preset)
        if key.startswith("zipf") and arm == "launcher":
            assert profile == paths[key.endswith("default")], (key, profile)
        else:
            assert profile is None, (key, arm, profile)
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results["cases"]) == keys and list(results["sizes"]) == ["smoke", "default"]
    assert results["sizes"]["default"]["rows_max"] == 1_000_000 and results["sizes"]["smoke"]["rows_max"] == 20_000
    for key in keys:
        case = results["cases"][key]
        assert (case["case"], case["sizes"]) == tuple(key.split("/")) and len(case["stock"]["runs"]) == 2
        assert case["launcher_over_stock"]["it_per_s"] == (1.5 if key.endswith("default") else 1.0), key
    text = (tmp_path / "results.md").read_text()
    assert "| zipf (alpha 1.1) | default | launcher | 3.00 |" in text, text
    assert "| uniform | default | 1.500 |" in text and "| uniform | smoke | 1.000 |" in text, text
    assert "- default: 26 tables of 100000..1000000 rows" in text, text


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
    assert list(results["cases"]) == ["uniform/smoke"] and results["repeats"] == 1
    case = results["cases"]["uniform/smoke"]
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
    assert set(case["targets"]) == {"within_5pct_of_stock_speed", "no_more_wire_bytes", "never_loses_0.97x_paired"}
    assert any("no access profile" in note for note in case["launcher"]["runs"][0]["notes"])


@pytest.mark.skipif(namespace_unavailable() is not None, reason=f"no emulated hosts here: {namespace_unavailable()}")
def test_quick_zipf_run_on_two_emulated_hosts_plans_the_plugin_from_the_measured_link(tmp_path: Path) -> None:
    """At 0.2 Gbit/s the measured link makes table_wise clearly dearer than row replication: the plugin's
    plan beats TorchRec's by more than the model's error (at 0.5 Gbit/s and above, at the smoke sizes, the
    two are priced within it and TorchRec's plan is kept). The compute is stated: a loaded machine's
    compute probe (both ranks and the test runner on 2 cores) is not what this test checks."""
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench.adoption", "--out", str(tmp_path), "--quick", "--steps", "10",
         "--cases", "zipf", "--network", "emulated", "--hosts", "2", "--gbit", "0.2",
         "--launcher-env", f"TORCHREC_HET_STEP_COMPUTE={STEP_COMPUTE}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    network = results["network"]
    assert (network["mode"], network["hosts"], network["gbit"], results["world_size"]) == ("emulated", 2, 0.2, 2)
    assert 0 < network["tcp"]["one_way_gbit"] <= 0.22 and "bulk TCP" in (tmp_path / "results.md").read_text()
    case = results["cases"]["zipf/smoke"]
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


def test_a_launcher_run_records_the_plans_predicted_step_and_its_error(tmp_path) -> None:
    from torchrec_het_bench.adoption_runs import _record

    log = tmp_path / "run"
    log.with_suffix(".stderr").write_text(
        "torchrec_het: plan: plugin types predicted 40.0 ms/step against TorchRec's plan's 60.0 ms (1.50x); "
        "the plan's predicted step: 40.0 ms (sparse_dist)\n"
    )
    stdout = "trained 20 steps in 1.0 s (20.00 it/s)\nfinal step 20 auc 0.7000\n"
    marks = {2: (0.0, None), 20: (0.9, None)}  # 18 steps in 0.9 s: 50 ms a step
    record = _record(stdout, log, [0], ["trainer"], 20, 2, marks, None)
    assert record["predicted_step_ms"] == 40.0
    assert record["prediction_error"] == pytest.approx(40.0 / 50.0 - 1)
    log.with_suffix(".stderr").write_text("")  # --print-plan: the planner's log (stdout) has the line
    logged = f"torchrec_het plan: TorchRec's plan: ...; the plan's predicted step: 45.0 ms (sparse_dist)\n{stdout}"
    assert _record(logged, log, [0], ["trainer"], 20, 2, marks, None)["predicted_step_ms"] == 45.0
    # a stock run: no planner line
    assert _record(stdout, log, [0], ["trainer"], 20, 2, marks, None)["prediction_error"] is None

"""What `make bench` runs: its configurations, loopback and the emulated reference link, or the line
that says why not; no ranks (the launch is replaced by a recorder)."""

import re
import shlex
from pathlib import Path

import pytest

import torchrec_het_bench.__main__ as bench_main
from torchrec_het_bench import networks
from torchrec_het_bench.networks import plan_networks, skip_line
from torchrec_het_bench.presets import REFERENCE_GBIT
from torchrec_het_bench.worker import LOOPBACK_BYTES_PER_S, RunSpec, probed_bytes_per_s

ROOT = Path(__file__).resolve().parents[2]
REASON = "not root (euid 1000): network namespaces need root"


def make_bench_args() -> list[str]:
    """The arguments `make bench` passes (the Makefile's BENCH_ARGS default)."""
    match = re.search(r"^BENCH_ARGS \?= (.*)$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert match, "the Makefile has no BENCH_ARGS default"
    return shlex.split(match.group(1))


def test_make_bench_runs_stock_and_the_planner_with_the_plugin_on_loopback_and_emulated_hosts():
    args = bench_main.parse_args(make_bench_args())
    assert args.preset == "default" and args.network == "auto" and args.seeds == 1
    # stock_dp_small applies to presets with small tables only (the default preset has none)
    assert [c.name for c in args.chosen] == [
        "stock_table_wise",
        "stock_table_wise_aa",
        "stock_table_wise_fp16",
        "stock_table_wise_int8",
        "stock_row_wise",
        "planned",
        "planned_aa",
        "planned_lookahead",
        "planned_s10",
        "planned_fp16",
        "planned_int8",
    ]
    assert args.gbit == REFERENCE_GBIT and args.hosts == 2
    smoke = bench_main.parse_args(["--preset", "smoke"])
    assert [c.name for c in smoke.chosen] == [
        "stock_table_wise",
        "stock_table_wise_aa",
        "stock_table_wise_fp16",
        "stock_table_wise_int8",
        "stock_row_wise",
        "stock_dp_small",
        "planned",
        "planned_aa",
        "planned_lookahead",
        "planned_s10",
        "planned_fp16",
        "planned_int8",
    ]


def test_plan_networks():
    runs, skipped = plan_networks("loopback", "out", 2, 1.25, 0.05, unavailable=lambda: REASON)
    assert [(r.network, r.out_dir) for r in runs] == [({"mode": "loopback"}, "out")] and skipped is None
    runs, skipped = plan_networks("auto", "out", 2, 1.25, 0.05, unavailable=lambda: None)
    assert [r.out_dir for r in runs] == ["out/loopback", "out/emulated"] and skipped is None
    assert runs[1].network == {"mode": "emulated", "hosts": 2, "gbit": 1.25, "delay_ms": 0.05}
    runs, skipped = plan_networks("auto", "out", 2, 1.25, 0.05, unavailable=lambda: REASON)
    assert [r.out_dir for r in runs] == ["out/loopback"]
    assert skipped == f"torchrec_het_bench: skipped the run on 2 emulated hosts at 1.25 Gbit/s: {REASON}"
    runs, _ = plan_networks("emulated", "out", 2, 1.25, 0.05, unavailable=lambda: None)
    assert [r.out_dir for r in runs] == ["out"]
    with pytest.raises(SystemExit, match="not possible here: not root"):
        plan_networks("emulated", "out", 2, 1.25, 0.05, unavailable=lambda: REASON)


class Launched(list):
    """The specs main() would have started ranks for, and beside them (``bodies``) what each rank would run."""

    def __init__(self):
        super().__init__()
        self.bodies = []

    def __call__(self, spec, on_done, body):
        self.append(spec)
        self.bodies.append(body)


@pytest.fixture
def launched(monkeypatch) -> Launched:
    specs = Launched()
    monkeypatch.setattr(bench_main, "spawn", specs)
    monkeypatch.setattr(bench_main, "launched_by_torchrun", lambda: False)
    return specs


def test_auto_without_emulation_runs_loopback_and_ends_on_one_line_saying_why(monkeypatch, capsys, launched, tmp_path):
    monkeypatch.setattr(networks, "emulation_unavailable", lambda: REASON)
    assert bench_main.main(["--preset", "smoke", "--network", "auto", "--out", str(tmp_path)]) == 0
    assert [(s.network["mode"], s.out_dir) for s in launched] == [("loopback", str(tmp_path / "loopback"))]
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed == [skip_line(2, REFERENCE_GBIT, REASON)]


def test_auto_with_emulation_runs_both_networks(monkeypatch, capsys, launched, tmp_path):
    monkeypatch.setattr(networks, "emulation_unavailable", lambda: None)
    assert bench_main.main(["--preset", "smoke", "--network", "auto", "--out", str(tmp_path)]) == 0
    loopback, emulated = launched
    assert loopback.host_of_rank == (0, 0) and loopback.out_dir == str(tmp_path / "loopback")
    assert emulated.network["gbit"] == REFERENCE_GBIT and emulated.host_of_rank == (0, 1)
    assert emulated.out_dir == str(tmp_path / "emulated")
    assert [c for c in loopback.config_names] == [
        "stock_table_wise",
        "stock_table_wise_aa",
        "stock_table_wise_fp16",
        "stock_table_wise_int8",
        "stock_row_wise",
        "stock_dp_small",
        "planned",
        "planned_aa",
        "planned_lookahead",
        "planned_s10",
        "planned_fp16",
        "planned_int8",
    ]
    assert "skipped" not in capsys.readouterr().out


def test_auto_soak_runs_the_soak_body_on_both_networks(monkeypatch, launched, tmp_path):
    monkeypatch.setattr(networks, "emulation_unavailable", lambda: None)
    argv = [
        "--preset",
        "smoke",
        "--network",
        "auto",
        "--soak",
        "40",
        "--configs",
        "stock_table_wise",
        "--out",
        str(tmp_path),
    ]
    assert bench_main.main(argv) == 0
    assert [s.network["mode"] for s in launched] == ["loopback", "emulated"]
    assert all(body.func is bench_main.run_soak for body in launched.bodies)


def test_seeds_with_soak_is_refused(capsys, launched):
    with pytest.raises(SystemExit) as exit_:
        bench_main.main(["--preset", "smoke", "--soak", "40", "--seeds", "2"])
    assert exit_.value.code == 2
    assert "argument --seeds: not with --soak" in capsys.readouterr().err
    assert not launched


def _network(mode: str, hosts: int, kind: str, source: str, steady: bool) -> dict:
    figures = {f"{k}_gbit": 0.5 if k == kind else 16.0 for k in ("intra", "inter")}
    figures.update({f"{k}_source": source if k == kind else "assumed" for k in ("intra", "inter")})
    figures["probe"] = {kind: {"gbit": 0.5, "steady": steady}} if source == "measured" else None
    return {"mode": mode, "hosts": hosts, "gbit": REFERENCE_GBIT if mode == "emulated" else None, "links": figures}


@pytest.mark.parametrize(
    "network, expected",
    [
        (_network("emulated", 2, "inter", "measured", True), 0.5e9 / 8),  # the probe's steady figure
        (_network("emulated", 2, "inter", "measured", False), 0.5e9 / 8),  # unsteady: still what was measured
        (_network("emulated", 2, "inter", "stated", True), REFERENCE_GBIT * 1e9 / 8),
        (_network("loopback", 1, "intra", "measured", True), 0.5e9 / 8),
        (_network("loopback", 1, "intra", "measured", False), LOOPBACK_BYTES_PER_S),
        ({"mode": "loopback", "hosts": 1}, LOOPBACK_BYTES_PER_S),  # no probe ran
    ],
)
def test_planned_entries_price_the_link_the_planners_probe_measured(network, expected):
    probed = expected == 0.5e9 / 8
    assert probed_bytes_per_s(network) == (pytest.approx(expected) if probed else None)
    spec = RunSpec.__new__(RunSpec)
    object.__setattr__(spec, "network", network)
    assert spec.link_bytes_per_s == pytest.approx(expected)

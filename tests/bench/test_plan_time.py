"""``python -m torchrec_het_bench.plan_time``: collective_plan timed with the link probe and without."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_plan_time_reports_both_and_the_probes_figures(tmp_path) -> None:
    from torchrec_het_testing.bench_runs import smoke_profile

    profile = smoke_profile(tmp_path / "smoke.pt")  # a table may take a plugin type: the link decides, it is probed
    run = subprocess.run([sys.executable, "-m", "torchrec_het_bench.plan_time", "--repeats", "1", "--profile", profile],
                         cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"^probe on: links .*within a host [\d.]+ Gbit/s \(measured: probe", run.stdout, re.M), run.stdout
    summary = re.search(r"^collective_plan, median of 1: probe on ([\d.]+) s .* probe off ([\d.]+) s .*adds (-?[\d.]+) s$",
                        run.stdout, re.M)  # fmt: skip
    assert summary, run.stdout
    assert "probe off), between hosts" in run.stderr  # the installed planner says what it priced without the probe

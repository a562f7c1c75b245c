"""The benchmark as the tests run it: a 2-rank smoke run in a subprocess (``python -m torchrec_het_bench``)."""

import json
import subprocess
import sys
from pathlib import Path


def run_smoke_bench(
    out: Path, configs: list[str], *extra: str, env: dict | None = None, timeout: int = 300
) -> tuple[dict, subprocess.CompletedProcess]:
    """Runs the benchmark's smoke preset on 2 ranks for ``configs`` (``extra``: more arguments) into
    ``out``, asserts it exited 0 (with its stderr's tail), and returns its results.json and the run."""
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench", "--preset", "smoke", "--configs", ",".join(configs),
         "--world-size", "2", "--out", str(out), "--no-progress", *extra],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads((Path(out) / "results.json").read_text()), run


def smoke_profile(path: Path | str, timeout: int = 300) -> str:
    """Writes the row reads of the smoke preset's data (40 steps, every 4th counted) to ``path``
    with ``python -m torchrec_het_bench.profile``; asserts it exited 0; returns ``path`` as a str."""
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench.profile", "--preset", "smoke", "--steps", "40", "--every", "4",
         "--out", str(path)],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return str(path)

"""What the DLRM recipe tells a new user, on one rank (plain ``python``, no launcher)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RECIPE = "torchrec_het_bench.recipes.train_dlrm"
TIMEOUT_S = 240  # a loaded 2-core machine; a run takes ~10 s here


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # one rank of its own
    argv = [sys.executable, "-m", RECIPE, "--preset", "smoke", "--eval-batches", "0", *args]
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A finished 2-step run with its checkpoint (a resume of a run with none starts at step 0)."""
    ckpt = tmp_path_factory.mktemp("recipe") / "ckpt"
    return ckpt, _run("--steps", "2", "--checkpoint-path", str(ckpt), "--resume")


def test_the_recipe_builds_its_topology_as_torchrec_asks(trained) -> None:
    _, first = trained
    assert "trained 2 steps" in first.stdout, first.stdout
    # TorchRec's warning on a Topology built directly: "...otherwise, the job will fail"
    assert "TopologyFactory" not in first.stderr and "job will fail" not in first.stderr, first.stderr


def test_a_rerun_that_resumes_a_finished_run_says_it_trained_nothing_and_how_to_start_fresh(trained) -> None:
    ckpt, first = trained
    assert "resumed at step" not in first.stdout, first.stdout  # no checkpoint yet: it trained
    again = _run("--steps", "2", "--checkpoint-path", str(ckpt), "--resume")
    lines = again.stdout.splitlines()
    assert f"loaded checkpoint step 2 {ckpt / 'step_2'}" in lines, again.stdout
    assert (
        f"resumed at step 2 of 2: trained nothing, the run under {ckpt} is finished; to start fresh leave out "
        "--resume (torchx: --resume False) or give another --checkpoint-path, to train on pass --steps above 2"
    ) in lines, again.stdout
    assert not any(line.startswith(("step ", "trained ")) for line in lines), again.stdout


def test_the_torchx_trains_default_checkpoint_directory_is_left_out_of_git() -> None:
    import inspect

    from torchrec_het_bench.recipes import components

    default = inspect.signature(components.train).parameters["checkpoint_path"].default
    assert inspect.signature(components.evaluate).parameters["checkpoint_path"].default == default
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{default}/step_50/COMPLETE"], cwd=REPO)
    assert ignored.returncode == 0, f"{default}/ (torchx train's default) is not in .gitignore"

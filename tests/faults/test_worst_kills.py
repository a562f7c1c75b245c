"""A rank killed (SIGKILL) at the runtime's worst moments resumes exactly (2 ranks, loopback).

The DLRM recipe trains through ``python -m torchrec_het.launch --max-restarts 1`` with a kill
armed by the harness (:mod:`torchrec_het_bench.testing.killed_recipe`): rank 1 kills itself in the
middle of a HET gradient push, right after a replica sync summed the replicated rows'
gradients, while the hybrid pipeline's embedding update runs on its worker thread, or while an
owner's early partial sums (lookahead) are in flight. torchrun
restarts both ranks, they resume from the newest complete checkpoint, and train to the end.
That checkpoint equals the uninterrupted run's at that step, and the finished weights equal
the uninterrupted run's (the hybrid pipeline, which reads ahead, those of the uninterrupted
run's checkpoint resumed without a fault): no recorded update lost or applied twice.

Slow (a run is about a minute here): the ``faults`` group, ``make test-faults``.
"""

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchrec_het_bench.testing.killed_recipe import KILL_ENV
from torchrec_het_testing.launched import LaunchedRun, first_match
from torchrec_het_testing.recipe_runs import (
    attempts_of,
    checkpoint_tensors,
    max_abs_difference,
    newest_checkpoint_before_restart,
    resumed_step,
    saved_weights,
    steps_logged,
)

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 420  # a loaded 2-core machine; a run takes ~45 s here, a restarted one ~1.5 min
TOLERANCE = 1e-6

pytestmark = pytest.mark.faults


@dataclass(frozen=True)
class Kill:
    """A kill point of a case: rank 1 dies at ``point`` once step ``step`` began."""

    case: str
    point: str
    step: int
    steps: int = 10
    every: int = 3


KILLS = [
    Kill("het_cached_row_wise", "het_push", 5),
    Kill("het_row_replicated", "replica_sync", 5),
    # the hybrid pipeline's embedding backward moves to its worker after 2 synchronous steps
    # and 8 measured inline: the first update on the worker is batch 11's
    Kill("hybrid", "hybrid_update", 11, steps=14, every=4),
    # lookahead: the next batch's partial sums are in flight and its step is expected
    Kill("lookahead", "lookahead_early", 5),
]


def _train(folder: Path, kill: Kill, env: dict[str, str], armed: bool) -> list[str]:
    """Trains the case (killing rank 1 when ``armed``); returns stdout's lines."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [
        sys.executable, "-m", "torchrec_het.launch", "--nproc-per-node", "2", "--max-restarts", "1",
        "-m", "torchrec_het_bench.testing.killed_recipe", "--preset", "smoke", "--steps", str(kill.steps),
        "--eval-batches", "0", "--resume", "--checkpoint-path", str(folder / "ckpt"),
        "--checkpoint-every", str(kill.every), "--save-weights", str(folder / "weights.pt"), "--print-plan",
    ]  # fmt: skip
    run_env = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    run_env.pop(KILL_ENV, None)
    if armed:
        run_env[KILL_ENV] = f"{kill.point}:1:{kill.step}"
    run = LaunchedRun(argv, REPO, folder / "stderr.txt", run_env)
    try:
        code = run.finish(RUN_TIMEOUT_S)
    finally:
        run.kill()  # only when the wait failed
    assert code == 0, f"exit {code}\n{run.report()}"
    return run.lines


@pytest.mark.parametrize("kill", KILLS, ids=[k.point for k in KILLS])
def test_a_rank_killed_at_a_worst_moment_resumes_exactly(
    case_settings, planned_types, tmp_path: Path, kill: Kill
) -> None:
    env = case_settings[kill.case]
    lines = _train(tmp_path / "killed", kill, env, armed=True)
    assert re.search(rf"^t_cat_0\s+\|\s+{planned_types[kill.case]}\s+\|", "\n".join(lines), re.M), "\n".join(lines[:40])
    killed = first_match(lines, rf"^kill point {kill.point} rank 1 step (\d+) pid \d+$")
    assert killed, f"rank 1 never reached {kill.point}:\n" + "\n".join(lines)
    assert attempts_of(lines, 0) == [0, 1] and attempts_of(lines, 1) == [0, 1], "torchrun did not restart the ranks"
    resumed = resumed_step(lines)
    assert resumed is not None and resumed == newest_checkpoint_before_restart(lines), "\n".join(lines)
    assert 0 < resumed < kill.steps and f"final step {kill.steps}" in lines
    assert steps_logged(lines)[-1] == kill.steps

    reference_dir = tmp_path / "uninterrupted"
    reference = _train(reference_dir, kill, env, armed=False)
    assert attempts_of(reference, 1) == [0] and not first_match(reference, "^kill point")
    at_resume = max_abs_difference(
        checkpoint_tensors(tmp_path / "killed" / "ckpt" / f"step_{resumed}", tmp_path / "killed.pt"),
        checkpoint_tensors(reference_dir / "ckpt" / f"step_{resumed}", tmp_path / "uninterrupted.pt"),
    )
    if kill.case == "hybrid":  # it had read ahead when the uninterrupted run saved: resume that checkpoint instead
        shutil.copytree(reference_dir / "ckpt" / f"step_{resumed}", tmp_path / "resumed" / "ckpt" / f"step_{resumed}")
        assert resumed_step(_train(tmp_path / "resumed", kill, env, armed=False)) == resumed
        reference_dir = tmp_path / "resumed"
    final = max_abs_difference(
        saved_weights(tmp_path / "killed" / "weights.pt"), saved_weights(reference_dir / "weights.pt")
    )
    print(
        f"kill at {kill.point} (step {killed.group(1)}): resumed at step {resumed}; checkpoint max abs diff "
        f"{at_resume:.3g}, final weights {final:.3g}"
    )
    assert at_resume <= TOLERANCE and final <= TOLERANCE

"""Link cuts during training on 2 emulated hosts (one rank each, each host its own launcher).

The DLRM recipe trains through ``python -m torchrec_het.launch --max-restarts 1`` with the
process group timeout ``TORCHREC_HET_PG_TIMEOUT`` made short. A cut shorter than the timeout
costs time only: the run finishes with the uncut run's weights. A longer one fails the ranks
with one line that says a collective timed out, torchrun restarts them, and they resume from
the newest complete checkpoint: that checkpoint equals the uncut run's at that step, and the
finished weights equal the uncut run's (the hybrid pipeline, which reads ahead, those of the
uncut run's checkpoint resumed without a fault).

Slow (a run is about a minute here): the ``faults`` group, ``make test-faults``.
"""

import os
import re
import shutil
import time
import warnings
from pathlib import Path

import pytest

from torchrec_het_bench.netem import EmulatedHosts, LinkSpec, NetworkEmulationUnavailable, check_available, run_command
from torchrec_het_bench.netem_faults import link_cut
from torchrec_het_bench.testing.emulated_launch import launch_on_hosts
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
PREFIX = "trhfault"  # namespaces of these tests: trhfault-<pid>-<serial>-<role>
STEPS, EVERY, CUT_AFTER = 10, 3, 4
PG_TIMEOUT_S = 10
SHORT_CUT_S = 2  # TCP's retransmissions resume within ~1.5 s of the restore: well inside the timeout
LONG_CUT_S = 2 * PG_TIMEOUT_S + 5  # every rank's collective times out while the link is down
RUN_TIMEOUT_S = 420  # a loaded 2-core machine; a run takes ~1 min here, a restarted one ~1.5 min
TOLERANCE = 1e-6

pytestmark = pytest.mark.faults


def _unavailable_reason() -> str | None:
    try:
        check_available()
    except NetworkEmulationUnavailable as error:
        return str(error)
    return None


_REASON = _unavailable_reason()
if _REASON is not None:
    pytest.skip(f"network emulation unavailable here: {_REASON}", allow_module_level=True)


@pytest.fixture(scope="module")
def settings(case_settings) -> dict[str, dict[str, str]]:
    """Each case's settings, with the short process group timeout."""
    return {case: {**env, "TORCHREC_HET_PG_TIMEOUT": str(PG_TIMEOUT_S)} for case, env in case_settings.items()}


class HostRun:
    """What a job on the emulated hosts left: each host's stdout lines and stderr, its folder."""

    def __init__(self, folder: Path, lines: list[list[str]], stderr: list[str]) -> None:
        self.folder, self.lines, self.stderr = folder, lines, stderr

    @property
    def rank0(self) -> list[str]:
        return self.lines[0]


def _train(folder: Path, env: dict[str, str], fault=None) -> HostRun:
    """Trains the recipe on 2 emulated hosts; ``fault(hosts, runs)`` runs while it trains."""
    folder.mkdir(parents=True, exist_ok=True)
    args = [
        "recipes/train_dlrm.py", "--preset", "smoke", "--steps", str(STEPS), "--eval-batches", "0", "--resume",
        "--checkpoint-path", str(folder / "ckpt"), "--checkpoint-every", str(EVERY),
        "--save-weights", str(folder / "weights.pt"), "--print-plan",
    ]  # fmt: skip
    run_env = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with EmulatedHosts(2, LinkSpec(1.25, 0.0), name_prefix=PREFIX) as hosts:
            runs = launch_on_hosts(hosts, 1, ["--max-restarts", "1"], args, REPO, folder, run_env)
            try:
                if fault is not None:
                    fault(hosts, runs)
                codes = [run.finish(RUN_TIMEOUT_S) for run in runs]
            finally:
                for run in runs:
                    run.kill()  # only when a wait failed
            assert codes == [0, 0], f"exit codes {codes}\n" + "\n".join(run.report() for run in runs)
    return HostRun(folder, [run.lines for run in runs], [run.stderr_path.read_text() for run in runs])


def _cut_after_step(step: int, seconds: float, stalled: list[int] | None = None):
    """A fault: once rank 0 logged ``step``, host 1 is off the switch for ``seconds``; ``stalled``
    gets the steps rank 0 logged meanwhile."""

    def fault(hosts, runs) -> None:
        runs[0].wait_for(lambda lines: step in steps_logged(lines), f"step {step}", RUN_TIMEOUT_S)
        before = len(steps_logged(runs[0].lines))
        with link_cut(hosts, 1):
            time.sleep(seconds)  # the cut's length: the fault itself
            during = steps_logged(runs[0].lines)[before:]
        if stalled is not None:
            stalled.extend(during)

    return fault


_references: dict[str, HostRun] = {}


@pytest.fixture(scope="module")
def uncut(settings, tmp_path_factory):
    """The uncut run of a case (trained once per module)."""

    def reference(case: str) -> HostRun:
        if case not in _references:
            _references[case] = _train(tmp_path_factory.mktemp(f"uncut_{case}"), settings[case])
        return _references[case]

    yield reference
    _references.clear()
    assert _namespaces_left() == []


def _check_plan(run: HostRun, case: str, planned: str) -> None:
    assert re.search(rf"^t_cat_0\s+\|\s+{planned}\s+\|", "\n".join(run.rank0), re.M), "\n".join(run.rank0[:40])
    if case == "hybrid":
        assert "runs as the hybrid pipeline, embedding_staleness=1" in run.stderr[0]


def _namespaces_left() -> list[str]:
    """Namespaces this test process made that still exist (none: each run's are deleted when it ends)."""
    mine = f"{PREFIX}-{os.getpid()}-"
    return [line.split()[0] for line in run_command("ip", "netns", "list").splitlines() if line.startswith(mine)]


def test_a_cut_shorter_than_the_timeout_costs_time_only(settings, planned_types, uncut, tmp_path: Path) -> None:
    case = "het_cached_row_wise"
    during: list[int] = []
    cut = _train(tmp_path / "cut", settings[case], _cut_after_step(CUT_AFTER, SHORT_CUT_S, during))
    assert _namespaces_left() == []
    assert len(during) <= 1, f"steps {during} trained while the link was cut: the cut did not stop traffic"
    assert attempts_of(cut.rank0, 0) == [0] and attempts_of(cut.lines[1], 1) == [0], "a short cut restarted the ranks"
    assert "CollectiveFailure" not in cut.stderr[0] + cut.stderr[1]
    assert steps_logged(cut.rank0) == list(range(1, STEPS + 1))
    _check_plan(cut, case, planned_types[case])
    reference = uncut(case)
    difference = max_abs_difference(
        saved_weights(cut.folder / "weights.pt"), saved_weights(reference.folder / "weights.pt")
    )
    print(
        f"short cut ({SHORT_CUT_S} s, timeout {PG_TIMEOUT_S} s) {case}: weights max abs diff vs uncut {difference:.3g}"
    )
    assert difference <= TOLERANCE


@pytest.mark.parametrize("case", ["het_cached_row_wise", "het_row_replicated", "hybrid", "lookahead"])
def test_a_cut_longer_than_the_timeout_fails_restarts_and_resumes(
    settings, planned_types, uncut, tmp_path: Path, case: str
) -> None:
    cut = _train(tmp_path / "cut", settings[case], _cut_after_step(CUT_AFTER, LONG_CUT_S))
    assert _namespaces_left() == []
    _check_plan(cut, case, planned_types[case])
    # the ranks failed, saying why, and torchrun restarted them
    failures = [line for text in cut.stderr for line in text.splitlines() if "CollectiveFailure: " in line]
    assert failures and all(f"timed out after {PG_TIMEOUT_S:g} s" in line for line in failures), "\n".join(
        text[-3000:] for text in cut.stderr
    )
    print(f"long cut ({LONG_CUT_S} s, timeout {PG_TIMEOUT_S} s) {case}: {failures[0]}")
    assert attempts_of(cut.rank0, 0) == [0, 1] and attempts_of(cut.lines[1], 1) == [0, 1]
    # ... from the newest complete checkpoint, to the end
    resumed = resumed_step(cut.rank0)
    assert resumed is not None and resumed == newest_checkpoint_before_restart(cut.rank0), "\n".join(cut.rank0)
    assert 0 < resumed < STEPS and f"final step {STEPS}" in cut.rank0

    reference = uncut(case)
    at_resume = max_abs_difference(
        checkpoint_tensors(cut.folder / "ckpt" / f"step_{resumed}", tmp_path / "cut.pt"),
        checkpoint_tensors(reference.folder / "ckpt" / f"step_{resumed}", tmp_path / "uncut.pt"),
    )
    if case == "hybrid":  # it had read ahead when the uncut run saved: resume the uncut run's checkpoint instead
        target = tmp_path / "resumed" / "ckpt" / f"step_{resumed}"
        shutil.copytree(reference.folder / "ckpt" / f"step_{resumed}", target)
        reference = _train(tmp_path / "resumed", settings[case])
        assert resumed_step(reference.rank0) == resumed
    final = max_abs_difference(saved_weights(cut.folder / "weights.pt"), saved_weights(reference.folder / "weights.pt"))
    print(
        f"long cut {case}: resumed at step {resumed}; checkpoint max abs diff {at_resume:.3g}, final weights {final:.3g}"
    )
    assert at_resume <= TOLERANCE and final <= TOLERANCE

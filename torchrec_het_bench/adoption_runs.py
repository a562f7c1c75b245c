"""One run of the adoption check: start the trainer's process trees, time rank 0's step lines,
read the kernel's byte counters at the warm and the last step, and parse what rank 0 printed.

Used by :mod:`torchrec_het_bench.adoption` (one process tree in a namespace of its own, or here)
and :mod:`torchrec_het_bench.adoption_hosts` (one tree per emulated host).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TRAINER = "torchrec_het_bench.recipes.train_dlrm"
RUN_TIMEOUT_S = 900

_STEP = re.compile(r"^step (\d+) loss ")
_TRAINED = re.compile(r"^trained (\d+) steps in ([\d.]+) s \(([\d.]+) it/s\)$", re.M)
_FINAL = re.compile(r"^final step (\d+) auc (0\.\d+|1\.0+)$", re.M)
_PLAN_ROW = re.compile(r"^(t_\w+?)\s+\|\s+(\w+)\s+\|\s+(\w+)\s+\|", re.M)  # param | sharding type | kernel |
_QCOMMS = re.compile(r"^qcomms \S+ runs (.+)$", re.M)
_PREDICTED = re.compile(r"the plan's predicted step: ([\d.]+) ms")  # the installed planner's line (launcher arm)


@dataclass(frozen=True)
class Case:
    """One data set, what the launcher is told about it, and the trainer's quantized comms
    (``qcomms``: a ``"<forward>/<backward>"`` pair of :mod:`torchrec_het_bench.qcomms`, both arms; None: fp32),
    at the trainer's ``sizes`` (its ``--preset``: ``smoke`` or ``default``, the benchmark's presets' sizes)."""

    name: str
    alpha: float
    with_profile: bool
    qcomms: str | None = None
    sizes: str = "smoke"

    @property
    def key(self) -> str:
        """The case at its sizes, as the report keys it: ``zipf/default``."""
        return f"{self.name}/{self.sizes}"


def trainer_args(case: Case, steps: int, eval_batches: int) -> list[str]:
    """The unchanged trainer and its arguments (``-m MODULE ...``): the case's sizes (the trainer's own
    ``--preset``: tables, embedding dim, MLPs, batch per rank), ids and codecs, the plan printed."""
    return ["-m", TRAINER, "--preset", case.sizes, "--steps", str(steps), "--alpha", f"{case.alpha:g}",
            "--eval-batches", str(eval_batches), "--print-plan", *codec_flags(case.qcomms)]  # fmt: skip


def codec_flags(pair: str | None) -> list[str]:
    """The trainer's flags of the codec pair ``pair`` (``fp16/bf16``); none for None."""
    if pair is None:
        return []
    forward, backward = pair.split("/")
    return ["--fwd-comm-precision", forward, "--bwd-comm-precision", backward]


def watch(
    runs: list[tuple[list[str], dict[str, str]]], steps: int, warm_step: int, log: Path,
    read_bytes: Callable[[], int] | None,
) -> dict:  # fmt: skip
    """Starts every ``(argv, env)`` of ``runs`` at once (each in a session of its own), times the step
    lines of the first (rank 0's) and reads ``read_bytes()`` before the start, at the warm and the
    last step line, and after all have exited; returns the run's record. Logs go to ``log``.*
    (``log``.stdout / .stderr for the first run, ``log``.run<i>.* for the others).

    Raises:
        RuntimeError: a run failed or rank 0 printed no result; the message has the logs' tail.
    """
    before = read_bytes() if read_bytes else None
    marks: dict[int, tuple[float, int | None]] = {}
    lines: list[str] = []
    procs, files = [], []
    watchdog = threading.Timer(RUN_TIMEOUT_S, lambda: [_kill_group(p) for p in procs])
    try:
        for index, (argv, env) in enumerate(runs):
            name = "" if index == 0 else f".run{index}"
            stderr = open(log.with_suffix(f"{name}.stderr"), "w")
            stdout = subprocess.PIPE if index == 0 else open(log.with_suffix(f"{name}.stdout"), "w")
            files += [stderr] if index == 0 else [stderr, stdout]
            procs.append(subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr, text=True, bufsize=1,
                                          start_new_session=True))  # fmt: skip
        watchdog.start()
        for line in procs[0].stdout:
            now = time.perf_counter()
            lines.append(line)
            step = _STEP.match(line)
            if step and int(step.group(1)) in (warm_step, steps):
                marks[int(step.group(1))] = (now, read_bytes() if read_bytes else None)
        for proc in procs:
            proc.wait(timeout=60)
    finally:
        watchdog.cancel()
        for proc in procs:
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
        for file in files:
            file.close()
    after = read_bytes() if read_bytes else None
    stdout = "".join(lines)
    log.with_suffix(".stdout").write_text(stdout)
    return _record(stdout, log, [p.returncode for p in procs], runs[0][0], steps, warm_step, marks,
                   None if before is None else after - before)  # fmt: skip


def _record(stdout: str, log: Path, codes: list[int], argv: list[str], steps: int, warm_step: int, marks: dict,
            run_bytes: int | None) -> dict:  # fmt: skip
    trained, final = _TRAINED.search(stdout), _FINAL.search(stdout)
    if any(codes) or not trained or not final:
        tail = log.with_suffix(".stderr").read_text()[-3000:]
        raise RuntimeError(f"run failed (exits {codes}; logs {log}.*): {' '.join(argv)}\n{stdout[-1500:]}\n{tail}")
    plan = Counter(kind for _param, kind, _kernel in _PLAN_ROW.findall(stdout))
    record = {
        "it_per_s": float(trained.group(3)),
        "train_s": float(trained.group(2)),
        "steady_it_per_s": None,
        "auc": float(final.group(2)),
        "plan": dict(sorted(plan.items())),
        "qcomms": qcomms.group(1) if (qcomms := _QCOMMS.search(stdout)) else None,
        "wire_bytes_run": run_bytes,
        "wire_bytes_per_step": None,
        "notes": sorted({line.strip() for line in open(log.with_suffix(".stderr")) if "torchrec_het:" in line}),
    }
    if warm_step in marks and steps in marks and steps > warm_step:
        (t0, b0), (t1, b1) = marks[warm_step], marks[steps]
        record["steady_it_per_s"] = (steps - warm_step) / (t1 - t0)
        if b0 is not None and b1 is not None:
            record["wire_bytes_per_step"] = (b1 - b0) / (steps - warm_step)
    predicted = [float(m.group(1)) for note in record["notes"] if (m := _PREDICTED.search(note))]
    predicted = predicted or [float(m.group(1)) for m in _PREDICTED.finditer(stdout)]  # --print-plan: the planner log
    record["predicted_step_ms"] = predicted[0] if predicted else None
    record["prediction_error"] = None
    if predicted and record["steady_it_per_s"]:  # the plan's prediction over the steady step measured
        record["prediction_error"] = predicted[0] * record["steady_it_per_s"] / 1e3 - 1
    return record


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)

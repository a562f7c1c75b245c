"""A command started for a test whose stdout lines can be waited on as they arrive."""

import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class LaunchedRun:
    """Runs ``argv`` in its own process group; stdout is read line by line, stderr goes to a file.

    Args:
        argv: the command.
        cwd: its working directory.
        stderr_path: file that receives its stderr (shown when a wait fails).
        env: its environment (default: this one's).
    """

    def __init__(self, argv: Sequence[str], cwd: str | Path, stderr_path: str | Path, env: dict | None = None) -> None:
        self.argv = list(argv)
        self.stderr_path = Path(stderr_path)
        self.lines: list[str] = []
        self._changed = threading.Condition()
        with open(self.stderr_path, "w") as stderr:
            self.process = subprocess.Popen(
                self.argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                start_new_session=True,
            )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        self.process.wait()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, found: Callable[[list[str]], T | None], what: str, timeout_s: float) -> T:
        """Waits until ``found(lines)`` returns something truthy and returns it.

        Raises AssertionError naming ``what`` if the command ends first or ``timeout_s`` passes
        (the command is then killed).
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                result = found(list(self.lines))
                if result:
                    return result
                if self.process.poll() is not None and not self._reader.is_alive():
                    raise AssertionError(
                        f"command ended (exit {self.process.returncode}) before {what}\n{self.report()}"
                    )
                if time.monotonic() > deadline:
                    self.kill()
                    raise AssertionError(f"no {what} within {timeout_s:.0f}s\n{self.report()}")
                self._changed.wait(timeout=0.5)

    def finish(self, timeout_s: float) -> int:
        """Waits for the command to end (killing it after ``timeout_s``); returns its exit code."""
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"command still running after {timeout_s:.0f}s\n{self.report()}") from None
        self._reader.join(timeout=10)
        return self.process.returncode

    def kill(self, grace_s: float = 20) -> None:
        """Stops the command: SIGTERM to its process group (torchrun then stops its workers,
        which run in sessions of their own), SIGKILL after ``grace_s``."""
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def first(self, pattern: str) -> re.Match | None:
        """The first stdout line matching ``pattern`` (``re.search``)."""
        return first_match(self.lines, pattern)

    def report(self, tail: int = 40) -> str:
        """The command and the ends of its stdout and stderr, for failure messages."""
        stderr = self.stderr_path.read_text(errors="replace").splitlines() if self.stderr_path.exists() else []
        return "\n".join(
            [f"$ {' '.join(self.argv)}", "--- stdout (tail)", *self.lines[-tail:], "--- stderr (tail)", *stderr[-tail:]]
        )


def first_match(lines: list[str], pattern: str) -> re.Match | None:
    """The first of ``lines`` matching ``pattern`` (``re.search``), or None."""
    compiled = re.compile(pattern)
    for line in lines:
        match = compiled.search(line)
        if match:
            return match
    return None

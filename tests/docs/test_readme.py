"""Every ```python block of README.md runs, so the guide cannot rot.

The blocks run in README order, each as its own script (``python snippet_<i>.py``, a subprocess
with a timeout) in one shared working directory: a later block may read what an earlier one
wrote (the guide's training snippet reads the ``profile.pt`` its profiling snippet saves).
Cheap shell lines (``--help``) of the ```bash blocks run too; the others (``make bench``,
training runs) are left to the benchmark and the recipe tests.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SNIPPET_TIMEOUT_S = 240  # each snippet takes well under a minute alone; the CI machine is shared
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def help_commands() -> list[str]:
    """The lines of the README's bash blocks that only ask a command for its ``--help``."""
    lines = [line.strip() for body in blocks("bash") for line in body.splitlines()]
    return [line for line in lines if line.endswith("--help") and "\\" not in line]


PYTHON_BLOCKS = blocks("python")


def test_readme_has_the_snippets_the_guide_promises():
    text = "\n".join(PYTHON_BLOCKS)
    assert len(PYTHON_BLOCKS) >= 2
    for needle in ("AccessProfiler", "get_het_sharders", "DistributedModelParallel", "HybridTrainPipeline",
                   "init_process_group"):
        assert needle in text, needle
    assert help_commands(), "no --help line found in the README's bash blocks"


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("readme")


_ran: dict[int, subprocess.CompletedProcess] = {}


def _run_upto(index: int, workdir: Path) -> subprocess.CompletedProcess:
    """Runs blocks 0..index in order (each once), so a block selected alone still finds its inputs."""
    for i in range(index + 1):
        if i not in _ran:
            script = workdir / f"snippet_{i}.py"
            script.write_text(PYTHON_BLOCKS[i])
            env = dict(os.environ, PYTHONWARNINGS="ignore")
            _ran[i] = subprocess.run(
                [sys.executable, script.name], cwd=workdir, env=env, capture_output=True, text=True,
                timeout=SNIPPET_TIMEOUT_S,
            )
    return _ran[index]


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=lambda i: f"python_block_{i}")
def test_python_block_runs(index, workdir):
    done = _run_upto(index, workdir)
    assert done.returncode == 0, (
        f"README python block {index} failed (rc {done.returncode}):\n{PYTHON_BLOCKS[index]}\n"
        f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-6000:]}"
    )
    assert done.stdout.strip(), "the snippet printed nothing"


@pytest.mark.parametrize("command", help_commands())
def test_help_command_runs(command):
    argv = shlex.split(command)
    if argv[0].startswith(".venv/bin/"):
        argv[0] = str(Path(sys.executable).parent / Path(argv[0]).name)
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}: rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "usage" in done.stdout.lower()

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
    for needle in (
        "AccessProfiler",
        "get_het_sharders",
        "DistributedModelParallel",
        "HybridTrainPipeline",
        "init_process_group",
    ):
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
            env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}  # every warning shows
            _ran[i] = subprocess.run(
                [sys.executable, script.name],
                cwd=workdir,
                env=env,
                capture_output=True,
                text=True,
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


# The warnings a README snippet may print: TorchRec's own, which no user code (and no plugin) can
# avoid. Each is (the file that warns, the start of its message).
TORCHREC_OWN_WARNINGS = (
    # torch's note about TorchRec's KeyedJaggedTensor constructor calling is_fx_tracing()
    ("torch/fx/_symbolic_trace.py", "is_fx_tracing will return true for both fx.symbolic_trace and torch.export"),
    # DistributedModelParallel builds its DDP with broadcast_buffers=False itself
    ("torchrec/distributed/model_parallel.py", "`broadcast_buffers` is deprecated"),
    # TorchRec's row-wise output dist (comm_ops) calls these; the warning comes from c10d's wrapper
    ("torch/distributed/c10d_logger.py", "`torch.distributed.reduce_scatter_tensor` is deprecated"),
    ("torch/distributed/c10d_logger.py", "`torch.distributed.all_gather_into_tensor` is deprecated"),
)
# a Python warning ("file.py:12: FutureWarning: ..."), a logging one ("WARNING:logger:..."), or torch's
# glog-style one ("[rank0]:W1126 04:50:01.000000 123 torch/fx/_symbolic_trace.py:56] ...")
WARNING_LINE = re.compile(
    r"^(?:\[rank\d+\]:)?(?:(?P<file>\S+\.py):\d+: \w*Warning: (?P<message>.*)"
    r"|(?:WARNING|ERROR|CRITICAL):(?P<logger>[\w.]*):(?P<logged>.*)"
    r"|[WE]\d{4} [\d:.]+ +\d+ (?P<glog_file>\S+):\d+\] (?P<glog_message>.*))$"
)


def avoidable_warnings(stderr: str) -> list[str]:
    """The warning lines of ``stderr`` that are not one of :data:`TORCHREC_OWN_WARNINGS`."""
    found = []
    for line in stderr.splitlines():
        match = WARNING_LINE.match(line)
        if match is None:
            continue
        origin = match["file"] or match["glog_file"] or (match["logger"] or "").replace(".", "/")
        message = match["message"] or match["logged"] or match["glog_message"] or ""
        if not any(origin.endswith(where) and message.startswith(start) for where, start in TORCHREC_OWN_WARNINGS):
            found.append(line)
    return found


def test_warning_lines_are_recognized() -> None:
    # the filter above must see each kind of warning line, or the check below could not fail
    lines = [
        "/x/torchrec/distributed/planner/planners.py:552: FutureWarning: HeuristicalStorageReservation is known",
        "WARNING:torchrec.distributed.planner.types:The topology was constructed directly",
        "[rank1]:W1126 04:50:01.000000 123 torchrec_het/x.py:5] something the plugin said",
        "[rank0]:W1126 04:50:01.000000 123 torch/fx/_symbolic_trace.py:56] is_fx_tracing will return true for both "
        "fx.symbolic_trace and torch.export. Please use ...",
        "/v/torch/distributed/c10d_logger.py:83: FutureWarning: `torch.distributed.reduce_scatter_tensor` is deprecated.",
    ]
    assert avoidable_warnings("\n".join(lines)) == lines[:3]


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=lambda i: f"python_block_{i}")
def test_python_block_prints_no_avoidable_warning(index, workdir):
    done = _run_upto(index, workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert avoidable_warnings(done.stderr) == [], f"README python block {index}:\n{done.stderr[-6000:]}"


def test_the_training_snippet_prints_the_planner_stats_and_the_plugin_counters(workdir):
    """The README says the planner's stats show the plugin's types as HC / HR, and its snippet reads
    the cache's counters with ``torchrec_het.stats_by_table``."""
    index = next(i for i, block in enumerate(PYTHON_BLOCKS) if "HetEmbeddingShardingPlanner" in block)
    done = _run_upto(index, workdir)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "Planner Statistics" in done.stderr and "torchrec_het sharding types: HC = het_cached_row_wise" in done.stderr
    )
    assert re.search(r"t_item: cache hit rate \d+%", done.stdout), done.stdout


@pytest.mark.parametrize("command", help_commands())
def test_help_command_runs(command):
    argv = shlex.split(command)
    if argv[0].startswith(".venv/bin/"):
        argv[0] = str(Path(sys.executable).parent / Path(argv[0]).name)
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}: rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "usage" in done.stdout.lower()

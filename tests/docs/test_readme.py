"""README.md is a short user guide whose code works, so it cannot rot.

Every ```python block runs, in README order, each as its own script (``python snippet_<i>.py``, a
subprocess with a timeout) in one shared working directory: a later block may read what an earlier
one wrote. Cheap shell lines (``--help``) of the ```bash blocks run too. The quickstart's ```diff
imports what it names; the whole training script it points to, ``examples/train_with_plugin.py``,
and the first command run in ``tests/recipes/test_examples.py``. The prose stays short: at most
:data:`MAX_PROSE_WORDS` words outside code blocks, and code within the first :data:`FIRST_SCREEN`
lines.
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
ANY_FENCE = re.compile(r"^```.*?^```$", re.MULTILINE | re.DOTALL)  # a code block of any language
MAX_PROSE_WORDS = 1_500
FIRST_SCREEN = 60  # lines
EXAMPLE = "examples/train_with_plugin.py"


def blocks(language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(README.read_text()) if lang == language]


def help_commands() -> list[str]:
    """The lines of the README's bash blocks that only ask a command for its ``--help``."""
    lines = [line.strip() for body in blocks("bash") for line in body.splitlines()]
    return [line for line in lines if line.endswith("--help") and "\\" not in line]


PYTHON_BLOCKS = blocks("python")


def prose_words(text: str) -> int:
    """Words of ``text`` outside its fenced code blocks (tables, lists and inline code count)."""
    return len(ANY_FENCE.sub("", text).split())


def test_prose_words_leave_out_code_blocks():
    text = "one two\n```bash\nthree four five\n```\nsix `seven`\n```text\neight\n```\n"
    assert prose_words(text) == 4


def test_readme_is_short_with_code_on_the_first_screen():
    text = README.read_text()
    words = prose_words(text)
    assert 200 < words <= MAX_PROSE_WORDS, f"README: {words} words outside code blocks (at most {MAX_PROSE_WORDS})"
    first = next((n for n, line in enumerate(text.splitlines(), 1) if line.startswith("```")), None)
    assert first is not None and first <= FIRST_SCREEN, f"README's first code block starts at line {first}"


def test_readme_has_the_snippets_the_guide_promises():
    assert PYTHON_BLOCKS, "README has no python block"
    assert "AccessProfiler" in "\n".join(PYTHON_BLOCKS)
    assert help_commands(), "no --help line found in the README's bash blocks"
    diff = blocks("diff")
    assert len(diff) == 1, "README's quickstart has one ```diff block: the three swaps"
    removed = "\n".join(line for line in diff[0].splitlines() if line.startswith("-"))
    added = "\n".join(line for line in diff[0].splitlines() if line.startswith("+"))
    for stock in ("get_default_sharders", "EmbeddingShardingPlanner"):
        assert stock in removed, stock
    for plugin in ("AccessProfiler", "get_het_sharders", "HetEmbeddingShardingPlanner"):
        assert plugin in added, plugin
    # the whole script the guide points to holds what a training script needs
    assert f"({EXAMPLE})" in README.read_text()
    script = (ROOT / EXAMPLE).read_text()
    for needle in (
        "AccessProfiler",
        "get_het_sharders",
        "HetEmbeddingShardingPlanner",
        "DistributedModelParallel",
        "HybridTrainPipeline",
        "TrainPipelineSparseDist",
        "init_process_group",
    ):
        assert needle in script, needle


def test_the_diff_imports_what_it_names():
    """The ``from X import A, B`` lines the quickstart adds import (the names are the plugin's real API)."""
    imports = [line[1:].strip() for line in blocks("diff")[0].splitlines() if re.match(r"^\+\s*from \S+ import ", line)]
    assert len(imports) >= 3, imports
    done = subprocess.run(
        [sys.executable, "-c", "\n".join(imports)], cwd=ROOT, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_readme_links_lead_to_files():
    text = README.read_text()
    targets = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", ANY_FENCE.sub("", text))
    for page in (
        "docs/configuration.md",
        "docs/sharding_types.md",
        "docs/planner.md",
        "docs/launcher.md",
        "docs/benchmark.md",
    ):
        assert page in targets, f"README does not link {page}"
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert not missing, f"README links to missing files: {missing}"


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


@pytest.mark.parametrize("command", help_commands())
def test_help_command_runs(command):
    argv = shlex.split(command)
    if argv[0] == "python":  # the README's commands assume the virtual environment is active
        argv[0] = sys.executable
    elif argv[0].startswith(".venv/bin/"):
        argv[0] = str(Path(sys.executable).parent / Path(argv[0]).name)
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{command}: rc {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    assert "usage" in done.stdout.lower()

"""The training script of examples/ and README's first command run and do what the README says.

The first command is read from README.md (the first ```bash line that runs ``examples/``), so the
README and this test cannot drift apart. Each run is a subprocess with a generous timeout: the
CI machine is shared.
"""

import importlib.util
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from torchrec_het.planner import PLUGIN_TYPES

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
EXAMPLE = "examples/train_with_plugin.py"
TIMEOUT_S = 600  # about 30 s alone on 2 cores
FIRST_COMMAND_LIMIT_S = 240  # the README promises about 30 s; this only catches a run gone far off
PLAN_LINE = re.compile(r"^plan: (?P<table>\S+) (?P<type>[a-z_]+)\b", re.MULTILINE)
LOSS_LINE = re.compile(r"mean loss of the first \d+ steps (?P<first>[\d.]+), of the last \d+ (?P<last>[\d.]+)")


def _readme_tests():
    """tests/docs/test_readme.py, for its filter of the warnings TorchRec itself prints."""
    spec = importlib.util.spec_from_file_location("readme_tests", ROOT / "tests" / "docs" / "test_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def first_command() -> list[str]:
    """README's first command that runs the example, as argv (``python`` is this interpreter)."""
    for lang, body in re.findall(r"^```(\w+)\n(.*?)^```$", README.read_text(), re.MULTILINE | re.DOTALL):
        for line in body.splitlines() if lang == "bash" else ():
            argv = shlex.split(line, comments=True)
            if len(argv) >= 2 and argv[0] == "python" and argv[1] == EXAMPLE:
                return [sys.executable, *argv[1:]]
    raise AssertionError(f"README has no bash line 'python {EXAMPLE} ...'")


def run(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, f"{argv}: rc {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return done, elapsed


def planned_types(stdout: str) -> dict[str, str]:
    return {m["table"]: m["type"] for m in PLAN_LINE.finditer(stdout)}


def assert_loss_went_down(stdout: str) -> None:
    found = LOSS_LINE.search(stdout)
    assert found, stdout[-3000:]
    assert float(found["last"]) < float(found["first"]), found[0]


def test_first_command_shows_the_planner_choosing_a_plugin_type():
    """README's first command: the planner chooses a plugin type for some table, says why, and the
    model trains (its loss goes down); the README's printed output names that type."""
    done, elapsed = run(first_command())
    types = planned_types(done.stdout)
    assert len(types) == 8, done.stdout[-3000:]  # the example's 8 tables
    chosen = {kind for kind in types.values() if kind in PLUGIN_TYPES}
    assert chosen, f"no plugin type planned: {types}"
    why = [line for line in done.stdout.splitlines() if line.startswith("planner: ")]
    assert why and len(why[0]) > len("planner: ") + 20, done.stdout[-3000:]  # the decision, and why
    assert_loss_went_down(done.stdout)
    assert _readme_tests().avoidable_warnings(done.stderr) == [], done.stderr[-6000:]
    assert elapsed < FIRST_COMMAND_LIMIT_S, f"the first command took {elapsed:.0f} s"
    readme = README.read_text()
    shown = readme[readme.index(" ".join(["python", EXAMPLE])) :]
    assert any(f" {kind}:" in shown.split("\n## ", 1)[0] for kind in chosen), "README's output names another type"


def test_example_trains_with_the_hybrid_pipeline_and_prints_the_planner_stats():
    """``--staleness 2``: HybridTrainPipeline; ``--print-stats``: TorchRec's planner table."""
    done, _ = run([sys.executable, EXAMPLE, "--steps", "30", "--staleness", "2", "--print-stats", "--log-every", "10"])
    assert "Planner Statistics" in done.stdout, done.stdout[-3000:]
    assert len(planned_types(done.stdout)) == 8, done.stdout[-3000:]
    assert re.search(r"^step 30 loss [\d.]+$", done.stdout, re.MULTILINE), done.stdout[-3000:]
    assert_loss_went_down(done.stdout)


def test_example_refuses_a_link_without_hosts():
    done = subprocess.run(
        [sys.executable, EXAMPLE, "--inter-gbit", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "--inter-gbit needs --hosts 2" in done.stderr, done.stderr[-2000:]

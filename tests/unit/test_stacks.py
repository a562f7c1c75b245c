"""The Makefile's stacks: one per pinned requirements/torchrec-<stack>.txt, each in its own venv with
its own install stamp, selected by STACK (default 1.8); TESTS picks what `make test` runs. Checked with
`make -n` (prints the commands, runs none)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


# what an outer `make test STACK=... TESTS=...` (this suite's own runner) hands a nested make
OUTER_MAKE = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "STACK", "TESTS", "BENCH_ARGS"}


def make_n(*args: str) -> subprocess.CompletedProcess:
    """``make -n`` in the checkout, as a user types it (none of the outer make's settings); ``-B``: as on a
    fresh clone (every stamp out of date), whatever venvs this checkout has."""
    env = {k: v for k, v in os.environ.items() if k not in OUTER_MAKE}
    return subprocess.run(
        ["make", "-n", "-B", "--no-print-directory", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def stacks_of_requirements() -> list[str]:
    return sorted(p.stem.removeprefix("torchrec-") for p in (ROOT / "requirements").glob("torchrec-*.txt"))


def test_the_makefile_offers_one_stack_per_pinned_file() -> None:
    declared = re.search(r"^STACKS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1).split()
    assert sorted(declared) == stacks_of_requirements() == ["1.8", "1.9"]


@pytest.mark.parametrize(
    "args, venv, stack, torchrec",
    [((), ".venv", "1.8", "1.8.0"), (("STACK=1.9",), ".venv-1.9", "1.9", "1.9.2")],
    ids=["default", "1.9"],
)
def test_each_stack_installs_its_pinned_file_into_its_own_venv(args, venv, stack, torchrec) -> None:
    run = make_n("test", *args)
    assert run.returncode == 0, run.stderr
    commands = run.stdout
    assert f"{venv}/bin/python -m pip install -q -r requirements/torchrec-{stack}.txt" in commands
    assert f"{venv}/bin/python -m pip install -q --no-deps torchrec=={torchrec}\n" in commands
    assert f"touch {venv}/.installed-torchrec-{stack}" in commands
    assert commands.rstrip().endswith(f'{venv}/bin/python -m pytest -q tests -m "not faults"')


def test_tests_and_bench_arguments_pass_through() -> None:
    run = make_n("test", "STACK=1.9", "TESTS=tests/unit tests/distributed -x")
    assert run.stdout.rstrip().endswith(
        '.venv-1.9/bin/python -m pytest -q tests/unit tests/distributed -x -m "not faults"'
    )
    bench = make_n("bench", "BENCH_ARGS=--preset smoke --out /tmp/b")
    assert bench.stdout.rstrip().endswith(".venv/bin/python -m torchrec_het_bench --preset smoke --out /tmp/b")


def test_an_unknown_stack_is_refused_naming_the_choices() -> None:
    run = make_n("test", "STACK=2.0")
    assert run.returncode != 0 and "STACK=2.0 is not a supported stack; choose one of: 1.8 1.9" in run.stderr

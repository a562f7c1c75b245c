"""A collective that timed out or lost its peer ends a launched worker with one line that says so."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_het.integration.collective_errors import describe_collective_error

TIMED_OUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete"
PAIR_CLOSED = "Application timeout caused pair closure"
RESET = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [198.18.0.2]:50360: Connection reset by "
    "peer. This is typically caused by a remote worker hanging or bugs in the application. GLHF!"
)


def _raised_in(filename: str, function: str, message: str) -> RuntimeError:
    """A RuntimeError raised by ``function`` defined in ``filename`` (its traceback names that frame)."""
    namespace: dict = {}
    exec(compile(f"def {function}():\n    raise RuntimeError({message!r})\n", filename, "exec"), namespace)
    try:
        namespace[function]()
    except RuntimeError as error:
        return error
    raise AssertionError("unreachable")


C10D = os.path.join("site-packages", "torch", "distributed", "distributed_c10d.py")


def test_a_timed_out_collective_names_itself_the_wait_and_the_setting(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    line = describe_collective_error(_raised_in(f"/venv/lib/{C10D}", "all_reduce", TIMED_OUT))
    assert line == (
        "rank 1: collective all_reduce timed out after 10 s (the process group timeout: $TORCHREC_HET_PG_TIMEOUT or "
        "init_process_group(timeout=)) with no data from a peer: the network link to a peer is down, or a peer hangs "
        "[gloo: Timed out waiting 10000ms for recv operation to complete]"
    )


def test_an_awaited_collective_is_named_by_where_it_was_waited_for(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    error = _raised_in("/repo/torchrec_het/sharding/het_cache/pushes.py", "wait_pushes", PAIR_CLOSED)
    line = describe_collective_error(error, timeout_s=4.0)
    assert line.startswith(
        "rank 0: a collective waited for at torchrec_het/sharding/het_cache/pushes.py:2 (wait_pushes) "
        "timed out after 4 s (the process group timeout"
    )
    assert line.endswith("[gloo: Application timeout caused pair closure]")
    assert " after " not in describe_collective_error(error)  # no timeout known: none made up


def test_a_lost_peer_is_named_and_the_cause_found_down_the_chain(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "0")
    try:
        try:
            raise _raised_in(f"/venv/{C10D}", "all_to_all_single", RESET)
        except RuntimeError as error:
            raise ValueError("a wrapper's own error") from error
    except ValueError as wrapped:
        line = describe_collective_error(wrapped)
    assert line == (
        "rank 0: collective all_to_all_single failed: the connection to the peer at 198.18.0.2 was closed: that peer's "
        "process died or gave up (see its log) [gloo: Read error [198.18.0.2]:50360: Connection reset by peer]"
    )


@pytest.mark.parametrize("message", ["CUDA out of memory", "index 7 is out of bounds", ""])
def test_other_errors_are_not_described(message: str) -> None:
    assert describe_collective_error(RuntimeError(message)) is None


SCRIPT = """
import sys
def all_reduce():
    raise RuntimeError(sys.argv[1])
all_reduce()
"""


@pytest.mark.parametrize("message, described", [(RESET, True), ("a bug of the script", False)])
def test_the_launchers_worker_ends_with_the_line(tmp_path: Path, message: str, described: bool) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, "-m", "torchrec_het.launch", str(script), message],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, RANK="1"),
    )
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 1
    if described:
        assert last.startswith(
            "torchrec_het.integration.collective_errors.CollectiveFailure: rank 1: a collective waited for at "
        )
        assert "the connection to the peer at 198.18.0.2 was closed" in last
        assert "The above exception was the direct cause" in done.stderr  # gloo's own traceback stays
    else:
        assert last == "RuntimeError: a bug of the script", done.stderr[-2000:]

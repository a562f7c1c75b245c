"""One clear line for a collective that failed because a peer or the network is gone.

gloo reports a lost link as ``Timed out waiting 5000ms for recv operation to complete`` and a
dead peer as ``Read error [addr]:port: Connection reset by peer``, deep in a traceback that
names neither the collective nor the setting that bounds the wait. The launcher's worker mode
(``python -m torchrec_het.launch``) ends a worker that fails so with
:class:`CollectiveFailure`, whose message says which collective failed, after how long, and
what to suspect; torchrun then restarts the workers (``--max-restarts``).
"""

import os
import re
import traceback

from torchrec_het.integration.env_settings import ENV_PG_TIMEOUT

_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation|Application timeout caused pair closure")
_PEER_GONE = re.compile(r"Connection reset by peer|Connection closed by peer|Socket closed|Broken pipe")
_PEER_ADDRESS = re.compile(r"\[([0-9A-Fa-f.:]+)\]:\d+")
_C10D_MODULE = os.path.join("torch", "distributed", "distributed_c10d.py")


class CollectiveFailure(RuntimeError):
    """A collective failed because a peer or the link to it is gone (the message says which and why)."""


def describe_collective_error(error: BaseException, timeout_s: float | None = None) -> str | None:
    """The one-line account of ``error`` (or an exception it was raised from), or None when it
    is not a collective that timed out or lost its peer.

    The line names the rank, the collective (the ``torch.distributed`` function the code called,
    or, for an asynchronous one, where it was waited for), how long it waited and the likely
    cause, and ends with gloo's own words.

    Args:
        error: what the collective raised.
        timeout_s: the process group's timeout, said where gloo's message does not give it
            (``Application timeout caused pair closure``: the other operations of a timed-out link).
    """
    for cause in _chain(error):
        text = str(cause)
        timed_out, gone = _TIMED_OUT.search(text), _PEER_GONE.search(text)
        if timed_out is None and gone is None:
            continue
        where = _collective(cause)
        rank = os.environ.get("RANK", "?")
        gloo = text.split("] ", 1)[-1].split(". This is typically", 1)[0].strip()
        if timed_out is not None:
            waited = int(timed_out.group(1)) / 1000 if timed_out.group(1) else timeout_s
            after = f" after {waited:g} s" if waited is not None else ""
            return (
                f"rank {rank}: {where} timed out{after} (the process group timeout: ${ENV_PG_TIMEOUT} or "
                f"init_process_group(timeout=)) with no data from a peer: the network link to a peer is down, "
                f"or a peer hangs [gloo: {gloo}]"
            )
        address = _PEER_ADDRESS.search(text)
        peer = f"the peer at {address.group(1)}" if address else "a peer"
        return (
            f"rank {rank}: {where} failed: the connection to {peer} was closed: that peer's process died or "
            f"gave up (see its log) [gloo: {gloo}]"
        )
    return None


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _collective(error: BaseException) -> str:
    """``collective all_reduce`` (the outermost ``distributed_c10d`` frame: what the code called),
    else ``a collective waited for at file:line (function)`` (the innermost frame: an asynchronous one)."""
    frames = traceback.extract_tb(error.__traceback__)
    called = [f for f in frames if f.filename.endswith(_C10D_MODULE) and not f.name.startswith("_")]
    if called:
        return f"collective {called[0].name}"
    if not frames:
        return "a collective"
    last = frames[-1]
    return f"a collective waited for at {_short(last.filename)}:{last.lineno} ({last.name})"


def _short(path: str) -> str:
    parts = path.replace(os.sep, "/").split("/")
    for anchor in ("site-packages", "torchrec_het", "recipes"):
        if anchor in parts:
            start = parts.index(anchor) + (1 if anchor == "site-packages" else 0)
            return "/".join(parts[start:])
    return "/".join(parts[-2:])

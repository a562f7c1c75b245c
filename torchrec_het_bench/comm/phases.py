"""Which phase of a training step a collective belongs to.

Rules, first match wins:

1. an explicit :func:`phase` override on this thread (innermost wins; the DDP
   hook of :mod:`torchrec_het_bench.comm.ddp` uses it to mark ``dense_allreduce``, and
   :func:`replica_sync_as_backward` marks the plugin's replica syncs ``bwd_grad``, wherever
   they run: at the end of the backward pass, or in the next read);
2. inside an autograd backward node -> ``bwd_grad``;
3. while TorchRec's KJT input dist is on the Python stack (a frame of a
   ``KJT*`` / ``SplitsAllToAll*`` class of ``torchrec/distributed/dist_data.py``
   or ``FusedKJT*`` of ``embedding_sharding.py``, or any function named
   ``input_dist``) -> ``fwd_ids``, which puts per-id weights there too;
4. otherwise by the dtype of what is sent: floating point and ``uint8`` (the
   payload of TorchRec's int8 and mx4 quantized-comms codecs; ids are never sent as
   bytes) -> ``fwd_emb``, other integers -> ``fwd_ids``.

Unpooled ``EmbeddingCollection`` lookups need nothing more: their ids go through the
same KJT input dist (rule 3), the per-id embeddings come back through
``SequenceEmbeddingsAllToAll`` in forward (rule 4, float) and their gradients in
backward (rule 2).
"""

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import CodeType, FrameType

import torch

from torchrec_het_bench.comm.totals import PHASES

_INPUT_DIST_CLASS_PREFIXES = {
    os.path.join("torchrec", "distributed", "dist_data.py"): ("KJT", "SplitsAllToAll"),
    os.path.join("torchrec", "distributed", "embedding_sharding.py"): ("FusedKJT", "KJT"),
}
_INPUT_DIST_FUNCTION = "input_dist"

_local = threading.local()
_code_is_input_dist: dict[CodeType, bool] = {}


def _override_stack() -> list[str]:
    stack = getattr(_local, "phases", None)
    if stack is None:
        stack = _local.phases = []
    return stack


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Counts every collective this thread issues inside the block under phase ``name``.

    Args:
        name: one of ``fwd_ids``, ``fwd_emb``, ``bwd_grad``, ``dense_allreduce``, ``other``.

    Raises:
        ValueError: for any other name.
    """
    if name not in PHASES:
        raise ValueError(f"unknown phase {name!r}; expected one of {PHASES}")
    stack = _override_stack()
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def _input_dist_prefixes(filename: str) -> tuple[str, ...]:
    for suffix, prefixes in _INPUT_DIST_CLASS_PREFIXES.items():
        if filename.endswith(suffix):
            return prefixes
    return ()


def _owner_name(frame: FrameType) -> str:
    qualname = getattr(frame.f_code, "co_qualname", None)  # Python >= 3.11
    if qualname is not None:
        return qualname
    owner = frame.f_locals.get("self")
    return type(owner).__name__ if owner is not None else frame.f_code.co_name


def _is_input_dist_frame(frame: FrameType) -> bool:
    code = frame.f_code
    verdict = _code_is_input_dist.get(code)
    if verdict is None:
        prefixes = _input_dist_prefixes(code.co_filename)
        verdict = code.co_name == _INPUT_DIST_FUNCTION or (bool(prefixes) and _owner_name(frame).startswith(prefixes))
        if hasattr(code, "co_qualname") or not prefixes:
            _code_is_input_dist[code] = verdict
    return verdict


def _in_input_dist(frame: FrameType | None) -> bool:
    while frame is not None:
        if _is_input_dist_frame(frame):
            return True
        frame = frame.f_back
    return False


def classify(dtype: torch.dtype) -> str:
    """The phase of a collective issued now, on this thread, sending tensors of ``dtype``."""
    stack = _override_stack()
    if stack:
        return stack[-1]
    if torch._C._current_autograd_node() is not None:
        return "bwd_grad"
    if _in_input_dist(sys._getframe(1)):
        return "fwd_ids"
    return "fwd_emb" if dtype.is_floating_point or dtype.is_complex or dtype == torch.uint8 else "fwd_ids"


@contextmanager
def replica_sync_as_backward() -> Iterator[None]:
    """While open, every collective of a row-replicated block's gradient sync, and the owners'
    deferred gradients (``Exchange.start_gradient``), count as ``bwd_grad``: they carry the
    backward's gradients, though they start at the end of the backward pass (a callback outside
    any autograd node) or finish in the next read."""
    from torchrec_het.sharding.common.exchange import Exchange
    from torchrec_het.sharding.row_replicated.replicas import ReplicaBlock

    methods = [(ReplicaBlock, name) for name in ("_start", "advance", "wait")] + [(Exchange, "start_gradient")]
    originals = {(owner, name): getattr(owner, name) for owner, name in methods}

    def counted(method):
        def run(*args, **kwargs):
            with phase("bwd_grad"):
                return method(*args, **kwargs)

        return run

    for (owner, name), method in originals.items():
        setattr(owner, name, counted(method))
    try:
        yield
    finally:
        for (owner, name), method in originals.items():
            setattr(owner, name, method)

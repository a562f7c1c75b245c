"""Counts the bytes of every collective a process issues, by wrapping ``torch.distributed``.

:class:`CommAccountant` replaces the collective functions on the
``torch.distributed`` module while it is entered and puts the originals back on
exit (also when the block raises). TorchRec calls ``dist.all_to_all_single(...)``
and friends through that module at call time, so the wrappers see them without
any change to the code being measured. A wrapper calls the original with the
same arguments and returns what it returned (``async_op=True`` work handles
included) or lets its exception through; only calls that returned are counted,
at issue time, and a collective issued from inside another wrapped one is
counted once.

Wrapped: ``all_to_all``, ``all_to_all_single``, ``reduce_scatter``,
``reduce_scatter_tensor``, ``reduce_scatter_single``, ``_reduce_scatter_base``,
``all_gather``, ``all_gather_into_tensor``, ``all_gather_single``,
``_all_gather_base``, ``all_reduce`` and ``broadcast``. They fold into five
families: ``all_to_all``, ``reduce_scatter``, ``all_gather``, ``all_reduce``,
``broadcast``.

Not seen: ``torch.ops._c10d_functional`` (the functional collectives used under
``torch.compile``); collectives that DDP's C++ reducer issues (use
:func:`torchrec_het_bench.comm.ddp.attach_ddp_hooks`, which routes the gradient
buckets through ``dist.all_reduce``); names bound before entering (``from
torch.distributed import all_reduce``) or called inside
``torch.distributed.distributed_c10d`` itself (``all_gather_object``,
``broadcast_object_list``, ``_broadcast_coalesced``); point-to-point, gather,
scatter, reduce, barrier and the ``*_coalesced`` collectives.

Bytes (see :mod:`torchrec_het_bench.comm.sizes` for the per-collective rules) are
what this rank sends, per destination global rank; ``group=`` arguments are
mapped to global ranks. *Payload* sums every destination including the sender
itself, *cross-rank* every other rank, *inter-host* every rank on another host
than the sender. Phases are decided by :func:`torchrec_het_bench.comm.phases.classify`.
"""

import copy
import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from torchrec_het_bench.comm import sizes
from torchrec_het_bench.comm.phases import classify
from torchrec_het_bench.comm.totals import CommTotals


@dataclass(frozen=True)
class _Sent:
    """One collective call as seen by this rank: its group and what it sends to each group rank."""

    group_ranks: list[int]  # global rank of each group rank
    group_rank: int  # this rank's index in group_ranks
    dtype: torch.dtype
    sends: list[int]  # bytes per group rank


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_ranks(group: Any) -> tuple[list[int], int]:
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank()
    return ranks, ranks.index(me) if me in ranks else -1


def _sent(group: Any, dtype: torch.dtype, sends_for: Callable[[int, int], list[int]]) -> _Sent:
    ranks, me = _group_ranks(group)
    return _Sent(ranks, me, dtype, sends_for(len(ranks), me) if me >= 0 else [])


# One sizer per wrapped function, with the argument order of torch 2.13.


def _size_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, *_, **__):
    rows = input.size(0) if input.dim() else 1
    row_bytes = _nbytes(input) // rows if rows else 0
    return _sent(group, input.dtype, lambda n, _: sizes.all_to_all_single_sends(rows, row_bytes, input_split_sizes, n))


def _size_all_to_all(output_tensor_list, input_tensor_list, group=None, *_, **__):
    chunks = [_nbytes(t) for t in input_tensor_list]
    dtype = input_tensor_list[0].dtype if input_tensor_list else torch.uint8
    return _sent(group, dtype, lambda n, _: sizes.per_chunk_sends(chunks))


def _size_reduce_scatter(output, input_list, op=None, group=None, *_, **__):
    chunks = [_nbytes(t) for t in input_list]
    return _sent(group, output.dtype, lambda n, _: sizes.per_chunk_sends(chunks))


def _size_reduce_scatter_tensor(output, input, op=None, group=None, *_, **__):
    return _sent(
        group, input.dtype, lambda n, _: sizes.reduce_scatter_tensor_sends(input.numel(), input.element_size(), n)
    )


def _size_all_gather(tensor_list, tensor, group=None, *_, **__):
    return _sent(group, tensor.dtype, lambda n, _: sizes.all_gather_sends(_nbytes(tensor), n))


def _size_all_gather_into_tensor(output_tensor, input_tensor, group=None, *_, **__):
    return _sent(group, input_tensor.dtype, lambda n, _: sizes.all_gather_sends(_nbytes(input_tensor), n))


def _size_all_reduce(tensor, op=None, group=None, *_, **__):
    return _sent(
        group, tensor.dtype, lambda n, me: sizes.all_reduce_sends(tensor.numel(), tensor.element_size(), n, me)
    )


def _size_broadcast(tensor, src=None, group=None, async_op=False, group_src=None, *_, **__):
    ranks, me = _group_ranks(group)
    source = group_src if group_src is not None else ranks.index(src)
    sends = sizes.broadcast_sends(_nbytes(tensor), len(ranks), me, source) if me >= 0 else []
    return _Sent(ranks, me, tensor.dtype, sends)


_COLLECTIVES: dict[str, tuple[str, Callable[..., _Sent]]] = {
    "all_to_all_single": ("all_to_all", _size_all_to_all_single),
    "all_to_all": ("all_to_all", _size_all_to_all),
    "reduce_scatter": ("reduce_scatter", _size_reduce_scatter),
    "reduce_scatter_tensor": ("reduce_scatter", _size_reduce_scatter_tensor),
    "reduce_scatter_single": ("reduce_scatter", _size_reduce_scatter_tensor),
    "_reduce_scatter_base": ("reduce_scatter", _size_reduce_scatter_tensor),
    "all_gather": ("all_gather", _size_all_gather),
    "all_gather_into_tensor": ("all_gather", _size_all_gather_into_tensor),
    "all_gather_single": ("all_gather", _size_all_gather_into_tensor),
    "_all_gather_base": ("all_gather", _size_all_gather_into_tensor),
    "all_reduce": ("all_reduce", _size_all_reduce),
    "broadcast": ("broadcast", _size_broadcast),
}
WRAPPED_NAMES = tuple(_COLLECTIVES)

_local = threading.local()  # .depth: wrapped calls in progress on this thread
_install_lock = threading.Lock()
_installed: "CommAccountant | None" = None


@contextmanager
def _uncounted() -> Iterator[None]:
    """Collectives this thread issues inside the block pass through uncounted."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


class CommAccountant:
    """Counts collective bytes per phase while entered; one per process.

    Entering installs the wrappers on ``torch.distributed`` (nested ``with``
    blocks on the same accountant are fine), leaving the outermost block puts
    the original functions back exactly, whatever happened inside.

    Attributes:
        enabled: counting is paused while False; the wrappers stay installed.
    """

    def __init__(self) -> None:
        self.enabled = True
        self._lock = threading.Lock()
        self._totals: CommTotals | None = None
        self._originals: dict[str, Callable] = {}
        self._entered = 0

    def __enter__(self) -> "CommAccountant":
        if self._entered == 0:
            self._install()
        self._entered += 1
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._entered -= 1
        if self._entered == 0:
            self._uninstall()

    @property
    def installed(self) -> bool:
        """Whether this accountant's wrappers are on ``torch.distributed`` now."""
        return bool(self._originals)

    def reset(self) -> None:
        """Forgets everything counted so far."""
        with self._lock:
            self._totals = None

    def totals(self) -> CommTotals:
        """A copy of what this rank sent since the last :meth:`reset`."""
        with self._lock:
            if self._totals is None:
                return CommTotals(dist.get_world_size() if dist.is_initialized() else 1)
            return copy.deepcopy(self._totals)

    def _install(self) -> None:
        global _installed
        with _install_lock:
            if _installed is not None:
                raise RuntimeError("another CommAccountant is already installed in this process")
            present = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
            for name, original in present.items():
                family, sizer = _COLLECTIVES[name]
                setattr(dist, name, self._wrap(original, family, sizer))
            self._originals = present
            _installed = self

    def _uninstall(self) -> None:
        global _installed
        with _install_lock:
            for name, original in self._originals.items():
                setattr(dist, name, original)
            self._originals = {}
            _installed = None

    def _wrap(self, original: Callable, family: str, sizer: Callable[..., _Sent]) -> Callable:
        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.enabled or getattr(_local, "depth", 0):
                return original(*args, **kwargs)
            with _uncounted():
                result = original(*args, **kwargs)
                self._record(family, sizer(*args, **kwargs))
            return result

        return counted

    def _record(self, family: str, sent: _Sent) -> None:
        if sent.group_rank < 0:  # this rank is not in the group: torch did nothing
            return
        phase_name = classify(sent.dtype)
        world_size = dist.get_world_size()
        sends = [0] * world_size
        for group_rank, n in enumerate(sent.sends):
            sends[sent.group_ranks[group_rank]] += n
        with self._lock:
            if self._totals is None:
                self._totals = CommTotals(world_size)
            self._totals.add_sends(phase_name, family, dist.get_rank(), sends)


def sum_over_ranks(totals: CommTotals, group: Any = None) -> CommTotals:
    """Every rank's totals added up; a collective over ``group`` that is itself not counted.

    Args:
        totals: this rank's totals (e.g. ``accountant.totals()``).
        group: process group to sum over; the default group when ``None``.

    Returns:
        The summed totals, the same on every rank of ``group``.
    """
    dense = totals.as_tensor()
    with _uncounted():
        dist.all_reduce(dense, group=group)
    return CommTotals.from_tensor(totals.world_size, dense)

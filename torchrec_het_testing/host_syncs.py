"""Counts host syncs: Python reading a tensor's value (``.tolist()``, ``.item()``, ``int(t)``, ...).

Each such read makes the host wait for the tensor (on a GPU, for the kernels that
produce it). :func:`count_host_syncs` patches the ``torch.Tensor`` methods behind
them while it is entered and restores them on exit. It counts Python-level reads
only: data-dependent shapes inside operators (``nonzero``, boolean-mask indexing,
``torch.unique``) also wait on a GPU but are not seen here.
"""

import functools
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch

SYNC_METHODS = ("tolist", "item", "__int__", "__bool__", "__float__", "__index__")

_local = threading.local()  # .depth: patched calls in progress on this thread (a read inside a read counts once)


@contextmanager
def count_host_syncs(where: bool = True) -> Iterator[Counter]:
    """Counts host syncs per method while the block runs; ``Counter.total()`` is the sum.

    Only reads of tensors with more than zero elements count (an empty ``tolist()`` reads
    nothing), and reads issued from inside another counted read count once.

    Args:
        where: also count per calling site (``"file:line"`` keys prefixed ``at:``), for finding them.
    """
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNC_METHODS}

    def wrap(name, original):
        @functools.wraps(original)
        def counted(self, *args, **kwargs):
            if getattr(_local, "depth", 0) or self.numel() == 0:
                return original(self, *args, **kwargs)
            counts[name] += 1
            if where:
                import sys

                frame = sys._getframe(1)
                counts[f"at:{frame.f_code.co_filename}:{frame.f_lineno}"] += 1
            _local.depth = 1
            try:
                return original(self, *args, **kwargs)
            finally:
                _local.depth = 0

        return counted

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def total(counts: Counter) -> int:
    """Host syncs in ``counts`` (the per-site ``at:`` keys left out)."""
    return sum(n for key, n in counts.items() if key in SYNC_METHODS)

"""Per-rank memory figures: resident set size of the process, bytes of model state, live Python objects."""

import ctypes
import gc
import os
from collections import Counter

import torch
from torch import nn

_STATUS = "/proc/self/status"


def _status_kb(field: str) -> int:
    with open(_STATUS) as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in {_STATUS}")


def rss_mb() -> float:
    """Current resident set size of this process, MiB."""
    return _status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
    """Peak resident set size since start or since the last :func:`reset_peak_rss`, MiB."""
    return _status_kb("VmHWM") / 1024


def reset_peak_rss() -> bool:
    """Resets the kernel's peak-RSS mark to the current RSS; False where not permitted."""
    try:
        with open(f"/proc/{os.getpid()}/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def _local_tensors(value: object) -> list[torch.Tensor]:
    if hasattr(value, "local_shards"):  # ShardedTensor
        return [shard.tensor for shard in value.local_shards()]  # type: ignore[attr-defined]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _local_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _local_tensors(v)]
    return []


def state_mb(model: nn.Module, optimizer: torch.optim.Optimizer) -> float:
    """MiB of this rank's model parameters, buffers and optimizer state (local shards only)."""
    seen: set[int] = set()
    total = 0
    tensors = _local_tensors(model.state_dict()) + _local_tensors(optimizer.state_dict()["state"])
    for tensor in tensors:
        key = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" else id(tensor)
        if key in seen:
            continue
        seen.add(key)
        total += tensor.untyped_storage().nbytes()
    return total / 2**20


def release_free_memory() -> bool:
    """Hands the C allocator's free pages back to the kernel (glibc ``malloc_trim``), so RSS shows what is
    live and memory freed by one entry does not hide another's growth; False where libc has no such call."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33): byte counts over all arenas."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_mb() -> tuple[float, float] | None:
    """``(in use, free)`` MiB of the C heap (glibc's ``mallinfo2``): bytes handed out by malloc (tensors' storage
    included, mmapped chunks too) and bytes freed but kept by the allocator (resident or not: ``malloc_trim``
    returns their pages but they stay counted). RSS that grows while ``in use`` stays flat is freed memory the
    allocator keeps, not live data. None without glibc >= 2.33."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def live_objects(by_type: bool = False) -> tuple[int, int, Counter | None]:
    """Objects that survive a full garbage collection: ``(torch tensors, all gc-tracked objects,
    counts by type or None)``. Takes a fraction of a second with TorchRec loaded. Counting touches no
    attribute of an object (names of types: :func:`type_name`, later), so it creates nothing itself."""
    gc.collect()
    objects = gc.get_objects()
    try:
        tensors = sum(
            1 for obj in objects if issubclass(type(obj), torch.Tensor)
        )  # type(): no __class__ lookups (deprecated proxies warn)
        types = Counter(type(obj) for obj in objects) if by_type else None
        return tensors, len(objects), types
    finally:
        del objects


def type_name(kind: type) -> str:
    """``module.QualifiedName`` of a type."""
    return f"{kind.__module__}.{kind.__qualname__}"

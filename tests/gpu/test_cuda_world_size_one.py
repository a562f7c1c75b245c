"""The plugin's types train exactly on CUDA, world size 1 (deliverable 8: device-agnostic).

``test_cuda_world_size_one`` runs the generic sharded-vs-unsharded cases
(:mod:`torchrec_het_testing.equivalence`) on the GPU with NCCL, in one process: pooled tables
(with weighted ones) on het_cached_row_wise at s = 0 and on het_row_replicated with hot rows,
and with a per-host tier too (the unstaged lookups), and sequence tables on het_row_replicated
likewise, with each fused optimizer. It is marked ``gpu`` and skips where no CUDA device or no
CUDA build of fbgemm_gpu exists. ``test_cpu_world_size_one`` runs the same cases on the CPU
(gloo) in the normal suite, so the body is proven where no GPU is at hand.
"""

import pytest
import torch

from torchrec_het.config import CacheSettings
from torchrec_het_testing.equivalence import EquivalenceCase, run_cases
from torchrec_het_testing.expectations import case_problems
from torchrec_het_testing.settings import ReplicaSettings
from torchrec_het_testing.spawn import one_rank_group

REP = "het_row_replicated"
CASES = [
    EquivalenceCase(tables, sharding, settings, optimizer, world_size=1)
    for optimizer in ("sgd", "adagrad", "rowwise_adagrad")
    for tables, sharding, settings in (
        ("bags", "het_cached_row_wise", CacheSettings(s_read=0, s_write=0, capacity=0.3)),
        ("bags", REP, ReplicaSettings(hot=8)),
        ("bags", REP, ReplicaSettings(hot=8, per_host=3)),
        ("sequences", REP, ReplicaSettings(hot=8)),
        ("sequences", REP, ReplicaSettings(hot=8, per_host=3)),
    )
]


def _cuda_missing() -> str | None:
    """Why the CUDA test cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    import fbgemm_gpu

    variant = getattr(fbgemm_gpu, "__variant__", "unknown")
    if variant not in ("cuda", "rocm"):
        return (
            f"the installed fbgemm_gpu has no GPU kernels (variant {variant!r}; install fbgemm-gpu, not fbgemm-gpu-cpu)"
        )
    return None


def _check(device: torch.device, store_dir) -> None:
    with one_rank_group(device, store_dir):
        results = run_cases(CASES, device)
    problems = {case.name: case_problems(case, [results[case.name]]) for case in CASES}
    assert not any(problems.values()), {name: p for name, p in problems.items() if p}


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_missing() is not None, reason=str(_cuda_missing()))
def test_cuda_world_size_one(tmp_path) -> None:
    _check(torch.device("cuda", 0), tmp_path)


def test_cpu_world_size_one(tmp_path) -> None:
    _check(torch.device("cpu"), tmp_path)

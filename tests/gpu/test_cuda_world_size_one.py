"""The plugin's types train exactly on CUDA, world size 1 (deliverable 8: device-agnostic).

``test_cuda_world_size_one`` shards a small EBC (het_cached_row_wise at s = 0,
het_row_replicated with hot rows, and with a per-host tier too, which takes the unstaged
lookups) and a pair of ECs (het_row_replicated, likewise) on the GPU with
NCCL, trains them with each fused optimizer and compares outputs and weights with the
unsharded model at 1e-5. It is marked ``gpu`` and skips where no CUDA device or no CUDA
build of fbgemm_gpu exists. ``test_cpu_world_size_one`` runs the same body on the CPU
(gloo) in the normal suite, so the body is proven where no GPU is at hand.
"""

import pytest
import torch

from torchrec_het_testing.het_ranks import STEPS
from torchrec_het_testing.replicated_device import CASES, DEVICE_OPTIMIZERS, world_size_one

TOLERANCE = 1e-5


def _cuda_missing() -> str | None:
    """Why the CUDA test cannot run here, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    import fbgemm_gpu

    variant = getattr(fbgemm_gpu, "__variant__", "unknown")
    if variant not in ("cuda", "rocm"):
        return f"the installed fbgemm_gpu has no GPU kernels (variant {variant!r}; install fbgemm-gpu, not fbgemm-gpu-cpu)"
    return None


def _check(results: dict) -> None:
    assert sorted(results) == sorted(f"{c}/{o}" for c in CASES for o in DEVICE_OPTIMIZERS)
    for case, errors in results.items():
        errors = dict(errors)
        if case.startswith("het_row_replicated"):  # hot rows were read from replicas and synced every step
            assert errors.pop("replica_syncs") >= STEPS, (case, errors)
        expected = {"out_rep_vs_unsharded", "weights_rep_vs_unsharded"} if "/sequences" in case else {
            "out/sum", "out/mean", "weights/sum", "weights/mean"
        }
        assert set(errors) == expected, (case, errors)
        for key, value in errors.items():
            assert value < TOLERANCE, (case, key, errors)


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_missing() is not None, reason=str(_cuda_missing()))
def test_cuda_world_size_one(tmp_path) -> None:
    _check(world_size_one(torch.device("cuda", 0), store_dir=tmp_path))


def test_cpu_world_size_one(tmp_path) -> None:
    _check(world_size_one(torch.device("cpu"), store_dir=tmp_path))

"""Reading and comparing runs of the DLRM recipe (``recipes/train_dlrm.py``) for fault tests.

A run prints ``worker rank <r> pid <p> attempt <a>`` (every rank, first), and rank 0 prints
``checkpoint step <n> saved <dir>`` once a checkpoint is complete, ``loaded checkpoint step
<n> <dir>`` when it resumes and ``final step <n>`` at the end. These helpers read those lines
and compare what two runs left: their unsharded weights (``--save-weights``) and their
checkpoints (every tensor: model, optimizer state and step).
"""

import re
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from torchrec_het_testing.launched import first_match


def steps_logged(lines: list[str]) -> list[int]:
    """The steps of the ``step <n> loss <x>`` lines, in order."""
    return [int(m.group(1)) for line in lines if (m := re.match(r"^step (\d+) loss \d", line))]


def attempts_of(lines: list[str], rank: int) -> list[int]:
    """The attempts (torchrun restarts) rank ``rank`` started, in order."""
    return [int(m.group(1)) for line in lines if (m := re.match(rf"^worker rank {rank} pid \d+ attempt (\d+)$", line))]


def resumed_step(lines: list[str]) -> int | None:
    """The step of the first ``loaded checkpoint step <n>`` line, or None."""
    match = first_match(lines, r"^loaded checkpoint step (\d+) ")
    return int(match.group(1)) if match else None


def newest_checkpoint_before_restart(lines: list[str]) -> int | None:
    """The newest checkpoint rank 0's first attempt completed (its lines before ``attempt 1``)."""
    restart = next(
        (i for i, line in enumerate(lines) if re.match(r"^worker rank 0 pid \d+ attempt 1$", line)), len(lines)
    )
    saved = [int(m.group(1)) for line in lines[:restart] if (m := re.match(r"^checkpoint step (\d+) saved ", line))]
    return max(saved, default=None)


def max_abs_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between same-named tensors of ``a`` and ``b``.

    Raises:
        AssertionError: the names or a tensor's shape differ.
    """
    assert sorted(a) == sorted(b), f"different tensors: {sorted(set(a) ^ set(b))[:10]}"
    worst = 0.0
    for name, tensor in a.items():
        other = b[name]
        assert tensor.shape == other.shape, f"{name}: shape {tuple(tensor.shape)} vs {tuple(other.shape)}"
        if tensor.numel():
            worst = max(worst, (tensor.double() - other.double()).abs().max().item())
    return worst


def saved_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The unsharded weights a run saved with ``--save-weights``."""
    return torch.load(path)


def checkpoint_tensors(directory: str | Path, scratch: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``torch.distributed.checkpoint`` directory, unsharded, by dotted name.

    Args:
        directory: the checkpoint (``<path>/step_<n>``).
        scratch: a file path it may write the converted checkpoint to.
    """
    dcp_to_torch_save(str(directory), str(scratch))
    flat: dict[str, torch.Tensor] = {}
    stack = [("", torch.load(scratch, weights_only=False))]
    while stack:
        prefix, node = stack.pop()
        for key, value in node.items():
            if isinstance(value, dict):
                stack.append((f"{prefix}{key}.", value))
            elif isinstance(value, torch.Tensor):
                flat[f"{prefix}{key}"] = value
    return flat

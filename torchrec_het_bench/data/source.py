"""The protocol every data source implements, and helpers shared by the sources."""

from typing import Protocol, runtime_checkable

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

SPLITS = ("train", "eval")


@runtime_checkable
class BatchSource(Protocol):
    """A random-access stream of ``Batch``es: any (step, rank, split), in any order.

    Attributes:
        feature_names: pooled sparse keys, one table per key (``cat_0``..).
        table_sizes: rows of each key's table, in ``feature_names`` order.
        num_dense: dense features per sample.
    """

    feature_names: list[str]
    table_sizes: list[int]
    num_dense: int

    def batch(self, step: int, rank: int, split: str = "train") -> Batch:
        """The batch of ``rank`` at ``step`` of ``split`` ("train" or "eval")."""
        ...


class DataExhaustedError(IndexError):
    """A step asks for rows beyond the end of the data."""


def check_request(step: int, rank: int, split: str, world_size: int | None = None) -> None:
    """Raises a ValueError naming the argument if a batch request is malformed.

    Args:
        step: step index (>= 0).
        rank: rank index (>= 0, and < world_size when given).
        split: "train" or "eval".
        world_size: ranks sharing the stream, if the source knows it.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if rank < 0 or (world_size is not None and rank >= world_size):
        bound = f" and < world_size ({world_size})" if world_size is not None else ""
        raise ValueError(f"rank must be >= 0{bound}, got {rank}")


def one_hot_kjt(keys: list[str], ids: torch.Tensor) -> KeyedJaggedTensor:
    """A KJT with one id per (sample, key).

    Args:
        keys: feature names, one per column of ``ids``.
        ids: int64 row ids, shape [batch, len(keys)].
    """
    batch_size = ids.shape[0]
    return KeyedJaggedTensor(
        keys=keys,
        values=ids.t().contiguous().view(-1),
        lengths=torch.ones(len(keys) * batch_size, dtype=torch.int32),
        stride=batch_size,
    )

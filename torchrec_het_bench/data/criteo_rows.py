"""Shared machinery of the Criteo readers: splits, row blocks per (step, rank), batches.

A reader is a list of row files. ``batch(step, rank, split)`` reads rows
``[(step * world_size + rank) * batch_size, + batch_size)`` of the split, where the
splits are, in order of preference:

* ``eval_paths`` given: train = all ``paths``, eval = all ``eval_paths``;
* several files: train = all but the last, eval = the last (Criteo's days are in time
  order, so eval is the latest day);
* one file: train = its first rows, eval = its last ``eval_fraction`` of rows (this
  needs the file's row count, so a TSV file is scanned once, on first use).
"""

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torchrec.datasets.utils import Batch

from torchrec_het_bench.data.config import CRITEO_KAGGLE_CARDINALITIES, CRITEO_NUM_DENSE, CRITEO_NUM_SPARSE
from torchrec_het_bench.data.source import DataExhaustedError, check_request, one_hot_kjt

DENSE_NAMES = [f"int_{i}" for i in range(CRITEO_NUM_DENSE)]
SPARSE_NAMES = [f"cat_{i}" for i in range(CRITEO_NUM_SPARSE)]


def join_path(directory: str, name: str) -> str:
    """``directory/name`` for any iopath path (keeps ``scheme://`` intact)."""
    return directory + name if directory.endswith("/") else f"{directory}/{name}"


class RowFile(Protocol):
    """One file of Criteo rows."""

    path: str

    def count_rows(self, limit: int | None = None) -> int:
        """Rows in the file, or ``limit`` if the file has at least that many (may read less)."""
        ...

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows [start, start + count): dense float32 [c, 13], raw sparse int64 [c, 26], labels float32 [c]."""
        ...


@dataclass(frozen=True)
class _Segment:
    file: RowFile
    first: int
    stop: int | None  # None: to the end of the file


class CriteoRowSource:
    """Base of the Criteo readers (see the module docstring for the splits).

    Args:
        files: training row files, in order.
        eval_files: held-out row files; None derives eval from ``files``.
        batch_size: rows per batch (per rank).
        table_sizes: rows of each of the 26 tables; raw ids are taken modulo these.
        world_size: ranks reading disjoint row blocks of the same step.
        eval_fraction: share of a single file's rows held out for eval.

    Attributes:
        feature_names: ``cat_0..cat_25``.
        table_sizes: rows of each table.
        num_dense: 13.
    """

    num_dense = CRITEO_NUM_DENSE

    def __init__(
        self,
        files: list[RowFile],
        eval_files: list[RowFile] | None,
        *,
        batch_size: int,
        table_sizes: tuple[int, ...] | list[int] | None = None,
        world_size: int = 1,
        eval_fraction: float = 0.1,
    ) -> None:
        table_sizes = list(CRITEO_KAGGLE_CARDINALITIES if table_sizes is None else table_sizes)
        if len(table_sizes) != CRITEO_NUM_SPARSE:
            raise ValueError(
                f"table_sizes has {len(table_sizes)} entries; Criteo data has {CRITEO_NUM_SPARSE} categorical features"
            )
        for index, rows in enumerate(table_sizes):
            if rows < 1:
                raise ValueError(f"table_sizes[{index}] must be >= 1, got {rows}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        if not files:
            raise ValueError("no training files given")
        self.feature_names = list(SPARSE_NAMES)
        self.table_sizes = [int(rows) for rows in table_sizes]
        self.batch_size = batch_size
        self.world_size = world_size
        self.eval_fraction = eval_fraction
        self._files = files
        self._eval_files = eval_files
        self._sizes = np.asarray(self.table_sizes, dtype=np.int64)
        self._split_segments: dict[str, list[_Segment]] | None = None

    def num_rows(self, split: str = "train") -> int:
        """Rows of ``split`` (reads a TSV split to its end)."""
        return sum(self._segment_rows(segment) for segment in self._segments(split))

    def batch(self, step: int, rank: int, split: str = "train") -> Batch:
        """Row block ``(step * world_size + rank)`` of ``split`` as a one-hot Batch."""
        check_request(step, rank, split, self.world_size)
        start = (step * self.world_size + rank) * self.batch_size
        dense, sparse, labels = self._read(split, start, step, rank)
        ids = torch.from_numpy(np.mod(sparse, self._sizes))
        return Batch(
            dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
            sparse_features=one_hot_kjt(self.feature_names, ids),
            labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32)),
        )

    def _segments(self, split: str) -> list[_Segment]:
        if self._split_segments is None:
            self._split_segments = self._make_splits()
        return self._split_segments[split]

    def _make_splits(self) -> dict[str, list[_Segment]]:
        if self._eval_files is not None:
            if not self._eval_files:
                raise ValueError("eval_paths is empty")
            return {
                "train": [_Segment(f, 0, None) for f in self._files],
                "eval": [_Segment(f, 0, None) for f in self._eval_files],
            }
        if len(self._files) >= 2:
            return {
                "train": [_Segment(f, 0, None) for f in self._files[:-1]],
                "eval": [_Segment(self._files[-1], 0, None)],
            }
        only = self._files[0]
        rows = only.count_rows()
        if rows < 2:
            raise ValueError(f"{only.path} has {rows} rows; a single file needs >= 2 to hold out eval rows")
        held_out = max(1, math.floor(rows * self.eval_fraction))
        return {"train": [_Segment(only, 0, rows - held_out)], "eval": [_Segment(only, rows - held_out, rows)]}

    @staticmethod
    def _segment_rows(segment: _Segment, limit: int | None = None) -> int:
        """Rows in the segment, or at least ``limit`` if it has that many."""
        if segment.stop is not None:
            return segment.stop - segment.first
        wanted = None if limit is None else segment.first + limit
        return max(0, segment.file.count_rows(wanted) - segment.first)

    def _read(self, split: str, start: int, step: int, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pieces = []
        offset, remaining = start, self.batch_size
        for segment in self._segments(split):
            available = self._segment_rows(segment, offset + remaining)
            if offset >= available:
                offset -= available
                continue
            take = min(remaining, available - offset)
            pieces.append(segment.file.read(segment.first + offset, take))
            remaining -= take
            offset = 0
            if remaining == 0:
                break
        if remaining:
            raise DataExhaustedError(
                f"{split} split ({self._describe(split)}) has {self.num_rows(split)} rows, but step {step} of rank "
                f"{rank} (world_size {self.world_size}, batch_size {self.batch_size}) needs rows "
                f"[{start}, {start + self.batch_size})"
            )
        if len(pieces) == 1:
            return pieces[0]
        return tuple(np.concatenate(parts) for parts in zip(*pieces))  # type: ignore[return-value]

    def _describe(self, split: str) -> str:
        names = list(dict.fromkeys(segment.file.path for segment in self._segments(split)))
        return names[0] if len(names) == 1 else f"{len(names)} files from {names[0]}"

"""Reader of torchrec's binary Criteo layout: ``day_{i}_{dense,sparse,labels}.npy``.

As written by ``torchrec.datasets.criteo.BinaryCriteoUtils.tsv_to_npys``: dense float32
[N, 13] (already log-transformed by the converter, used as stored), sparse int [N, 26]
(raw ids; row id = id modulo the table size, so negative
ids from an int32 overflow still land in range), labels int [N, 1] or [N]. Arrays are
memory-mapped (``mmap_mode="r"``) from ``PathManager.get_local_path``.
"""

import re

import numpy as np
from iopath.common.file_io import PathManager

from torchrec_het_bench.data.criteo_rows import DENSE_NAMES, SPARSE_NAMES, CriteoRowSource, join_path

_DAY_FILE = re.compile(r"day_(\d+)_(dense|sparse|labels)\.npy")
_PARTS = ("dense", "sparse", "labels")


def find_npy_days(directory: str, path_manager: PathManager) -> list[int]:
    """Day numbers with at least one ``day_{i}_*.npy`` file in ``directory``, ascending."""
    days = {int(m.group(1)) for m in map(_DAY_FILE.fullmatch, path_manager.ls(directory)) if m}
    return sorted(days)


class NpyDayFile:
    """The three memory-mapped arrays of one day.

    Args:
        directory: folder holding the day's files.
        day: day number.
        path_manager: resolves the paths to local files.
    """

    def __init__(self, directory: str, day: int, path_manager: PathManager) -> None:
        base = join_path(directory, f"day_{day}")
        self.path = f"{base}_*.npy"
        arrays = {}
        for part in _PARTS:
            path = f"{base}_{part}.npy"
            if not path_manager.isfile(path):
                raise FileNotFoundError(f"Criteo npy file not found: {path} (day {day} needs {_PARTS} files)")
            try:
                arrays[part] = np.load(path_manager.get_local_path(path), mmap_mode="r")
            except ValueError as error:
                raise ValueError(f"{path}: not a readable .npy array ({error})") from None
        self._dense, self._sparse, labels = arrays["dense"], arrays["sparse"], arrays["labels"]
        self._check(f"{base}_dense.npy", self._dense, len(DENSE_NAMES), np.floating)
        self._check(f"{base}_sparse.npy", self._sparse, len(SPARSE_NAMES), np.integer)
        if labels.ndim == 2 and labels.shape[1] == 1:
            labels = labels.reshape(-1)
        if labels.ndim != 1:
            raise ValueError(f"{base}_labels.npy: expected shape [N] or [N, 1], got {list(labels.shape)}")
        self._labels = labels
        lengths = {part: len(a) for part, a in zip(_PARTS, (self._dense, self._sparse, self._labels))}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"{base}_*.npy: row counts differ: {lengths}")
        self.rows = lengths["dense"]

    @staticmethod
    def _check(path: str, array: np.ndarray, columns: int, kind: type) -> None:
        if array.ndim != 2 or array.shape[1] != columns:
            raise ValueError(f"{path}: expected shape [N, {columns}], got {list(array.shape)}")
        if not np.issubdtype(array.dtype, kind):
            raise ValueError(f"{path}: expected {kind.__name__} values, got dtype {array.dtype}")

    def count_rows(self, limit: int | None = None) -> int:
        """Rows of the day (known from the headers)."""
        return self.rows

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows [start, start + count): dense float32, raw sparse int64, labels float32."""
        stop = start + count
        if stop > self.rows:
            raise IndexError(f"{self.path} has {self.rows} rows; asked for rows [{start}, {stop})")
        return (
            np.array(self._dense[start:stop], dtype=np.float32),
            np.array(self._sparse[start:stop], dtype=np.int64),
            np.array(self._labels[start:stop], dtype=np.float32),
        )


class CriteoNpySource(CriteoRowSource):
    """torchrec's binary Criteo days as a BatchSource (one-hot ``cat_0..cat_25``, 13 dense).

    Args:
        directory: folder with ``day_{i}_{dense,sparse,labels}.npy``.
        batch_size: rows per batch (per rank).
        table_sizes: rows of each of the 26 tables; None uses the Criteo Kaggle cardinalities.
        world_size: ranks reading disjoint row blocks of each step.
        days: day numbers to train on; None uses every day found.
        eval_days: held-out day numbers; None derives eval from ``days`` (the last day,
            or the tail of a single day; see ``criteo_rows``).
        eval_fraction: share of a single day's rows held out for eval.
        path_manager: iopath manager that resolves the paths.
    """

    def __init__(
        self,
        directory: str,
        *,
        batch_size: int,
        table_sizes: tuple[int, ...] | list[int] | None = None,
        world_size: int = 1,
        days: list[int] | None = None,
        eval_days: list[int] | None = None,
        eval_fraction: float = 0.1,
        path_manager: PathManager | None = None,
    ) -> None:
        path_manager = path_manager or PathManager()
        if not path_manager.isdir(directory):
            raise FileNotFoundError(f"Criteo npy directory not found: {directory}")
        if days is None:
            days = [d for d in find_npy_days(directory, path_manager) if eval_days is None or d not in eval_days]
            if not days:
                raise FileNotFoundError(f"no day_{{i}}_{{dense,sparse,labels}}.npy files in {directory}")
        files = [NpyDayFile(directory, day, path_manager) for day in days]
        eval_files = None if eval_days is None else [NpyDayFile(directory, day, path_manager) for day in eval_days]
        super().__init__(
            files,
            eval_files,
            batch_size=batch_size,
            table_sizes=table_sizes,
            world_size=world_size,
            eval_fraction=eval_fraction,
        )

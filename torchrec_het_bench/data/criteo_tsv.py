"""Reader of raw Criteo TSV files (Kaggle ``train.txt``, Terabyte ``day_N``) through iopath.

Each line is ``label \\t 13 integer dense \\t 26 hex categorical``; dense and categorical
fields may be empty. Dense values become log(1 + max(x, 0)) (empty = 0). A categorical's
row id is its hex value modulo the table size (empty = value 0), as torchrec's
``BinaryCriteoUtils.tsv_to_npys`` stores it, so this reader and the npy reader agree.

Random access: files are scanned lazily (only as far as a request needs) for newline
offsets; every 256th line start is kept, so a batch seeks to the nearest such line.
"""

import re
from collections.abc import Callable

import numpy as np
from iopath.common.file_io import PathManager

from torchrec_het_bench.data.criteo_rows import DENSE_NAMES, SPARSE_NAMES, CriteoRowSource, join_path

_COLUMNS = 1 + len(DENSE_NAMES) + len(SPARSE_NAMES)
_SCAN_CHUNK = 8 << 20
_CHECKPOINT_EVERY = 256
_TSV_NAME = re.compile(r"(.*\.(tsv|txt)|day_\d+)$")


def natural_key(name: str) -> list:
    """Sort key that orders ``day_2`` before ``day_10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def list_tsv_files(directory: str, path_manager: PathManager) -> list[str]:
    """The ``*.tsv``, ``*.txt`` and ``day_N`` files of ``directory``, in natural order."""
    names = sorted((n for n in path_manager.ls(directory) if _TSV_NAME.fullmatch(n)), key=natural_key)
    return [join_path(directory, name) for name in names]


class TsvRowFile:
    """One TSV file with lazy, sparse line indexing.

    Args:
        path: any iopath path.
        path_manager: opens the path.
    """

    def __init__(self, path: str, path_manager: PathManager) -> None:
        if not path_manager.isfile(path):
            raise FileNotFoundError(f"Criteo TSV file not found: {path}")
        self.path = path
        self._path_manager = path_manager
        self._checkpoints = [0]  # byte offset of line i * _CHECKPOINT_EVERY
        self._lines = 0  # lines found so far
        self._scan_offset = 0  # where scanning resumes: the start of line self._lines
        self._eof = False
        self._resume = (0, 0)  # (line, byte offset) just after the last read

    def count_rows(self, limit: int | None = None) -> int:
        """Lines in the file, or a number >= ``limit`` if it has at least that many."""
        if self._eof or (limit is not None and self._lines >= limit):
            return self._lines
        with self._path_manager.open(self.path, "rb") as handle:
            while not self._eof and (limit is None or self._lines < limit):
                handle.seek(self._scan_offset)
                self._scan(handle.read(_SCAN_CHUNK))
        return self._lines

    def _scan(self, chunk: bytes) -> None:
        if not chunk:
            self._eof = True
            return
        ends = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == ord("\n"))
        if ends.size == 0:
            if len(chunk) == _SCAN_CHUNK:
                raise ValueError(f"{self.path}:{self._lines + 1}: line longer than {_SCAN_CHUNK} bytes")
            self._lines += 1  # a last line without a newline
            self._scan_offset += len(chunk)
            self._eof = True
            return
        starts = self._scan_offset + ends + 1  # starts of lines self._lines + 1, + 2, ...
        numbers = np.arange(self._lines + 1, self._lines + 1 + ends.size)
        self._checkpoints.extend(starts[numbers % _CHECKPOINT_EVERY == 0].tolist())
        self._lines += int(ends.size)
        self._scan_offset = int(starts[-1])

    def read(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Parsed lines [start, start + count) (0-based)."""
        if self.count_rows(start + count) < start + count:
            raise IndexError(f"{self.path} has {self._lines} lines; asked for lines [{start}, {start + count})")
        with self._path_manager.open(self.path, "rb") as handle:
            if self._resume[0] == start:
                handle.seek(self._resume[1])
            else:
                checkpoint = start // _CHECKPOINT_EVERY
                handle.seek(self._checkpoints[checkpoint])
                for _ in range(start - checkpoint * _CHECKPOINT_EVERY):
                    handle.readline()
            lines = [handle.readline() for _ in range(count)]
            self._resume = (start + count, handle.tell())
        return self._parse(lines, start)

    def _parse(self, lines: list[bytes], start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        dense = np.empty((len(lines), len(DENSE_NAMES)), dtype=np.float64)
        sparse = np.empty((len(lines), len(SPARSE_NAMES)), dtype=np.int64)
        labels = np.empty(len(lines), dtype=np.float32)
        for row, raw in enumerate(lines):
            where = f"{self.path}:{start + row + 1}"
            try:
                columns = raw.decode("utf-8").rstrip("\r\n").split("\t")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: not UTF-8 text ({error.reason})") from None
            if len(columns) != _COLUMNS:
                raise ValueError(
                    f"{where}: expected {_COLUMNS} tab-separated columns "
                    f"(label, {len(DENSE_NAMES)} integer, {len(SPARSE_NAMES)} categorical), found {len(columns)}"
                )
            if columns[0] not in ("0", "1"):
                raise ValueError(f"{where}: label must be 0 or 1, got {columns[0]!r}")
            labels[row] = float(columns[0])
            dense_fields, sparse_fields = columns[1 : 1 + len(DENSE_NAMES)], columns[1 + len(DENSE_NAMES) :]
            try:
                dense[row] = [_dense_value(v) for v in dense_fields]
            except ValueError:
                raise _bad_field(where, DENSE_NAMES, dense_fields, _dense_value, "an integer") from None
            try:
                sparse[row] = [_sparse_value(v) for v in sparse_fields]
            except ValueError:
                raise _bad_field(where, SPARSE_NAMES, sparse_fields, _sparse_value, "a hexadecimal id") from None
        return np.log1p(np.maximum(dense, 0.0)).astype(np.float32), sparse, labels


def _dense_value(text: str) -> int:
    return int(text) if text else 0


def _sparse_value(text: str) -> int:
    value = int(text, 16) if text else 0
    if not 0 <= value < 2**63:
        raise ValueError(f"hexadecimal id out of range: {text!r}")
    return value


def _bad_field(
    where: str, names: list[str], fields: list[str], parse: Callable[[str], int], expected: str
) -> ValueError:
    for name, value in zip(names, fields):
        try:
            parse(value)
        except ValueError:
            return ValueError(f"{where}: {name} must be {expected} or empty, got {value!r}")
    return ValueError(f"{where}: malformed line")


class CriteoTsvSource(CriteoRowSource):
    """Criteo TSV files as a BatchSource (one-hot ``cat_0..cat_25``, 13 dense).

    Args:
        paths: a TSV file, a directory of them (``*.tsv``, ``*.txt``, ``day_N``), or a list
            of files, in time order.
        batch_size: rows per batch (per rank).
        table_sizes: rows of each of the 26 tables; None uses the Criteo Kaggle cardinalities.
        world_size: ranks reading disjoint row blocks of each step.
        eval_paths: held-out files; None derives eval from ``paths`` (see ``criteo_rows``).
        eval_fraction: share of a single file's rows held out for eval.
        path_manager: iopath manager that opens the paths.
    """

    def __init__(
        self,
        paths: str | list[str],
        *,
        batch_size: int,
        table_sizes: tuple[int, ...] | list[int] | None = None,
        world_size: int = 1,
        eval_paths: str | list[str] | None = None,
        eval_fraction: float = 0.1,
        path_manager: PathManager | None = None,
    ) -> None:
        path_manager = path_manager or PathManager()
        files = [TsvRowFile(p, path_manager) for p in _expand(paths, path_manager)]
        eval_files = (
            None if eval_paths is None else [TsvRowFile(p, path_manager) for p in _expand(eval_paths, path_manager)]
        )
        super().__init__(
            files,
            eval_files,
            batch_size=batch_size,
            table_sizes=table_sizes,
            world_size=world_size,
            eval_fraction=eval_fraction,
        )


def _expand(paths: str | list[str], path_manager: PathManager) -> list[str]:
    expanded = []
    for path in [paths] if isinstance(paths, str) else paths:
        if path_manager.isdir(path):
            found = list_tsv_files(path, path_manager)
            if not found:
                raise FileNotFoundError(f"no Criteo TSV files (*.tsv, *.txt, day_N) in directory {path}")
            expanded.extend(found)
        elif not path_manager.exists(path):
            raise FileNotFoundError(f"Criteo TSV path not found: {path}")
        else:
            expanded.append(path)
    return expanded

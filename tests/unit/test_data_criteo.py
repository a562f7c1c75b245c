import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from iopath.common.file_io import NativePathHandler, PathManager
from torchrec.datasets.criteo import BinaryCriteoUtils

from torchrec_het_bench.data import (
    BatchSource,
    CriteoNpySource,
    CriteoTsvSource,
    DataConfig,
    DataExhaustedError,
    SyntheticCriteo,
    criteo_tsv,
    open_source,
    preset_table_sizes,
)

SIZES = preset_table_sizes("smoke")


def _rows(count: int, seed: int) -> list[list[str]]:
    """Criteo-like rows: label, 13 ints (some empty/negative), 26 hex ids (some empty)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        dense = [str(rng.randint(-2, 500)) if rng.random() > 0.2 else "" for _ in range(13)]
        sparse = [f"{rng.getrandbits(32):08x}" if rng.random() > 0.1 else "" for _ in range(26)]
        rows.append([str(rng.randint(0, 1)), *dense, *sparse])
    return rows


def _write(path: Path, rows: list[list[str]], trailing_newline: bool = True) -> Path:
    text = "\n".join("\t".join(row) for row in rows)
    path.write_text(text + ("\n" if trailing_newline else ""))
    return path


def _expected(rows: list[list[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dense = np.array([[math.log1p(max(int(v or 0), 0)) for v in row[1:14]] for row in rows], dtype=np.float32)
    ids = np.array([[int(v or "0", 16) % size for v, size in zip(row[14:], SIZES)] for row in rows], dtype=np.int64)
    labels = np.array([float(row[0]) for row in rows], dtype=np.float32)
    return dense, ids, labels


def _check_batch(batch, rows: list[list[str]], dense_too: bool = True) -> None:
    dense, ids, labels = _expected(rows)
    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    assert torch.equal(kjt.lengths(), torch.ones(26 * len(rows), dtype=torch.int32))
    assert torch.equal(kjt.values().view(26, len(rows)).t(), torch.from_numpy(ids))
    assert torch.equal(batch.labels, torch.from_numpy(labels))
    if dense_too:
        assert torch.allclose(batch.dense_features, torch.from_numpy(dense))


def test_tsv_batches_are_row_blocks_per_step_and_rank(tmp_path):
    rows = _rows(100, seed=0)
    source = CriteoTsvSource(str(_write(tmp_path / "day_0.tsv", rows)), batch_size=4, table_sizes=SIZES, world_size=3)
    assert isinstance(source, BatchSource)
    assert source.num_dense == 13 and source.table_sizes == list(SIZES)
    assert source.num_rows("train") == 90 and source.num_rows("eval") == 10
    for step, rank in [(2, 1), (0, 0), (6, 2), (7, 0), (2, 1)]:  # any order, repeatable
        first = (step * 3 + rank) * 4
        _check_batch(source.batch(step, rank), rows[first : first + 4])
    _check_batch(source.batch(0, 1, "eval"), rows[94:98])
    with pytest.raises(
        DataExhaustedError, match=r"train split .*day_0.tsv.* has 90 rows.*step 7 of rank 1.*\[88, 92\)"
    ):
        source.batch(7, 1)
    with pytest.raises(ValueError, match="rank"):
        source.batch(0, 3)


def test_tsv_random_access_across_checkpoints_and_scan_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(criteo_tsv, "_SCAN_CHUNK", 1000)  # several scan chunks, lines across chunk edges
    rows = _rows(700, seed=1)
    path = _write(tmp_path / "big.txt", rows, trailing_newline=False)
    source = CriteoTsvSource(str(path), batch_size=7, table_sizes=SIZES)
    for step in [80, 3, 36, 37, 0, 89]:
        _check_batch(source.batch(step, 0), rows[step * 7 : step * 7 + 7])
    assert source.num_rows("eval") == 70
    _check_batch(source.batch(9, 0, "eval"), rows[693:700])


def test_tsv_directory_uses_the_last_file_for_eval_and_spans_files(tmp_path):
    days = [_rows(10, seed=d) for d in range(3)]
    for d, rows in enumerate(days):
        _write(tmp_path / f"day_{d}.tsv", rows)
    (tmp_path / "notes.md").write_text("ignored")
    source = CriteoTsvSource(str(tmp_path), batch_size=6, table_sizes=SIZES, world_size=2)
    _check_batch(source.batch(0, 1), days[0][6:] + days[1][:2])  # rows 6..11 span day_0 and day_1
    _check_batch(source.batch(0, 0, "eval"), days[2][:6])
    with pytest.raises(DataExhaustedError):
        source.batch(1, 0, "eval")
    explicit = CriteoTsvSource(
        [str(tmp_path / "day_1.tsv")], batch_size=5, table_sizes=SIZES, eval_paths=str(tmp_path / "day_0.tsv")
    )
    _check_batch(explicit.batch(1, 0), days[1][5:10])
    _check_batch(explicit.batch(0, 0, "eval"), days[0][:5])


@pytest.mark.parametrize(
    "column, value, message",
    [
        (0, "2", r"bad.tsv:4: label must be 0 or 1, got '2'"),
        (4, "12x", r"bad.tsv:4: int_3 must be an integer or empty, got '12x'"),
        (19, "zz", r"bad.tsv:4: cat_5 must be a hexadecimal id or empty, got 'zz'"),
    ],
)
def test_tsv_bad_fields_name_file_line_and_feature(tmp_path, column, value, message):
    rows = _rows(20, seed=2)
    rows[3][column] = value
    source = CriteoTsvSource(str(_write(tmp_path / "bad.tsv", rows)), batch_size=4, table_sizes=SIZES)
    source.batch(1, 0)  # lines 5..8 are fine
    with pytest.raises(ValueError, match=message):
        source.batch(0, 0)


def test_tsv_wrong_column_count_and_missing_file(tmp_path):
    rows = _rows(20, seed=3)
    rows[5] = rows[5][:-1]
    source = CriteoTsvSource(str(_write(tmp_path / "short.tsv", rows)), batch_size=4, table_sizes=SIZES)
    with pytest.raises(ValueError, match=r"short.tsv:6: expected 40 tab-separated columns .* found 39"):
        source.batch(1, 0)
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        CriteoTsvSource(str(tmp_path / "nope.tsv"), batch_size=4)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no Criteo TSV files"):
        CriteoTsvSource(str(empty), batch_size=4)
    with pytest.raises(ValueError, match="table_sizes has 3 entries"):
        CriteoTsvSource(str(tmp_path / "short.tsv"), batch_size=4, table_sizes=(1, 2, 3))


def _convert(tsv: Path, out_dir: Path, day: int) -> None:
    BinaryCriteoUtils.tsv_to_npys(
        str(tsv),
        str(out_dir / f"day_{day}_dense.npy"),
        str(out_dir / f"day_{day}_sparse.npy"),
        str(out_dir / f"day_{day}_labels.npy"),
    )


def test_npy_days_from_torchrec_converter_match_the_tsv_reader(tmp_path):
    days = [_rows(40, seed=10), _rows(24, seed=20)]
    npy_dir = tmp_path / "npy"
    npy_dir.mkdir()
    for d, rows in enumerate(days):
        _convert(_write(tmp_path / f"day_{d}.tsv", rows), npy_dir, d)
    source = CriteoNpySource(str(npy_dir), batch_size=8, table_sizes=SIZES, world_size=2)
    assert source.num_rows("train") == 40 and source.num_rows("eval") == 24
    stored_dense = np.load(npy_dir / "day_0_dense.npy")
    for step, rank in [(1, 1), (0, 0), (2, 0)]:
        first = (step * 2 + rank) * 8
        batch = source.batch(step, rank)
        _check_batch(batch, days[0][first : first + 8], dense_too=False)
        assert torch.equal(batch.dense_features, torch.from_numpy(stored_dense[first : first + 8]))
    _check_batch(source.batch(1, 0, "eval"), days[1][16:24], dense_too=False)
    with pytest.raises(DataExhaustedError, match="has 40 rows"):
        source.batch(2, 1)
    tsv = CriteoTsvSource(
        str(tmp_path / "day_0.tsv"), batch_size=8, table_sizes=SIZES, eval_paths=str(tmp_path / "day_1.tsv")
    )
    assert torch.equal(tsv.batch(1, 0).sparse_features.values(), source.batch(0, 1).sparse_features.values())


def test_npy_single_day_layout_written_directly(tmp_path):
    rng = np.random.default_rng(0)
    rows = 50
    dense = rng.random((rows, 13), dtype=np.float32)
    sparse = rng.integers(0, 2**40, (rows, 26))
    labels = rng.integers(0, 2, rows).astype(np.int32)  # [N], not [N, 1]
    for name, array in [("dense", dense), ("sparse", sparse), ("labels", labels)]:
        np.save(tmp_path / f"day_3_{name}.npy", array)
    source = CriteoNpySource(str(tmp_path), batch_size=5, table_sizes=SIZES)
    assert source.num_rows("train") == 45 and source.num_rows("eval") == 5
    batch = source.batch(4, 0)
    assert torch.equal(batch.dense_features, torch.from_numpy(dense[20:25]))
    assert torch.equal(
        batch.sparse_features.values().view(26, 5).t(), torch.from_numpy(sparse[20:25] % np.array(SIZES))
    )
    assert torch.equal(batch.labels, torch.from_numpy(labels[20:25].astype(np.float32)))
    assert torch.equal(source.batch(0, 0, "eval").labels, torch.from_numpy(labels[45:].astype(np.float32)))


def test_npy_errors_name_the_file(tmp_path):
    np.save(tmp_path / "day_0_dense.npy", np.zeros((4, 13), np.float32))
    np.save(tmp_path / "day_0_sparse.npy", np.zeros((4, 26), np.int64))
    with pytest.raises(FileNotFoundError, match="day_0_labels.npy"):
        CriteoNpySource(str(tmp_path), batch_size=2)
    np.save(tmp_path / "day_0_labels.npy", np.zeros((5, 1), np.int32))
    with pytest.raises(ValueError, match=r"day_0_\*.npy: row counts differ"):
        CriteoNpySource(str(tmp_path), batch_size=2)
    np.save(tmp_path / "day_0_labels.npy", np.zeros((4, 1), np.int32))
    np.save(tmp_path / "day_0_dense.npy", np.zeros((4, 12), np.float32))
    with pytest.raises(ValueError, match=r"day_0_dense.npy: expected shape \[N, 13\], got \[4, 12\]"):
        CriteoNpySource(str(tmp_path), batch_size=2)
    with pytest.raises(FileNotFoundError, match="not found"):
        CriteoNpySource(str(tmp_path / "missing"), batch_size=2)


def test_open_source_dispatches_on_the_path(tmp_path):
    config = DataConfig(SIZES, batch_size=4)
    assert isinstance(open_source(None, config), SyntheticCriteo)
    tsv = _write(tmp_path / "train.txt", _rows(30, seed=4))
    assert isinstance(open_source(str(tsv), config, world_size=2), CriteoTsvSource)
    tsv_dir = tmp_path / "tsv"
    tsv_dir.mkdir()
    shutil.copy(tsv, tsv_dir / "day_0")
    assert isinstance(open_source(str(tsv_dir), config), CriteoTsvSource)
    npy_dir = tmp_path / "npy"
    npy_dir.mkdir()
    _convert(tsv, npy_dir, 0)
    source = open_source(str(npy_dir), config, world_size=2)
    assert isinstance(source, CriteoNpySource) and source.world_size == 2
    _check_batch(source.batch(1, 1), _rows(30, seed=4)[12:16], dense_too=False)
    with pytest.raises(FileNotFoundError, match="not found"):
        open_source(str(tmp_path / "absent"), config)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="no Criteo data in directory"):
        open_source(str(empty), config)
    with pytest.raises(ValueError, match="directory holding day_"):
        open_source(str(npy_dir / "day_0_dense.npy"), config)
    with pytest.raises(ValueError, match="table_sizes has 2 entries"):
        open_source(str(tsv), DataConfig((10, 10), batch_size=4))


class _RootedHandler(NativePathHandler):
    """Serves ``rooted://<rest>`` from a local folder, to prove every access goes through iopath."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self._root = str(root)

    def _get_supported_prefixes(self) -> list[str]:
        return ["rooted://"]

    def _local(self, path: str) -> str:
        return f"{self._root}/{path[len('rooted://') :]}"

    def _exists(self, path, **kwargs):
        return super()._exists(self._local(path), **kwargs)

    def _isfile(self, path, **kwargs):
        return super()._isfile(self._local(path), **kwargs)

    def _isdir(self, path, **kwargs):
        return super()._isdir(self._local(path), **kwargs)

    def _ls(self, path, **kwargs):
        return super()._ls(self._local(path), **kwargs)

    def _open(self, path, mode="r", **kwargs):
        return super()._open(self._local(path), mode, **kwargs)

    def _get_local_path(self, path, force=False, **kwargs):
        return super()._get_local_path(self._local(path), force, **kwargs)


def test_readers_go_through_the_path_manager(tmp_path):
    rows = _rows(20, seed=5)
    _write(tmp_path / "day_0.tsv", rows)
    _convert(tmp_path / "day_0.tsv", tmp_path, 0)
    manager = PathManager()
    manager.register_handler(_RootedHandler(tmp_path))
    config = DataConfig(SIZES, batch_size=4)
    tsv = open_source("rooted://day_0.tsv", config, path_manager=manager)
    _check_batch(tsv.batch(2, 0), rows[8:12])
    npy = open_source("rooted://", config, path_manager=manager)
    assert isinstance(npy, CriteoNpySource)
    _check_batch(npy.batch(2, 0), rows[8:12], dense_too=False)

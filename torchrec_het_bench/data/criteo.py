"""Criteo readers (TSV and torchrec's npy layout) and ``open_source``, the data factory."""

from iopath.common.file_io import PathManager

from torchrec_het_bench.data.config import CRITEO_NUM_SPARSE, DataConfig
from torchrec_het_bench.data.criteo_npy import CriteoNpySource, find_npy_days
from torchrec_het_bench.data.criteo_tsv import CriteoTsvSource, list_tsv_files
from torchrec_het_bench.data.source import BatchSource
from torchrec_het_bench.data.synthetic import SyntheticCriteo

__all__ = ["CriteoNpySource", "CriteoTsvSource", "open_source"]

_TSV_SUFFIXES = (".tsv", ".txt")


def open_source(
    path: str | None,
    config: DataConfig,
    world_size: int = 1,
    path_manager: PathManager | None = None,
) -> BatchSource:
    """The data a benchmark trains on.

    Args:
        path: None for ``SyntheticCriteo(config)``; a directory of
            ``day_{i}_{dense,sparse,labels}.npy`` for the npy reader; a ``.tsv``/``.txt``
            file or a directory of them for the TSV reader.
        config: batch size and table sizes (readers use only these two; ids are taken
            modulo the table sizes), or the whole synthetic stream.
        world_size: ranks reading disjoint row blocks of each step (readers only; the
            synthetic stream is independent per rank).
        path_manager: iopath manager for the path.
    """
    if path is None:
        return SyntheticCriteo(config)
    if len(config.table_sizes) != CRITEO_NUM_SPARSE:
        raise ValueError(
            f"config.table_sizes has {len(config.table_sizes)} entries; Criteo data has {CRITEO_NUM_SPARSE} "
            "categorical features"
        )
    path_manager = path_manager or PathManager()
    common = dict(batch_size=config.batch_size, table_sizes=config.table_sizes, world_size=world_size)
    if path_manager.isdir(path):
        if find_npy_days(path, path_manager):
            return CriteoNpySource(path, path_manager=path_manager, **common)
        if list_tsv_files(path, path_manager):
            return CriteoTsvSource(path, path_manager=path_manager, **common)
        raise FileNotFoundError(
            f"no Criteo data in directory {path}: expected day_{{i}}_{{dense,sparse,labels}}.npy or *.tsv/*.txt files"
        )
    if not path_manager.exists(path):
        raise FileNotFoundError(f"Criteo data path not found: {path}")
    if path.endswith(".npy"):
        raise ValueError(f"{path}: pass the directory holding day_{{i}}_{{dense,sparse,labels}}.npy, not one array")
    if not path.endswith(_TSV_SUFFIXES):
        raise ValueError(f"{path}: expected a .tsv or .txt file, or a directory of Criteo files")
    return CriteoTsvSource(path, path_manager=path_manager, **common)

"""Criteo-like data for TorchRec benchmarks: a synthetic skewed stream and Criteo readers."""

from torchrec_het_bench.data.config import (
    CRITEO_KAGGLE_CARDINALITIES,
    DataConfig,
    clamped_cardinalities,
    preset_table_sizes,
)
from torchrec_het_bench.data.criteo import CriteoNpySource, CriteoTsvSource, open_source
from torchrec_het_bench.data.metrics import binary_auc
from torchrec_het_bench.data.source import BatchSource, DataExhaustedError
from torchrec_het_bench.data.synthetic import SyntheticCriteo

__all__ = [
    "CRITEO_KAGGLE_CARDINALITIES",
    "BatchSource",
    "CriteoNpySource",
    "CriteoTsvSource",
    "DataConfig",
    "DataExhaustedError",
    "SyntheticCriteo",
    "binary_auc",
    "clamped_cardinalities",
    "open_source",
    "preset_table_sizes",
]

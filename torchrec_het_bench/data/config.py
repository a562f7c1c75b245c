"""What the data looks like: table sizes, skew, bag shapes, and the planted label signal."""

import math
import numbers
from dataclasses import dataclass

# Distinct values of the 26 categorical columns of the Criteo Kaggle Display
# Advertising Challenge training set, in column order (C1..C26).
CRITEO_KAGGLE_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip

CRITEO_NUM_DENSE = 13
CRITEO_NUM_SPARSE = 26

# Row-count bounds of the named table-size presets.
PRESET_BOUNDS: dict[str, tuple[int, int]] = {
    "smoke": (1_000, 20_000),
    "default": (100_000, 1_000_000),
    "full": (100_000, 2_000_000),
}


def clamped_cardinalities(lo: int, hi: int) -> tuple[int, ...]:
    """The Criteo Kaggle cardinalities, each clamped to ``[lo, hi]`` rows.

    Args:
        lo: fewest rows a table gets.
        hi: most rows a table gets.
    """
    if lo < 1:
        raise ValueError(f"lo must be >= 1, got {lo}")
    if hi < lo:
        raise ValueError(f"hi must be >= lo, got lo={lo}, hi={hi}")
    return tuple(min(max(size, lo), hi) for size in CRITEO_KAGGLE_CARDINALITIES)


def preset_table_sizes(name: str) -> tuple[int, ...]:
    """Table sizes of a named preset: "smoke", "default" or "full".

    Args:
        name: the preset name.
    """
    if name not in PRESET_BOUNDS:
        raise ValueError(f"unknown table-size preset {name!r}; choose one of {sorted(PRESET_BOUNDS)}")
    return clamped_cardinalities(*PRESET_BOUNDS[name])


@dataclass(frozen=True)
class DataConfig:
    """Shape, skew and label signal of a synthetic Criteo-like stream.

    Readers of real Criteo data use only ``table_sizes`` and ``batch_size``.

    Attributes:
        table_sizes: rows of each categorical table; feature ``cat_i`` looks up table i.
        batch_size: samples per batch (per rank).
        alpha: Zipf exponent of the ids; row rank k is drawn with p ∝ (k+1)^-alpha
            (0 = uniform).
        num_dense: dense features per sample.
        standardize_dense: whether dense features are standardized to mean 0, variance 1 per
            feature (the default); False: the raw log(1 + count) values.
        pooling_factor: mean ids per bag; 1.0 is one-hot, above that bag lengths are
            1 + Poisson(pooling_factor - 1), capped at ``max_bag_size``.
        max_bag_size: longest bag; None picks ceil(3 * pooling_factor).
        weighted: whether the KJT carries a per-id weight in (0, 1].
        sequence_features: extra keys ``seq_0..`` holding variable-length histories of
            Zipf ids, placed in the same KJT after the ``cat_*`` keys.
        sequence_length: longest history; lengths are uniform in [1, sequence_length].
        sequence_table_size: rows of each sequence feature's table; None uses the largest
            of ``table_sizes``.
        seed: seed of everything: permutations, planted model, and the batch streams.
        base_ctr: target mean label.
        categorical_signal: standard deviation (in logits) of the summed per-id effects
            of the categorical features.
        dense_signal: standard deviation (in logits) of the linear dense term.
        pair_signal: standard deviation (in logits) of the pairwise term over the
            table pairs (0, 1), (2, 3), ... up to ``num_pairs``.
        num_pairs: table pairs with an interaction effect.
    """

    table_sizes: tuple[int, ...]
    batch_size: int
    alpha: float = 1.1
    num_dense: int = CRITEO_NUM_DENSE
    standardize_dense: bool = True
    pooling_factor: float = 1.0
    max_bag_size: int | None = None
    weighted: bool = False
    sequence_features: int = 0
    sequence_length: int = 50
    sequence_table_size: int | None = None
    seed: int = 0
    base_ctr: float = 0.25
    categorical_signal: float = 1.5
    dense_signal: float = 0.5
    pair_signal: float = 0.3
    num_pairs: int = 4

    def __post_init__(self) -> None:
        sizes = tuple(self.table_sizes)
        if not sizes:
            raise ValueError("DataConfig.table_sizes must name at least one table")
        for index, rows in enumerate(sizes):
            if isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or not 1 <= rows < 2**31:
                raise ValueError(f"DataConfig.table_sizes[{index}] must be an int in [1, 2**31), got {rows!r}")
        object.__setattr__(self, "table_sizes", tuple(int(rows) for rows in sizes))
        _require(self.batch_size >= 1, "batch_size", "must be >= 1", self.batch_size)
        _require(math.isfinite(self.alpha) and self.alpha >= 0, "alpha", "must be finite and >= 0", self.alpha)
        _require(self.num_dense >= 0, "num_dense", "must be >= 0", self.num_dense)
        _require(
            math.isfinite(self.pooling_factor) and self.pooling_factor >= 1.0,
            "pooling_factor",
            "must be finite and >= 1.0",
            self.pooling_factor,
        )
        if self.max_bag_size is not None:
            _require(
                self.max_bag_size >= self.pooling_factor,
                "max_bag_size",
                f"must be >= pooling_factor ({self.pooling_factor})",
                self.max_bag_size,
            )
        _require(self.sequence_features >= 0, "sequence_features", "must be >= 0", self.sequence_features)
        _require(self.sequence_length >= 1, "sequence_length", "must be >= 1", self.sequence_length)
        if self.sequence_table_size is not None:
            _require(
                1 <= self.sequence_table_size < 2**31,
                "sequence_table_size",
                "must be in [1, 2**31)",
                self.sequence_table_size,
            )
        _require(0.0 < self.base_ctr < 1.0, "base_ctr", "must be in (0, 1)", self.base_ctr)
        for name in ("categorical_signal", "dense_signal", "pair_signal"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0, name, "must be finite and >= 0", value)
        _require(self.num_pairs >= 0, "num_pairs", "must be >= 0", self.num_pairs)

    @property
    def bag_cap(self) -> int:
        """Longest bag of a categorical feature."""
        if self.max_bag_size is not None:
            return self.max_bag_size
        return max(1, math.ceil(3 * self.pooling_factor))

    @property
    def feature_names(self) -> list[str]:
        """Keys of the pooled categorical features, ``cat_0..``."""
        return [f"cat_{i}" for i in range(len(self.table_sizes))]

    @property
    def sequence_feature_names(self) -> list[str]:
        """Keys of the sequence features, ``seq_0..``."""
        return [f"seq_{i}" for i in range(self.sequence_features)]

    @property
    def sequence_table_sizes(self) -> list[int]:
        """Rows of each sequence feature's table."""
        rows = self.sequence_table_size if self.sequence_table_size is not None else max(self.table_sizes)
        return [rows] * self.sequence_features

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """Table pairs that carry an interaction effect."""
        count = min(self.num_pairs, len(self.table_sizes) // 2)
        return [(2 * i, 2 * i + 1) for i in range(count)]


def _require(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"DataConfig.{field} {rule}, got {value!r}")

import math

import pytest
import torch

from torchrec_het_bench.data import (
    CRITEO_KAGGLE_CARDINALITIES,
    DataConfig,
    binary_auc,
    clamped_cardinalities,
    preset_table_sizes,
)


def test_criteo_cardinalities_are_the_26_kaggle_columns():
    assert len(CRITEO_KAGGLE_CARDINALITIES) == 26
    assert CRITEO_KAGGLE_CARDINALITIES[2] == 10131227
    assert CRITEO_KAGGLE_CARDINALITIES[-1] == 142572
    assert sum(CRITEO_KAGGLE_CARDINALITIES) == 33762577


def test_clamped_cardinalities_clamp_every_table():
    sizes = clamped_cardinalities(1_000, 20_000)
    assert len(sizes) == 26
    assert min(sizes) == 1_000 and max(sizes) == 20_000
    assert sizes[6] == 12517  # already inside the bounds
    with pytest.raises(ValueError, match="hi must be >= lo"):
        clamped_cardinalities(10, 5)
    with pytest.raises(ValueError, match="lo must be >= 1"):
        clamped_cardinalities(0, 5)


@pytest.mark.parametrize(
    "name, lo, hi",
    [("smoke", 1_000, 20_000), ("default", 100_000, 1_000_000), ("full", 100_000, 2_000_000)],
)
def test_presets(name, lo, hi):
    assert preset_table_sizes(name) == clamped_cardinalities(lo, hi)


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="'huge'.*default"):
        preset_table_sizes("huge")


def test_config_coerces_table_sizes_to_a_tuple_and_derives_names():
    config = DataConfig(table_sizes=[10, 20, 30], batch_size=4, sequence_features=2)
    assert config.table_sizes == (10, 20, 30)
    assert config.feature_names == ["cat_0", "cat_1", "cat_2"]
    assert config.sequence_feature_names == ["seq_0", "seq_1"]
    assert config.sequence_table_sizes == [30, 30]
    assert config.pairs == [(0, 1)]
    assert DataConfig((5,), 1, pooling_factor=2.5).bag_cap == 8
    assert DataConfig((5,), 1, pooling_factor=2.5, max_bag_size=4).bag_cap == 4


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(table_sizes=()), "table_sizes"),
        (dict(table_sizes=(10, 0)), r"table_sizes\[1\]"),
        (dict(table_sizes=(10, 2**31)), r"table_sizes\[1\]"),
        (dict(batch_size=0), "batch_size"),
        (dict(alpha=-0.5), "alpha"),
        (dict(alpha=math.inf), "alpha"),
        (dict(num_dense=-1), "num_dense"),
        (dict(pooling_factor=0.5), "pooling_factor"),
        (dict(pooling_factor=3.0, max_bag_size=2), "max_bag_size"),
        (dict(sequence_features=-1), "sequence_features"),
        (dict(sequence_length=0), "sequence_length"),
        (dict(sequence_table_size=0), "sequence_table_size"),
        (dict(base_ctr=1.0), "base_ctr"),
        (dict(categorical_signal=-1.0), "categorical_signal"),
        (dict(dense_signal=math.nan), "dense_signal"),
        (dict(pair_signal=-0.1), "pair_signal"),
        (dict(num_pairs=-1), "num_pairs"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    kwargs = dict(table_sizes=(10, 20), batch_size=4) | overrides
    with pytest.raises(ValueError, match=f"DataConfig.{field}"):
        DataConfig(**kwargs)


def test_config_is_frozen():
    config = DataConfig((10,), 4)
    with pytest.raises(AttributeError):
        config.alpha = 2.0  # type: ignore[misc]


def _pairwise_auc(scores, labels):
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    wins = sum((p > n) + 0.5 * (p == n) for p in pos for n in neg)
    return wins / (len(pos) * len(neg))


def test_binary_auc_matches_pairwise_counting_with_ties():
    generator = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 7, (300,), generator=generator).float()  # many ties
    labels = (torch.rand(300, generator=generator) < 0.3).float()
    assert binary_auc(scores, labels) == pytest.approx(_pairwise_auc(scores.tolist(), labels.tolist()), abs=1e-12)


def test_binary_auc_edge_cases():
    assert binary_auc([0.1, 0.2, 0.9], [0, 0, 1]) == 1.0
    assert binary_auc([0.9, 0.2, 0.1], [0, 0, 1]) == 0.0
    assert binary_auc([0.5, 0.5], [0, 1]) == 0.5
    assert math.isnan(binary_auc([0.1, 0.2], [1, 1]))
    with pytest.raises(ValueError, match="differ in length"):
        binary_auc([0.1, 0.2], [1])

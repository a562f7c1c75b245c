"""Cache configuration and the input checks of the het sharded module, in one process."""

import dataclasses

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.sharders import HetEmbeddingBagCollection, HetEmbeddingBagCollectionSharder
from torchrec_het.sharding.common.validate import check_features
from torchrec_het.types import HET_CACHED_ROW_WISE


def test_settings_validate() -> None:
    with pytest.raises(ValueError, match="s_read and s_write"):
        CacheSettings(s_read=-1)
    with pytest.raises(ValueError, match="fractional capacity"):
        CacheSettings(capacity=1.5)
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        CacheSettings(capacity=-3)
    with pytest.raises(TypeError, match="capacity"):
        CacheSettings(capacity="10%")
    with pytest.raises(ValueError, match="eviction policy"):
        CacheSettings(policy="fifo")
    with pytest.raises(ValueError, match="protocol"):
        CacheSettings(protocol="push")
    assert CacheSettings(capacity=0.1).capacity_rows(1000) == 100
    assert CacheSettings(capacity=5000).capacity_rows(1000) == 1000
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheSettings().s_read = 3  # frozen


def test_per_table_overrides() -> None:
    special = CacheSettings(s_read=5, s_write=1, capacity=10)
    config = HetCacheConfig(default=CacheSettings(s_read=2), per_table={"t1": special})
    assert config.for_table("t1") is special and config.for_table("t0").s_read == 2
    assert config.with_default(s_read=7).for_table("t0").s_read == 7
    with pytest.raises(TypeError):
        config.per_table["t2"] = special  # read-only mapping
    with pytest.raises(ValueError, match=r"unknown table\(s\) \['t9'\]"):
        HetCacheConfig(per_table={"t9": special}).check_tables(["t0", "t1"])
    with pytest.raises(TypeError, match="per_table\\['t1'\\]"):
        HetCacheConfig(per_table={"t1": {"s_read": 1}})


def test_collection_carries_its_config() -> None:
    tables = [EmbeddingBagConfig(name="t0", feature_names=["f0"], embedding_dim=4, num_embeddings=10)]
    cache = HetCacheConfig(default=CacheSettings(s_read=3))
    ebc = HetEmbeddingBagCollection(tables, cache=cache, device=torch.device("meta"))
    assert ebc.het_cache_config is cache
    with pytest.raises(ValueError, match="t9"):
        HetEmbeddingBagCollection(tables, cache=HetCacheConfig(per_table={"t9": CacheSettings()}))


def test_sharder_offers_the_het_type_on_cpu() -> None:
    sharder = HetEmbeddingBagCollectionSharder()
    types = sharder.sharding_types("cpu")
    assert HET_CACHED_ROW_WISE in types and "row_wise" in types and "table_wise" in types
    assert sharder.compute_kernels(HET_CACHED_ROW_WISE, "cpu") == ["fused"]


ROWS = {"f0": 10, "f1": 5}


def _kjt(keys, values, lengths, weights=None) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values),
        lengths=torch.tensor(lengths),
        weights=None if weights is None else torch.tensor(weights),
    )


def test_check_features_accepts_a_good_batch() -> None:
    check_features(_kjt(["f0", "f1"], [0, 9, 4], [2, 0, 1, 0]), ROWS)


@pytest.mark.parametrize(
    "keys, values, lengths, message",
    [
        (["f0", "f2"], [0, 1], [1, 0, 1, 0], r"feature key\(s\) \['f1'\] missing"),  # f2: another module's
        (["f0"], [0], [1, 0], r"feature key\(s\) \['f1'\] missing"),
        (["f0", "f1"], [10, 0], [1, 0, 1, 0], r"feature 'f0': id 10 outside its table's rows \[0, 10\)"),
        (["f0", "f1"], [0, 5], [1, 0, 1, 0], r"feature 'f1': id 5 outside its table's rows \[0, 5\)"),
        (["f0", "f1"], [-1, 2], [1, 0, 1, 0], r"feature 'f0': id -1"),
        (["f0", "f1"], [0, 1, 2], [1, 0, 1, 0], r"lengths add up to 2 ids but the batch holds 3 values"),
        (["f0", "f1"], [0, 1], [1, 0, -1, 2], r"feature 'f1': negative lengths"),
    ],
)
def test_check_features_names_the_problem(keys, values, lengths, message) -> None:
    with pytest.raises(ValueError, match=message):
        check_features(_kjt(keys, values, lengths), ROWS)


def test_check_features_weights_must_match_ids() -> None:
    kjt = KeyedJaggedTensor(
        keys=["f0", "f1"], values=torch.tensor([0, 1]), lengths=torch.tensor([1, 0, 1, 0]), weights=torch.ones(3)
    )
    with pytest.raises(ValueError, match="3 weights for 2 ids"):
        check_features(kjt, ROWS)


def test_adagrad_family_is_recognized_for_scaled_pushes() -> None:
    from types import SimpleNamespace

    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from torchrec_het._tbe import accumulates_squares

    assert accumulates_squares(SimpleNamespace(optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD))
    assert accumulates_squares(SimpleNamespace(optimizer=EmbOptimType.EXACT_ADAGRAD))
    assert not accumulates_squares(SimpleNamespace(optimizer=EmbOptimType.EXACT_SGD))

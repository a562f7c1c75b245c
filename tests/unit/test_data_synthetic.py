import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig

from torchrec_het_bench.data import BatchSource, DataConfig, SyntheticCriteo, preset_table_sizes
from torchrec_het_bench.data.zipf import ZipfTables, zipf_top_share

SMALL = (50, 1_000, 3_000, 20_000)


def _source(**overrides) -> SyntheticCriteo:
    return SyntheticCriteo(DataConfig(**(dict(table_sizes=SMALL, batch_size=256) | overrides)))


def _same_batch(a, b) -> bool:
    fa, fb = a.sparse_features, b.sparse_features
    weights_equal = (fa.weights_or_none() is None and fb.weights_or_none() is None) or torch.equal(
        fa.weights(), fb.weights()
    )
    return (
        fa.keys() == fb.keys()
        and torch.equal(fa.values(), fb.values())
        and torch.equal(fa.lengths(), fb.lengths())
        and weights_equal
        and torch.equal(a.dense_features, b.dense_features)
        and torch.equal(a.labels, b.labels)
    )


def test_batch_layout():
    source = _source()
    assert isinstance(source, BatchSource)
    assert source.feature_names == ["cat_0", "cat_1", "cat_2", "cat_3"]
    assert source.table_sizes == list(SMALL)
    batch = source.batch(0, 0)
    assert batch.dense_features.shape == (256, 13) and batch.dense_features.dtype == torch.float32
    assert batch.labels.shape == (256,) and batch.labels.dtype == torch.float32
    assert set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    assert batch.dense_features.abs().max() < 10  # standardized per feature
    assert (_source(standardize_dense=False).batch(0, 0).dense_features >= 0).all()  # raw log(1 + count)
    kjt = batch.sparse_features
    assert kjt.keys() == source.feature_names
    assert kjt.stride() == 256
    assert kjt.values().dtype == torch.int64
    assert torch.equal(kjt.lengths(), torch.ones(4 * 256, dtype=torch.int32))
    assert kjt.weights_or_none() is None


def test_batches_are_deterministic_and_random_access():
    first, second = _source(weighted=True, pooling_factor=2.0), _source(weighted=True, pooling_factor=2.0)
    requests = [(step, rank, split) for step in range(3) for rank in range(2) for split in ("train", "eval")]
    forward = {r: first.batch(*r) for r in requests}
    backward = {r: second.batch(*r) for r in reversed(requests)}
    for request in requests:
        assert _same_batch(forward[request], backward[request])
        assert _same_batch(forward[request], first.batch(*request))
    for a in requests:
        for b in requests:
            if a != b:
                assert not torch.equal(forward[a].dense_features, forward[b].dense_features), (a, b)


def test_seed_changes_the_stream_and_the_permutations():
    a, b = _source(seed=0), _source(seed=1)
    assert not _same_batch(a.batch(0, 0), b.batch(0, 0))
    assert not torch.equal(a.hot_rows(3, 10), b.hot_rows(3, 10))


def test_ids_in_range_for_every_key():
    source = _source(pooling_factor=2.5, sequence_features=2, sequence_length=7, sequence_table_size=77)
    sizes = source.table_sizes + source.sequence_table_sizes
    for step in range(5):
        for key, jagged in source.batch(step, 0).sparse_features.to_dict().items():
            values = jagged.values()
            size = sizes[(source.feature_names + source.sequence_feature_names).index(key)]
            assert values.min() >= 0 and values.max() < size, key


@pytest.mark.parametrize("alpha", [0.0, 0.7, 1.0, 1.1, 1.5])
def test_rank_frequencies_match_zipf_in_head_and_tail(alpha):
    rows, draws = 200_000, 400_000
    generator = torch.Generator().manual_seed(1)
    tables = ZipfTables([rows], alpha, torch.Generator().manual_seed(0), head_size=512)
    ids = tables.sample(
        torch.zeros(draws, dtype=torch.int64), torch.rand(draws, dtype=torch.float64, generator=generator)
    )
    rank_of_row = torch.empty(rows, dtype=torch.int64)
    rank_of_row[tables.hot_rows(0, rows)] = torch.arange(rows)
    ranks = rank_of_row[ids]
    # Shares of log-spaced rank buckets, crossing the exact head (< 512) into the tail.
    edges = [0, 1, 10, 100, 511, 513, 2_000, 20_000, rows]
    for lo, hi in zip(edges, edges[1:]):
        expected = zipf_top_share(rows, alpha, hi) - zipf_top_share(rows, alpha, lo)
        observed = ((ranks >= lo) & (ranks < hi)).double().mean().item()
        tolerance = 4 * (expected * (1 - expected) / draws) ** 0.5 + 1e-4
        assert abs(observed - expected) < tolerance, (alpha, lo, hi, observed, expected)


def test_top_one_percent_share_matches_analytic_and_grows_with_alpha():
    shares = {}
    for alpha in (0.8, 1.1, 1.3):
        source = _source(alpha=alpha, batch_size=2048)
        lookups = torch.cat([source.batch(step, 0).sparse_features["cat_3"].values() for step in range(20)])
        hot = source.hot_rows(3, 200)  # top 1% of 20_000 rows
        shares[alpha] = torch.isin(lookups, hot).double().mean().item()
        assert shares[alpha] == pytest.approx(zipf_top_share(20_000, alpha, 200), abs=0.012)
    assert shares[0.8] < shares[1.1] < shares[1.3]


def test_hot_rows_are_scattered_and_most_frequent():
    source = _source(batch_size=4096)
    hot = source.hot_rows(3, 100)
    assert hot.dtype == torch.int64 and hot.unique().numel() == 100
    assert not torch.equal(hot.sort().values, torch.arange(100))
    assert hot.max() > 10_000  # spread over the table, not clustered at the front
    counts = torch.bincount(source.batch(0, 0).sparse_features["cat_3"].values(), minlength=20_000)
    assert counts.argmax().item() == hot[0].item()
    with pytest.raises(IndexError):
        source.hot_rows(4, 1)


def test_multi_hot_lengths_have_the_requested_mean_and_cap():
    source = _source(pooling_factor=3.0, batch_size=4096)
    lengths = source.batch(0, 0).sparse_features.lengths()
    assert lengths.min() >= 1 and lengths.max() <= source.config.bag_cap
    assert lengths.double().mean().item() == pytest.approx(3.0, abs=0.03)
    capped = _source(pooling_factor=3.0, max_bag_size=4).batch(0, 0).sparse_features.lengths()
    assert capped.max() == 4


def test_weights_in_unit_interval():
    kjt = _source(weighted=True, pooling_factor=2.0).batch(0, 0).sparse_features
    weights = kjt.weights()
    assert weights.dtype == torch.float32 and weights.numel() == kjt.values().numel()
    assert weights.min() > 0 and weights.max() <= 1


def test_sequence_features_follow_cat_keys_and_stock_modules_run():
    source = _source(sequence_features=2, sequence_length=12, sequence_table_size=500)
    batch = source.batch(0, 0)
    kjt = batch.sparse_features
    assert kjt.keys() == source.feature_names + ["seq_0", "seq_1"]
    seq_lengths = kjt["seq_1"].lengths()
    assert seq_lengths.min() >= 1 and seq_lengths.max() <= 12
    assert seq_lengths.double().mean().item() == pytest.approx(6.5, abs=0.6)
    bags = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t_{f}", embedding_dim=8, num_embeddings=n, feature_names=[f])
            for f, n in zip(source.feature_names, source.table_sizes)
        ]
    )
    pooled = bags(kjt)
    assert pooled.keys() == source.feature_names
    assert pooled.values().shape == (256, 4 * 8)
    sequences = EmbeddingCollection(
        tables=[EmbeddingConfig(name="t_seq", embedding_dim=8, num_embeddings=500, feature_names=["seq_0", "seq_1"])]
    )
    unpooled = sequences(kjt)
    assert unpooled["seq_0"].values().shape == (int(kjt["seq_0"].lengths().sum()), 8)


def test_bad_requests_name_the_argument():
    source = _source()
    with pytest.raises(ValueError, match="split"):
        source.batch(0, 0, "test")
    with pytest.raises(ValueError, match="step"):
        source.batch(-1, 0)
    with pytest.raises(ValueError, match="rank"):
        source.batch(0, -1)


def test_default_preset_memory_is_small():
    source = SyntheticCriteo(DataConfig(preset_table_sizes("default"), batch_size=1024))
    assert source.nbytes < 64 * 2**20
    assert source.batch(0, 0).sparse_features.values().numel() == 26 * 1024


def test_dense_features_are_standardized_per_feature():
    source = _source(batch_size=4096)
    dense = torch.cat([source.batch(step, 0).dense_features for step in range(4)])
    assert dense.mean(0).abs().max() < 0.05
    assert (dense.std(0) - 1).abs().max() < 0.05
    raw = torch.cat(
        [_source(batch_size=4096, standardize_dense=False).batch(step, 0).dense_features for step in range(4)]
    )
    torch.testing.assert_close(
        (raw - raw.mean(0)) / raw.std(0), (dense - dense.mean(0)) / dense.std(0), rtol=1e-4, atol=1e-4
    )
    assert torch.equal(
        _source().batch(0, 0).labels, _source(standardize_dense=False).batch(0, 0).labels
    )  # same label model

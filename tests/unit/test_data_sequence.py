"""The synthetic sequence stream: layout, determinism, rank slices, skew and the planted signal."""

import functools

import pytest
import torch

from torchrec_het_bench.data import binary_auc
from torchrec_het_bench.data.sequence import SEQUENCE_KEYS, SequenceDataConfig, SyntheticSequences
from torchrec_het_bench.data.zipf import zipf_top_share

ITEMS, CATEGORIES = 50_000, 1_000


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one thread is as fast, and immune to OpenMP spinning when other processes hold the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _source(world_size: int = 1, **overrides) -> SyntheticSequences:
    return _cached_source(world_size, tuple(sorted(overrides.items())))


@functools.cache
def _cached_source(world_size: int, overrides: tuple) -> SyntheticSequences:  # sources are immutable
    config = dict(item_rows=ITEMS, category_rows=CATEGORIES, batch_size=128, history_length=30) | dict(overrides)
    return SyntheticSequences(SequenceDataConfig(**config), world_size=world_size)


def _same(a, b) -> bool:
    fa, fb = a.sparse_features, b.sparse_features
    return (
        fa.keys() == fb.keys()
        and torch.equal(fa.values(), fb.values())
        and torch.equal(fa.lengths(), fb.lengths())
        and torch.equal(a.labels, b.labels)
    )


def test_layout_fixed_length():
    source = _source()
    batch = source.batch(0, 0)
    kjt = batch.sparse_features
    assert kjt.keys() == list(SEQUENCE_KEYS) and kjt.stride() == 128
    assert batch.dense_features.shape == (128, 0)
    assert batch.labels.shape == (128,) and set(batch.labels.unique().tolist()) <= {0.0, 1.0}
    features = kjt.to_dict()
    assert torch.equal(features["hist_item"].lengths(), torch.full((128,), 30, dtype=torch.int32))
    assert torch.equal(features["hist_cat"].lengths(), features["hist_item"].lengths())
    assert torch.equal(features["target_item"].lengths(), torch.ones(128, dtype=torch.int32))
    assert torch.equal(features["target_cat"].lengths(), torch.ones(128, dtype=torch.int32))
    for key, rows in (
        ("hist_item", ITEMS),
        ("target_item", ITEMS),
        ("hist_cat", CATEGORIES),
        ("target_cat", CATEGORIES),
    ):
        values = features[key].values()
        assert values.dtype == torch.int64 and values.min() >= 0 and values.max() < rows, key
    # A category is a fixed function of its item.
    assert torch.equal(features["hist_cat"].values(), source.category_of(features["hist_item"].values()))
    assert torch.equal(features["target_cat"].values(), source.category_of(features["target_item"].values()))


def test_variable_lengths_stay_in_range_and_cover_it():
    source = _source(min_history_length=5, history_length=12, batch_size=1024)
    lengths = source.batch(0, 0).sparse_features["hist_item"].lengths()
    assert lengths.min() == 5 and lengths.max() == 12
    assert set(lengths.tolist()) == set(range(5, 13))


def test_samples_depend_on_seed_and_index_only():
    one = _source(world_size=1, batch_size=256)
    two = _source(world_size=2, batch_size=128)
    # Step 1 of one rank of 256 = step 1 of ranks 0 and 1 of 128, concatenated.
    whole = one.batch(1, 0)
    halves = [two.batch(1, rank) for rank in range(2)]
    assert torch.equal(whole.labels, torch.cat([h.labels for h in halves]))
    for key in SEQUENCE_KEYS:
        assert torch.equal(
            whole.sparse_features[key].values(), torch.cat([h.sparse_features[key].values() for h in halves])
        )
    # Random access, any order, repeatable; splits and ranks differ.
    requests = [(step, rank, split) for step in range(2) for rank in range(2) for split in ("train", "eval")]
    forward = {r: two.batch(*r) for r in requests}
    again = SyntheticSequences(two.config, world_size=2)  # a fresh instance
    for r in reversed(requests):
        assert _same(forward[r], again.batch(*r))
    for a in requests:
        for b in requests:
            if a != b:
                assert not torch.equal(forward[a].sparse_features.values(), forward[b].sparse_features.values())
    other_seed = _source(world_size=2, batch_size=128, seed=1)
    assert not torch.equal(
        other_seed.batch(0, 0).sparse_features.values(), forward[(0, 0, "train")].sparse_features.values()
    )


def test_item_draws_are_zipf():
    source = _source(batch_size=2048)
    items = torch.cat([source.batch(step, 0).sparse_features["hist_item"].values() for step in range(4)])
    top = ITEMS // 100
    share = torch.isin(items, source.hot_items(top)).double().mean().item()
    assert share == pytest.approx(zipf_top_share(ITEMS, 1.1, top), abs=0.01)
    # Categories of Zipf items are skewed too: the top 1% of categories take most draws.
    _, counts = source.batch(0, 0).sparse_features["hist_cat"].values().unique(return_counts=True)
    assert counts.sort(descending=True).values[: CATEGORIES // 100].sum() > 0.5 * counts.sum()
    flat = _source(alpha=0.0, batch_size=2048)
    flat_items = flat.batch(0, 0).sparse_features["hist_item"].values()
    assert torch.isin(flat_items, flat.hot_items(top)).double().mean().item() == pytest.approx(0.01, abs=0.005)


def test_planted_signal_separates_labels_at_the_base_rate():
    source = _source(batch_size=1024)
    pairs = [source.batch_and_logits(step, 0, "eval") for step in range(4)]
    logits = torch.cat([logit for _, logit in pairs])
    labels = torch.cat([b.labels for b, _ in pairs])
    assert labels.mean().item() == pytest.approx(0.25, abs=0.02)
    assert binary_auc(logits, labels) > 0.8
    # The target's own effect alone separates far less than the whole signal: the history matters.
    no_history = _source(batch_size=1024, interaction_signal=0.0)
    alone = torch.cat([no_history.true_logits(step, 0, "eval") for step in range(4)])
    assert binary_auc(alone, labels) < binary_auc(logits, labels) - 0.1
    silent = _source(interaction_signal=0.0, target_signal=0.0, base_ctr=0.1)
    assert torch.allclose(silent.true_logits(0, 0), torch.full((128,), silent.bias, dtype=torch.float64))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="min_history_length"):
        SequenceDataConfig(item_rows=10, category_rows=5, batch_size=4, history_length=5, min_history_length=6)
    with pytest.raises(ValueError, match="item_rows"):
        SequenceDataConfig(item_rows=0, category_rows=5, batch_size=4)
    source = _source(world_size=2, batch_size=128)
    with pytest.raises(ValueError, match="rank"):
        source.batch(0, 2)
    with pytest.raises(ValueError, match="split"):
        source.batch(0, 0, "test")

"""FAE's loader wrapper without a process group: placement, sample selection, errors."""

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.replication.all_hot import AllHotBatches, fillable_batches, spread, take_kjt


def _batch(first: int, size: int, weighted: bool = False) -> Batch:
    """Sample i has ``i % 3`` ids on key a (all equal to i) and one id (i) on key b."""
    labels = torch.arange(first, first + size)
    a_lengths = labels % 3
    values = torch.cat([torch.repeat_interleave(labels, a_lengths), labels])
    kjt = KeyedJaggedTensor(
        keys=["a", "b"],
        values=values,
        lengths=torch.cat([a_lengths, torch.ones(size, dtype=torch.int64)]).int(),
        weights=values.float() / 10 if weighted else None,
        stride=size,
    )
    return Batch(dense_features=labels.float().unsqueeze(1), sparse_features=kjt, labels=labels.float())


def test_spread_places_batches_evenly_and_distinctly() -> None:
    assert spread(0, 8) == []
    assert spread(1, 8) == [4]
    assert spread(2, 8) == [2, 6]
    assert spread(8, 8) == list(range(8))
    for count in range(1, 17):
        assert len(set(spread(count, 16))) == count


def test_fillable_batches_counts_what_the_hot_samples_fill() -> None:
    assert fillable_batches([4] * 8, 0) == 0
    assert fillable_batches([4] * 8, 11) == 2
    assert fillable_batches([4] * 8, 32) == 8
    assert fillable_batches([4, 4, 4, 1], 6) == 2  # spread(2, 4) = [1, 3]: 4 + 1 = 5 fit; spread(3, 4) needs 12
    assert fillable_batches([4, 4, 4, 1], 4) == 1
    assert fillable_batches([], 5) == 0


@pytest.mark.parametrize("weighted", [False, True])
def test_take_kjt_selects_whole_samples_across_batches(weighted: bool) -> None:
    batches = [_batch(0, 4, weighted), _batch(4, 5, weighted)]
    index = torch.tensor([8, 0, 5, 2])
    got = take_kjt([b.sparse_features for b in batches], index)
    assert got.stride() == 4 and got.keys() == ["a", "b"]
    per_key = got.to_dict()
    assert per_key["a"].lengths().tolist() == [8 % 3, 0, 5 % 3, 2 % 3]
    assert per_key["a"].values().tolist() == [8, 8, 5, 5, 2, 2]
    assert per_key["b"].values().tolist() == [8, 0, 5, 2]
    if weighted:
        assert torch.allclose(per_key["a"].weights(), per_key["a"].values().float() / 10)


def test_without_a_process_group_hot_samples_fill_batches_in_the_middle() -> None:
    batches = [_batch(6 * i, 6) for i in range(5)]  # labels 0..29; hot: even labels (15 samples)
    wrapper = AllHotBatches(batches, lambda kjt: kjt["b"].values() % 2 == 0, window=4)
    out = list(wrapper)
    assert [int(b.labels.numel()) for b in out] == [6] * 5
    # window 1 (24 samples, 12 hot): spread(2, 4) = [1, 3] are all-hot; window 2 (one batch, 3 hot): none
    assert wrapper.stats == {"windows": 2, "batches": 5, "all_hot_batches": 2}
    assert out[1].labels.tolist() == [0, 2, 4, 6, 8, 10] and out[3].labels.tolist() == [12, 14, 16, 18, 20, 22]
    assert out[0].labels.tolist() == [1, 3, 5, 7, 9, 11] and out[4].labels.tolist() == list(range(24, 30))
    assert torch.equal(out[1].dense_features.flatten(), out[1].labels)
    assert out[1].sparse_features["b"].values().tolist() == [0, 2, 4, 6, 8, 10]


def test_bad_input_raises_naming_the_problem() -> None:
    with pytest.raises(ValueError, match="window"):
        AllHotBatches([], lambda kjt: None, window=0)
    with pytest.raises(ValueError, match="flags"):
        list(AllHotBatches([_batch(0, 4)], lambda kjt: torch.ones(3, dtype=torch.bool)))
    other = _batch(4, 4)
    other.sparse_features = KeyedJaggedTensor(
        keys=["c"], values=torch.arange(4), lengths=torch.ones(4, dtype=torch.int32)
    )
    with pytest.raises(ValueError, match="different sparse features"):
        list(AllHotBatches([_batch(0, 4), other], lambda kjt: torch.ones(kjt.stride(), dtype=torch.bool)))

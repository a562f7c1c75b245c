"""FeatureLayout: the groups' input positions, fused ids and output columns both plugin types share."""

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.feature_layout import FeatureLayout
from torchrec_het.sharding.common.id_space import FusedIdSpace, TableInfo


def _group(rows: list[int], features: list[int], dim: int, first: int) -> FusedIdSpace:
    tables = [
        TableInfo(
            f"t{first + i}", tuple(f"f{first + i}_{k}" for k in range(n)), r, torch.tensor([0, r]), 0, i, False, 0.0
        )
        for i, (r, n) in enumerate(zip(rows, features))
    ]
    return FusedIdSpace(tables, dim, 0, 1)


def _layout(end_to_end: bool) -> FeatureLayout:
    # positions: a (dim 4, tables of 5 and 7 rows), b (dim 2, 3 rows), then a's second table twice
    groups = [_group([5, 7], [1, 2], 4, 0), _group([3], [1], 2, 2)]
    return FeatureLayout(groups, [(0, 0), (1, 0), (0, 1), (0, 1)], end_to_end)


def test_ids_are_the_groups_or_laid_end_to_end() -> None:
    assert _layout(False).position_base.tolist() == [0, 0, 5, 5]
    layout = _layout(True)
    assert layout.group_base.tolist() == [0, 12] and layout.group_ends.tolist() == [12, 15]
    assert layout.position_base.tolist() == [0, 12, 5, 5]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        list("abcd"), torch.tensor([1, 0, 2, 0, 1, 2]), torch.tensor([1, 2, 0, 3])
    )
    bags, ids = layout.flatten(kjt)  # batch 1: a value's bag is its position
    assert bags.tolist() == [0, 1, 1, 3, 3, 3] and ids.tolist() == [1, 12, 14, 5, 6, 7]


def test_each_group_fills_its_positions_columns() -> None:
    layout = _layout(True)
    assert layout.width == 14 and layout.columns.tolist() == [0, 4, 6, 10] and not layout.single
    positions, columns = layout.group_part(0)
    assert positions.tolist() == [0, 2, 3] and columns.tolist() == [0, 1, 2, 3, *range(6, 14)]
    positions, columns = layout.group_part(1)
    assert positions.tolist() == [1] and columns.tolist() == [4, 5]
    # position 3 is group 0's third feature: its bag of sample 1 (batch 2) is 2 * 2 + 1
    assert layout.group_feature_bags(torch.tensor([0, 7]), 2, 0).tolist() == [0, 5]


def test_one_group_keeps_the_input_order() -> None:
    layout = FeatureLayout([_group([5], [2], 4, 0)], [(0, 0), (0, 0)], True)
    assert layout.single and layout.group_part(0)[1] is None
    bags = torch.tensor([0, 3])
    assert layout.group_feature_bags(bags, 2, 0) is bags

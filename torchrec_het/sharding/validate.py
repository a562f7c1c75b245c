"""Checks a batch of sparse features before any of it is sent, cached or applied.

A good batch costs one vectorized pass and one host sync (:class:`FeatureCheck`
keeps the per-key layout between batches); only a bad one is looked at feature by
feature, to name the culprit.
"""

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class FeatureCheck:
    """Raises ValueError, naming the feature, for a batch the sharded module cannot take.

    Checked: unknown or missing feature keys, negative lengths, lengths that do not add
    up to the number of ids (or weights), and ids outside ``[0, rows)`` of the
    feature's table.

    Args:
        rows_of_feature: feature name -> rows of its table.
    """

    def __init__(self, rows_of_feature: dict[str, int]) -> None:
        self.rows_of_feature = dict(rows_of_feature)
        self._rows: dict[tuple, torch.Tensor] = {}  # (key order, device) -> rows of each key's table

    def _rows_by_key(self, keys: list[str], device: torch.device) -> torch.Tensor:
        order = (tuple(keys), device)
        rows = self._rows.get(order)
        if rows is None:
            unknown = [k for k in keys if k not in self.rows_of_feature]
            if unknown:
                raise ValueError(f"unknown feature key(s) {unknown}; this module has {sorted(self.rows_of_feature)}")
            missing = sorted(set(self.rows_of_feature) - set(keys))
            if missing:
                raise ValueError(f"feature key(s) {missing} missing from the batch")
            rows = torch.tensor([self.rows_of_feature[k] for k in keys], dtype=torch.int64, device=device)
            self._rows[order] = rows
        return rows

    def __call__(self, features: KeyedJaggedTensor) -> None:
        keys = features.keys()
        lengths, values = features.lengths(), features.values()
        rows = self._rows_by_key(keys, values.device)
        stride = features.stride()
        if lengths.numel() != len(keys) * stride:
            raise ValueError(f"lengths hold {lengths.numel()} entries; {len(keys)} features x batch {stride} expected")
        weights = features.weights_or_none()
        if weights is not None and weights.numel() != values.numel():
            raise ValueError(f"{weights.numel()} weights for {values.numel()} ids")
        per_key = lengths.view(len(keys), stride)
        totals = per_key.sum(1)
        key_of_value = torch.repeat_interleave(torch.arange(len(keys), device=totals.device), totals.clamp(min=0))
        if key_of_value.numel() == values.numel():
            bad = (per_key < 0).any() | ((values < 0) | (values >= rows.index_select(0, key_of_value))).any()
            if not bool(bad):  # the one host sync of a good batch
                return
        _name_the_problem(keys, per_key, values, self.rows_of_feature)
        raise ValueError("malformed batch")  # not reached: the search above names the problem


def check_features(features: KeyedJaggedTensor, rows_of_feature: dict[str, int]) -> None:
    """:class:`FeatureCheck` for one batch (a module that checks every batch keeps a ``FeatureCheck``).

    Args:
        features: the batch.
        rows_of_feature: feature name -> rows of its table.
    """
    FeatureCheck(rows_of_feature)(features)


def _name_the_problem(keys: list[str], per_key: torch.Tensor, values: torch.Tensor, rows_of_feature) -> None:
    """Feature by feature, raises ValueError for the first problem of a batch known to have one."""
    totals = per_key.sum(1).tolist()
    for key, row_lengths in zip(keys, per_key):
        if bool((row_lengths < 0).any()):
            raise ValueError(f"feature {key!r}: negative lengths")
    if sum(totals) != values.numel():
        end = 0
        for key, total in zip(keys, totals):
            end += total
            if end > values.numel():
                break
        raise ValueError(
            f"feature {key!r}: lengths add up to {sum(totals)} ids but the batch holds {values.numel()} values"
        )
    for key, ids in zip(keys, values.split(totals)):
        if ids.numel() == 0:
            continue
        low, high = int(ids.min()), int(ids.max())
        rows = rows_of_feature[key]
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise ValueError(f"feature {key!r}: id {bad} outside its table's rows [0, {rows})")


__all__ = ["FeatureCheck", "check_features"]

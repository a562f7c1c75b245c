"""Checks a batch of sparse features before any of it is sent, cached or applied.

A good batch costs one vectorized pass and one host sync (:class:`FeatureCheck`
keeps the per-key layout between batches); only a bad one is looked at feature by
feature, to name the culprit.
"""

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class FeatureCheck:
    """Raises ValueError, naming the feature, for a batch the sharded module cannot take.

    Keys the module does not own are ignored, as TorchRec's sharded modules ignore them (one
    KeyedJaggedTensor may feed several modules). Checked: the module's keys are all there and
    the keys come in the order of the first batch (TorchRec's input dist fixes its permutation
    then), a batch size per feature (VBE) only where the module takes one, negative lengths,
    lengths that do not add up to the number of ids (or weights), and the module's ids outside
    ``[0, rows)`` of the feature's table.

    Args:
        rows_of_feature: feature name -> rows of its table (the module's features).
        refuses_variable_batch: feature -> why the module cannot take it with a batch size of
            its own (VBE), e.g. ``"table 't1' (het_cached_row_wise)"``.
    """

    def __init__(self, rows_of_feature: dict[str, int], refuses_variable_batch: dict[str, str] | None = None) -> None:
        self.rows_of_feature = dict(rows_of_feature)
        self.refuses_variable_batch = dict(refuses_variable_batch or {})
        self.first_keys: list[str] | None = None
        self._bounds: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # (keys, device) -> each key's id bounds

    def _bounds_by_key(self, keys: list[str], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per key, the lowest and one past the highest id the module accepts (any id for a key it does not own)."""
        order = (tuple(keys), device)
        bounds = self._bounds.get(order)
        if bounds is None:
            missing = [k for k in self.rows_of_feature if k not in keys]
            if missing:
                raise ValueError(f"feature key(s) {missing} missing from the batch (its keys: {keys})")
            low = torch.tensor([0 if k in self.rows_of_feature else _ANY[0] for k in keys], device=device)
            high = torch.tensor([self.rows_of_feature.get(k, _ANY[1]) for k in keys], device=device)
            bounds = self._bounds[order] = (low, high)
        return bounds

    def __call__(self, features: KeyedJaggedTensor) -> None:
        keys = features.keys()
        variable = features.variable_stride_per_key()
        if variable:
            self._refuse_variable_batch(features)
        lengths, values = features.lengths(), features.values()
        low, high = self._bounds_by_key(keys, values.device)
        if self.first_keys is not None and keys != self.first_keys:
            raise ValueError(
                f"feature keys {keys} differ from the first batch's {self.first_keys}: TorchRec's input dist "
                "fixed its key order then; give every batch the same keys in the same order"
            )
        strides = features.stride_per_key() if variable else [features.stride()] * len(keys)
        if lengths.numel() != sum(strides):
            expected = f"batch sizes {strides}" if variable else f"x batch {features.stride()}"
            raise ValueError(f"lengths hold {lengths.numel()} entries; {len(keys)} features {expected} expected")
        weights = features.weights_or_none()
        if weights is not None and weights.numel() != values.numel():
            raise ValueError(f"{weights.numel()} weights for {values.numel()} ids")
        if variable:
            key_of_length = torch.repeat_interleave(torch.arange(len(keys)), torch.tensor(strides)).to(lengths.device)
            totals = torch.zeros(len(keys), dtype=lengths.dtype, device=lengths.device).index_add_(
                0, key_of_length, lengths
            )
        else:
            totals = lengths.view(len(keys), -1).sum(1)
        key_of_value = torch.repeat_interleave(torch.arange(len(keys), device=totals.device), totals.clamp(min=0))
        if key_of_value.numel() == values.numel():
            bad = (lengths < 0).any() | (
                (values < low.index_select(0, key_of_value)) | (values >= high.index_select(0, key_of_value))
            ).any()
            if not bool(bad):  # the one host sync of a good batch
                if self.first_keys is None:
                    self.first_keys = list(keys)
                return
        _name_the_problem(keys, lengths.split(strides), values, self.rows_of_feature)
        raise ValueError("malformed batch")  # not reached: the search above names the problem

    def _refuse_variable_batch(self, features: KeyedJaggedTensor) -> None:
        """Raises for a VBE batch (a batch size per feature) if any of the module's features is refused one."""
        refused = [f for f in self.refuses_variable_batch if f in features.keys()]
        if refused:
            strides = dict(zip(features.keys(), features.stride_per_key()))
            raise ValueError(
                f"feature(s) {refused} come with a batch size per feature (VBE: a KeyedJaggedTensor with "
                f"stride_per_key_per_rank; batch sizes {strides}), which "
                + "; ".join(sorted(set(self.refuses_variable_batch[f] for f in refused)))
                + " cannot take: give every feature the batch's size, or plan these tables on a TorchRec "
                "type (e.g. ParameterConstraints(sharding_types=['row_wise']))"
            )


# ids of a key the module does not own are not its to check
_ANY = (torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max)


def plugin_features(plan: dict, configs: list, plugin_types: tuple[str, ...]) -> dict[str, str]:
    """Feature -> ``"table 'name' (type)"`` for the tables of ``configs`` that ``plan`` gives a plugin type.

    Args:
        plan: table name -> ``ParameterSharding``.
        configs: the module's table configs.
        plugin_types: the plugin's sharding types.
    """
    out = {}
    for config in configs:
        sharding = plan.get(config.name)
        if sharding is not None and sharding.sharding_type in plugin_types:
            for feature in config.feature_names:
                out[feature] = f"table {config.name!r} ({sharding.sharding_type})"
    return out


def check_features(features: KeyedJaggedTensor, rows_of_feature: dict[str, int]) -> None:
    """:class:`FeatureCheck` for one batch (a module that checks every batch keeps a ``FeatureCheck``).

    Args:
        features: the batch.
        rows_of_feature: feature name -> rows of its table.
    """
    FeatureCheck(rows_of_feature)(features)


def _name_the_problem(keys: list[str], lengths_by_key, values: torch.Tensor, rows_of_feature) -> None:
    """Feature by feature, raises ValueError for the first problem of a batch known to have one."""
    totals = [int(lengths.sum()) for lengths in lengths_by_key]
    for key, lengths in zip(keys, lengths_by_key):
        if bool((lengths < 0).any()):
            raise ValueError(f"feature {key!r}: negative lengths")
    if sum(totals) != values.numel():
        end = 0
        for key, total in zip(keys, totals):  # noqa: B007 (key: the feature the message names, after the loop)
            end += total
            if end > values.numel():
                break
        raise ValueError(
            f"feature {key!r}: lengths add up to {sum(totals)} ids but the batch holds {values.numel()} values"
        )
    for key, ids in zip(keys, values.split(totals)):
        if ids.numel() == 0 or key not in rows_of_feature:
            continue
        low, high = int(ids.min()), int(ids.max())
        rows = rows_of_feature[key]
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise ValueError(f"feature {key!r}: id {bad} outside its table's rows [0, {rows})")


__all__ = ["FeatureCheck", "check_features", "plugin_features"]

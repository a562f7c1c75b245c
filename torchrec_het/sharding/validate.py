"""Checks a batch of sparse features before any of it is sent, cached or applied."""

from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


def check_features(features: KeyedJaggedTensor, rows_of_feature: dict[str, int]) -> None:
    """Raises ValueError, naming the feature, for a batch the sharded module cannot take.

    Checked: unknown or missing feature keys, negative lengths, lengths that do not add
    up to the number of ids (or weights), and ids outside ``[0, rows)`` of the
    feature's table.

    Args:
        features: the batch.
        rows_of_feature: feature name -> rows of its table.
    """
    keys = features.keys()
    unknown = [k for k in keys if k not in rows_of_feature]
    if unknown:
        raise ValueError(f"unknown feature key(s) {unknown}; this module has {sorted(rows_of_feature)}")
    missing = sorted(set(rows_of_feature) - set(keys))
    if missing:
        raise ValueError(f"feature key(s) {missing} missing from the batch")
    lengths = features.lengths()
    stride = features.stride()
    values = features.values()
    per_key = lengths.view(len(keys), -1) if lengths.numel() == len(keys) * stride else None
    if per_key is None:
        raise ValueError(f"lengths hold {lengths.numel()} entries; {len(keys)} features x batch {stride} expected")
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
    weights = features.weights_or_none()
    if weights is not None and weights.numel() != values.numel():
        raise ValueError(f"{weights.numel()} weights for {values.numel()} ids")
    for key, ids in zip(keys, values.split(totals)):
        if ids.numel() == 0:
            continue
        low, high = int(ids.min()), int(ids.max())
        rows = rows_of_feature[key]
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise ValueError(f"feature {key!r}: id {bad} outside its table's rows [0, {rows})")


__all__ = ["check_features"]

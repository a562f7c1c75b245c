"""Where a plugin lookup's groups sit in its input and output (static indexes, built once): which
group reads each input position, at which fused id its table starts, and which output columns
each group's bags fill. Both plugin types build their id layout on :class:`FeatureLayout`."""

from itertools import accumulate

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.id_space import FusedIdSpace, flatten_batch, tensors_to


class FeatureLayout:
    """A lookup's input positions (its features in order; a feature two tables read has two) and
    ``[batch, width]`` output columns, over groups of fused tables (one dimension each).

    The groups' fused ids lie end to end: group g's fused id i is id ``group_base[g] + i`` of the
    lookup. A group's positions are its features, in order; its output columns are those of its
    positions, feature by feature (:meth:`group_part`).

    Args:
        groups: the lookup's groups.
        positions: per input position, (its group, its table's index in the group).
        end_to_end: ids of :meth:`flatten` are the lookup's (else its group's fused ids).
    """

    sharding_type = ""  # named in the errors of :meth:`flatten`

    def __init__(self, groups: list[FusedIdSpace], positions: list[tuple[int, int]], end_to_end: bool) -> None:
        self.groups, self.num_positions, self.single = groups, len(positions), len(groups) == 1
        offsets = [g.offsets.tolist() for g in groups]
        sizes = torch.tensor([o[-1] for o in offsets], dtype=torch.int64)
        self.group_ends = torch.cumsum(sizes, 0)
        self.group_base = self.group_ends - sizes
        self.position_group = torch.tensor([g for g, _ in positions], dtype=torch.int64)
        starts = [offsets[g][t] + (int(self.group_base[g]) if end_to_end else 0) for g, t in positions]
        self.position_base = torch.tensor(starts, dtype=torch.int64)  # fused id of its table's row 0
        dims = [groups[g].dim for g, _ in positions]
        self.dims = torch.tensor(dims, dtype=torch.int64)
        self.columns = torch.cumsum(self.dims, 0) - self.dims  # first output column of each position
        self.width = int(self.dims.sum())
        at = [[p for p, (g, _) in enumerate(positions) if g == i] for i in range(len(groups))]
        first = self.columns.tolist()
        self.group_sizes = [len(ps) for ps in at]
        self.group_positions = torch.tensor([p for ps in at for p in ps], dtype=torch.int64)
        self.group_columns = torch.tensor(
            [c for ps in at for p in ps for c in range(first[p], first[p] + dims[p])], dtype=torch.int64
        )
        local = {p: i for ps in at for i, p in enumerate(ps)}
        self.position_local = torch.tensor([local[p] for p in range(len(positions))], dtype=torch.int64)
        cuts = [0, *accumulate(self.group_sizes)]
        ends = [0, *accumulate(n * g.dim for n, g in zip(self.group_sizes, groups))]
        self.group_spans = [(cuts[i], cuts[i + 1], ends[i], ends[i + 1]) for i in range(len(groups))]

    def to(self, device: torch.device | str) -> "FeatureLayout":
        """Moves every index to ``device`` (where the batches arrive); returns self."""
        self.device = device
        return tensors_to(self, device)

    def flatten(self, features: KeyedJaggedTensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bag of every value, as position * batch + sample; its id): :func:`flatten_batch`."""
        return flatten_batch(features, self.position_base, self.sharding_type)

    def group_part(self, group: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the group's positions, its output columns; None when it is the only group)."""
        start, end, first, last = self.group_spans[group]
        return self.group_positions[start:end], None if self.single else self.group_columns[first:last]

    def group_feature_bags(self, bags: torch.Tensor, batch: int, group: int) -> torch.Tensor:
        """Bags (``position * batch + sample``) of ``group``'s positions as ``its position's index
        among them * batch + sample`` (the order of its values)."""
        if self.single:
            return bags
        return self.position_local.index_select(0, bags // batch) * batch + bags % batch

"""Where a ``het_cached_row_wise`` lookup's groups sit in its input and output (static indexes,
built once at construction): which group reads each input position, at which fused id its table
starts, and which output columns each group's bags fill. A step runs no Python loop over tables
or features, only over the groups."""

from collections.abc import Callable, Iterator

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.id_space import bag_divisors, flatten_batch
from torchrec_het.sharding.common.output_layout import OutputPlan, Part, Source, bag_offsets, output_layout
from torchrec_het.sharding.het_cache import protocol
from torchrec_het.sharding.het_cache.batch import CachedBatch
from torchrec_het.sharding.het_cache.groups import HetGroup


class GroupLayout:
    """The groups' places in the lookup's input (features) and output (``[batch, width]`` bags).

    Args:
        groups: the lookup's groups (their layouts are set here).
        features: the lookup's input features, in order.
        positions: each table's input positions.
        device: where the indexes live.
    """

    def __init__(
        self, groups: list[HetGroup], features: list[str], positions: dict[str, list[int]], device: torch.device
    ) -> None:
        self.groups, self.features = groups, features
        dims = [0] * len(features)
        for g in groups:
            for t in g.tables:
                for at in positions[t.name]:
                    dims[at] = g.dim
        starts = torch.cumsum(torch.tensor([0] + dims), 0).tolist()
        self.width = starts[-1]
        for g in groups:
            at = [a for t in g.tables for a in positions[t.name]]
            g.set_layout(at, [starts[a] for a in at], len(features), self.width)
        self.single = len(groups) == 1 and groups[0].all_features  # one group reads every position in order
        self.value_group = torch.full((len(features),), -1, dtype=torch.int64, device=device)
        self.position_base = torch.zeros(len(features), dtype=torch.int64, device=device)  # in its group
        self.position_local = torch.zeros(len(features), dtype=torch.int64, device=device)  # feature of its group
        for index, g in enumerate(groups):
            self.value_group[g.positions] = index
            self.position_base[g.positions] = g.feature_offset
            self.position_local[g.positions] = torch.arange(g.positions.numel(), device=device)
        sizes = [int(g.offsets[-1]) for g in groups]
        self.group_base = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))], dtype=torch.int64, device=device)
        self.group_ends = torch.tensor(
            [sum(sizes[: i + 1]) for i in range(len(sizes))], dtype=torch.int64, device=device
        )

    def split(self, features: KeyedJaggedTensor) -> Iterator[tuple]:
        """Per group of a batch: (index, group, fused ids, bags, weights or None, ``[F, B]`` lengths,
        ids per feature); bags are ``feature of the group * batch + sample``."""
        if features.keys() != self.features:
            raise ValueError(f"het_cached_row_wise lookup expects features {self.features}, got {features.keys()}")
        # every group's fused ids at once (each position's base is its table's in its group)
        bags, values = flatten_batch(features, self.position_base, "het_cached_row_wise")
        batch = features.stride()
        lengths = features.lengths().view(len(self.features), batch)
        weights = features.weights_or_none()
        per_feature = lengths.sum(1)
        if self.single:
            for index, g in enumerate(self.groups):
                yield index, g, values, bags, weights, lengths, per_feature
            return
        value_group = (
            torch.repeat_interleave(self.value_group, per_feature, output_size=values.numel()) if self.groups else None
        )
        for index, g in enumerate(self.groups):
            chosen = (value_group == index).nonzero().flatten()
            gids, gbags = values.index_select(0, chosen), bags.index_select(0, chosen)
            gbags = self.position_local.index_select(0, gbags // batch) * batch + gbags % batch
            w = weights.index_select(0, chosen) if weights is not None else None
            yield (
                index,
                g,
                gids,
                gbags,
                w,
                lengths.index_select(0, g.positions),
                per_feature.index_select(0, g.positions),
            )

    def pooled(
        self, batch: CachedBatch, anchor: torch.Tensor, write_back: Callable[[CachedBatch, list], None]
    ) -> torch.Tensor:
        """The ``[batch, width]`` output: per group, its bags pooled from the rows read this step
        (one ``embedding_bag``, columns ``g.columns``); the backward's row gradients (one more)
        go to ``write_back(batch, row gradients per group)`` (which scales them)."""
        grads: list = [None] * len(self.groups)
        parts = []
        for index, (g, read) in enumerate(zip(self.groups, batch.reads)):
            if read.bags is None:  # else ``prefetch`` built the bag order
                protocol.sample_major(read)
            source = Source(
                read.rows,
                read.bags,
                read.inverse,
                read.weights,
                sink=lambda _, grad, i=index: grads.__setitem__(i, grad),
                bag_order=(read.by_bag, read.bag_offsets),
                row_order=(read.by_row, bag_offsets(read.uses)),
            )
            divisors = bag_divisors(read.lengths, g.feature_is_mean).t().reshape(-1, 1) if g.has_mean else None
            columns = None if self.single else g.columns
            parts.append(Part([source], read.lengths.numel(), g.dim, divisors, columns))
        plan = OutputPlan(parts, (batch.batch, self.width), after_backward=lambda: write_back(batch, grads))
        return output_layout(plan, anchor)

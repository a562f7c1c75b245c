"""Where a ``het_cached_row_wise`` lookup's groups sit in its input and output
(:class:`~torchrec_het.sharding.common.feature_layout.FeatureLayout`), and the two steps that
read it: a batch's ids split by group, and the output pooled from the rows read. A step runs
no Python loop over tables or features, only over the groups."""

from collections.abc import Callable, Iterator

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.feature_layout import FeatureLayout
from torchrec_het.sharding.common.id_space import bag_divisors
from torchrec_het.sharding.common.output_layout import OutputPlan, Part, Source, bag_offsets, output_layout
from torchrec_het.sharding.het_cache import protocol
from torchrec_het.sharding.het_cache.batch import CachedBatch
from torchrec_het.sharding.het_cache.groups import HetGroup


class GroupLayout(FeatureLayout):
    """The groups' places in the lookup's input (features) and output (``[batch, width]`` bags);
    a value's id is its group's fused id (the requests add ``group_base``).

    Args:
        groups: the lookup's groups.
        features: the lookup's input features, in order.
        positions: each table's input positions.
        device: where the indexes live.
    """

    sharding_type = "het_cached_row_wise"

    def __init__(
        self, groups: list[HetGroup], features: list[str], positions: dict[str, list[int]], device: torch.device
    ) -> None:
        at = {p: (i, j) for i, g in enumerate(groups) for j, t in enumerate(g.tables) for p in positions[t.name]}
        super().__init__(groups, [at[p] for p in range(len(features))], end_to_end=False)
        self.features = features
        self.to(device)

    def split(self, features: KeyedJaggedTensor) -> Iterator[tuple]:
        """Per group of a batch: (index, group, fused ids, bags, weights or None, ``[F, B]`` lengths,
        ids per feature); bags are ``feature of the group * batch + sample``."""
        if features.keys() != self.features:
            raise ValueError(f"het_cached_row_wise lookup expects features {self.features}, got {features.keys()}")
        bags, values = self.flatten(features)  # every group's fused ids at once
        batch = features.stride()
        lengths = features.lengths().view(len(self.features), batch)
        weights = features.weights_or_none()
        per_feature = lengths.sum(1)
        if self.single:
            yield 0, self.groups[0], values, bags, weights, lengths, per_feature
            return
        value_group = torch.repeat_interleave(self.position_group, per_feature, output_size=values.numel())
        for index, g in enumerate(self.groups):
            at, _ = self.group_part(index)
            chosen = (value_group == index).nonzero().flatten()
            w = weights.index_select(0, chosen) if weights is not None else None
            gbags = self.group_feature_bags(bags.index_select(0, chosen), batch, index)
            counts = lengths.index_select(0, at), per_feature.index_select(0, at)
            yield index, g, values.index_select(0, chosen), gbags, w, *counts

    def pooled(
        self, batch: CachedBatch, anchor: torch.Tensor, write_back: Callable[[CachedBatch, list], None]
    ) -> torch.Tensor:
        """The ``[batch, width]`` output: per group, its bags pooled from the rows read this step
        (one ``embedding_bag``, at its columns); the backward's row gradients (one more)
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
            parts.append(Part([source], read.lengths.numel(), g.dim, divisors, self.group_part(index)[1]))
        plan = OutputPlan(parts, (batch.batch, self.width), after_backward=lambda: write_back(batch, grads))
        return output_layout(plan, anchor)

"""The typed per-batch context of the plugin's sharding types, in TorchRec's sharding-context slot.

:class:`HetShardingContext` is TorchRec's sharding context plus the batch the input dist
planned (``CachedBatch``, ``ReplicatedBagBatch`` or ``ReplicatedSequenceBatch``) and whether
the module was training. :class:`PlannedBatch` carries it on the input dist's awaitable;
:func:`het_sharding_context` and :class:`ContextBoundLookup` put it in place, and
:class:`PluginContexts` (a mixin placed before TorchRec's sharded EBC / EC in the bases) does so
for the plugin's shardings only: after ``input_dist`` their entries of ``ctx.sharding_contexts``
hold the planned batch, and TorchRec's loops call their lookups ``lookup(features, sharding_ctx)``.
Stock shardings run as TorchRec runs them.

Design: docs/internals.md#sharding-context
"""

from dataclasses import dataclass, field, fields
from typing import Generic, Protocol, TypeVar

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import (
    input_dist_awaitables,
    lookups_called_with,
    sharded_embedding_shardings,
    sharded_lookups,
)
from torchrec_het.sharding.common.row_wise import StagedSharding

BatchT = TypeVar("BatchT")


@dataclass
class HetShardingContext(EmbeddingShardingContext, Generic[BatchT]):
    """TorchRec's sharding context of a plugin sharding, with the batch its stages share.

    Attributes:
        batch: what the input dist planned for this batch; the lookup and the output dist read
            and fill it (one per batch: never kept on a module, a tensor or a KJT).
        training: the sharded module's ``training`` when the input dist ran.
    """

    batch: BatchT | None = field(default=None, repr=False)
    training: bool = True


@dataclass
class HetSequenceShardingContext(SequenceShardingContext, HetShardingContext[BatchT]):
    """:class:`HetShardingContext` for an EmbeddingCollection (TorchRec's sequence fields kept)."""


class PlannedBatch(Protocol):
    """What a plugin input dist's awaitable offers: the batch it planned."""

    batch: object


def het_sharding_context(stock: EmbeddingShardingContext | None, batch, training: bool) -> HetShardingContext:
    """``stock`` (the entry TorchRec's ``input_dist`` made) as a :class:`HetShardingContext` holding ``batch``."""
    if stock is None:
        return HetShardingContext(batch=batch, training=training)
    kind = HetSequenceShardingContext if isinstance(stock, SequenceShardingContext) else HetShardingContext
    return kind(**{f.name: getattr(stock, f.name) for f in fields(stock)}, batch=batch, training=training)


class ContextBoundLookup:
    """A plugin lookup as TorchRec's sharded module calls it (``lookup(features)``, ``lookup.prefetch(...)``),
    for one batch: it calls the lookup with that batch's sharding context."""

    def __init__(self, lookup: torch.nn.Module, sharding_ctx: HetShardingContext) -> None:
        self.lookup, self.sharding_ctx = lookup, sharding_ctx

    def __call__(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.lookup(features, self.sharding_ctx)

    def prefetch(self, sparse_features: KeyedJaggedTensor, forward_stream=None) -> None:
        self.lookup.prefetch(sparse_features, forward_stream, self.sharding_ctx)


class PluginContexts:
    """Mixin of the plugin's sharded modules; call :meth:`find_plugin_shardings` at the end of ``__init__``."""

    def find_plugin_shardings(self) -> None:
        """Notes which shardings are the plugin's (their index in TorchRec's per-sharding lists)."""
        self._plugin_shardings = [
            i for i, sharding in enumerate(sharded_embedding_shardings(self)) if isinstance(sharding, StagedSharding)
        ]

    def input_dist(self, ctx, features):
        shardings = sharded_embedding_shardings(self)
        for i in self._plugin_shardings:  # TorchRec's input dists are not submodules: they learn the mode here
            shardings[i].set_training(self.training)
        splits = super().input_dist(ctx, features)  # one sharding context per sharding, in order
        if self._plugin_shardings:
            awaitables = input_dist_awaitables(splits)
            for i in self._plugin_shardings:
                ctx.sharding_contexts[i] = het_sharding_context(
                    ctx.sharding_contexts[i], awaitables[i].batch, self.training
                )
        return splits

    def compute(self, ctx, dist_input):
        with lookups_called_with(self, self._bound_lookups(ctx)):
            return super().compute(ctx, dist_input)

    def compute_and_output_dist(self, ctx, input):  # noqa: A002 (TorchRec's name)
        with lookups_called_with(self, self._bound_lookups(ctx)):
            return super().compute_and_output_dist(ctx, input)

    def prefetch(self, dist_input, forward_stream=None, ctx=None) -> None:
        with lookups_called_with(self, self._bound_lookups(ctx) if ctx is not None else {}):
            super().prefetch(dist_input, forward_stream, ctx)

    def _bound_lookups(self, ctx) -> dict[int, ContextBoundLookup]:
        """Each plugin lookup bound to this batch's sharding context."""
        lookups, bound = sharded_lookups(self), {}
        for i in self._plugin_shardings:
            sharding_ctx = ctx.sharding_contexts[i]
            if not isinstance(sharding_ctx, HetShardingContext):
                raise RuntimeError(
                    f"{type(self).__name__}: the context of this batch did not come from this module's input_dist "
                    f"(sharding {i} has a {type(sharding_ctx).__name__}); call input_dist(ctx, features) first"
                )
            bound[i] = ContextBoundLookup(lookups[i], sharding_ctx)
        return bound

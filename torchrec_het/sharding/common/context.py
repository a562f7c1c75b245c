"""The typed per-batch context of the plugin's sharding types, in TorchRec's sharding-context slot.

:class:`HetShardingContext` is TorchRec's sharding context plus the batch the input dist
planned (``CachedBatch``, ``ReplicatedBagBatch`` or ``ReplicatedSequenceBatch``) and whether
the module was training. :class:`PlannedBatch` carries it on the input dist's awaitable;
:func:`het_sharding_context` and :class:`ContextBoundLookup` put it in place.

Design: docs/internals.md#sharding-context
"""

from dataclasses import dataclass, field, fields
from typing import Generic, Protocol, TypeVar

import torch
from torchrec.distributed.embedding_sharding import EmbeddingShardingContext
from torchrec.distributed.sharding.sequence_sharding import SequenceShardingContext
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

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

"""The dists of ``het_cached_row_wise``: every collective of the type, as TorchRec awaitables.

:class:`HetRequestsDist` (input dist: request counts, then requests), :class:`HetRowsDist`
(output dist: the owners' versions, then the rows, then local settle and pooling) and
:class:`HetPushDist` (the backward's gradient pushes and the flush). The protocol is in
:mod:`~torchrec_het.sharding.het_cache.lookup`; the lookup is local compute.

Under the sharder's quantized comms, the rows' and the pushes' all-to-alls carry their values coded
(:mod:`~torchrec_het.sharding.het_cache.coded_rows`): the same collectives, fewer bytes.

Design (collectives and host syncs per step, fetching ahead): docs/internals.md#het-cache-dists
"""

from typing import Protocol

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, BaseSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.context import HetShardingContext
from torchrec_het.sharding.common.exchange import (
    Exchange,
    GatheredCounts,
    Transfer,
    exchange_counts,
    exchange_flat,
    start_exchange,
)
from torchrec_het.sharding.het_cache.batch import CachedBatch
from torchrec_het.sharding.het_cache.coded_rows import CodedPayload


class CacheSide(Protocol):
    """What the dists ask of the lookup (:class:`~torchrec_het.sharding.het_cache.lookup.HetCachedEmbeddingLookup`):
    the protocol's local steps between the exchanges."""

    exchange_pg: dist.ProcessGroup
    ahead: bool
    holds_nothing: bool
    training: bool

    def plan_requests(self, sparse_features: KeyedJaggedTensor, training: bool) -> CachedBatch: ...

    def answer_ahead(self, batch: CachedBatch) -> None: ...

    def expect_rows_ahead(self, batch: CachedBatch, replies: torch.Tensor) -> tuple[list[int], list[int]]: ...

    def settle_ahead(self, batch: CachedBatch, training: bool) -> torch.Tensor: ...

    def rows_request(
        self, batch: CachedBatch, replies: torch.Tensor, training: bool
    ) -> tuple[torch.Tensor, list[int], list[int]]: ...

    def settle_fetched(self, batch: CachedBatch, received: torch.Tensor, training: bool) -> torch.Tensor: ...


class HetRequestsDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Keeps the batch on its rank and sends (id, held version) requests to the owners."""

    def __init__(self, lookup: CacheSide):
        super().__init__()
        self._lookup = [lookup]  # not a submodule: the lookup is the sharded module's own
        self.pg = lookup.exchange_pg
        self.rank, self.world_size = dist.get_rank(self.pg), dist.get_world_size(self.pg)

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        lookup = self._lookup[0]
        batch = lookup.plan_requests(sparse_features, lookup.training)  # the sharded module's mode (TorchRec sets it)
        return _RequestSplits(self, sparse_features, batch, GatheredCounts(batch.dest, batch.batch, self.pg))

    def fetch_ahead(self, features: KeyedJaggedTensor, batch: CachedBatch) -> "_RowsAhead":
        """The requests arrived (``batch.received``): the owners answer, their versions come back,
        and the rows' all-to-all starts (the second awaitable waits for it)."""
        lookup = self._lookup[0]
        lookup.answer_ahead(batch)
        if batch.local_only:
            replies = batch.held.new_empty(0)
        else:
            replies = exchange_flat(batch.current, batch.recv_splits, batch.send_splits, self.pg)
        send, recv = lookup.expect_rows_ahead(batch, replies)
        rows = None
        if any(send) or any(recv):
            rows = _payload(batch.payload, send, recv, self.pg, batch.coded_rows)
        batch.payload = batch.payload.new_empty(0)  # nothing left for the output dist to carry
        batch.coded_rows = None
        return _RowsAhead(features, batch, rows)


class _RequestSplits(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """First stage: every rank's request counts known; starts the requests' all-to-all. ``batch``: the batch planned."""

    def __init__(self, dist_: HetRequestsDist, features: KeyedJaggedTensor, batch: CachedBatch, counts: GatheredCounts):
        super().__init__()
        self.dist, self.features, self.batch, self.counts = dist_, features, batch, counts

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        splits, batch = self.counts.wait(), self.batch
        batch.send_splits, batch.recv_splits = splits.send, splits.recv
        batch.local_only = not splits.crosses_ranks()  # a requester never asks itself
        requests = torch.stack([batch.ids, batch.held], 1).view(-1)
        exchange = start_exchange(
            requests,
            [2 * c for c in batch.send_splits],
            [2 * c for c in batch.recv_splits],
            self.dist.pg,
            batch.local_only,
        )
        if self.dist._lookup[0].ahead:  # the owners answer now; the rows' all-to-all runs while the caller goes on
            batch.received = exchange.wait().view(-1, 2)
            return self.dist.fetch_ahead(self.features, batch)
        return _Requests(self.features, batch, exchange)


class _RowsAhead(Awaitable[KeyedJaggedTensor]):
    """Second stage when fetching ahead: the rows arrived (``batch.rows_received``)."""

    def __init__(self, features: KeyedJaggedTensor, batch: CachedBatch, rows: Transfer | None):
        super().__init__()
        self.features, self.batch, self.rows = features, batch, rows

    def _wait_impl(self) -> KeyedJaggedTensor:
        rows, self.rows = self.rows, None
        self.batch.rows_received = rows.wait() if rows is not None else self.batch.payload.new_empty(0)
        return self.features


class _Requests(Awaitable[KeyedJaggedTensor]):
    """Second stage: the requests asked of this rank arrived."""

    def __init__(self, features: KeyedJaggedTensor, batch: CachedBatch, exchange: Exchange):
        super().__init__()
        self.features, self.batch, self.exchange = features, batch, exchange

    def _wait_impl(self) -> KeyedJaggedTensor:
        self.batch.received = self.exchange.wait().view(-1, 2)
        return self.features


class HetRowsDist(BaseEmbeddingDist):
    """Sends the owners' versions back, then (in its awaitable) the rows; returns the pooled bags."""

    def __init__(self, lookup: CacheSide):
        super().__init__()
        self._lookup = [lookup]
        self.pg = lookup.exchange_pg

    def forward(
        self, local_embs: torch.Tensor, sharding_ctx: HetShardingContext[CachedBatch]
    ) -> Awaitable[torch.Tensor]:  # noqa: ARG002
        lookup, batch, training = self._lookup[0], sharding_ctx.batch, sharding_ctx.training
        if lookup.ahead:  # fetched in the input dist: only local work is left
            return _Settled(lookup, batch, training)
        if lookup.holds_nothing:  # every request brings its row: the versions need not come back
            return _FetchedBags(self, batch, training, None)
        exchange = start_exchange(batch.current, batch.recv_splits, batch.send_splits, self.pg, batch.local_only)
        return _FetchedBags(self, batch, training, exchange)


class _FetchedBags(Awaitable[torch.Tensor]):
    """The owners' versions on their way back (None: not asked for); waited: the rows' exchange,
    the settle, the bags."""

    def __init__(self, dist_: HetRowsDist, batch: CachedBatch, training: bool, exchange: Exchange | None):
        super().__init__()
        self.dist, self.batch, self.training, self.exchange = dist_, batch, training, exchange

    def _wait_impl(self) -> torch.Tensor:
        lookup = self.dist._lookup[0]
        replies = self.exchange.wait() if self.exchange is not None else self.batch.held  # held: -1, no copy
        send, send_sizes, recv_sizes = lookup.rows_request(self.batch, replies, self.training)
        coded, self.batch.coded_rows = self.batch.coded_rows, None
        received = _payload(send, send_sizes, recv_sizes, self.dist.pg, coded).wait()
        return lookup.settle_fetched(self.batch, received, self.training)


class _Settled(Awaitable[torch.Tensor]):
    def __init__(self, lookup: CacheSide, batch: CachedBatch, training: bool):
        super().__init__()
        self.lookup, self.batch, self.training = lookup, batch, training

    def _wait_impl(self) -> torch.Tensor:
        return self.lookup.settle_ahead(self.batch, self.training)


class HetPushDist:
    """The exchanges of the write path (:class:`~torchrec_het.sharding.het_cache.pushes.HetPushes`
    prepares what goes out and applies what comes in).

    Args:
        pg: the lookup's exchange group.
    """

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg

    def counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Row d of ``counts`` (int64 ``[world_size, k]``) to rank d; returns what each rank sent here (blocking)."""
        return exchange_counts(counts, self.pg)

    def start(
        self, flat: torch.Tensor, send: list[int], recv: list[int], coded: CodedPayload | None = None
    ) -> Awaitable[torch.Tensor]:
        """Starts the backward's pushes (``send[d]`` floats to rank d; ``coded``: under the backward
        codec); the awaitable returns what arrived."""
        return _payload(flat, send, recv, self.pg, coded)

    def exchange(
        self, flat: torch.Tensor, send: list[int], recv: list[int], coded: CodedPayload | None = None
    ) -> torch.Tensor:
        """A flush's pushes, at once (blocking)."""
        return _payload(flat, send, recv, self.pg, coded).wait()


def _payload(flat: torch.Tensor, send: list[int], recv: list[int], pg, coded: CodedPayload | None) -> Transfer:
    """A float payload's all-to-all (the rows or the pushes); ``coded``: its values travel under a
    codec, the rest as it is (:mod:`~torchrec_het.sharding.het_cache.coded_rows`)."""
    if coded is None:
        return Transfer(flat, send, recv, pg)
    return Transfer(flat, send, recv, pg, coded.codec, sides=(coded.out, coded.into))

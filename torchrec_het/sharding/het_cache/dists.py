"""The input and output dists of ``het_cached_row_wise`` (the protocol is in :mod:`~torchrec_het.sharding.het_cache.lookup`).

input dist (:class:`HetRequestsDist`, two awaitables as TorchRec's row-wise dist)
  the requester plans its reads and requests (:meth:`HetCachedEmbeddingLookup.plan_requests`).
  First awaitable: every rank's request counts (and batch size), one all-gather
  (:func:`~torchrec_het.sharding.common.counts.gather_counts`). Second: the requests,
  one int64 all-to-all (none when no rank asks another anything). The batch's own KJT
  comes out; the batch's bookkeeping (:class:`~torchrec_het.sharding.het_cache.batch.CachedBatch`)
  is the first awaitable's ``batch``, which the sharded module puts in the batch's sharding
  context (:class:`~torchrec_het.sharding.common.context.HetShardingContext`) for the lookup
  and the output dist.
output dist (:class:`HetRowsDist`)
  starts the owners' versions on their way back (int64 all-to-all, sizes known from the
  input dist); its awaitable waits for them, then runs the rows' all-to-all, the settle
  and the pooling (:meth:`HetCachedEmbeddingLookup.finish`), which returns the
  ``[batch, width]`` bags with an autograd function whose backward starts the pushes.

Collectives per step, whatever the number of groups: forward 4 (counts all-gather,
requests, versions, rows), backward 1 (pushes); host syncs 3 (the counts, the rows'
splits, the pushes' splits).

Fetching ahead (``lookup.ahead``: one step of lag fits every group's read bound, see
:meth:`HetCachedEmbeddingLookup.fetch_ahead`) the first awaitable also waits for the
requests, has the owners answer (versions all-to-all) and starts the rows' all-to-all; the
second waits for the rows. Under ``TrainPipelineSparseDist`` all of it runs between the
previous batch's forward and backward, and the forward exchanges nothing. The push counts
then go out in the backward: collectives 4 in the input dist, 0 in the forward, 2 in the
backward; host syncs 4 (the counts, the rows' splits, the cache's rescan decision, the
pushes' splits).
"""

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_sharding import BaseEmbeddingDist, BaseSparseFeaturesDist
from torchrec.distributed.types import Awaitable
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.sharding.common.counts import gather_counts
from torchrec_het.sharding.common.exchange import Exchange, start_exchange
from torchrec_het.sharding.het_cache.batch import CachedBatch
from torchrec_het.sharding.common.context import HetShardingContext
from torchrec_het.sharding.het_cache.lookup import HetCachedEmbeddingLookup


class _RequestSplits(Awaitable[Awaitable[KeyedJaggedTensor]]):
    """First stage: every rank's request counts known; starts the requests' all-to-all. ``batch``: the batch planned."""

    def __init__(self, dist_: "HetRequestsDist", features: KeyedJaggedTensor, batch: CachedBatch, work, gathered):
        super().__init__()
        self.dist, self.features, self.batch, self.work, self.gathered = dist_, features, batch, work, gathered

    def _wait_impl(self) -> Awaitable[KeyedJaggedTensor]:
        self.work.wait()
        ws, rank = self.dist.world_size, self.dist.rank
        table = torch.stack(self.gathered).tolist()  # [source][dest counts..., batch size]: the input dist's host sync
        step = self.batch
        step.send_splits = [table[rank][d] for d in range(ws)]
        step.recv_splits = [table[s][rank] for s in range(ws)]
        step.local_only = not any(table[s][d] for s in range(ws) for d in range(ws))  # a requester never asks itself
        requests = torch.stack([step.ids, step.held], 1).view(-1)
        exchange = start_exchange(
            requests, [2 * c for c in step.send_splits], [2 * c for c in step.recv_splits], self.dist.pg, torch.int64,
            step.local_only,
        )
        lookup = self.dist._lookup[0]
        if lookup.ahead:  # the owners answer now; the rows' all-to-all runs while the caller goes on
            step.received = exchange.wait().view(-1, 2)
            lookup.fetch_ahead(step)
            return _RowsAhead(self.features, step)
        return _Requests(self.features, step, exchange)


class _RowsAhead(Awaitable[KeyedJaggedTensor]):
    """Second stage when fetching ahead: the rows arrived."""

    def __init__(self, features: KeyedJaggedTensor, step: CachedBatch):
        super().__init__()
        self.features, self.step = features, step

    def _wait_impl(self) -> KeyedJaggedTensor:
        if self.step.rows_work is not None:
            self.step.rows_work.wait()
        return self.features


class _Requests(Awaitable[KeyedJaggedTensor]):
    """Second stage: the requests asked of this rank arrived."""

    def __init__(self, features: KeyedJaggedTensor, step: CachedBatch, exchange: Exchange):
        super().__init__()
        self.features, self.step, self.exchange = features, step, exchange

    def _wait_impl(self) -> KeyedJaggedTensor:
        self.step.received = self.exchange.wait().view(-1, 2)
        return self.features


class HetRequestsDist(BaseSparseFeaturesDist[KeyedJaggedTensor]):
    """Keeps the batch on its rank and sends (id, held version) requests to the owners."""

    def __init__(self, lookup: HetCachedEmbeddingLookup):
        super().__init__()
        self._lookup = [lookup]  # not a submodule: the lookup is the sharded module's own
        self.pg = lookup._exchange_pg
        self.rank, self.world_size = dist.get_rank(self.pg), dist.get_world_size(self.pg)

    def forward(self, sparse_features: KeyedJaggedTensor) -> Awaitable[Awaitable[KeyedJaggedTensor]]:
        step = self._lookup[0].plan_requests(sparse_features)
        work, gathered = gather_counts(step.dest, step.batch, self.pg)
        return _RequestSplits(self, sparse_features, step, work, gathered)


class _FetchedBags(Awaitable[torch.Tensor]):
    def __init__(self, lookup: HetCachedEmbeddingLookup, step: CachedBatch, exchange: Exchange):
        super().__init__()
        self.lookup, self.step, self.exchange = lookup, step, exchange

    def _wait_impl(self) -> torch.Tensor:
        return self.lookup.finish(self.step, self.exchange.wait())


class _Settled(Awaitable[torch.Tensor]):
    def __init__(self, lookup: HetCachedEmbeddingLookup, step: CachedBatch):
        super().__init__()
        self.lookup, self.step = lookup, step

    def _wait_impl(self) -> torch.Tensor:
        return self.lookup.finish_ahead(self.step)


class HetRowsDist(BaseEmbeddingDist):
    """Sends the owners' versions back, then (in its awaitable) the rows; returns the pooled bags."""

    def __init__(self, lookup: HetCachedEmbeddingLookup):
        super().__init__()
        self._lookup = [lookup]
        self.pg = lookup._exchange_pg

    def forward(self, local_embs: torch.Tensor, sharding_ctx: HetShardingContext[CachedBatch]) -> Awaitable[torch.Tensor]:
        lookup, step = self._lookup[0], sharding_ctx.batch
        if lookup.ahead:  # fetched in the input dist: only local work is left
            return _Settled(lookup, step)
        exchange = start_exchange(step.current, step.recv_splits, step.send_splits, self.pg, torch.int64,
                                  step.local_only)
        return _FetchedBags(lookup, step, exchange)

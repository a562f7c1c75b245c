"""The lookups of ``het_row_replicated`` (local compute), bags and sequences.

The owner's fused kernels read what the input dist brought it (their fused backward steps
those rows, as stock row-wise does); the reader reads its hot rows from its replica blocks at
the same moment (:meth:`~torchrec_het.sharding.row_replicated.holder.ReplicaHolder.read_hot`),
and a holder of per-host rows reads the ones its host's ranks sent it from its per-host blocks
(:meth:`~torchrec_het.sharding.row_replicated.holder.ReplicaHolder.read_host`). Each lookup owns
its :class:`~torchrec_het.sharding.row_replicated.holder.ReplicaHolder` (``replicas``).
"""

import functools
import warnings

import torch
from torchrec.distributed.embedding_lookup import GroupedEmbeddingsLookup, GroupedPooledEmbeddingsLookup
from torchrec.distributed.types import ShardingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import lookup_kernels
from torchrec_het.sharding.common.context import HetShardingContext
from torchrec_het.sharding.row_replicated.batch import ReplicatedBagBatch, ReplicatedSequenceBatch
from torchrec_het.sharding.row_replicated.holder import ReplicaHolder
from torchrec_het.sharding.row_replicated.lookahead import lookup_partials, start_early_partials
from torchrec_het.sharding.row_replicated.owner import kernel_features
from torchrec_het.sharding.row_replicated.placement import ReplicaGroup, ReplicaPlacement


class ReplicaHooks:
    """What both lookups add to TorchRec's grouped lookup: their replicas' groups and checkpoint
    hooks, and TorchRec's prefetch with the plugin lookups' signature.

    Both lookups take ``(grouped_configs, feature_names, pg, placement, device, env)``: the local
    shards grouped as row-wise groups them, the sharding's features (unused), process group, the
    sharding's :class:`~torchrec_het.sharding.row_replicated.placement.ReplicaPlacement` (tables,
    tiers, layout, settings), the compute device and the sharding environment.
    """

    replicas: ReplicaHolder

    def _hold_replicas(self, placement: ReplicaPlacement, pg, device, pooled: bool) -> None:
        kernels = [m.emb_module for m in lookup_kernels(self)]
        self.replicas = ReplicaHolder(kernels, placement, pg, device, pooled)

    @property
    def groups(self) -> list[ReplicaGroup]:
        return self.replicas.groups

    def prefetch(self, sparse_features: KeyedJaggedTensor, forward_stream=None, sharding_ctx=None) -> None:
        """TorchRec's prefetch of the kernels (the batch's context unused)."""
        super().prefetch(sparse_features, forward_stream)

    def flush(self) -> None:
        """Applies held replica gradients (a collective); shards then hold current hot rows."""
        self.replicas.flush()
        super().flush()

    def purge(self) -> None:
        """Replicas are copied from the (loaded) shards again at the next forward."""
        self.replicas.purge()
        super().purge()


class ReplicatedBagLookup(ReplicaHooks, GroupedPooledEmbeddingsLookup):
    """The owner pools received ids with its fused kernels; the reader pools hot ids from replicas."""

    def __init__(self, grouped_configs, feature_names, pg, placement: ReplicaPlacement, device=None, env=None):
        super().__init__(
            grouped_configs=grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env
        )
        self._hold_replicas(placement, pg, device, pooled=True)
        self._feature_names_of_kernels = feature_names
        if placement.layout.fetches_rows:  # distinct remote rows of cold_rows tables fetched in training,
            # counted without a host sync (``replication_stats()`` reads it as a number)
            self.replicas.stats["rows_fetched"] = torch.zeros((), dtype=torch.int64, device=placement.device)
        if placement.settings.lookahead:
            self._look_ahead(placement)

    def forward(
        self, sparse_features: KeyedJaggedTensor, sharding_ctx: HetShardingContext[ReplicatedBagBatch]
    ) -> torch.Tensor:
        step, replicas = sharding_ctx.batch, self.replicas
        replicas.settle()  # the owners' kernels take the steps they owe before they are read
        replicas.begin_read(step.hot_version)
        step.hot_read = replicas.pool_hot(step.hot)
        step.owed, step.anchor = replicas.owed, replicas.anchor  # for the output dist's exchange and layout
        if replicas.owner is not None:  # the owner pools its rows itself, in arrival order (owner.py)
            owner = replicas.owner
            if step.owner is None:  # not planned at its arrival (lookahead off)
                step.owner = owner.plan(step.received)
            step.owner_step = functools.partial(owner.step, step.owner)
            early = lookup_partials(step.early, owner, step.owner) if step.early is not None else None
            partials = (early if early is not None else owner.pool(step.owner)).reshape(-1)
            if early is not None:  # entries served: sent early, and sent at the output dist
                stale = step.early.stale_served.numel()
                replicas.stats["lookahead_early"] += step.owner.entries - stale
                replicas.stats["lookahead_late"] += stale
            elif step.early is not None:  # the rows were reloaded since: every entry travels now
                replicas.stats["lookahead_void"] += 1
        else:
            partials = self._kernel_partials(step)
        if step.host_values is not None:  # a holder: per-host ids pooled from its blocks into the same partials
            partials = partials + self._held_partials(step.host_values, partials.numel())
        replicas.stats["skipped_steps"] += int(step.local_only)
        if step.fetched is not None and self.training:
            replicas.stats["rows_fetched"] += (step.fetched.owners != replicas.rank).sum()
        return partials

    def _look_ahead(self, placement: ReplicaPlacement) -> None:
        """Lookahead: the input dist hands this lookup every batch that reached its owners
        (``placement.early_partials``). Only where the owner pools its rows itself (one width, an
        optimizer with a row update); elsewhere it stays off, said once."""
        owner = self.replicas.owner
        if owner is None:
            warnings.warn(
                f"het_row_replicated tables {[name for _, name in placement.positions]}: lookahead needs one "
                "embedding width and sgd, adagrad or rowwise_adagrad; it is off for them",
                stacklevel=3,
            )
            return
        self.replicas.stats.update(lookahead_early=0, lookahead_late=0, lookahead_void=0)
        placement.early_partials = lambda step: start_early_partials(
            step, owner, placement.exchange_pg, placement.codecs, placement.training
        )

    def _kernel_partials(self, step: ReplicatedBagBatch) -> torch.Tensor:
        """The partials, flat in arrival order, from the kernels' call on the owner's compact KJT."""
        layout = self.replicas.layout
        features, step.partial_at = kernel_features(step.received, self._feature_names_of_kernels, layout.num_positions)
        pooled = super().forward(features)  # [compact bags, width]: the kernels' fused forward and backward
        rows, position, stride = step.partial_at
        if layout.uniform_dim is not None:  # the output dist pools hot rows as it finishes the bags
            partials = pooled.view(stride * layout.num_positions, layout.uniform_dim).index_select(
                0, rows * layout.num_positions + position
            )
            partials = partials.reshape(-1)
        else:
            partials = pooled.reshape(-1).index_select(0, layout.elements(rows, position, layout.width))
        return partials

    def _held_partials(self, host_values: tuple, size: int) -> torch.Tensor:
        """``[size]``: the per-host ids' rows (weighted) summed into their partials' elements."""
        slots, starts, weights = host_values
        out = torch.zeros(size, device=self.replicas.device)
        for mine, rows in self.replicas.read_host(slots):
            if weights is not None:
                rows = rows * weights.index_select(0, mine).unsqueeze(1)
            at = starts.index_select(0, mine).unsqueeze(1) + torch.arange(rows.size(1), device=rows.device)
            out = out.index_add(0, at.view(-1), rows.reshape(-1))
        return out


class ReplicatedSequenceLookup(ReplicaHooks, GroupedEmbeddingsLookup):
    """The owner's fused kernels read the asked rows (local compute); their backward steps them."""

    def __init__(self, grouped_configs, feature_names, pg, placement: ReplicaPlacement, device=None, env=None):
        super().__init__(grouped_configs=grouped_configs, pg=pg, device=device, env=env)
        self._hold_replicas(placement, pg, device, pooled=False)
        if self.replicas.layout.uniform_dim is None:
            raise ValueError("het_row_replicated sequences need one embedding dimension for all their tables")
        self.replicas.stats["rows_fetched"] = 0  # distinct rows this rank read from other ranks

    def forward(
        self, sparse_features: KeyedJaggedTensor, sharding_ctx: HetShardingContext[ReplicatedSequenceBatch]
    ) -> torch.Tensor:
        step, replicas = sharding_ctx.batch, self.replicas
        replicas.begin_read(step.hot_version)
        step.hot_read = replicas.read_hot([slots for slots, _ in step.hot])
        step.anchor = replicas.anchor
        # the kernels' own forward and fused backward, the rows put back in arrival order
        by_position = super().forward(sparse_features).view(-1, replicas.layout.uniform_dim)
        step.rows = torch.empty_like(by_position).index_copy(0, step.kernel_order, by_position)
        if step.host_values is not None:  # a holder: per-host ids read from its block
            held, slots = step.host_values
            ((_, rows),) = replicas.read_host(slots)  # sequences: one width, one block
            arrival = torch.cat([step.kernel_at, held])
            step.rows = torch.cat([step.rows, rows]).index_select(0, torch.argsort(arrival))
        replicas.stats["skipped_steps"] += int(step.local_only)
        replicas.stats["rows_fetched"] += sum(c for r, c in enumerate(step.send_splits) if r != replicas.rank)
        return step.rows.reshape(-1)

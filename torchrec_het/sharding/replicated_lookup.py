"""The lookup of ``het_row_replicated``: hot rows local, cold rows pooled at their owners (DES).

Each rank keeps its own batch (no input dist). Per step, for the tables of one dimension
(:class:`~torchrec_het.sharding.replica_group.ReplicaGroup`):

forward
  every id is read from its nearest holder (:meth:`ReplicaGroup.server_of`). Ids this
  rank owns or holds are pooled here. The others go, as (id, bag) pairs, to their
  server, which pools them into **one partial sum per bag** and sends the partials back
  (never raw rows); the receiver adds them to its local partial. One small all-gather
  per step tells every rank how many ids each rank sends and how many replicated rows
  each touched: when nobody sends anything the cold exchange is skipped (FAE's all-hot
  step).
backward
  partial-sum gradients go back to the servers that pooled them; every holder then has
  the gradients its reads produced. Gradients of replicated rows are summed over all
  ranks (sparse or dense, whichever moves fewer bytes) and of per-host rows over the
  holder group (one rank per host), so every copy of a row takes the same fused
  optimizer step as its owner's shard: exactly synchronous. With
  ``replica_sync_every = s > 1`` gradients of replicated rows are held and combined
  every s steps instead.

With no hot rows this is row-wise sharding with partial sums in place of the
reduce-scatter, and trains as stock row-wise does.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding_lookup import GroupedPooledEmbeddingsLookup
from torchrec.distributed.types import ShardingType
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharding.exchange import exchange_counts, exchange_flat
from torchrec_het.sharding.id_space import TableInfo, members, row_starts_from_shards
from torchrec_het.sharding.replica_group import ReplicaGroup
from torchrec_het.sharding.replica_sync import combine_dense, combine_sparse, dense_bytes, gather_counts, sparse_bytes
from torchrec_het.sharding.row_apply import apply_row_grads, check_row_local, replica_kernel, row_state


@dataclass
class _Step:
    """One group's batch in one step, kept for the backward."""

    lengths: torch.Tensor  # [F * B] bag lengths, the group's features one after the other
    weights: torch.Tensor | None  # per-id weights
    ids: torch.Tensor  # fused id of every value
    bags: torch.Tensor  # bag of every value
    here: torch.Tensor  # positions of values read on this rank
    exchanged: bool = False  # whether the cold exchange ran
    send_counts: torch.Tensor | None = None  # ids sent to each server
    recv_counts: torch.Tensor | None = None  # ids received from each reader
    partial_bags: torch.Tensor | None = None  # bag of each partial received, grouped by server
    partials_in: torch.Tensor | None = None  # partials received from each server
    partials_out: torch.Tensor | None = None  # partials sent to each reader
    served_ids: torch.Tensor | None = None  # ids received, by reader
    served_weights: torch.Tensor | None = None
    served_partial: torch.Tensor | None = None  # partial of each received id
    hot_counts: list[int] | None = None  # replicated rows each rank touched


class RowReplicatedEmbeddingLookup(GroupedPooledEmbeddingsLookup):
    """TorchRec's row-wise fused lookup plus hot-row replicas and partial-sum exchanges.

    Args:
        grouped_configs: the local shards, grouped as row-wise groups them.
        feature_names: input feature order (the sharding's ``feature_names()``).
        pg: the process group of the sharding.
        device: compute device.
        env: sharding environment.
    """

    def __init__(self, grouped_configs, feature_names: list[str], pg, device=None, env=None) -> None:
        super().__init__(
            grouped_configs=grouped_configs, pg=pg, device=device, sharding_type=ShardingType.ROW_WISE, env=env
        )
        self._pg = pg
        self._rank = dist.get_rank(pg)
        self._ws = dist.get_world_size(pg)
        self._features = list(feature_names)
        self._groups: list[ReplicaGroup] = []
        self._replicas: list = []
        self._host_pg = None
        self._sync_every = 1
        self._skip_all_hot = True
        self._pending: list[torch.Tensor] = []
        self._step = 0
        self._needs_refresh = True
        self._anchor = torch.zeros(1, requires_grad=True)  # lets backward reach the write path
        self.stats = {"steps": 0, "skipped_steps": 0, "sparse_syncs": 0, "dense_syncs": 0}

    # --- set-up ------------------------------------------------------------------------

    def attach(self, config: ReplicationConfig, shards_by_table: dict[str, list]) -> None:
        """Builds groups and replica kernels; called once by the sharded module (a collective)."""
        local_ws = config.ranks_per_host(self._ws)
        self._sync_every, self._skip_all_hot = config.replica_sync_every, config.skip_all_hot
        by_dim: dict[int, list[tuple[TableInfo, tuple]]] = {}
        for module_index, group in enumerate(self.grouped_configs):
            check_row_local(self._emb_modules[module_index].emb_module, f"tables {[t.name for t in group.embedding_tables]}")
            for table_index, table in enumerate(group.embedding_tables):
                info = TableInfo(
                    name=table.name,
                    features=tuple(table.feature_names),
                    num_rows=table.num_embeddings,
                    row_starts=row_starts_from_shards(shards_by_table[table.name], self._ws, table.name),
                    module_index=module_index,
                    table_index=table_index,
                    mean=table.pooling == PoolingType.MEAN,
                    learning_rate=0.0,
                )
                by_dim.setdefault(table.embedding_dim, []).append((info, config.table_tiers(table.name, table.num_embeddings)))
        self._groups = [
            ReplicaGroup([t for t, _ in items], [tiers for _, tiers in items], dim, self._rank, self._ws, local_ws)
            for dim, items in by_dim.items()
        ]
        rows = [[0] * len(g.embedding_tables) for g in self.grouped_configs]
        for g in self._groups:
            for t, n in zip(g.tables, g.replica_rows):
                rows[t.module_index][t.table_index] = n
        self._replicas = [
            replica_kernel(m.emb_module, rows[i], dict(self.grouped_configs[i].fused_params or {}))
            for i, m in enumerate(self._emb_modules)
        ]
        self._pending = [torch.zeros(g.hot.numel(), g.dim + 1) for g in self._groups]
        if self._ws // local_ws > 1:  # holder groups of the per-host tier: one rank per host
            for local in range(local_ws):
                group = dist.new_group(list(range(local, self._ws, local_ws)), backend=dist.get_backend(self._pg))
                if self._rank % local_ws == local:
                    self._host_pg = group

    @property
    def groups(self) -> list[ReplicaGroup]:
        return self._groups

    def _shard_weights(self, g: ReplicaGroup) -> list[torch.Tensor]:
        return [self._weights[t.module_index][t.table_index] for t in g.tables]

    def _replica_weights(self, g: ReplicaGroup) -> list[torch.Tensor]:
        return [self._replica_views[t.module_index][t.table_index] for t in g.tables]

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies every held row, with its optimizer state, from its owner (a collective)."""
        for g in self._groups:
            for i, t in enumerate(g.tables):
                rows = torch.cat([g.hot, g.host])
                rows = torch.sort(rows[g.table_of(rows) == i]).values
                if rows.numel() == 0:
                    continue
                shard = row_state(self._emb_modules[t.module_index].emb_module, t.table_index)
                replica = row_state(self._replicas[t.module_index], t.table_index)
                widths = [s.size(1) for s in shard]
                block = torch.zeros(rows.numel(), sum(widths))
                owned = g.owner_of(rows) == self._rank
                local = g.local_rows(rows[owned], torch.full((int(owned.sum()),), i))
                block[owned] = torch.cat([s[local].float() for s in shard], 1)
                dist.all_reduce(block, group=self._pg)
                held, pos = members(g.held, rows)
                for state, part in zip(replica, block[held].split(widths, 1)):
                    state[g.held_row[pos[held]]] = part.to(state.dtype)
        self._needs_refresh = False

    # --- forward -------------------------------------------------------------------------

    def forward(self, sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        if sparse_features.variable_stride_per_key():
            raise NotImplementedError("het_row_replicated does not support variable batch sizes per feature")
        if self._needs_refresh:
            self.refresh()
        self._step += 1
        self._weights = [m.split_embedding_weights() for m in self._emb_modules]
        self._replica_views = [r.split_embedding_weights() for r in self._replicas]
        by_feature = sparse_features.to_dict()
        steps = [self._plan(g, by_feature) for g in self._groups]
        facts = torch.tensor(
            [[s.ids.numel() - s.here.numel(), int(g.is_hot(torch.unique(s.ids)).sum())] for g, s in zip(self._groups, steps)],
            dtype=torch.int64,
        ).view(-1)
        everyone = [torch.empty_like(facts) for _ in range(self._ws)]
        dist.all_gather(everyone, facts, group=self._pg)
        facts = torch.stack(everyone).view(self._ws, len(self._groups), 2)
        pooled = []
        for index, (g, step) in enumerate(zip(self._groups, steps)):
            step.exchanged = not (self._skip_all_hot and int(facts[:, index, 0].sum()) == 0)
            step.hot_counts = facts[:, index, 1].tolist()
            pooled.append(self._pool(g, step))
        self.stats["steps"] += 1
        self.stats["skipped_steps"] += int(not any(s.exchanged for s in steps))
        return _ReplicatedPooling.apply(self._anchor, self, steps, pooled, sparse_features.stride())

    def _plan(self, g: ReplicaGroup, by_feature) -> _Step:
        jts = [by_feature[f] for f in g.features]
        lengths = torch.cat([jt.lengths() for jt in jts]).long()
        weights = [jt.weights_or_none() for jt in jts]
        per_feature = torch.tensor([jt.values().numel() for jt in jts], dtype=torch.int64)
        ids = torch.cat([jt.values() for jt in jts]).long() + g.offsets[torch.repeat_interleave(g.feature_table, per_feature)]
        bags = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        here = (g.server_of(ids) == self._rank).nonzero().flatten()
        return _Step(lengths, torch.cat(weights) if weights[0] is not None else None, ids, bags, here)

    def _pool(self, g: ReplicaGroup, step: _Step) -> torch.Tensor:
        """[F * B, dim] bag sums: local rows here, partial sums of the rest from their servers."""
        shards, replicas = self._shard_weights(g), self._replica_weights(g)
        values = g.read(step.ids[step.here], shards, replicas)
        if step.weights is not None:
            values = values * step.weights[step.here].unsqueeze(1)
        pooled = torch.zeros(step.lengths.numel(), g.dim).index_add_(0, step.bags[step.here], values)
        if not step.exchanged:
            return pooled
        ws, dim = self._ws, g.dim
        away = torch.ones(step.ids.numel(), dtype=torch.bool)
        away[step.here] = False
        away = away.nonzero().flatten()
        server = g.server_of(step.ids[away])
        order = torch.sort(server, stable=True).indices
        away, server = away[order], server[order]
        step.send_counts = torch.bincount(server, minlength=ws)
        step.recv_counts = exchange_counts(step.send_counts.view(ws, 1), self._pg).view(ws)
        send, recv = step.send_counts.tolist(), step.recv_counts.tolist()
        pairs = torch.stack([step.ids[away], step.bags[away]], 1).view(-1)
        requests = exchange_flat(pairs, [2 * c for c in send], [2 * c for c in recv], self._pg).view(-1, 2)
        step.served_ids = requests[:, 0]
        if step.weights is not None:
            step.served_weights = exchange_flat(step.weights[away], send, recv, self._pg)
        # server side: one partial per (reader, bag)
        reader = torch.repeat_interleave(torch.arange(ws), step.recv_counts)
        width = int(requests[:, 1].max()) + 1 if requests.numel() else 1
        keys, step.served_partial = torch.unique(reader * width + requests[:, 1], return_inverse=True)
        rows = g.read(step.served_ids, shards, replicas)
        if step.served_weights is not None:
            rows = rows * step.served_weights.unsqueeze(1)
        partials = torch.zeros(keys.numel(), dim).index_add_(0, step.served_partial, rows)
        step.partials_out = torch.bincount(keys // width, minlength=ws)
        # reader side: the partials to expect, in the servers' order (by bag)
        mine = torch.unique(server * step.lengths.numel() + step.bags[away])
        step.partial_bags = mine % step.lengths.numel()
        step.partials_in = torch.bincount(mine // step.lengths.numel(), minlength=ws)
        received = exchange_flat(
            partials.view(-1), (step.partials_out * dim).tolist(), (step.partials_in * dim).tolist(), self._pg
        ).view(-1, dim)
        return pooled.index_add_(0, step.partial_bags, received)

    # --- backward --------------------------------------------------------------------------

    def write_back(self, steps: list[_Step], bag_grads: list[torch.Tensor]) -> None:
        """Called by the backward with the gradient [F * B, dim] of every group's bag sums."""
        scale = 1.0 / self._ws if get_gradient_division() else 1.0  # as TorchRec's row-wise backward
        for index, (g, step, grad) in enumerate(zip(self._groups, steps, bag_grads)):
            ids, grads = self._served_grads(g, step, grad * scale)
            hot = g.is_hot(ids)
            host = g.is_host(ids)
            apply_ids, apply_grads = [ids[~hot & ~host]], [grads[~hot & ~host]]
            hot_ids, hot_grads = self._combine_hot(index, g, ids[hot], grads[hot], step.hot_counts)
            apply_ids.append(hot_ids)
            apply_grads.append(hot_grads)
            if self._host_pg is None:  # one host: per-host rows are read from their owners
                apply_ids.append(ids[host])
                apply_grads.append(grads[host])
            elif g.host.numel():
                host_ids, host_grads = ids[host], grads[host]
                counts = gather_counts(host_ids.numel(), self._host_pg)
                host_ids, host_grads = combine_sparse(host_ids, host_grads, counts, self._host_pg)
                apply_ids.append(host_ids)
                apply_grads.append(host_grads)
            self._apply(g, torch.cat(apply_ids), torch.cat(apply_grads))

    def _served_grads(self, g: ReplicaGroup, step: _Step, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(distinct ids this rank serves, the gradient its readers' bags give each)."""
        values = grad[step.bags[step.here]]
        if step.weights is not None:
            values = values * step.weights[step.here].unsqueeze(1)
        ids, per_value = [step.ids[step.here]], [values]
        if step.exchanged:
            dim = g.dim
            partial_grads = exchange_flat(
                grad[step.partial_bags].reshape(-1),
                (step.partials_in * dim).tolist(),
                (step.partials_out * dim).tolist(),
                self._pg,
            ).view(-1, dim)
            served = partial_grads[step.served_partial]
            if step.served_weights is not None:
                served = served * step.served_weights.unsqueeze(1)
            ids.append(step.served_ids)
            per_value.append(served)
        uniq, inverse = torch.unique(torch.cat(ids), return_inverse=True)
        return uniq, torch.zeros(uniq.numel(), g.dim).index_add_(0, inverse, torch.cat(per_value))

    def _combine_hot(self, index: int, g: ReplicaGroup, ids, grads, counts: list[int]):
        """Replicated rows: the gradient summed over ranks (now, or every ``replica_sync_every`` steps)."""
        if self._sync_every > 1:
            pending = self._pending[index]
            pos = torch.searchsorted(g.hot, ids)
            pending[pos, : g.dim] += grads
            pending[pos, g.dim] += 1.0
            if self._step % self._sync_every:
                return ids[:0], grads[:0]
            return self._release_pending(index, g)
        if sum(counts) == 0:
            return ids[:0], grads[:0]
        if sparse_bytes(counts, g.dim) <= dense_bytes(g.hot.numel(), g.dim, self._ws):
            self.stats["sparse_syncs"] += 1
            return combine_sparse(ids, grads, counts, self._pg)
        self.stats["dense_syncs"] += 1
        ids, grads, _ = combine_dense(ids, grads, g.hot, self._pg)
        return ids, grads

    def _release_pending(self, index: int, g: ReplicaGroup):
        """Sums the held gradients of replicated rows over ranks and empties the hold."""
        pending = self._pending[index]
        dist.all_reduce(pending, group=self._pg)
        self.stats["dense_syncs"] += 1
        touched = pending[:, g.dim] > 0
        ids, grads, touches = g.hot[touched], pending[touched, : g.dim].clone(), pending[touched, g.dim]
        pending.zero_()
        if self._accumulates_squares():
            # k held steps arrive as one sum; 1/sqrt(k) keeps Adagrad's squared-gradient state growing
            # as over k steps (k counted as touches over ranks, capped at the steps held).
            grads = grads / touches.clamp(min=1, max=self._sync_every).sqrt().unsqueeze(1)
        return ids, grads

    def _accumulates_squares(self) -> bool:
        return any("adagrad" in str(getattr(r.optimizer, "value", r.optimizer)).lower() for r in self._replicas)

    @torch.no_grad()
    def _apply(self, g: ReplicaGroup, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """One fused-optimizer step per row this rank owns (its shard) or holds (its replica)."""
        if ids.numel() == 0:
            return
        tables = g.table_of(ids)
        owned = g.owner_of(ids) == self._rank
        rows = torch.where(owned, g.local_rows(ids, tables), 0)
        if bool((~owned).any()):
            rows[~owned] = g.replica_rows_of(ids[~owned])
        module_of = torch.tensor([t.module_index for t in g.tables])[tables]
        table_index = torch.tensor([t.table_index for t in g.tables])[tables]
        for module_index in torch.unique(module_of).tolist():
            for kernel, mask in ((self._emb_modules[module_index].emb_module, owned), (self._replicas[module_index], ~owned)):
                mine = mask & (module_of == module_index)
                if bool(mine.any()):
                    apply_row_grads(kernel, table_index[mine], rows[mine], grads[mine])

    # --- checkpoints -------------------------------------------------------------------------

    @torch.no_grad()
    def flush(self) -> None:
        """Applies held gradients of replicated rows (a collective; before a state dict is taken)."""
        if self._sync_every > 1:
            for index, g in enumerate(self._groups):
                ids, grads = self._release_pending(index, g)
                self._apply(g, ids, grads)
        super().flush()

    def purge(self) -> None:
        """Drops held gradients; replicas are copied from the owners again at the next forward."""
        for pending in self._pending:
            pending.zero_()
        self._needs_refresh = True
        super().purge()


class _ReplicatedPooling(torch.autograd.Function):
    """Finishes the bags (weights, mean) into the lookup's output; its backward runs the write path."""

    @staticmethod
    def forward(ctx, anchor, lookup, steps, pooled, batch):  # noqa: ARG004
        ctx.lookup, ctx.steps, ctx.batch = lookup, steps, batch
        blocks = {}
        for g, step, sums in zip(lookup.groups, steps, pooled):
            out = (sums / _divisors(g, step, batch)).view(len(g.features), batch, g.dim)
            blocks.update(zip(g.features, out.unbind(0)))
        if not blocks:
            return torch.empty(batch, 0)
        return torch.cat([blocks[f] for f in lookup._features], dim=1)

    @staticmethod
    def backward(ctx, grad_output):
        lookup, steps, batch = ctx.lookup, ctx.steps, ctx.batch
        columns, start = {}, 0
        dims = {f: g.dim for g in lookup.groups for f in g.features}
        for feature in lookup._features:
            columns[feature] = grad_output[:, start : start + dims[feature]]
            start += dims[feature]
        bag_grads = [
            torch.stack([columns[f] for f in g.features]).reshape(-1, g.dim) / _divisors(g, step, batch)
            for g, step in zip(lookup.groups, steps)
        ]
        lookup.write_back(steps, bag_grads)
        return None, None, None, None, None


def _divisors(g: ReplicaGroup, step: _Step, batch: int) -> torch.Tensor:
    """Per bag: its length for mean pooling, else 1."""
    mean = torch.repeat_interleave(g.feature_is_mean, batch)
    return torch.where(mean, step.lengths.clamp(min=1), 1).unsqueeze(1).float()

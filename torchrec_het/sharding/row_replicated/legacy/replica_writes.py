"""The replica half of a ``het_row_replicated`` lookup, shared by the pooled and the sequence lookups.

:class:`ReplicaWrites` is a mixin for a TorchRec row-wise lookup (it needs ``_emb_modules``
and ``grouped_configs``, as ``GroupedPooledEmbeddingsLookup`` and
``GroupedEmbeddingsLookup`` have). It owns everything that does not depend on how a
lookup reads rows or what its output looks like:

set-up
  :meth:`attach` builds one :class:`~torchrec_het.sharding.row_replicated.routing.ReplicaGroup`
  per embedding dimension, one replica kernel per fused kernel (shaped like it, pooled
  or not) and the holder groups of the per-host tier; :meth:`refresh` copies every held
  row, with its optimizer state, from its owner.
write path
  :meth:`settle` takes the distinct ids this rank serves and their gradients (what the
  lookup's backward gathered from its readers) and makes every copy take the same
  fused-optimizer step: replicated rows' gradients summed over all ranks (sparse or
  dense, or held for ``replica_sync_every`` steps; on several hosts within each host,
  then between host leaders, then back within the host), per-host rows' over the holder
  group (one rank per host), the rest applied at their owners.
checkpoints
  :meth:`flush` applies held gradients before a state dict; :meth:`purge` drops them and
  refreshes replicas at the next forward (TorchRec calls it when a state dict is loaded).

The lookup's forward calls :meth:`read_groups` (which calls :meth:`begin_step`, the
lookup's ``_plan``, ``_facts`` and ``_read``, and :meth:`agree`, the step's one small
all-gather); its backward calls :meth:`write_back`, which calls :meth:`settle` once per
group, in group order.
:meth:`samples_read_here` tells a data loader which samples need no other rank (FAE).
"""

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import lookup_kernels
from torchrec_het._tbe import (
    apply_row_grads,
    apply_rows,
    check_row_local,
    num_tables,
    optimizer_kind,
    replica_kernel,
    row_state,
    square_width,
    squares_of,
)
from torchrec_het.replication.config import WIRE_DTYPES, ReplicationConfig
from torchrec_het.sharding.common.exchange import exchange_flat
from torchrec_het.sharding.common.id_space import TableInfo, members
from torchrec_het.sharding.row_replicated.routing import ReplicaGroup
from torchrec_het.sharding.row_replicated.sync import (
    HostGroups,
    collective_device,
    combine_dense,
    combine_sparse,
    dense_bytes,
    every_rank_count,
    sparse_bytes,
)


class ReplicaWrites:
    """Hot-row replicas, their refresh, the gradient combine and the fused apply (a mixin).

    Call :meth:`init_replicas` at the end of the lookup's ``__init__``.
    """

    def init_replicas(self, pg, feature_names: list[str], device: torch.device | None = None) -> None:
        """``device``: where the lookup computes (its kernels', groups' and held gradients' home)."""
        self._pg = pg
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._rank = dist.get_rank(pg)
        self._ws = dist.get_world_size(pg)
        self._features = list(feature_names)
        self._groups: list[ReplicaGroup] = []
        self._replicas: list = []
        self._host_pg = None
        self._hosts: HostGroups | None = None
        self._sync_every = 1
        self._skip_all_hot = True
        self._wire = torch.float32
        self._pending: list[torch.Tensor] = []
        self._step = 0
        self._needs_refresh = True
        self._anchor = torch.zeros(1, device=self._device, requires_grad=True)  # lets backward reach the write path
        self.stats = {"steps": 0, "skipped_steps": 0, "sparse_syncs": 0, "dense_syncs": 0}

    # --- set-up ------------------------------------------------------------------------

    def attach(self, config: ReplicationConfig, shards_by_table: dict[str, list]) -> None:
        """Builds groups and replica kernels; called once by the sharded module (a collective)."""
        local_ws = config.ranks_per_host(self._ws)
        self._sync_every, self._skip_all_hot = config.replica_sync_every, config.skip_all_hot
        self._wire = WIRE_DTYPES[config.wire_dtype]
        self._config, self._shards_by_table = config, shards_by_table
        self._build(config)
        # replicated rows sum within each host, then between host leaders; the per-host tier's holder
        # group is one rank per host (the ranks of this local rank: a cross group; every rank with one per host)
        self._hosts = HostGroups(self._pg, local_ws)
        if self._hosts.hierarchical:
            self._host_pg = self._hosts.cross
        elif self._ws // local_ws > 1:
            self._host_pg = self._pg

    def _build(self, config: ReplicationConfig) -> None:
        """Groups, replica kernels and held-gradient buffers for ``config``'s tiers."""
        local_ws = config.ranks_per_host(self._ws)
        by_dim: dict[int, list[tuple[TableInfo, tuple]]] = {}
        for module_index, group in enumerate(self.grouped_configs):
            check_row_local(lookup_kernels(self)[module_index].emb_module, f"tables {[t.name for t in group.embedding_tables]}")
            for table_index, table in enumerate(group.embedding_tables):
                info = TableInfo.of(table, module_index, table_index, self._shards_by_table[table.name], self._ws)
                by_dim.setdefault(table.embedding_dim, []).append((info, config.table_tiers(table.name, table.num_embeddings)))
        self._groups = [
            ReplicaGroup([t for t, _ in items], [tiers for _, tiers in items], dim, self._rank, self._ws, local_ws).to(
                self._device
            )
            for dim, items in by_dim.items()
        ]
        rows = [[0] * len(g.embedding_tables) for g in self.grouped_configs]
        for g in self._groups:
            for t, n in zip(g.tables, g.replica_rows):
                rows[t.module_index][t.table_index] = n
        self._replicas = [
            replica_kernel(m.emb_module, rows[i], dict(self.grouped_configs[i].fused_params or {}))
            for i, m in enumerate(lookup_kernels(self))
        ]
        # per group: held gradients, then (Adagrad family) what each held step adds to the state, then touches
        self._held_kinds = [self._held_kind(g) for g in self._groups]
        self._pending = [
            torch.zeros(g.hot.numel(), g.dim + square_width(kind, g.dim) + 1, device=self._device)
            for g, kind in zip(self._groups, self._held_kinds)
        ]

    @property
    def groups(self) -> list[ReplicaGroup]:
        return self._groups

    def _shard_weights(self, g: ReplicaGroup) -> list[torch.Tensor]:
        return [self._weights[t.module_index][t.table_index] for t in g.tables]

    def _replica_weights(self, g: ReplicaGroup) -> list[torch.Tensor]:
        return [self._replica_views[t.module_index][t.table_index] for t in g.tables]

    def replica_nbytes(self) -> int:
        """Bytes of the replica kernels' weights and optimizer state."""
        total = 0
        for kernel in self._replicas:
            for t in range(num_tables(kernel)):
                total += sum(state.numel() * state.element_size() for state in row_state(kernel, t))
        return total

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies every held row, with its optimizer state, from its owner (a collective)."""
        for g in self._groups:
            for i, t in enumerate(g.tables):
                rows = torch.cat([g.hot, g.host])
                rows = torch.sort(rows[g.table_of(rows) == i]).values
                if rows.numel() == 0:
                    continue
                shard = row_state(lookup_kernels(self)[t.module_index].emb_module, t.table_index)
                replica = row_state(self._replicas[t.module_index], t.table_index)
                widths = [s.size(1) for s in shard]
                block = torch.zeros(rows.numel(), sum(widths), device=rows.device)
                owned = g.owner_of(rows) == self._rank
                local = g.local_rows(rows[owned], torch.full((int(owned.sum()),), i, device=rows.device))
                block[owned] = torch.cat([s[local].float() for s in shard], 1)
                dist.all_reduce(block, group=self._pg)
                held, pos = members(g.held, rows)
                for state, part in zip(replica, block[held].split(widths, 1)):
                    state[g.held_row[pos[held]]] = part.to(state.dtype)
        self._needs_refresh = False

    def samples_read_here(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """bool ``[batch]``: samples whose ids of this lookup's features are all read on this
        rank (owned, replicated, or held for the host), so they need no exchange (FAE's hot
        samples). Features the lookup does not have are ignored. On the batch's device (a data
        loader's batch may still be on the host)."""
        if features.variable_stride_per_key():
            raise ValueError("samples_read_here needs one batch size for every feature")
        stride, device = features.stride(), features.device()
        remote = torch.zeros(stride, dtype=torch.int64, device=self._device)
        by_feature = features.to(self._device).to_dict()
        for g in self._groups:
            for feature, table in zip(g.features, g.feature_table.tolist()):
                if feature not in by_feature:
                    continue
                jt = by_feature[feature]
                ids = jt.values().long() + g.offsets[table]
                sample = torch.repeat_interleave(torch.arange(stride, device=self._device), jt.lengths().long())
                remote += torch.bincount(sample[g.server_of(ids) != self._rank], minlength=stride)
        return (remote == 0).to(device)

    def exchange_rows(self, values: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """``exchange_flat`` of float values (cold partials, rows, gradients) in the wire dtype; float32 back."""
        return exchange_flat(values.to(self._wire), send, recv, self._pg).float()

    # --- forward -------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Refreshes replicas if due, counts the step and takes
        views of the shard and replica weights."""
        if self._needs_refresh:
            self.refresh()
        self._step += 1
        self._weights = [m.split_embedding_weights() for m in lookup_kernels(self)]
        self._replica_views = [r.split_embedding_weights() for r in self._replicas]

    def read_groups(self, features: KeyedJaggedTensor) -> tuple[list, list[torch.Tensor]]:
        """One forward over every group: the lookup's ``_plan(g, by_feature)`` per group, the step's
        one all-gather of each plan's ``_facts(g, step)`` (ids this rank reads from other ranks,
        distinct replicated rows it touched), then ``_read(g, step)`` with the cold exchange skipped
        when no rank reads from another (FAE's all-hot step). Returns (the plans, the reads)."""
        if features.variable_stride_per_key():
            raise NotImplementedError("het_row_replicated does not support variable batch sizes per feature")
        self.begin_step()
        by_feature = features.to_dict()
        steps = [self._plan(g, by_feature) for g in self._groups]
        facts = self.agree([self._facts(g, step) for g, step in zip(self._groups, steps)])
        reads = []
        for index, (g, step) in enumerate(zip(self._groups, steps)):
            step.exchanged = not (self._skip_all_hot and int(facts[:, index, 0].sum()) == 0)
            step.hot_counts = facts[:, index, 1].tolist()
            reads.append(self._read(g, step))
        self.stats["steps"] += 1
        self.stats["skipped_steps"] += int(not any(step.exchanged for step in steps))
        return steps, reads

    def agree(self, facts: list[tuple[int, int]]) -> torch.Tensor:
        """The step's one small all-gather.

        Args:
            facts: per group, (ids this rank reads from other ranks, distinct replicated rows it touched).

        Returns:
            int64 ``[world_size, groups, 2]``: every rank's facts.
        """
        mine = torch.tensor(facts, dtype=torch.int64, device=collective_device(self._pg)).view(-1)
        everyone = [torch.empty_like(mine) for _ in range(self._ws)]
        dist.all_gather(everyone, mine, group=self._pg)
        return torch.stack(everyone).view(self._ws, len(self._groups), 2)

    # --- backward --------------------------------------------------------------------------

    def write_back(self, steps: list, grads: list[torch.Tensor]) -> None:
        """Called by the lookup's backward with the gradient of every group's output (bag sums or
        rows); the lookup's ``_served_grads(g, step, grad)`` turns each into the distinct ids this
        rank serves and their gradients, which :meth:`settle` applies."""
        scale = 1.0 / self._ws if get_gradient_division() else 1.0  # as TorchRec's row-wise backward
        for index, (g, step, grad) in enumerate(zip(self._groups, steps, grads)):
            ids, summed = self._served_grads(g, step, grad * scale)
            self.settle(index, g, ids, summed, step.hot_counts)

    def settle(self, index: int, g: ReplicaGroup, ids: torch.Tensor, grads: torch.Tensor, hot_counts: list[int]) -> None:
        """Applies the gradients of the distinct ``ids`` this rank serves, combined over their holders.

        Every rank calls it for every group in the same order (the combines are collectives).

        Args:
            index: the group's index.
            g: the group.
            ids: distinct fused ids this rank served this step (sorted).
            grads: ``[len(ids), dim]`` their gradients from every reader served.
            hot_counts: per rank, how many replicated rows it touched (from :meth:`agree`).
        """
        hot = g.is_hot(ids)
        host = g.is_host(ids)
        apply_ids, apply_grads = [ids[~hot & ~host]], [grads[~hot & ~host]]
        hot_ids, hot_grads, beyond = self._combine_hot(index, g, ids[hot], grads[hot], hot_counts)
        if beyond is None:
            apply_ids.append(hot_ids)
            apply_grads.append(hot_grads)
        else:
            self._apply(g, hot_ids, hot_grads, beyond)
        if self._host_pg is None:  # one host: per-host rows are read from their owners
            apply_ids.append(ids[host])
            apply_grads.append(grads[host])
        elif g.host.numel():
            host_ids, host_grads = ids[host], grads[host]
            counts = every_rank_count(host_ids.numel(), self._host_pg)
            host_ids, host_grads = combine_sparse(host_ids, host_grads, counts, self._host_pg)
            apply_ids.append(host_ids)
            apply_grads.append(host_grads)
        self._apply(g, torch.cat(apply_ids), torch.cat(apply_grads))

    def _combine_hot(self, index: int, g: ReplicaGroup, ids, grads, counts: list[int]):
        """Replicated rows: (ids, the gradient summed over ranks, held squares beyond its square or None), now or every
        ``replica_sync_every`` steps (nothing in between)."""
        if self._sync_every > 1:
            pending = self._pending[index]
            pos = torch.searchsorted(g.hot, ids)
            pending[pos, : g.dim] += grads
            kind = self._held_kinds[index]
            if kind is not None:  # ids are distinct: each row's gradient of this step
                pending[pos, g.dim : -1] += squares_of(kind, grads).float()
            pending[pos, -1] += 1.0
            if self._step % self._sync_every:
                return ids[:0], grads[:0], None
            return self._release_pending(index, g)
        if sum(counts) == 0:
            return ids[:0], grads[:0], None
        if sparse_bytes(counts, g.dim) <= dense_bytes(g.hot.numel(), g.dim, self._ws):
            self.stats["sparse_syncs"] += 1
            return (*self._hosts.combine_sparse(ids, grads), None)
        self.stats["dense_syncs"] += 1
        ids, grads, _ = combine_dense(ids, grads, g.hot, self._pg, self._hosts)
        return ids, grads, None

    def _release_pending(self, index: int, g: ReplicaGroup):
        """Sums the held gradients of replicated rows over ranks (sparse over the rows touched
        since the last sync, or dense over the block, whichever moves fewer bytes) and empties the hold.

        Adagrad family: the state grows by the held steps' squares, as
        :meth:`~torchrec_het.sharding.row_replicated.replicas.ReplicaBlock._apply` explains (each rank
        sends its squares beyond its own sum's; the sum over ranks is added to the square of the
        summed gradient). Returns (ids, summed gradients, their squares beyond the square of the sum, or None).
        """
        pending, kind = self._pending[index], self._held_kinds[index]
        if kind is not None:
            pending[:, g.dim : -1] -= squares_of(kind, pending[:, : g.dim]).float()
        touched_here = (pending[:, -1] > 0).nonzero().flatten()
        counts = every_rank_count(touched_here.numel(), self._pg)
        if sparse_bytes(counts, pending.size(1)) <= dense_bytes(g.hot.numel(), pending.size(1) - 1, self._ws):
            self.stats["sparse_syncs"] += 1
            ids, summed = self._hosts.combine_sparse(g.hot[touched_here], pending[touched_here])
        else:
            self.stats["dense_syncs"] += 1
            self._hosts.all_reduce(pending)
            touched = pending[:, -1] > 0
            ids, summed = g.hot[touched], pending[touched].clone()
        pending.zero_()
        grads = summed[:, : g.dim]
        return ids, grads, (summed[:, g.dim : -1] if kind is not None else None)

    def _held_kind(self, g: ReplicaGroup) -> str | None:
        """The group's optimizer kind when held gradients carry squares (Adagrad family, synced every k > 1)."""
        if self._sync_every <= 1:
            return None
        kind = optimizer_kind(lookup_kernels(self)[g.tables[0].module_index].emb_module)
        return kind if kind in ("adagrad", "rowwise_adagrad") else None

    @torch.no_grad()
    def _apply(self, g: ReplicaGroup, ids: torch.Tensor, grads: torch.Tensor, beyond: torch.Tensor | None = None) -> None:
        """One fused-optimizer step per row this rank owns (its shard) or holds (its replica);
        with ``beyond``, the held-gradient step (:func:`~torchrec_het._tbe.apply_rows`)."""
        if ids.numel() == 0:
            return
        tables = g.table_of(ids)
        owned = g.owner_of(ids) == self._rank
        rows = torch.where(owned, g.local_rows(ids, tables), 0)
        if bool((~owned).any()):
            rows[~owned] = g.replica_rows_of(ids[~owned])
        module_of = torch.tensor([t.module_index for t in g.tables], device=tables.device)[tables]
        table_index = torch.tensor([t.table_index for t in g.tables], device=tables.device)[tables]
        for module_index in torch.unique(module_of).tolist():
            for kernel, mask in ((lookup_kernels(self)[module_index].emb_module, owned), (self._replicas[module_index], ~owned)):
                mine = mask & (module_of == module_index)
                if bool(mine.any()) and beyond is not None:
                    spans = torch.full_like(rows[mine], self._sync_every)
                    apply_rows(kernel, table_index[mine], rows[mine], grads[mine], beyond[mine], spans)
                elif bool(mine.any()):
                    apply_row_grads(kernel, table_index[mine], rows[mine], grads[mine])

    # --- checkpoints -------------------------------------------------------------------------

    @torch.no_grad()
    def flush(self) -> None:
        """Applies held gradients of replicated rows (a collective; before a state dict is taken)."""
        if self._sync_every > 1:
            for index, g in enumerate(self._groups):
                self._apply(g, *self._release_pending(index, g))
        super().flush()

    def purge(self) -> None:
        """Drops held gradients; replicas are copied from the owners again at the next forward."""
        for pending in self._pending:
            pending.zero_()
        self._needs_refresh = True
        super().purge()


def sum_by_id(ids: list[torch.Tensor], values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the distinct ids of ``ids``' parts, sorted; each one's ``values`` rows summed)."""
    uniq, inverse = torch.unique(torch.cat(ids), return_inverse=True)
    rows = torch.cat(values)
    return uniq, torch.zeros(uniq.numel(), rows.size(1), dtype=rows.dtype, device=rows.device).index_add_(0, inverse, rows)


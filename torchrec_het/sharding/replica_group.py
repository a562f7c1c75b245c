"""Tables of one ``het_row_replicated`` lookup that share a dimension: tiers, holders and servers.

Every row lives in its row-wise owner's shard (the copy checkpoints export). Hot rows
have more holders: a row of the *replicated* tier is held by every rank; a row of the
*per-host* tier by one rank per host, the one whose local rank is its owner's (so on
the owner's host the owner itself holds it). Non-owner holders keep their copies in a
replica kernel. A rank reads a row from the nearest holder: itself, a rank of its host,
or the owner.
"""

import torch

from torchrec_het.sharding.id_space import FusedIdSpace, TableInfo, members


class ReplicaGroup(FusedIdSpace):
    """Fused id space of same-dimension tables plus their hot tiers.

    Args:
        tables: the tables, in the lookup's order.
        tiers: per table, (replicated, per_host) sorted row ids.
        dim: their embedding dimension.
        rank: this rank.
        world_size: ranks in the sharding's process group.
        local_world_size: ranks per host (a host's ranks are consecutive).
    """

    def __init__(
        self,
        tables: list[TableInfo],
        tiers: list[tuple[torch.Tensor, torch.Tensor]],
        dim: int,
        rank: int,
        world_size: int,
        local_world_size: int,
    ) -> None:
        super().__init__(tables, dim, rank, world_size)
        self.local_world_size = local_world_size
        empty = torch.zeros(0, dtype=torch.int64)
        self.hot = torch.cat([empty] + [self.offsets[i] + rep for i, (rep, _) in enumerate(tiers)])
        self.host = torch.cat([empty] + [self.offsets[i] + per for i, (_, per) in enumerate(tiers)])
        host_owner = self.owner_of(self.host)
        same_local = host_owner % local_world_size == rank % local_world_size
        other_host = host_owner // local_world_size != rank // local_world_size
        self.host_block = self.host[same_local]  # per-host rows this rank's holder group combines
        held = torch.cat([self.hot[self.owner_of(self.hot) != rank], self.host[same_local & other_host]])
        self.held = torch.sort(held).values
        held_table = self.table_of(self.held)
        per_table = torch.bincount(held_table, minlength=len(tables))
        self.replica_rows = per_table.tolist()
        self.held_row = torch.arange(self.held.numel()) - (torch.cumsum(per_table, 0) - per_table)[held_table]

    def server_of(self, ids: torch.Tensor) -> torch.Tensor:
        """The rank each id is read from by this rank."""
        server = self.owner_of(ids)
        hot, _ = members(self.hot, ids)
        server[hot] = self.rank
        host, _ = members(self.host, ids)
        first = (self.rank // self.local_world_size) * self.local_world_size
        server[host] = first + server[host] % self.local_world_size
        return server

    def is_hot(self, ids: torch.Tensor) -> torch.Tensor:
        return members(self.hot, ids)[0]

    def is_host(self, ids: torch.Tensor) -> torch.Tensor:
        return members(self.host, ids)[0]

    def replica_rows_of(self, ids: torch.Tensor) -> torch.Tensor:
        """Row of each held id in its table's replica; RuntimeError if one is not held here."""
        held, pos = members(self.held, ids)
        if not bool(held.all()):
            raise RuntimeError(f"rank {self.rank} was asked for rows it neither owns nor holds")
        return self.held_row[pos]

    def read(self, ids: torch.Tensor, shards: list[torch.Tensor], replicas: list[torch.Tensor]) -> torch.Tensor:
        """Rows of ids this rank owns or holds (``shards[i]`` / ``replicas[i]``: table i's local copies)."""
        out = torch.empty(ids.numel(), self.dim, device=ids.device)
        owned = self.owner_of(ids) == self.rank
        out[owned] = self.read_owned(ids[owned], shards)
        held = (~owned).nonzero().flatten()
        if held.numel():
            rows = self.replica_rows_of(ids[held])
            tables = self.table_of(ids[held])
            for i in torch.unique(tables).tolist():
                mine = tables == i
                out[held[mine]] = replicas[i][rows[mine]].float()
        return out

"""Settings of the row-replicated sharding type (``het_row_replicated``), as the user gives them.

:class:`ReplicationConfig` is the builder a sharder (or a module) holds: it gives each table's
:class:`~torchrec_het.plan_options.ReplicaOptions` for the plan (:meth:`ReplicationConfig.table_options`)
and holds the hot-row source (``tiers``). The sharded module builds from the plan's options and the
hot row ids of its tables (:func:`table_tiers`), never from this object.
"""

from dataclasses import dataclass

import torch

from torchrec_het.plan_options import ReplicaOptions


def table_tiers(source: object | None, name: str, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(replicated, per_host) row ids of table ``name`` in the hot-row source ``source`` (empty when it
    does not name it); ValueError naming the table if they do not fit it."""
    empty = torch.zeros(0, dtype=torch.int64)
    tiers = None if source is None else source.tables.get(name)
    if tiers is None:
        return empty, empty
    if tiers.num_rows != num_rows:
        raise ValueError(f"table {name!r}: the tier plan was made for {tiers.num_rows} rows, the table has {num_rows}")
    out = []
    for kind in ("replicated", "per_host"):
        ids = getattr(tiers, kind).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_rows):
            raise ValueError(f"table {name!r}: {kind} row ids must lie in [0, {num_rows})")
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            raise ValueError(f"table {name!r}: {kind} row ids must be sorted and distinct")
        out.append(ids)
    if out[0].numel() and out[1].numel() and bool(torch.isin(out[0], out[1]).any()):
        raise ValueError(f"table {name!r}: a row is in both the replicated and the per-host tier")
    return out[0], out[1]


@dataclass(frozen=True)
class ReplicationConfig:
    """How a row-replicated module keeps its hot rows (the user's builder of each table's plan options).

    Attributes:
        tiers: the hot-row source (a :class:`torchrec_het.replication.tiers.TierPlan`, a
            ``ProfileTiers``, or any object with a ``tables`` dict of name -> tiers with ``num_rows``,
            ``replicated`` and ``per_host`` sorted int64 row ids). None, or a table it does not
            name: no hot rows, the table behaves as stock row-wise.
        replica_sync_every: combine gradients of replicated rows every this many steps
            (1 = exactly synchronous; s > 1 lets replicas lag up to s - 1 steps, HET's write
            bound applied to replicas). Rows of the per-host tier always sync every step.
        skip_all_hot: FAE: when no rank reads a row it does not hold this step, skip the
            cold exchanges (agreed with the step's one small collective).
        local_world_size: ranks per host (ranks of a host are consecutive); None takes
            ``LOCAL_WORLD_SIZE`` from the environment, else one host.
        online_profile_steps: with no ``tiers``, count every row's reads during the first
            this many steps (as plain row-wise: no hot rows yet), then replicate the rows read
            at least once per ``replica_sync_every`` steps (at most ``online_max_hot_fraction``
            of a table), chosen from the counts of all ranks. 0: off.
        online_max_hot_fraction: cap of the online choice, per table.
        lookahead: bags under TorchRec's ``TrainPipelineSparseDist``: while step i runs, owners send
            batch i + 1's partial sums of the rows step i's update leaves alone; at batch i + 1's
            lookup only the others travel. Exact; needs hot rows known when planning.
        cold_rows: bags: the tables (names) whose cold ids fetch their rows, each distinct row once a
            step, pooled by the reader, instead of their owners' partial sums (the cached tier's
            exact form; ``ReplicaOptions.cold_rows``). Exact. None: the planner chooses per table,
            by the bytes and compute it prices each with (a hand-written plan: partial sums).
    """

    tiers: object | None = None
    replica_sync_every: int = 1
    skip_all_hot: bool = True
    local_world_size: int | None = None
    online_profile_steps: int = 0
    online_max_hot_fraction: float = 0.5
    lookahead: bool = False
    cold_rows: frozenset[str] | None = None

    def __post_init__(self) -> None:
        if self.cold_rows is not None:
            object.__setattr__(self, "cold_rows", frozenset(self.cold_rows))
        if self.lookahead and self.online_profile_steps > 0:
            raise ValueError(
                "lookahead needs the hot rows known when planning (tiers or a profile), not counted online "
                f"(online_profile_steps={self.online_profile_steps})"
            )
        if self.online_profile_steps < 0:
            raise ValueError(f"online_profile_steps must be >= 0, got {self.online_profile_steps}")
        if not 0.0 <= self.online_max_hot_fraction <= 1.0:
            raise ValueError(f"online_max_hot_fraction must lie in [0, 1], got {self.online_max_hot_fraction}")
        if self.replica_sync_every < 1:
            raise ValueError(f"replica_sync_every must be >= 1, got {self.replica_sync_every}")
        if self.local_world_size is not None and self.local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {self.local_world_size}")

    def check_tables(self, num_rows_of: dict[str, int], shared: bool = False) -> None:
        """ValueError naming the table for tiers that do not fit a module's tables (``num_rows_of``:
        name -> rows). ``shared``: these settings serve several modules (a sharder's, or a whole
        model's profile), so the tiers of tables this module does not have are left to the others."""
        if self.tiers is None:
            return
        unknown = [] if shared else sorted(set(self.tiers.tables) - set(num_rows_of))
        if unknown:
            raise ValueError(f"the tier plan names table(s) {unknown} that this module does not have")
        for name, rows in num_rows_of.items():
            table_tiers(self.tiers, name, rows)

    def table_options(self, table: str, world_size: int) -> ReplicaOptions:
        """The plan options of ``table``: these settings, and the sizes of the tiers ``tiers`` gives the
        table for ``world_size`` ranks (None when it names no hot rows of the table: counted online,
        or left to the planner's estimate), with the profile they come from."""
        sizes: tuple[int | None, int | None] = (None, None)
        fingerprint = None
        if self.tiers is not None:
            sized = getattr(self.tiers, "tables_for", None)  # ProfileTiers scale their counts by the world size
            tiers = (sized(world_size) if sized is not None else self.tiers.tables).get(table)
            if tiers is not None:
                sizes = (int(tiers.replicated.numel()), int(tiers.per_host.numel()))
                fingerprint = getattr(self.tiers, "fingerprint", None)
        return ReplicaOptions(
            self.replica_sync_every, self.skip_all_hot, self.local_world_size, sizes[0], sizes[1],
            fingerprint, self.online_profile_steps, self.online_max_hot_fraction, self.lookahead,
            self.cold_rows is not None and table in self.cold_rows,
        )  # fmt: skip

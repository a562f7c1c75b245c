"""Benchmark configurations of ``het_row_replicated``: memory budget x replica sync, per workload.

Each configuration profiles a 5% sample of its workload's training stream (every 20th
step, counted on every rank and summed), takes the per-rank peak of the plan the stock
planner would choose as the memory-neutral budget, scales it by ``memory_budget_ratio``,
and lets :func:`~torchrec_het.replication.tier_selection.select_tiers` choose the hot rows.
"""

import dataclasses

import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation

from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.hot_rows import replication_threshold
from torchrec_het.replication.memory import TableMemory, TierTopology, bytes_per_row, plan_peak_bytes, replica_copies
from torchrec_het.replication.profile import AccessProfile, count_accesses
from torchrec_het.replication.tier_selection import select_tiers
from torchrec_het.replication.tiers import TierPlan
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder
from torchrec_het.sharding import het_row_replicated
from torchrec_het_bench import qcomms
from torchrec_het_bench.config_types import BenchConfig, ShardingContext
from torchrec_het_bench.het_configs import plan_every_table
from torchrec_het_bench.topology import cpu_topology

BUDGET_RATIOS = (1.0, 1.1, 1.25)
SYNC_EVERY = (1, 10)


_PROFILES: dict = {}  # (sample function, table names) -> the summed profile: a run's entries share their data


def stream_profile(context: ShardingContext) -> AccessProfile:
    """Row reads per table over every rank's sample, summed over ranks (a collective the first time a
    process asks for that sample's: every rank builds the same entries in the same order)."""
    key = (context.sample, tuple(t.name for t in context.tables))
    if key not in _PROFILES:
        local = count_accesses(context.sample(), context.tables)
        counts = []
        for table_counts in local.counts:
            total = table_counts.clone()
            dist.all_reduce(total)
            counts.append(total)
        _PROFILES[key] = AccessProfile(local.tables, local.num_rows, tuple(counts), local.batches)
    return _PROFILES[key]


def table_memory(context: ShardingContext) -> list[TableMemory]:
    return [
        TableMemory(
            t.name, t.num_embeddings, t.embedding_dim, bytes_per_row(t.embedding_dim, context.embedding_optimizer)
        )
        for t in context.tables
    ]


def stock_peak_bytes(context: ShardingContext) -> int:
    """Per-rank peak of the plan the stock planner chooses for this model (a collective)."""
    stock = EmbeddingCollectionSharder() if context.workload == "sequence" else EmbeddingBagCollectionSharder()
    planner = EmbeddingShardingPlanner(
        topology=_topology(context),
        batch_size=context.batch_size,
        # The stock planner's default percentage, without its deprecated HeuristicalStorageReservation
        # (a FutureWarning); on CPU storage never binds, so the plan is the same.
        storage_reservation=FixedPercentageStorageReservation(percentage=0.15),
    )
    plan = planner.collective_plan(context.train_model, [stock], dist.GroupMember.WORLD)
    return plan_peak_bytes(table_memory(context), plan.plan[context.embedding_path], context.world_size)


def _topology(context: ShardingContext) -> Topology:
    return cpu_topology(context.world_size, context.local_world_size)


def tier_plan(context: ShardingContext, ratio: float, sync_every: int, all_hot: bool = False) -> TierPlan:
    """The hot rows for a budget of ``ratio`` x the stock peak; rows whose sync would move more
    bytes than their reads sharded (:func:`replication_threshold`) stay sharded. ``all_hot``
    (FAE's regrouped batches): the hottest rows the budget holds that are read at least once per
    sync, as FAE chooses them: a batch of hot samples only needs no exchange when every row it
    reads is replicated, which is worth more than the rows' own bytes."""
    budget = int(stock_peak_bytes(context) * ratio)
    min_reads = 1.0 / sync_every if all_hot else replication_threshold(context.world_size, sync_every)
    return select_tiers(
        [dataclasses.replace(t, replica_copies=replica_copies(sync_every)) for t in table_memory(context)],
        stream_profile(context),
        TierTopology.from_torchrec(_topology(context)),
        budget,
        min_reads_per_step=min_reads,
        sync_every=sync_every,
        price_sync=not all_hot,
    )


def plugin_sharders(
    context: ShardingContext, replication: ReplicationConfig, cache=None, pair: str | None = None
) -> list:
    """The plugin's sharder for the context's workload (EmbeddingCollection or EmbeddingBagCollection),
    with TorchRec's quantized comms ``pair`` (:mod:`~torchrec_het_bench.qcomms`; None: none)."""
    codecs = qcomms.registry(pair)
    if context.workload == "sequence":
        return [HetEmbeddingCollectionSharder(replication=replication, qcomm_codecs_registry=codecs)]
    return [HetEmbeddingBagCollectionSharder(cache=cache, replication=replication, qcomm_codecs_registry=codecs)]


def _sharders(ratio: float, sync_every: int, pair: str | None = None, all_hot: bool = False, rows: bool = False):
    def build(context: ShardingContext):
        replication = ReplicationConfig(
            tiers=tier_plan(context, ratio, sync_every, all_hot),
            replica_sync_every=sync_every,
            local_world_size=context.local_world_size,
            cold_rows=frozenset(t.name for t in context.tables) if rows else frozenset(),
        )
        return plugin_sharders(context, replication, pair=pair)

    return build


_all_replicated = plan_every_table(het_row_replicated)


def replicated_config_name(workload: str, ratio: float, sync_every: int) -> str:
    prefix = "seq_rep" if workload == "sequence" else "rep"
    return f"{prefix}_m{round(ratio * 100)}_s{sync_every}"


def hot_fraction(model: nn.Module) -> float | None:
    """Share of all rows a row-replicated module keeps hot (replicated or per host), or None."""
    for module in model.modules():
        if hasattr(module, "replicated_lookups"):
            hot = rows = 0
            for lookup in module.replicated_lookups():
                for g in lookup.groups:
                    hot += g.hot.numel() + g.host.numel()
                    rows += int(g.offsets[-1])
            return hot / rows if rows else 0.0
    return None


ONLINE_PROFILE_STEPS = 20  # the "_online" configurations count reads during their first 20 (warm-up) steps
FAE_WINDOW = 16  # batches regrouped together by AllHotBatches in the "_fae" configurations
FAE_RATIO = 1.0


def replicated_configs() -> list[BenchConfig]:
    """Every budget x sync interval per workload, with the FAE, quantized-comms and online variants, for
    the registry (:func:`torchrec_het_bench.configs.all_configs`)."""
    configs = []
    for workload in ("dlrm", "sequence"):
        for ratio in BUDGET_RATIOS:
            for sync_every in SYNC_EVERY:
                configs.append(_config(workload, ratio, sync_every, None))
        for sync_every in SYNC_EVERY:
            configs.append(_config(workload, FAE_RATIO, sync_every, FAE_WINDOW))
            for pair in (qcomms.FP16, qcomms.INT8):
                configs.append(_config(workload, FAE_RATIO, sync_every, None, pair=pair))
            configs.append(_online_config(workload, sync_every))
    configs.append(_config("dlrm", FAE_RATIO, 1, None, rows=True))
    return configs


def _online_config(workload: str, sync_every: int) -> BenchConfig:
    """Hot rows counted online during the first steps (no profile, no budget)."""
    name = f"{'seq_rep' if workload == 'sequence' else 'rep'}_online_s{sync_every}"

    def build(context: ShardingContext):
        replication = ReplicationConfig(
            replica_sync_every=sync_every, local_world_size=context.local_world_size,
            online_profile_steps=ONLINE_PROFILE_STEPS,
        )  # fmt: skip
        return plugin_sharders(context, replication)

    return BenchConfig(
        name=name,
        stock=False,
        description=f"{workload}: row-replicated, hot rows counted online in the first {ONLINE_PROFILE_STEPS} steps, "
        f"replicas synced every {sync_every} step(s)",
        make_sharders=lambda: [],
        make_constraints=lambda tables, preset: None,
        applies=(lambda preset: preset.sequence is not None) if workload == "sequence" else (lambda preset: True),
        workload=workload,
        params={
            "sharding": "het_row_replicated",
            "replica_sync_every": sync_every,
            "online_profile_steps": ONLINE_PROFILE_STEPS,
        },  # fmt: skip
        make_plan=_all_replicated,
        make_sharders_for=build,
    )


def _config(
    workload: str, ratio: float, sync_every: int, all_hot_window: int | None, pair: str | None = None,
    rows: bool = False,
) -> BenchConfig:  # fmt: skip
    name = replicated_config_name(workload, ratio, sync_every)
    sync = "exact sync" if sync_every == 1 else f"replicas synced every {sync_every} steps"
    description = f"{workload}: row-replicated, hot rows within {ratio:.2f} x the stock plan's memory, {sync}"
    params = {"sharding": "het_row_replicated", "memory_budget_ratio": ratio, "replica_sync_every": sync_every}
    if all_hot_window is not None:
        name += "_fae"
        description += f", batches regrouped so hot samples fill whole batches (window {all_hot_window})"
        params["all_hot_window"] = all_hot_window
    if pair is not None:
        name += qcomms.suffix(pair)
        description += f", TorchRec's quantized comms {pair} on the cold partials/rows and their gradients"
        params["qcomms"] = pair
    if rows:
        name += "_rows"
        description += ", cold ids fetch their rows (each distinct row once a step), pooled by the reader"
        params["cold_rows"] = True
    return BenchConfig(
        name=name,
        stock=False,
        description=description,
        make_sharders=lambda: [],
        make_constraints=lambda tables, preset: None,
        applies=(lambda preset: preset.sequence is not None) if workload == "sequence" else (lambda preset: True),
        workload=workload,
        params=params,
        make_plan=_all_replicated,
        make_sharders_for=_sharders(ratio, sync_every, pair, all_hot_window is not None, rows),
    )


__all__ = ["ShardingContext", "hot_fraction", "replicated_configs", "stream_profile", "tier_plan"]

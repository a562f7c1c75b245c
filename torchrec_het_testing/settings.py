"""A case's settings (fused optimizer, sharding-type settings), and the plugin's sharders and
planner pricing built from them.

This is the one place where a test's settings reach the plugin: the generic body
(:mod:`~torchrec_het_testing.equivalence`) and the behaviour tests build their sharders here.
"""

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torchrec.optim
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.planner import AccessModel, PluginPricing
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfile, AccessProfiler
from torchrec_het.replication.tiers import TableTiers
from torchrec_het.sharders import get_het_sharders

# the fused optimizers users use, as (class, arguments) for apply_optimizer_in_backward
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adagrad": (torch.optim.Adagrad, {"lr": 0.1, "eps": 1e-8}),
    "rowwise_adagrad": (torchrec.optim.RowWiseAdagrad, {"lr": 0.1, "eps": 1e-8}),
}


@dataclass(frozen=True)
class ReplicaSettings:
    """``het_row_replicated`` in a test: rows ``0, stride, 2 * stride, ...`` of every table (the
    batches' hottest) are replicated on every rank, the next ``per_host`` of them get one copy per host.

    Attributes:
        hot: replicated rows per table (0 with ``online_profile_steps``: chosen while training).
        per_host: rows of the per-host tier per table.
        stride: distance between hot rows.
        sync_every: ``replica_sync_every``.
        online_profile_steps: count reads this many steps, then replicate (no hot rows given).
        skip_all_hot: skip the cold exchanges of steps no rank reads a cold row in.
        from_profile: the hot rows are the ones the access profile the planner priced names, by
            the planner's rule on its topology (``get_het_sharders(profile=..., topology=...)``);
            ``hot``, ``per_host`` and ``stride`` are not used.
        lookahead: owners send the next batch's partial sums early (bags).
        cold_rows: bags: every table's cold ids fetch their rows, pooled by the reader.
    """

    hot: int = 8
    per_host: int = 0
    stride: int = 1
    sync_every: int = 1
    online_profile_steps: int = 0
    skip_all_hot: bool = True
    from_profile: bool = False
    lookahead: bool = False
    cold_rows: bool = False


def describe(settings: CacheSettings | ReplicaSettings | None) -> str:
    """A short name of ``settings`` for test ids, e.g. ``s0_w0_c0.3``, ``hot8``, ``hot4_per_host3_sync2``."""
    if isinstance(settings, CacheSettings):
        name = f"s{settings.s_read}_w{settings.s_write}_c{settings.capacity}"
        return name + ("" if settings.protocol == "het" else f"_{settings.protocol}")
    if not isinstance(settings, ReplicaSettings):
        return ""
    if settings.from_profile:
        name = "profiled"
    elif settings.online_profile_steps:
        name = f"online{settings.online_profile_steps}"
    else:
        name = f"hot{settings.hot}" + (f"_per_host{settings.per_host}" if settings.per_host else "")
        name += f"_stride{settings.stride}" if settings.stride != 1 else ""
    name += f"_sync{settings.sync_every}" if settings.sync_every != 1 else ""
    name += "" if settings.skip_all_hot else "_no_skip"
    name += "_cold_rows" if settings.cold_rows else ""
    return name + ("_lookahead" if settings.lookahead else "")


@dataclass(frozen=True, eq=False)
class HotRows:
    """Hot rows of a whole model's tables (a ``ReplicationConfig.tiers``); every sharded module takes its own."""

    tables: dict[str, TableTiers]
    spans_modules: bool = True


def hot_rows(tables, hot: int, per_host: int = 0, stride: int = 1) -> HotRows:
    """Rows ``0, stride, ...`` of each table: the first ``hot`` replicated, the next ``per_host`` per host."""
    out = {}
    for config in tables:
        ids = torch.arange(0, config.num_embeddings, stride)
        out[config.name] = TableTiers(config.name, config.num_embeddings, ids[:hot], ids[hot : hot + per_host])
    return HotRows(out)


def unchecked_tiers(tables, hot: int) -> SimpleNamespace:
    """A tier plan as a user may write one, checked by nothing but the plugin: rows ``0..hot-1``
    of each table replicated (its fields may be edited to make it wrong)."""
    empty = torch.zeros(0, dtype=torch.int64)
    return SimpleNamespace(tables={
        c.name: SimpleNamespace(num_rows=c.num_embeddings, replicated=torch.arange(hot), per_host=empty) for c in tables
    })  # fmt: skip


def replication_config(
    settings: ReplicaSettings, tables, world_size: int, local_world_size: int | None
) -> ReplicationConfig:
    """The ``ReplicationConfig`` of ``settings`` for ``tables`` on ``world_size`` ranks, ``local_world_size``
    per host (without tiers when they come from a profile)."""
    given = not (settings.online_profile_steps or settings.from_profile)
    return ReplicationConfig(
        tiers=hot_rows(tables, settings.hot, settings.per_host, settings.stride) if given else None,
        replica_sync_every=settings.sync_every,
        local_world_size=local_world_size or world_size,
        skip_all_hot=settings.skip_all_hot,
        online_profile_steps=settings.online_profile_steps,
        lookahead=settings.lookahead,
        cold_rows=frozenset(c.name for c in tables) if settings.cold_rows else frozenset(),
    )


def qcomms_registry(qcomms: str | None) -> dict | None:
    """TorchRec's codecs registry of ``"<forward>/<backward>"`` (``"fp16/bf16"``), as a user builds
    it (``get_qcomm_codecs_registry(QCommsConfig(...))``); None: no quantized comms."""
    if qcomms is None:
        return None
    forward, backward = qcomms.split("/")
    config = QCommsConfig(forward_precision=CommType(forward), backward_precision=CommType(backward))
    return get_qcomm_codecs_registry(config)


def het_sharders(settings: CacheSettings | ReplicaSettings | None, tables, world_size: int,
                 local_world_size: int | None = None, profile: AccessProfile | None = None, topology=None,
                 qcomms: str | None = None) -> list:  # fmt: skip
    """``get_het_sharders()`` carrying ``settings`` (None: the defaults) for ``tables``; with
    ``ReplicaSettings(from_profile=True)``, the hot rows of ``profile`` on the planner's ``topology``;
    ``qcomms``: TorchRec's quantized comms (:func:`qcomms_registry`) on every table they shard."""
    registry = qcomms_registry(qcomms)
    if isinstance(settings, CacheSettings):
        return get_het_sharders(cache=HetCacheConfig(default=settings), qcomm_codecs_registry=registry)
    if isinstance(settings, ReplicaSettings):
        replication = replication_config(settings, tables, world_size, local_world_size)
        if settings.from_profile:
            return get_het_sharders(
                replication=replication, profile=profile, topology=topology, qcomm_codecs_registry=registry
            )
        return get_het_sharders(replication=replication, qcomm_codecs_registry=registry)
    return get_het_sharders(qcomm_codecs_registry=registry)


def profile_of(groups: list[tuple[list, list]]) -> AccessProfile:
    """One profile of every table from ``(tables, KeyedJaggedTensors read by them)`` groups
    (a model's unweighted and weighted features come in separate KeyedJaggedTensors)."""
    profiles = []
    for tables, batches in groups:
        if not tables:
            continue
        profiler = AccessProfiler(tables)
        for features in batches:
            profiler.observe(features)
        profiles.append(profiler.profile())
    return AccessProfile(
        tables=tuple(n for p in profiles for n in p.tables),
        num_rows=tuple(r for p in profiles for r in p.num_rows),
        counts=tuple(c for p in profiles for c in p.counts),
        batches=max(p.batches for p in profiles),
    )


def plugin_pricing(settings: CacheSettings | ReplicaSettings | None, profile: AccessProfile) -> PluginPricing:
    """What the planner prices with besides the sharders' options: reads measured in ``profile``
    (and, for hot rows counted online, that they are)."""
    online = settings.online_profile_steps if isinstance(settings, ReplicaSettings) else 0
    return PluginPricing(access=AccessModel(profile), online_profile_steps=online)

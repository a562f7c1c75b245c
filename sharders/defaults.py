"""``get_het_sharders()``: TorchRec's default sharders with the plugin's in place of the stock
EmbeddingBagCollection and EmbeddingCollection sharders (the one-line swap for
``get_default_sharders()``)."""

import dataclasses

from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import get_default_sharders

from torchrec_het._compat import uses_index_dedup
from torchrec_het.config import HetCacheConfig
from torchrec_het.planner.access import ProfileTiers, check_not_empty
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfile, load_profile
from torchrec_het.sharders.het import HetEmbeddingBagCollectionSharder
from torchrec_het.sharders.het_ec import HetEmbeddingCollectionSharder


def get_het_sharders(
    cache: HetCacheConfig | None = None,
    replication: ReplicationConfig | None = None,
    stock=get_default_sharders,
    profile: AccessProfile | str | None = None,
    topology=None,
    qcomm_codecs_registry: dict | None = None,
) -> list:
    """``stock()`` (TorchRec's ``get_default_sharders``), with its ``EmbeddingBagCollectionSharder``
    and ``EmbeddingCollectionSharder`` replaced by the plugin's, built with ``cache`` and ``replication``.

    Args:
        profile: the access profile (or an iopath path of one) the planner priced from: tables
            planned ``het_row_replicated`` replicate its hot rows (``ProfileTiers`` with
            ``replication``'s sync interval). Without it, or tiers in ``replication``, or online
            counting, sharding a ``het_row_replicated`` table raises a ValueError naming it.
        topology: the planner's ``Topology``: on several hosts, the profile's tiers take the
            per-host tier the planner priced (and ``replication`` its ranks per host, unless set).
            None: the rows are replicated on every rank; give the planner
            ``PluginPricing(per_host_tier=False)`` then, so it prices those.
        qcomm_codecs_registry: TorchRec's quantized comms
            (``get_qcomm_codecs_registry(QCommsConfig(...))``) for both plugin sharders: their stock
            tables and their plugin tables alike. None: each plugin sharder takes the registry of
            the stock sharder it replaces (it always takes that sharder's ``fused_params``).
    """
    if profile is not None:
        replication = with_profile_tiers(replication, profile, topology)
    out = []
    for sharder in stock():
        registry = qcomm_codecs_registry
        if registry is None:
            registry = getattr(sharder, "qcomm_codecs_registry", None)
        if type(sharder) is EmbeddingBagCollectionSharder:
            sharder = HetEmbeddingBagCollectionSharder(
                cache=cache, replication=replication, fused_params=sharder.fused_params, qcomm_codecs_registry=registry
            )
        elif type(sharder) is EmbeddingCollectionSharder:
            sharder = HetEmbeddingCollectionSharder(
                replication=replication,
                fused_params=sharder.fused_params,
                qcomm_codecs_registry=registry,
                use_index_dedup=uses_index_dedup(sharder),
            )
        out.append(sharder)
    return out


def with_profile_tiers(
    replication: ReplicationConfig | None, profile: AccessProfile | str, topology=None
) -> ReplicationConfig:
    """``replication`` (default ``ReplicationConfig()``) with the hot rows of ``profile`` as its
    tiers (per host too on a ``topology`` of several hosts).

    Raises:
        ValueError: ``replication`` has tiers already, or the profile is empty (naming its path).
    """
    replication = replication if replication is not None else ReplicationConfig()
    if replication.tiers is not None:
        raise ValueError("pass the hot rows once: either profile= or ReplicationConfig(tiers=...), not both")
    source = profile if isinstance(profile, str) else None
    if isinstance(profile, str):
        profile = load_profile(profile)
    check_not_empty(profile, source)
    tiers = ProfileTiers(profile, replica_sync_every=replication.replica_sync_every, topology=topology)
    if topology is not None and replication.local_world_size is None:
        replication = dataclasses.replace(replication, local_world_size=tiers.topology.local_world_size)
    return dataclasses.replace(replication, tiers=tiers)

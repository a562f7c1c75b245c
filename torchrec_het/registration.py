"""Opt-in registration of the plugin into TorchRec: ``install()`` / ``uninstall()`` (also ``torchrec_het.install()``).

Nothing here runs on import. :func:`install` makes TorchRec's ``get_default_sharders()``
return the plugin's EmbeddingBagCollection / EmbeddingCollection sharders (the rest of
TorchRec's defaults unchanged) and makes a stock ``EmbeddingShardingPlanner(...)`` built
without its own enumerator, performance model, partitioner or stats use the plugin's,
so the planner can choose the plugin's sharding types. :func:`uninstall` puts every
replaced attribute back. Every change is made here and nowhere else.

Scripts that ran ``from torchrec.distributed.model_parallel import get_default_sharders``
before ``install()`` keep the stock function: install first (``python -m torchrec_het.launch``
does), then import the script.
"""

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from torchrec_het import _compat
from torchrec_het.config import HetCacheConfig
from torchrec_het.planner.access import DEFAULT_ALPHA, AccessModel, ProfileTiers
from torchrec_het.planner.pricing import PluginPricing
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfile, load_profile

# settings ``install()`` reads when not given (the launcher passes them this way)
ENV_PROFILE, ENV_ALPHA, ENV_SYNC = "TORCHREC_HET_PROFILE", "TORCHREC_HET_ALPHA", "TORCHREC_HET_REPLICA_SYNC_EVERY"
ENV_ONLINE = "TORCHREC_HET_ONLINE_PROFILE_STEPS"
ENV_STALENESS = "TORCHREC_HET_EMBEDDING_STALENESS"


@dataclass
class _Installed:
    cache: HetCacheConfig
    replication: ReplicationConfig
    pricing: PluginPricing
    saved: list[tuple[object, str, object]] = field(default_factory=list)  # (owner, attribute, original)


_state: _Installed | None = None


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _state is not None


def install(
    profile: AccessProfile | str | None = None,
    alpha: float | None = None,
    cache: HetCacheConfig | None = None,
    replica_sync_every: int | None = None,
    max_hot_fraction: float = 0.5,
    online_profile_steps: int | None = None,
    embedding_staleness: int | None = None,
) -> None:
    """Registers the plugin with TorchRec until :func:`uninstall` (calling it again re-installs).

    Args:
        profile: row access counts (an ``AccessProfile`` or an iopath path of one, e.g. from
            ``python -m torchrec_het.profile``); default ``$TORCHREC_HET_PROFILE``. It prices
            the plugin's types and names the rows ``het_row_replicated`` replicates; without
            one (and without ``online_profile_steps``) the planner offers only
            ``het_cached_row_wise``, priced by a Zipf skew.
        alpha: the Zipf exponent assumed for tables without counts (default
            ``$TORCHREC_HET_ALPHA`` or 1.05).
        cache: settings of ``het_cached_row_wise`` tables (default ``HetCacheConfig()``).
        replica_sync_every: replica sync interval of ``het_row_replicated`` tables (default
            ``$TORCHREC_HET_REPLICA_SYNC_EVERY`` or 1, exact).
        max_hot_fraction: at most this share of a table's rows is replicated.
        online_profile_steps: without a profile, let ``het_row_replicated`` tables count their
            reads during this many first steps and then replicate the hot rows (default
            ``$TORCHREC_HET_ONLINE_PROFILE_STEPS`` or 0: off); the planner then offers row
            replication for every table, priced from the stated skew.
        embedding_staleness: k >= 0 makes TorchRec's ``TrainPipelineSparseDist`` (as a script
            imports it after this call) the hybrid pipeline with that bound
            (:class:`~torchrec_het.pipeline.HybridTrainPipeline`); default
            ``$TORCHREC_HET_EMBEDDING_STALENESS`` or unset: TorchRec's own.
    """
    global _state
    uninstall()
    if profile is None:
        profile = os.environ.get(ENV_PROFILE) or None
    if isinstance(profile, str):
        profile = load_profile(profile)
    alpha = float(os.environ.get(ENV_ALPHA, DEFAULT_ALPHA)) if alpha is None else alpha
    sync = int(os.environ.get(ENV_SYNC, 1)) if replica_sync_every is None else replica_sync_every
    online = int(os.environ.get(ENV_ONLINE, 0)) if online_profile_steps is None else online_profile_steps
    online = 0 if profile is not None else online
    if embedding_staleness is None and os.environ.get(ENV_STALENESS, "") != "":
        text = os.environ[ENV_STALENESS]
        if not text.strip().isdigit():
            raise ValueError(f"{ENV_STALENESS} must be an int >= 0, got {text!r}")
        embedding_staleness = int(text)
    if embedding_staleness is not None and (
        isinstance(embedding_staleness, bool) or not isinstance(embedding_staleness, int) or embedding_staleness < 0
    ):
        raise ValueError(f"embedding_staleness must be an int >= 0, got {embedding_staleness!r}")
    cache = cache or HetCacheConfig()
    pricing = PluginPricing(AccessModel(profile, alpha), cache, sync, max_hot_fraction, online)
    tiers = ProfileTiers(profile, None, sync, max_hot_fraction) if profile is not None else None
    replication = ReplicationConfig(
        tiers=tiers, replica_sync_every=sync, online_profile_steps=online, online_max_hot_fraction=max_hot_fraction
    )
    state = _Installed(cache, replication, pricing)
    sharder_homes = _compat.default_sharders_homes()  # the first defines it
    plugin_sharders = _plugin_default_sharders(sharder_homes[0].get_default_sharders, state)
    for home in sharder_homes:
        _replace(state, home, "get_default_sharders", plugin_sharders)
    from torchrec_het.planner.planner import HetEmbeddingShardingPlanner

    for home in _compat.planner_homes():
        _replace(state, home, "EmbeddingShardingPlanner", HetEmbeddingShardingPlanner)
    if embedding_staleness is not None:
        hybrid = _hybrid_sparse_dist(embedding_staleness)
        for home in _compat.train_pipeline_homes():
            _replace(state, home, "TrainPipelineSparseDist", hybrid)
    _state = state


def installed_pricing() -> PluginPricing | None:
    """The planner settings of the current installation, or None."""
    return _state.pricing if _state is not None else None


def uninstall() -> None:
    """Restores everything :func:`install` replaced; a no-op when not installed."""
    global _state
    if _state is None:
        return
    for owner, attribute, original in reversed(_state.saved):
        setattr(owner, attribute, original)
    _state = None


def _replace(state: _Installed, owner: object, attribute: str, replacement: object) -> None:
    state.saved.append((owner, attribute, getattr(owner, attribute)))
    setattr(owner, attribute, replacement)


def _plugin_default_sharders(stock: Callable[[], list], state: _Installed) -> Callable[[], list]:
    from torchrec_het.sharders import get_het_sharders

    def get_default_sharders() -> list:
        """TorchRec's default sharders, with the EmbeddingBagCollection and EmbeddingCollection
        sharders replaced by torchrec_het's (installed by ``torchrec_het.install()``)."""
        return get_het_sharders(state.cache, state.replication, stock=stock)

    return get_default_sharders


def _hybrid_sparse_dist(k: int) -> type:
    """``TrainPipelineSparseDist``'s constructor, building the hybrid pipeline with bound ``k``."""
    import sys

    import torch.distributed as dist

    from torchrec_het.pipeline import HybridTrainPipeline

    class TrainPipelineSparseDist(HybridTrainPipeline):
        """TorchRec's ``TrainPipelineSparseDist`` as torchrec_het installed it: the hybrid pipeline."""

        def __init__(self, model, optimizer, device, execute_all_batches: bool = True, apply_jit: bool = False, **kwargs):
            super().__init__(model, optimizer, device, embedding_staleness=k, execute_all_batches=execute_all_batches,
                             apply_jit=apply_jit, **kwargs)
            if not dist.is_initialized() or dist.get_rank() == 0:
                print(f"torchrec_het: TrainPipelineSparseDist runs as the hybrid pipeline, embedding_staleness={k} "
                      f"(${ENV_STALENESS})", file=sys.stderr, flush=True)

    return TrainPipelineSparseDist

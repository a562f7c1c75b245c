"""The plugin's bag sharder, the sharded module it builds, and EmbeddingBagCollections that carry settings.

Users swap :class:`HetEmbeddingBagCollectionSharder` in for TorchRec's
``EmbeddingBagCollectionSharder``; tables planned ``het_cached_row_wise`` get the HET
cache, tables planned ``het_row_replicated`` get hot-row replicas, every other table
is sharded by stock TorchRec in the same module.
"""

from typing import Any

import torch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder, ShardedEmbeddingBagCollection
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import sharded_lookups, sharded_table_configs
from torchrec_het.config import HetCacheConfig
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders.plugin_sharder import PluginSharder, plan_hot_rows
from torchrec_het.sharders.replicated_module import ReplicatedModule
from torchrec_het.sharding.common.context import PluginContexts
from torchrec_het.sharding.common.validate import FeatureCheck, plugin_features
from torchrec_het.sharding.het_cache.sharding import HetCachedRwPooledEmbeddingSharding
from torchrec_het.sharding.row_replicated.cached_tier import CachedTierPooledEmbeddingSharding, served_exactly
from torchrec_het.sharding.row_replicated.lookup import ReplicatedBagLookup
from torchrec_het.sharding.row_replicated.sharding import RowReplicatedPooledEmbeddingSharding
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED, HET_SHARDING_TYPES


class HetEmbeddingBagCollection(EmbeddingBagCollection):
    """An ``EmbeddingBagCollection`` that carries the settings of its plugin-sharded tables.

    Args:
        tables: the tables, as for ``EmbeddingBagCollection``.
        cache: HET cache settings (global, with per-table overrides).
        replication: hot-row tiers and sync settings of ``het_row_replicated`` tables.
        is_weighted: whether features carry per-id weights.
        device: where the tables are created (``meta`` to let sharding materialize them).
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        cache: HetCacheConfig | None = None,
        is_weighted: bool = False,
        device: torch.device | None = None,
        replication: ReplicationConfig | None = None,
    ) -> None:
        super().__init__(tables=tables, is_weighted=is_weighted, device=device)
        self.het_cache_config = cache if cache is not None else HetCacheConfig()
        self.het_cache_config.check_tables([t.name for t in tables])
        self.het_replication_config = replication  # None: the sharder's
        if replication is not None:
            replication.check_tables({t.name: t.num_embeddings for t in tables})


class HetShardedEmbeddingBagCollection(ReplicatedModule, PluginContexts, ShardedEmbeddingBagCollection):
    """TorchRec's sharded EBC, with the plugin's types routed to their shardings (each given its
    per-batch context, :class:`~torchrec_het.sharding.common.context.PluginContexts`).

    Every plugin table is built from the options its plan entry carries
    (:class:`~torchrec_het.plan_options.HetParameterSharding`); ``hot_rows`` is this rank's source of
    the hot row ids of ``het_row_replicated`` tables (checked against the plan's tier sizes before
    TorchRec builds anything).
    """

    def __init__(self, *args: Any, hot_rows: object | None = None, **kwargs: Any) -> None:
        plan = kwargs.get("table_name_to_parameter_sharding", args[1] if len(args) > 1 else {})
        module = kwargs.get("module", args[0] if args else None)
        rows = {t.name: t.num_embeddings for t in module.embedding_bag_configs()}
        self._het_hot_rows = plan_hot_rows(hot_rows, plan, rows)  # read by create_embedding_bag_sharding
        super().__init__(*args, **kwargs)
        self.het_plan = dict(plan)  # each table's sharding as built, plugin options included
        self._rows_of_feature = {
            feature: config.num_embeddings for config in sharded_table_configs(self) for feature in config.feature_names
        }
        self._check_features = FeatureCheck(
            self._rows_of_feature, plugin_features(plan, module.embedding_bag_configs(), HET_SHARDING_TYPES)
        )
        self.find_plugin_shardings()

    def create_embedding_bag_sharding(
        self, sharding_infos, env, device=None, permute_embeddings=False, qcomm_codecs_registry=None
    ):
        """The plugin's shardings for its types (built from the plan's options), TorchRec's for the others."""
        sharding_type = sharding_infos[0].param_sharding.sharding_type
        if sharding_type == HET_ROW_REPLICATED:
            return RowReplicatedPooledEmbeddingSharding(
                sharding_infos, env, self._het_hot_rows, device, qcomm_codecs_registry=qcomm_codecs_registry
            )
        if sharding_type == HET_CACHED_ROW_WISE:  # exact: the fetched-rows tier; bounded: HET's cache
            cached = (
                CachedTierPooledEmbeddingSharding
                if served_exactly(sharding_infos)
                else HetCachedRwPooledEmbeddingSharding
            )
            return cached(sharding_infos, env, None, device, qcomm_codecs_registry=qcomm_codecs_registry)
        return super().create_embedding_bag_sharding(
            sharding_infos,
            env,
            device,
            permute_embeddings=permute_embeddings,
            qcomm_codecs_registry=qcomm_codecs_registry,
        )

    def input_dist(self, ctx, features: KeyedJaggedTensor):
        self._check_features(features)  # before anything is sent or cached
        return super().input_dist(ctx, features)

    def het_lookups(self) -> list:
        """The lookups of ``het_cached_row_wise`` tables (those that count as a cache: ``cache_stats``)."""
        return [lookup for lookup in sharded_lookups(self) if hasattr(lookup, "cache_stats")]

    def cache_stats(self) -> dict[str, dict]:
        """Cache counters per het table on this rank (hit rates, rows fetched and pushed, staleness)."""
        stats: dict[str, dict] = {}
        for lookup in self.het_lookups():
            stats.update(lookup.cache_stats())
        return stats

    def reset_cache_stats(self) -> None:
        for lookup in self.het_lookups():
            lookup.reset_cache_stats()

    def replicated_lookups(self) -> list:
        return [lookup for lookup in sharded_lookups(self) if isinstance(lookup, ReplicatedBagLookup)]

    def flush_cache(self) -> None:
        """Pushes every pending gradient to its owner; a collective, every rank calls it."""
        for lookup in self.het_lookups():
            lookup.flush()


class HetEmbeddingBagCollectionSharder(PluginSharder, EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` that also offers the plugin's types (and row_wise on CPU).

    Args:
        cache: HET cache settings for modules that carry none
            (a :class:`HetEmbeddingBagCollection` brings its own).
        replication: hot-row settings for modules that carry none.
        fused_params: as for ``EmbeddingBagCollectionSharder``.
        module_type: the module class this sharder shards. DistributedModelParallel and the
            planner pick sharders by a module's exact type: pass
            ``HetEmbeddingBagCollection`` to shard those (a model with both kinds passes
            one sharder of each).
        **kwargs: passed on to ``EmbeddingBagCollectionSharder``.
    """

    plugin_types = HET_SHARDING_TYPES
    module_base = EmbeddingBagCollection

    def __init__(
        self,
        cache: HetCacheConfig | None = None,
        fused_params: dict | None = None,
        replication: ReplicationConfig | None = None,
        module_type: type[EmbeddingBagCollection] = EmbeddingBagCollection,
        **kwargs: Any,
    ) -> None:
        super().__init__(fused_params=fused_params, **kwargs)
        self._set_module_type(module_type)
        self._cache = cache if cache is not None else HetCacheConfig()
        self._replication = replication if replication is not None else ReplicationConfig()

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        if ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types + list(HET_SHARDING_TYPES)

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingBagCollection:
        if not any(p.sharding_type in HET_SHARDING_TYPES for p in params.values()):
            return super().shard(module, params, env, device, module_fqn)
        cache, replication = self.settings_for(module)
        cache.check_tables([n for n, p in params.items() if p.sharding_type == HET_CACHED_ROW_WISE])
        from_sharder = getattr(module, "het_replication_config", None) is None
        whole_model = from_sharder and getattr(replication.tiers, "spans_modules", False)  # e.g. a model's profile
        replication.check_tables({t.name: t.num_embeddings for t in module.embedding_bag_configs()}, whole_model)
        params = self.with_table_options(module, params, env.world_size)
        return HetShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            hot_rows=replication.tiers,
        )

    def settings_for(self, module: EmbeddingBagCollection) -> tuple[HetCacheConfig, ReplicationConfig]:
        """The module's cache and replication settings, else the sharder's (whose hot-row source may
        name a whole model's tables, ``spans_modules``: each module takes its own)."""
        cache = getattr(module, "het_cache_config", None) or self._cache
        replication = getattr(module, "het_replication_config", None)
        return cache, replication if replication is not None else self._replication

"""The plugin's sequence sharder, the sharded module it builds, and EmbeddingCollections that carry settings.

Users swap :class:`HetEmbeddingCollectionSharder` in for TorchRec's
``EmbeddingCollectionSharder``; tables planned ``het_row_replicated`` get hot-row
replicas and distinct-row fetches, every other table is sharded by stock TorchRec in
the same module.
"""

from typing import Any

import torch
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import sharded_lookups, sharded_table_configs, uses_index_dedup
from torchrec_het.config import HetCacheConfig
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders.plugin_sharder import PluginSharder, plan_hot_rows
from torchrec_het.sharders.replicated_module import ReplicatedModule
from torchrec_het.sharding.common.context import PluginContexts
from torchrec_het.sharding.common.validate import FeatureCheck, plugin_features
from torchrec_het.sharding.row_replicated.lookup import ReplicatedSequenceLookup
from torchrec_het.sharding.row_replicated.sharding import RowReplicatedSequenceEmbeddingSharding
from torchrec_het.types import HET_ROW_REPLICATED

SEQUENCE_PLUGIN_TYPES = (HET_ROW_REPLICATED,)


class HetEmbeddingCollection(EmbeddingCollection):
    """An ``EmbeddingCollection`` that carries the settings of its ``het_row_replicated`` tables.

    Args:
        tables: the tables, as for ``EmbeddingCollection`` (one embedding dimension).
        device: where the tables are created (``meta`` to let sharding materialize them).
        replication: hot-row tiers and sync settings; None takes the sharder's.
        **kwargs: passed on to ``EmbeddingCollection`` (``need_indices``, ...).
    """

    def __init__(
        self,
        tables: list[EmbeddingConfig],
        device: torch.device | None = None,
        replication: ReplicationConfig | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tables=tables, device=device, **kwargs)
        self.het_replication_config = replication  # None: the sharder's
        if replication is not None:
            replication.check_tables({t.name: t.num_embeddings for t in tables})


class HetShardedEmbeddingCollection(ReplicatedModule, PluginContexts, ShardedEmbeddingCollection):
    """TorchRec's sharded EC, with ``het_row_replicated`` routed to its sharding (given its per-batch
    context, :class:`~torchrec_het.sharding.common.context.PluginContexts`).

    The plan (fused kernel for ``het_row_replicated`` tables) and the replication
    settings (against the module's tables) are checked before TorchRec builds anything;
    batches are checked before anything is read or sent.
    """

    def __init__(self, *args: Any, hot_rows: object | None = None, **kwargs: Any) -> None:
        module = kwargs.get("module", args[0] if args else None)
        plan = kwargs.get("table_name_to_parameter_sharding", args[1] if len(args) > 1 else {})
        for name, sharding in plan.items():
            kernel = sharding.compute_kernel
            if sharding.sharding_type == HET_ROW_REPLICATED and kernel != EmbeddingComputeKernel.FUSED.value:
                raise ValueError(f"table {name!r}: het_row_replicated needs the fused kernel, planned {kernel!r}")
        rows = {t.name: t.num_embeddings for t in module.embedding_configs()}
        self._het_hot_rows = plan_hot_rows(hot_rows, plan, rows)  # read by create_embedding_sharding
        super().__init__(*args, **kwargs)
        self._rows_of_feature = {
            feature: config.num_embeddings for config in sharded_table_configs(self) for feature in config.feature_names
        }
        self._check_features = FeatureCheck(
            self._rows_of_feature, plugin_features(plan, module.embedding_configs(), SEQUENCE_PLUGIN_TYPES)
        )  # its per-key layout kept between batches
        self.find_plugin_shardings()

    def create_embedding_sharding(self, sharding_type, sharding_infos, env, device=None, qcomm_codecs_registry=None):
        """``het_row_replicated``'s sharding (built from the plan's options), TorchRec's for the others."""
        if sharding_type == HET_ROW_REPLICATED:
            return RowReplicatedSequenceEmbeddingSharding(
                sharding_infos, env, self._het_hot_rows, device, qcomm_codecs_registry=qcomm_codecs_registry
            )
        return super().create_embedding_sharding(
            sharding_type, sharding_infos, env, device, qcomm_codecs_registry=qcomm_codecs_registry
        )

    def input_dist(self, ctx, features):
        if isinstance(features, KeyedJaggedTensor):  # before anything is read or sent
            self._check_features(features)
        return super().input_dist(ctx, features)

    def replicated_lookups(self) -> list:
        return [lookup for lookup in sharded_lookups(self) if isinstance(lookup, ReplicatedSequenceLookup)]


class HetEmbeddingCollectionSharder(PluginSharder, EmbeddingCollectionSharder):
    """``EmbeddingCollectionSharder`` that also offers ``het_row_replicated`` (fused kernel).

    DistributedModelParallel and the planner pick a sharder by the module's *exact*
    type, so one sharder serves either plain ``EmbeddingCollection`` modules (the
    default) or :class:`HetEmbeddingCollection` modules (``module_type=``); a model
    with both passes one sharder of each.

    Args:
        replication: hot-row settings for modules that carry none
            (a :class:`HetEmbeddingCollection` with a config brings its own).
        fused_params: as for ``EmbeddingCollectionSharder``.
        module_type: the module class this sharder shards (``EmbeddingCollection`` or a subclass).
        **kwargs: passed on to ``EmbeddingCollectionSharder``.
    """

    plugin_types = SEQUENCE_PLUGIN_TYPES
    module_base = EmbeddingCollection

    def __init__(
        self,
        replication: ReplicationConfig | None = None,
        fused_params: dict | None = None,
        module_type: type[EmbeddingCollection] = EmbeddingCollection,
        **kwargs: Any,
    ) -> None:
        super().__init__(fused_params=fused_params, **kwargs)
        self._set_module_type(module_type)
        self._replication = replication if replication is not None else ReplicationConfig()

    def sharding_types(self, compute_device_type: str) -> list[str]:
        """TorchRec's types and ``het_row_replicated``; on CPU without ``data_parallel``: TorchRec
        1.8's data-parallel EmbeddingCollection returns one row per bag there, not one per id,
        and its output dist fails on the first batch (``split_with_sizes``; found with the stock
        sharder and planner, a small table planned data_parallel)."""
        stock = list(super().sharding_types(compute_device_type))
        if compute_device_type == "cpu":
            stock = [t for t in stock if t != ShardingType.DATA_PARALLEL.value]
        return stock + list(SEQUENCE_PLUGIN_TYPES)

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> ShardedEmbeddingCollection:
        if not any(p.sharding_type in SEQUENCE_PLUGIN_TYPES for p in params.values()):
            return super().shard(module, params, env, device, module_fqn)
        _, replication = self.settings_for(module)
        shared = getattr(module, "het_replication_config", None) is None  # the sharder's, shared by every EC
        replication.check_tables({t.name: t.num_embeddings for t in module.embedding_configs()}, shared)
        return HetShardedEmbeddingCollection(
            module=module,
            table_name_to_parameter_sharding=self.with_table_options(module, params, env.world_size),
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=uses_index_dedup(self),
            module_fqn=module_fqn,
            hot_rows=replication.tiers,
        )

    def settings_for(self, module: EmbeddingCollection) -> tuple[HetCacheConfig, ReplicationConfig]:
        """No cache (sequences have no ``het_cached_row_wise``); the module's replication, else the sharder's."""
        replication = getattr(module, "het_replication_config", None)
        return HetCacheConfig(), replication if replication is not None else self._replication

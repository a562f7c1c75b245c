"""Every TorchRec private the plugin reads or patches, behind one small function each.

FBGEMM's are in :mod:`torchrec_het._tbe`. When a private name moves, this module (and
``tests/unit/test_compat.py``, which calls every function here on real TorchRec objects) is
the one place to change. Functions answer for the installed release (:data:`TORCHREC_RELEASE`,
one of :data:`SUPPORTED_TORCHREC`); importing warns for another version.

Design: docs/internals.md#compat
"""

import copy
import importlib.metadata
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torchrec.distributed.model_parallel as _model_parallel
import torchrec.distributed.planner as _planner_package
import torchrec.distributed.planner.planners as _planners
import torchrec.distributed.planner.stats as _stats
import torchrec.distributed.shard as _shard
import torchrec.distributed.sharding_plan as _sharding_plan
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor as _ShardedTensor
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.planner.stats import EmbeddingStats
from torchrec.distributed.planner.types import GeneralizedCommsBandwidth, Topology

SUPPORTED_TORCHREC = ("1.8.0", "1.9.2")


class TorchRecVersionWarning(UserWarning):
    """The installed TorchRec is not one the plugin's privates were checked against."""


def torchrec_release(installed: str | None = None) -> tuple[int, ...]:
    """``installed`` (default: the installed torchrec) as numbers, a local build tag dropped: ``1.9.2+cpu`` -> (1, 9, 2)."""
    installed = installed if installed is not None else importlib.metadata.version("torchrec")
    return tuple(int(part) for part in re.findall(r"\d+", installed.split("+")[0])[:3])


def check_torchrec_version(installed: str | None = None) -> bool:
    """Whether ``installed`` (default: the installed torchrec) is one of :data:`SUPPORTED_TORCHREC`; warns when not.

    A local build tag (``1.8.0+cpu``) counts as its release.
    """
    installed = installed if installed is not None else importlib.metadata.version("torchrec")
    if installed.split("+")[0] in SUPPORTED_TORCHREC:
        return True
    supported = " or ".join(f"torchrec=={version}" for version in SUPPORTED_TORCHREC)
    warnings.warn(
        f"torchrec_het supports {supported} and reaches into their internals (torchrec_het/_compat.py); "
        f"torchrec {installed} is installed. Install a supported release (requirements/torchrec-*.txt), "
        "or run tests/unit/test_compat.py to see which internals moved.",
        TorchRecVersionWarning,
        stacklevel=2,
    )
    return False


check_torchrec_version()
TORCHREC_RELEASE = torchrec_release()
"""The installed torchrec as numbers, e.g. (1, 9, 2): what the version-dependent functions below key on."""


def _set(owner: object, name: str, value: object) -> None:
    """Sets a private TorchRec defines; AttributeError (not a silently dead attribute) if it is gone."""
    if not hasattr(owner, name):
        raise AttributeError(f"{type(owner).__name__} has no {name!r} in this torchrec; update torchrec_het/_compat.py")
    setattr(owner, name, value)


# ---- planner ---------------------------------------------------------------------------------


def planner_settings(planner: Any) -> tuple[Topology, int, dict | None]:
    """``EmbeddingPlannerBase._topology``, ``._batch_size`` and ``._constraints`` (the defaults filled in)."""
    return planner._topology, planner._batch_size, planner._constraints


def set_planner_parts(
    planner: Any, topology: Topology | None = None, enumerator: Any = None, stats: list | None = None
) -> None:
    """Replaces ``EmbeddingPlannerBase._topology``, ``._enumerator`` and ``._stats`` where given."""
    for name, value in (("_topology", topology), ("_enumerator", enumerator), ("_stats", stats)):
        if value is not None:
            _set(planner, name, value)


def planner_storage_reservation(planner: Any) -> Any:
    """``EmbeddingPlannerBase._storage_reservation``."""
    return planner._storage_reservation


@contextmanager
def planner_callback_first(planner: Any, callback: Callable) -> Iterator[None]:
    """Runs ``callback`` on the best plan before ``EmbeddingPlannerBase._callbacks`` for the block (restored after)."""
    saved = planner._callbacks
    _set(planner, "_callbacks", [callback, *saved])
    try:
        yield
    finally:
        planner._callbacks = saved


def planner_best_plan(planner: Any) -> list | None:
    """``EmbeddingShardingPlanner._best_plan``: the sharding options of its last plan."""
    return planner._best_plan


def enumerator_settings(enumerator: Any) -> tuple[str, int, dict | None]:
    """``EmbeddingEnumerator._compute_device``, ``._batch_size`` and ``._constraints``."""
    return enumerator._compute_device, enumerator._batch_size, enumerator._constraints


@contextmanager
def enumerator_constraints(enumerator: Any, constraints: dict | None) -> Iterator[None]:
    """Sets ``EmbeddingEnumerator._constraints`` for the block (restored after, also on error)."""
    saved = enumerator._constraints
    _set(enumerator, "_constraints", constraints)
    try:
        yield
    finally:
        enumerator._constraints = saved


def set_enumerator_sharders(enumerator: Any, sharders_by_key: dict) -> None:
    """Sets ``EmbeddingEnumerator._sharder_map`` (sharder key -> sharder) that ``populate_estimates`` reads."""
    _set(enumerator, "_sharder_map", sharders_by_key)


def estimator_topology(estimator: Any) -> Topology:
    """``EmbeddingPerfEstimator._topology`` / ``EmbeddingStorageEstimator._topology``."""
    return estimator._topology


def with_comms_bandwidths(topology: Topology, bandwidths: GeneralizedCommsBandwidth) -> Topology:
    """A shallow copy of ``topology`` whose ``Topology._comms_bandwidths`` is ``bandwidths`` (no public setter)."""
    out = copy.copy(topology)
    _set(out, "_comms_bandwidths", bandwidths)
    return out


_STOCK_ABBREVIATION = _stats._get_sharding_type_abbr  # taken before sharding_type_abbreviations() can patch it


def stock_sharding_type_abbreviation(sharding_type: str) -> str:
    """``torchrec.distributed.planner.stats._get_sharding_type_abbr``: the stats table's short name of a type."""
    return _STOCK_ABBREVIATION(sharding_type)


@contextmanager
def sharding_type_abbreviations(abbreviation: Callable[[str], str]) -> Iterator[None]:
    """Patches ``torchrec.distributed.planner.stats._get_sharding_type_abbr`` for the block (restored after)."""
    saved = _stats._get_sharding_type_abbr
    _set(_stats, "_get_sharding_type_abbr", abbreviation)
    try:
        yield
    finally:
        _stats._get_sharding_type_abbr = saved


class EmbeddingStatsWithShardOption(EmbeddingStats):
    """``EmbeddingStats`` whose per-shard rows (its private ``_get_shard_stats``) show :meth:`shard_stats_option`."""

    def shard_stats_option(self, sharding_option: Any) -> Any:
        """The option whose shard stats the table shows for ``sharding_option`` (itself by default)."""
        return sharding_option

    def _get_shard_stats(self, shard, sharding_option, *args, **kwargs):  # overrides TorchRec's private
        return super()._get_shard_stats(shard, self.shard_stats_option(sharding_option), *args, **kwargs)


# ---- registration: the module globals install() replaces --------------------------------------


def default_sharders_homes() -> tuple[ModuleType, ...]:
    """Modules that bind ``get_default_sharders`` by name; the first (``distributed.sharding_plan``) defines it."""
    return _sharding_plan, _model_parallel, _shard, _planners


def train_pipeline_homes() -> tuple[ModuleType, ...]:
    """Where TorchRec exports ``TrainPipelineSparseDist`` (its defining module first). Not homes:
    ``train_pipeline.experimental_pipelines`` and (TorchRec 1.9) ``train_pipeline.pec_train_pipeline``,
    which import it only to subclass it."""
    import torchrec.distributed as distributed
    from torchrec.distributed import train_pipeline
    from torchrec.distributed.train_pipeline import train_pipelines

    return (train_pipelines, train_pipeline, distributed)


def planner_homes() -> tuple[ModuleType, ...]:
    """Modules that bind ``EmbeddingShardingPlanner`` by name (``torchrec.distributed.planner`` and its importers).

    TorchRec 1.9 adds ``distributed.planner.provider``, whose ``DefaultPlannerProvider.build_planner``
    constructs the planner from a ``ShardingPlanRequest``.
    """
    if TORCHREC_RELEASE < (1, 9):
        return _planner_package, _planners, _model_parallel, _shard
    from torchrec.distributed.planner import provider

    return _planner_package, _planners, _model_parallel, _shard, provider


# ---- sharding plans and state dicts ------------------------------------------------------------


def row_wise_shard_rows(num_rows: int, world_size: int) -> list[int]:
    """Rows of each rank's ``row_wise`` shard, by ``sharding_plan._calculate_rw_shard_sizes_and_offsets``."""
    sizes, _ = _sharding_plan._calculate_rw_shard_sizes_and_offsets(num_rows, world_size, 1)
    return [size[0] for size in sizes]


def is_sharded_tensor(value: object) -> bool:
    """Whether ``value`` is a ``torch.distributed._shard...ShardedTensor`` (TorchRec's sharded state-dict entries)."""
    return isinstance(value, _ShardedTensor)


# ---- for the sharded modules (torchrec_het.sharding, torchrec_het.sharders.het*) ----------------


def sharded_lookups(module: nn.Module) -> list[nn.Module]:
    """``ShardedEmbeddingBagCollection._lookups`` / ``ShardedEmbeddingCollection._lookups``: one per sharding type."""
    return module._lookups


def sharded_embedding_shardings(module: ShardedEmbeddingBagCollection | ShardedEmbeddingCollection) -> list:
    """``ShardedEmbeddingBagCollection._embedding_shardings`` / ``ShardedEmbeddingCollection._sharding_type_to_sharding``
    values, in the order of :func:`sharded_lookups`."""
    if isinstance(module, ShardedEmbeddingBagCollection):
        return list(module._embedding_shardings)
    return list(module._sharding_type_to_sharding.values())


def sharded_table_configs(module: ShardedEmbeddingBagCollection | ShardedEmbeddingCollection) -> list:
    """``ShardedEmbeddingBagCollection._embedding_bag_configs`` / ``ShardedEmbeddingCollection._embedding_configs``."""
    if isinstance(module, ShardedEmbeddingBagCollection):
        return module._embedding_bag_configs
    return module._embedding_configs


def uses_index_dedup(sharder: Any) -> bool:
    """``EmbeddingCollectionSharder._use_index_dedup``."""
    return sharder._use_index_dedup


def codec_precision(codec: Any) -> str | None:
    """FBGEMM's quantized-comms codec's precision (``fp16``, ``int8``, ...; TorchRec's comm_ops read the
    same attribute), or None for another codec class."""
    precision = getattr(codec, "_comm_precision", None)
    return None if precision is None else str(precision)


def codec_row_dim(codec: Any) -> int:
    """The row dim an FBGEMM codec quantizes in (fp8 row-wise, mx4); -1: none."""
    return int(getattr(codec, "_row_dim", -1))


def lookup_kernels(lookup: nn.Module) -> list[nn.Module]:
    """``GroupedPooledEmbeddingsLookup._emb_modules`` / ``GroupedEmbeddingsLookup._emb_modules``: a kernel per group."""
    return lookup._emb_modules


def sharding_lookup_arguments(sharding: Any) -> dict[str, Any]:
    """An ``EmbeddingSharding``'s ``_grouped_embedding_configs``, ``_pg``, ``_device``, ``_env``: a lookup's arguments."""
    return {
        "grouped_configs": sharding._grouped_embedding_configs,
        "pg": sharding._pg,
        "device": sharding._device,
        "env": sharding._env,
    }


def input_dist_awaitables(splits: Any) -> list:
    """``KJTListSplitsAwaitable.awaitables``: what each sharding's input dist returned, in the order of
    :func:`sharded_lookups` (a sharded module's ``input_dist`` returns the ``KJTListSplitsAwaitable``)."""
    return splits.awaitables


@contextmanager
def lookups_called_with(module: nn.Module, replacements: dict[int, Callable]) -> Iterator[None]:
    """Inside the block, TorchRec's loops over ``module._lookups`` (``compute``,
    ``compute_and_output_dist``, ``prefetch`` of a sharded EBC or EC: a plain list) find
    ``replacements[i]`` in place of lookup i (a plugin lookup bound to its batch's context); the
    list itself is put back after, the registered submodules are never touched."""
    if not replacements:
        yield
        return
    lookups = module._lookups
    module._lookups = [replacements.get(i, lookup) for i, lookup in enumerate(lookups)]
    try:
        yield
    finally:
        module._lookups = lookups


# ---- for the train pipelines (torchrec_het.pipeline) ----------------------------------------


def pipeline_attach_if_detached(pipeline: Any) -> None:
    """What ``TrainPipelineSparseDist.progress`` does first: re-attach a model the user detached."""
    if not pipeline._model_attached:
        pipeline.attach(pipeline._model)


def pipeline_model(pipeline: Any) -> nn.Module:
    """``TrainPipelineSparseDist._model``: the model the pipeline trains (rewritten on its first step)."""
    return pipeline._model


def pipeline_optimizer(pipeline: Any) -> Any:
    """``TrainPipelineSparseDist._optimizer``."""
    return pipeline._optimizer


def pipeline_model_forward(pipeline: Any, batch: Any) -> Any:
    """``TrainPipelineSparseDist._model_fwd(batch)``: the model (or the user's ``custom_model_fwd``) on a batch."""
    return pipeline._model_fwd(batch)


def pipelined_modules(pipeline: Any) -> list[nn.Module]:
    """``TrainPipelineSparseDist._pipelined_modules``: the sharded modules whose forward the pipeline swapped."""
    return pipeline._pipelined_modules


def init_pipelined_modules(pipeline: Any, batch: Any, context: Any, forward_type: type) -> None:
    """``TrainPipelineSparseDist._init_pipelined_modules``: on the first batch, fx-trace the model and swap
    each top-level sharded module's forward for ``forward_type``; then start ``batch``'s input dist."""
    pipeline._init_pipelined_modules(batch, context, forward_type)


def sync_embeddings(pipeline: Any, context: Any) -> None:
    """``TrainPipelineSparseDist.sync_embeddings`` with the pipeline's own 2D-sharding interval."""
    pipeline.sync_embeddings(pipeline._model, pipeline._dmp_collection_sync_interval_batches, context)


def pipeline_data_dist_stream(pipeline: Any) -> Any:
    """``TrainPipelineSparseDist._data_dist_stream``: where input dists run on CUDA (None on CPU)."""
    return pipeline._data_dist_stream


def pec_train_pipeline_class() -> type | None:
    """TorchRec 1.9's ``TrainPipelinePEC`` (a compute-ahead pipeline for PEC EmbeddingCollections); None on 1.8,
    which has none."""
    if TORCHREC_RELEASE < (1, 9):
        return None
    from torchrec.distributed.train_pipeline.pec_train_pipeline import TrainPipelinePEC

    return TrainPipelinePEC


def cpu_semi_sync_class() -> type:
    """TorchRec's ``TrainPipelineSemiSync`` made to run on CPU: the smallest adapter that works.

    TorchRec's semi-sync pipeline calls ``record_stream`` even on CPU, where it rejects CPU
    tensors; on CPU only, this adapter records no stream and otherwise is TorchRec's own.
    Details: docs/internals.md#compat
    """
    from torchrec.distributed.train_pipeline import train_pipelines, utils
    from torchrec.distributed.train_pipeline.runtime_forwards import EmbeddingPipelinedForward
    from torchrec.sparse.jagged_tensor import KeyedTensor

    class CpuEmbeddingPipelinedForward(EmbeddingPipelinedForward):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            if self._stream is None:  # TorchRec makes streams on CUDA only; without one it assumes CUDA anyway
                self._device = torch.device("cpu")

        def detach_embeddings(self, embeddings, cur_stream) -> None:
            if not isinstance(embeddings, KeyedTensor) or embeddings.values().is_cuda:
                return super().detach_embeddings(embeddings, cur_stream)
            tensor = embeddings.values()
            detached = tensor.detach().requires_grad_()
            detached.retain_grad()
            embeddings._values = detached
            self._context.embedding_tensors.append([tensor])
            self._context.embedding_features.append([list(embeddings.keys())])
            self._context.detached_embedding_tensors.append([detached])
            return None

    class CpuTrainPipelineSemiSync(train_pipelines.TrainPipelineSemiSync):
        _pipelined_forward_type = CpuEmbeddingPipelinedForward

        def _mlp_forward(self, batch, context):
            if self._device.type != "cpu":
                return super()._mlp_forward(batch, context)
            utils._wait_for_events(batch, context, None)
            return self._model_fwd(batch)

        def start_embedding_lookup(self, batch, context) -> None:
            if self._device.type != "cpu":
                return super().start_embedding_lookup(batch, context)
            if batch is None:
                return None
            utils._wait_for_events(batch, context, None)
            for module in self._pipelined_modules:
                utils._start_embedding_lookup(module, context, None, None, self._stream_context)
            return None

    return CpuTrainPipelineSemiSync


def process_group_timeout(pg: Any) -> Any:
    """The timeout (a ``timedelta``) of ``pg``'s collectives (None: the default group), or None when
    torch does not say. ``dist.new_group`` without a ``timeout`` takes the backend's default (30
    minutes for gloo), not its parent's: the plugin's groups pass this instead."""
    group = dist.group.WORLD if pg is None else pg
    for device_type in getattr(group, "_device_types", ()):
        try:
            return group._get_backend(torch.device(device_type)).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def collective_device(pg: dist.ProcessGroup | None) -> torch.device:
    """Where a small tensor of host facts must be for a collective on ``pg``: the current CUDA
    device for NCCL, else the CPU."""
    if dist.get_backend(pg) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")

"""What a benchmark configuration is: :class:`BenchConfig`, what it sees when it builds its
sharders (:class:`ShardingContext`), and the unique-name check of the benchmark's registries.

The bottom of the configuration modules: ``configs`` (the registry), ``het_configs``,
``replicated_configs``, ``planned_configs`` and the model builders import from here, and
this module imports none of them.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from torch import nn
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ModuleSharder
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het_bench.presets import BenchPreset

ConstraintsFn = Callable[[list[BaseEmbeddingConfig], BenchPreset], dict[str, ParameterConstraints] | None]


@dataclass(frozen=True)
class BenchConfig:
    """One way of sharding the model.

    Attributes:
        name: identifier used on the command line and in results.json.
        stock: True when nothing of torchrec_het changes TorchRec's behaviour.
        description: one line for ``--list``.
        make_sharders: the sharders handed to the planner and DistributedModelParallel.
        make_constraints: per-table planner constraints; None lets the planner decide.
        applies: whether the configuration means anything for a preset.
        workload: the model and data it trains: "dlrm" or "sequence"
            (``torchrec_het_bench.workloads``).
        params: the configuration's own settings, copied into results.json.
        make_plan: builds the embedding module's plan directly (for sharding types the
            stock planner does not know yet); None lets the planner plan.
        make_sharders_for: builds the sharders from a :class:`ShardingContext` (the model, its
            tables, a sample of the training stream) instead of ``make_sharders``.
        make_planner_for: builds the planner from the context and TorchRec's planner
            arguments (``topology``, ``batch_size``, ...); None: a stock ``EmbeddingShardingPlanner``.
    """

    name: str
    stock: bool
    description: str
    make_sharders: Callable[[], list[ModuleSharder]]
    make_constraints: ConstraintsFn
    applies: Callable[[BenchPreset], bool] = lambda preset: True
    workload: str = "dlrm"
    params: dict = field(default_factory=dict)
    make_plan: Callable | None = None
    make_sharders_for: Callable | None = None
    make_planner_for: Callable | None = None


@dataclass(frozen=True)
class ShardingContext:
    """What a configuration sees when it builds its sharders (the same on every rank)."""

    workload: str
    train_model: nn.Module
    embedding_path: str
    tables: list
    world_size: int
    local_world_size: int
    batch_size: int
    embedding_optimizer: str
    sample: Callable[[], list[KeyedJaggedTensor]]  # this rank's sampled training batches
    link_bytes_per_s: float | None = None  # the run's network (None: TorchRec's default topology)


def add_unique(registry: dict, name: str, item, what: str):
    """Adds ``item`` to ``registry`` under ``name`` and returns it; ValueError naming ``what`` if
    the name is taken (the benchmark's registries of configurations and pipelines)."""
    if name in registry:
        raise ValueError(f"{what} {name!r} is already registered")
    registry[name] = item
    return item


def by_name(items: Iterable, what: str) -> dict:
    """``{item.name: item}`` in the order given; ValueError naming ``what`` on a repeated name."""
    registry: dict = {}
    for item in items:
        add_unique(registry, item.name, item, what)
    return registry

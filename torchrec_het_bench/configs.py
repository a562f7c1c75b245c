"""Benchmark configurations: which sharders and which sharding types a run compares.

A configuration says which workload it trains (the DLRM, or the sequence model over
unpooled histories) and how that model's tables are sharded; the benchmark trains every
selected configuration on its workload's data in the same run. Configurations are
registered by name so later sharding types add theirs beside the stock ones.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import get_default_sharders
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ModuleSharder, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_het_bench.presets import BenchPreset
from torchrec_het.sharders import CpuRowWiseEmbeddingBagCollectionSharder

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
        make_sharders_for: builds the sharders from a
            :class:`~torchrec_het_bench.replicated_configs.ShardingContext` (the model, its
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


def _force(sharding_type: str) -> ConstraintsFn:
    def constraints(tables, preset):
        return {t.name: ParameterConstraints(sharding_types=[sharding_type]) for t in tables}

    return constraints


def _dp_small_tw_rest(tables, preset):
    small = ShardingType.DATA_PARALLEL.value
    return {
        t.name: ParameterConstraints(
            sharding_types=[small if t.num_embeddings <= preset.dp_max_rows else ShardingType.TABLE_WISE.value]
        )
        for t in tables
    }


def _has_small_tables(preset: BenchPreset) -> bool:
    return any(rows <= preset.dp_max_rows for rows in preset.table_sizes)


def _no_constraints(tables, preset):
    return None


def _has_sequence(preset: BenchPreset) -> bool:
    return preset.sequence is not None


CONFIGS: dict[str, BenchConfig] = {}


def add_unique(registry: dict, name: str, item, what: str):
    """Adds ``item`` to ``registry`` under ``name`` and returns it; ValueError naming ``what`` if
    the name is taken (the benchmark's registries of configurations and pipelines)."""
    if name in registry:
        raise ValueError(f"{what} {name!r} is already registered")
    registry[name] = item
    return item


def register(config: BenchConfig) -> BenchConfig:
    """Adds a configuration to the registry; names are unique."""
    return add_unique(CONFIGS, config.name, config, "benchmark configuration")


register(
    BenchConfig(
        name="stock_table_wise",
        stock=True,
        description="every table whole on one rank (stock EmbeddingBagCollectionSharder)",
        make_sharders=lambda: [EmbeddingBagCollectionSharder()],
        make_constraints=_force(ShardingType.TABLE_WISE.value),
        params={"sharding": "table_wise"},
    )
)
register(
    BenchConfig(
        name="stock_row_wise",
        stock=True,
        description="every table split by rows over all ranks (stock row-wise, enabled on CPU)",
        make_sharders=lambda: [CpuRowWiseEmbeddingBagCollectionSharder()],
        make_constraints=_force(ShardingType.ROW_WISE.value),
        params={"sharding": "row_wise"},
    )
)
register(
    BenchConfig(
        name="stock_dp_small",
        stock=True,
        description="tables of at most dp_max_rows rows data_parallel, the rest table_wise",
        make_sharders=lambda: [EmbeddingBagCollectionSharder()],
        make_constraints=_dp_small_tw_rest,
        applies=_has_small_tables,
        params={"sharding": "data_parallel+table_wise"},
    )
)
register(
    BenchConfig(
        name="stock_planner",
        stock=True,
        description="the stock planner's own choice with get_default_sharders()",
        make_sharders=lambda: list(get_default_sharders()),
        make_constraints=_no_constraints,
        params={"sharding": "planner"},
    )
)

# The sequence workload: unpooled EmbeddingCollection, one embedding per id comes back.
register(
    BenchConfig(
        name="seq_stock_table_wise",
        stock=True,
        description="sequence model: item and category tables whole on one rank each (stock EmbeddingCollectionSharder)",
        make_sharders=lambda: [EmbeddingCollectionSharder()],
        make_constraints=_force(ShardingType.TABLE_WISE.value),
        applies=_has_sequence,
        workload="sequence",
        params={"sharding": "table_wise"},
    )
)
register(
    BenchConfig(
        name="seq_stock_row_wise",
        stock=True,
        description="sequence model: item and category tables split by rows over all ranks (stock EmbeddingCollectionSharder)",
        make_sharders=lambda: [EmbeddingCollectionSharder()],
        make_constraints=_force(ShardingType.ROW_WISE.value),
        applies=_has_sequence,
        workload="sequence",
        params={"sharding": "row_wise"},
    )
)

DEFAULT_CONFIGS = ("stock_table_wise", "stock_row_wise", "stock_dp_small")


def select(names: list[str] | None, preset: BenchPreset) -> list[BenchConfig]:
    """The configurations to run: ``names`` in order, or the defaults that apply to ``preset``."""
    if not names:
        return [CONFIGS[n] for n in DEFAULT_CONFIGS if CONFIGS[n].applies(preset)]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; --list shows {sorted(CONFIGS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"configuration named twice in {names}")
    chosen = [CONFIGS[n] for n in names]
    idle = [c.name for c in chosen if not c.applies(preset)]
    if idle:
        raise ValueError(f"configuration(s) {idle} do not apply to preset {preset.name!r}")
    return chosen

# The plugin's own configurations register themselves beside the stock ones.
from torchrec_het_bench import het_configs, planned_configs, replicated_configs  # noqa: E402,F401  (keep last)

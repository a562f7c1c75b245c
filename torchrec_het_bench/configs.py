"""Benchmark configurations: which sharders and which sharding types a run compares.

A configuration says which workload it trains (the DLRM, or the sequence model over
unpooled histories) and how that model's tables are sharded; the benchmark trains every
selected configuration on its workload's data in the same run.

:data:`CONFIGS` is built in one place, :func:`all_configs`, from the lists each
configuration module returns when asked (:func:`stock_configs` here,
``het_configs.het_configs()``, ``replicated_configs.replicated_configs()``,
``planned_configs.planned_configs()``); importing a configuration module registers nothing.
A new family of configurations adds its function to :func:`all_configs`.
"""

import dataclasses

from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import get_default_sharders
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingType

from torchrec_het.sharders import CpuRowWiseEmbeddingBagCollectionSharder
from torchrec_het_bench import qcomms
from torchrec_het_bench.config_types import BenchConfig, ConstraintsFn, by_name
from torchrec_het_bench.het_configs import het_configs
from torchrec_het_bench.planned_configs import planned_configs
from torchrec_het_bench.presets import BenchPreset
from torchrec_het_bench.replicated_configs import replicated_configs
from torchrec_het_bench.speed_intervals import twin_of

__all__ = ["CONFIGS", "DEFAULT_CONFIGS", "BenchConfig", "all_configs", "select", "stock_configs"]


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


def _quantized_table_wise(pair: str) -> BenchConfig:
    """Stock table_wise with TorchRec's quantized comms ``pair``: one ``QCommsConfig`` handed to the stock sharder."""
    forward, backward = pair.split("/")
    return BenchConfig(
        name="stock_table_wise" + qcomms.suffix(pair),
        stock=True,
        description=f"stock table_wise with TorchRec's quantized comms: {forward} forward, {backward} backward",
        make_sharders=lambda: [EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomms.registry(pair))],
        make_constraints=_force(ShardingType.TABLE_WISE.value),
        params={"sharding": "table_wise", "qcomms": pair},
    )


def stock_configs() -> list[BenchConfig]:
    """Stock TorchRec's configurations: nothing of torchrec_het changes its behaviour."""
    return [
        BenchConfig(
            name="stock_table_wise",
            stock=True,
            description="every table whole on one rank (stock EmbeddingBagCollectionSharder)",
            make_sharders=lambda: [EmbeddingBagCollectionSharder()],
            make_constraints=_force(ShardingType.TABLE_WISE.value),
            params={"sharding": "table_wise"},
        ),
        *(_quantized_table_wise(pair) for pair in qcomms.PAIRS),
        BenchConfig(
            name="stock_row_wise",
            stock=True,
            description="every table split by rows over all ranks (stock row-wise, enabled on CPU)",
            make_sharders=lambda: [CpuRowWiseEmbeddingBagCollectionSharder()],
            make_constraints=_force(ShardingType.ROW_WISE.value),
            params={"sharding": "row_wise"},
        ),
        BenchConfig(
            name="stock_dp_small",
            stock=True,
            description="tables of at most dp_max_rows rows data_parallel, the rest table_wise",
            make_sharders=lambda: [EmbeddingBagCollectionSharder()],
            make_constraints=_dp_small_tw_rest,
            applies=_has_small_tables,
            params={"sharding": "data_parallel+table_wise"},
        ),
        BenchConfig(
            name="stock_planner",
            stock=True,
            description="the stock planner's own choice with get_default_sharders()",
            make_sharders=lambda: list(get_default_sharders()),
            make_constraints=_no_constraints,
            params={"sharding": "planner"},
        ),
        # The sequence workload: unpooled EmbeddingCollection, one embedding per id comes back.
        BenchConfig(
            name="seq_stock_table_wise",
            stock=True,
            description="sequence model: item and category tables whole on one rank each (stock EmbeddingCollectionSharder)",
            make_sharders=lambda: [EmbeddingCollectionSharder()],
            make_constraints=_force(ShardingType.TABLE_WISE.value),
            applies=_has_sequence,
            workload="sequence",
            params={"sharding": "table_wise"},
        ),
        BenchConfig(
            name="seq_stock_row_wise",
            stock=True,
            description="sequence model: item and category tables split by rows over all ranks (stock EmbeddingCollectionSharder)",
            make_sharders=lambda: [EmbeddingCollectionSharder()],
            make_constraints=_force(ShardingType.ROW_WISE.value),
            applies=_has_sequence,
            workload="sequence",
            params={"sharding": "row_wise"},
        ),
    ]


def all_configs() -> dict[str, BenchConfig]:
    """Every configuration by name, in ``--list`` order: the stock ones, then the plugin's.

    Raises:
        ValueError: two configurations share a name.
    """
    configs = [*stock_configs(), *het_configs(), *replicated_configs(), *planned_configs()]
    named = {c.name: c for c in configs}
    return by_name([*configs, *(twin(named[name]) for name in TWINNED)], "benchmark configuration")


# The entries measured twice in a run (A/A pairs: the run's noise floor, speed_intervals.noise_floor):
# the reference and the plugin's exact planned entry.
TWINNED = ("stock_table_wise", "planned")


def twin(config: BenchConfig) -> BenchConfig:
    """``config`` under a second name (``<name>_aa``): built, trained and measured as ``config`` is."""
    return dataclasses.replace(config, name=twin_of(config.name), description=f"A/A twin of {config.name}")


CONFIGS: dict[str, BenchConfig] = all_configs()

# What a run without --configs (make bench) compares: the stock configurations that apply (table_wise also
# with TorchRec's fp16/bf16 quantized comms, what a user who wants fewer bytes turns on first), the planner's
# choice with the plugin's types (exact; and exact looking one batch ahead) and its bounded-staleness variant
# (replicas and caches 10 steps).
DEFAULT_CONFIGS = (
    "stock_table_wise",
    "stock_table_wise_aa",
    "stock_table_wise_fp16",
    "stock_table_wise_int8",
    "stock_row_wise",
    "stock_dp_small",
    "planned",
    "planned_aa",
    "planned_lookahead",
    "planned_s10",
    "planned_fp16",
    "planned_int8",
)


def select(names: list[str] | None, preset: BenchPreset) -> list[BenchConfig]:
    """The configurations to run: ``names`` in order, or the defaults that apply to ``preset``.

    Raises:
        ValueError: an unknown or repeated name, or one that does not apply to ``preset``; the
            message lists the valid names.
    """
    if not names:
        return [CONFIGS[n] for n in DEFAULT_CONFIGS if CONFIGS[n].applies(preset)]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise ValueError(
            f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)} (--list describes them)"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"configuration named twice in {','.join(names)}")
    chosen = [CONFIGS[n] for n in names]
    idle = [c.name for c in chosen if not c.applies(preset)]
    if idle:
        fit = [n for n, c in CONFIGS.items() if c.applies(preset)]
        raise ValueError(
            f"configuration(s) {', '.join(idle)} do not apply to preset {preset.name!r}; it runs {', '.join(fit)}"
        )
    return chosen

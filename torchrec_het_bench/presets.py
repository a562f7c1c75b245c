"""Named benchmark presets: the workload sizes and how long each configuration runs."""

from dataclasses import dataclass, replace

from torchrec_het_bench.data import clamped_cardinalities, preset_table_sizes

MIN_ROUNDS = 3  # rounds a preset measures at least (the "test" preset of the tests excepted)


@dataclass(frozen=True)
class SequencePreset:
    """How big the sequence workload (``torchrec_het_bench.sequence_model``) is.

    Its ids share the preset's ``alpha``; it trains as many steps as the DLRM
    (``warmup_steps``, ``steps_per_round``, ``rounds`` of the preset).

    Attributes:
        item_rows: rows of the item table (history items and target).
        category_rows: rows of the category table.
        history_length: longest history.
        min_history_length: shortest history; None: every history is ``history_length`` long.
        embedding_dim: width of both tables.
        batch_size: samples per rank per step.
        over_arch: MLP widths after the pooled features (the last is 1).
        eval_batches: held-out batches per rank for the final AUC.
        learning_rate: of the embedding and dense optimizers.
    """

    item_rows: int
    category_rows: int
    history_length: int
    embedding_dim: int
    batch_size: int
    over_arch: tuple[int, ...]
    eval_batches: int
    min_history_length: int | None = None
    learning_rate: float = 0.02  # best of 0.01..0.2 for 300 default-preset steps (0.05: AUC 0.65, 0.02: 0.68)

    def __post_init__(self) -> None:
        if min(self.item_rows, self.category_rows, self.history_length, self.embedding_dim) < 1:
            raise ValueError("sequence preset: rows, history_length and embedding_dim must be >= 1")
        if self.min_history_length is not None and not 1 <= self.min_history_length <= self.history_length:
            raise ValueError("sequence preset: min_history_length must be in [1, history_length]")
        if self.over_arch[-1] != 1:
            raise ValueError("sequence preset: over_arch must end with 1")
        if self.batch_size < 1 or self.eval_batches < 1:
            raise ValueError("sequence preset: batch_size and eval_batches must be >= 1")


@dataclass(frozen=True)
class BenchPreset:
    """How big the DLRM workload is and how long it is measured.

    Attributes:
        name: preset name.
        table_sizes: rows per sparse feature's table (26 Criteo-like tables).
        embedding_dim: embedding width of every table.
        batch_size: samples per rank per step.
        alpha: Zipf exponent of the synthetic ids.
        warmup_steps: steps each configuration trains before anything is measured.
        steps_per_round: measured steps per configuration per round.
        rounds: rounds; every round runs every configuration once, in turn.
        eval_batches: held-out batches per rank of every evaluation (the final AUC and the curve's points).
        dense_arch: DLRM bottom MLP widths (the last equals ``embedding_dim``).
        over_arch: DLRM top MLP widths (the last is 1).
        learning_rate: learning rate of the embedding and dense optimizers.
        dp_max_rows: tables with at most this many rows are data_parallel in the
            ``stock_dp_small`` configuration.
        sequence: size of the sequence workload (None: its configurations do not apply).
        eval_every: held-out AUC every this many trained steps (warm-up included) besides the
            final one, for each entry's ``auc_curve``; 0: the final one only.
    """

    name: str
    table_sizes: tuple[int, ...]
    embedding_dim: int
    batch_size: int
    alpha: float
    warmup_steps: int
    steps_per_round: int
    rounds: int
    eval_batches: int
    dense_arch: tuple[int, ...]
    over_arch: tuple[int, ...]
    learning_rate: float = 0.05
    dp_max_rows: int = 20_000
    sequence: SequencePreset | None = None
    eval_every: int = 0

    def __post_init__(self) -> None:
        if not self.table_sizes or min(self.table_sizes) < 1:
            raise ValueError(f"preset {self.name!r}: table_sizes must be positive")
        if self.dense_arch[-1] != self.embedding_dim:
            raise ValueError(
                f"preset {self.name!r}: dense_arch must end with embedding_dim "
                f"({self.dense_arch[-1]} != {self.embedding_dim})"
            )
        if self.over_arch[-1] != 1:
            raise ValueError(f"preset {self.name!r}: over_arch must end with 1")
        for field in ("batch_size", "steps_per_round", "rounds", "eval_batches"):
            if getattr(self, field) < 1:
                raise ValueError(f"preset {self.name!r}: {field} must be >= 1")
        if self.eval_every < 0 or self.warmup_steps < 0:
            raise ValueError(f"preset {self.name!r}: eval_every and warmup_steps must be >= 0")
        if self.rounds < MIN_ROUNDS and self.name != "test":
            raise ValueError(f"preset {self.name!r}: at least {MIN_ROUNDS} rounds are needed")

    @property
    def measured_steps(self) -> int:
        return self.rounds * self.steps_per_round

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.measured_steps

    def batch_size_of(self, workload: str) -> int:
        """Samples per rank per step of ``workload`` ("dlrm" or "sequence")."""
        return self.sequence.batch_size if workload == "sequence" and self.sequence else self.batch_size

    def eval_batches_of(self, workload: str) -> int:
        """Held-out batches per rank of ``workload``."""
        return self.sequence.eval_batches if workload == "sequence" and self.sequence else self.eval_batches


def smoke() -> BenchPreset:
    """Small tables and few steps: the whole run takes well under a minute."""
    return BenchPreset(
        name="smoke",
        table_sizes=preset_table_sizes("smoke"),
        embedding_dim=16,
        batch_size=256,
        alpha=1.1,
        warmup_steps=3,
        steps_per_round=5,
        rounds=3,
        eval_batches=4,
        dense_arch=(64, 16),
        over_arch=(64, 1),
        dp_max_rows=5_000,
        sequence=SequencePreset(
            item_rows=20_000,
            category_rows=500,
            history_length=20,
            min_history_length=5,
            embedding_dim=16,
            batch_size=256,
            over_arch=(64, 1),
            eval_batches=4,
        ),
    )


def converge() -> BenchPreset:
    """Tables of 500..5k rows (the Criteo Kaggle cardinalities clamped), trained 3100 steps of 512
    samples per rank, with held-out AUC every 200 steps: long enough that stock table_wise's AUC
    plateaus (mean over seeds 0-2: 0.802 at step 1800, 0.806 at the end; it rises smoothly since the
    data's dense features are standardized, see docs/data_model.md), short enough
    that stock table_wise and a few plugin configurations train in about 10 minutes on 2 ranks.
    For convergence (final AUC, steps to 99.5% of stock's plateau), not for speed. (The plugin's
    lookups count the evaluations' forwards in their own counters: results.json's ``replication``
    steps and the HET cache's statistics include them here.)"""
    return BenchPreset(
        name="converge",
        table_sizes=clamped_cardinalities(500, 5_000),
        embedding_dim=16,
        batch_size=512,
        alpha=1.1,
        warmup_steps=100,
        steps_per_round=1000,
        rounds=3,
        eval_batches=16,
        eval_every=200,
        dense_arch=(64, 16),
        over_arch=(64, 1),
        dp_max_rows=2_000,
    )


def default() -> BenchPreset:
    """Criteo-like tables clamped to 100k..1M rows, dim 64, 1024 samples per rank."""
    return BenchPreset(
        name="default",
        table_sizes=preset_table_sizes("default"),
        embedding_dim=64,
        batch_size=1024,
        alpha=1.1,
        warmup_steps=50,
        steps_per_round=100,
        rounds=3,
        eval_batches=20,
        dense_arch=(256, 64),
        over_arch=(256, 128, 1),
        sequence=SequencePreset(
            item_rows=1_000_000,
            category_rows=20_000,
            history_length=50,
            embedding_dim=64,
            batch_size=1024,
            over_arch=(256, 64, 1),
            eval_batches=20,
        ),
    )


def full() -> BenchPreset:
    """Larger tables (clamped to 100k..2M rows), 2048 samples per rank, longer training."""
    return BenchPreset(
        name="full",
        table_sizes=preset_table_sizes("full"),
        embedding_dim=64,
        batch_size=2048,
        alpha=1.1,
        warmup_steps=50,
        steps_per_round=100,
        rounds=3,
        eval_batches=40,
        dense_arch=(512, 256, 64),
        over_arch=(512, 256, 1),
        sequence=SequencePreset(
            item_rows=2_000_000,
            category_rows=50_000,
            history_length=100,
            min_history_length=20,
            embedding_dim=64,
            batch_size=1024,
            over_arch=(256, 64, 1),
            eval_batches=40,
        ),
    )


# The emulated link (2 hosts, 1 rank each) at which stock table_wise on the default
# preset spends about half of its step communicating: its step took 1.96x and 1.85x its
# loopback step here (loopback 24646 vs 12571 samples/s in one pair of runs, 20926 vs 11332 in
# another; 1 Gbit/s gave 2.16x and 1.96x). Later configurations are compared at this speed.
REFERENCE_GBIT = 1.25

PRESETS = {"smoke": smoke, "converge": converge, "default": default, "full": full}


def get_preset(name: str, **overrides: object) -> BenchPreset:
    """Returns the named preset with ``overrides`` applied (e.g. ``alpha=1.2``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    preset = PRESETS[name]()
    given = {k: v for k, v in overrides.items() if v is not None}
    return replace(preset, **given) if given else preset

"""The benchmark's rank body: every entry trained on the same data, interleaved.

An entry is a configuration trained under one of the run's pipelines (``RunSpec.pipeline``
names one or several, see :mod:`~torchrec_het_bench.pipelines`; with one, entries are the
configurations). Each rank builds all entries, warms each up, then runs ``rounds``
rounds; in a round every entry trains ``steps_per_round`` steps on the same
batches (those of its workload: configurations of one workload share them), in turn, the
order rotated by one each round, so machine noise hits all entries alike and no entry always
follows the same one (speed figures leave out each window's first steps:
:mod:`~torchrec_het_bench.speed_intervals`). Bytes of every
collective are counted during measured steps only. Rank 0 gathers the per-rank
records and returns them.

Each entry has one loop for the whole run, fed
from a :class:`~torchrec_het_bench.pipelines.BatchFeed` that holds the next round's batches
(and, after the last round, ``lookahead`` batches past the end) before a round starts, so
a pipeline that reads ahead never finds it empty and batch building stays off the clock.
A pipeline that refuses the entry's model (its own check at its first step, or one the
benchmark knows: TorchRec's semi-sync with ``het_cached_row_wise`` tables) leaves the entry
not run, with the reason. An entry is settled (``loop.settle()``: the hybrid pipeline's
embedding backward on its worker thread finished, on the clock of its last step) before the
run moves to another entry or evaluates, so no two threads issue collectives at once.

Held-out AUC: every ``preset.eval_every`` trained steps (warm-up included) each entry
predicts the workload's held-out batches, off the clock and off the byte count, with the
pipeline attached and its batches in flight
(:meth:`~torchrec_het_bench.pipelines.TorchRecLoop.evaluate`), and once more after the
last step, with the pipeline detached; the points are the entry's ``auc_curve``. (The HET
cache's lookups count evaluation forwards as steps: results.json says so for those entries.)
Under ``sparse_dist`` a step issues the next batch's input dist, so the bytes counted in a
round are those of that round's steps shifted by one batch; the last measured step issues
the input dist of batch ``total_steps``, which is never trained (fixed-size batches: the
same bytes). Each step's time is split into parts by :mod:`~torchrec_het_bench.step_time`.
"""

import logging
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchrec_het.integration.cpu_budget import CpuBudget, apply_budget, budget_for
from torchrec_het.replication.all_hot import AllHotBatches, read_here_of
from torchrec_het_bench import configs as bench_configs
from torchrec_het_bench import stage_profile
from torchrec_het_bench.allocator import hold_allocator_steady
from torchrec_het_bench.comm import CommAccountant, attach_ddp_hooks
from torchrec_het_bench.comm.phases import replica_sync_as_backward
from torchrec_het_bench.data import DataExhaustedError
from torchrec_het_bench.het_stats import ideal_lru, rank_cache_stats
from torchrec_het_bench.memory import peak_rss_mb, reset_peak_rss, rss_mb, state_mb
from torchrec_het_bench.model import BENCH_DEVICE, ShardedModel, predict, table_configs
from torchrec_het_bench.pipelines import (
    DEFAULT_EMBEDDING_STALENESS,
    DEFAULT_PIPELINE,
    BatchFeed,
    PipelineRefused,
    PipelineRun,
    entry_name,
    parse_pipelines,
)
from torchrec_het_bench.prediction import model_inputs, predict_entry
from torchrec_het_bench.presets import BenchPreset
from torchrec_het_bench.replicated_configs import hot_fraction
from torchrec_het_bench.step_time import CLOCK, TIMED_PARTS, instrument, timing_installed
from torchrec_het_bench.workloads import open_workload_source, shard_workload

# What configurations that plan for the network assume of gloo over loopback: ~2 GB/s for
# the benchmark's message sizes on this kind of VM (a stated figure, not measured per run).
LOOPBACK_BYTES_PER_S = 2e9


def probed_bytes_per_s(network: dict) -> float | None:
    """The planner probe's figure for the link a run's ranks cross (bytes/s; None: none): between emulated
    hosts the probe's median, steady or not (a user's planner prices what it measured, not the link's
    nominal rate); on one host only a steady figure (on 2 cores the loopback probe's spread is the ranks'
    compute, not the link)."""
    figures = network.get("links") or {}
    kind = "inter" if (network.get("hosts") or 1) > 1 else "intra"
    if figures.get(f"{kind}_source") != "measured":
        return None
    if kind == "intra" and not ((figures.get("probe") or {}).get(kind) or {}).get("steady"):
        return None
    return figures[f"{kind}_gbit"] * 1e9 / 8


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs; picklable, identical on every rank."""

    preset: BenchPreset
    config_names: tuple[str, ...]
    world_size: int
    host_of_rank: tuple[int, ...]
    network: dict
    embedding_optimizer: str = "rowwise_adagrad"
    data_path: str | None = None
    out_dir: str = "bench_out"
    seed: int = 0
    progress: bool = True
    pipeline: str = DEFAULT_PIPELINE  # comma-separated: every configuration trains under each
    embedding_staleness: int = DEFAULT_EMBEDDING_STALENESS  # k of the pipelines that take it (hybrid)
    cpu: CpuBudget | None = None  # the ranks' share of the machine, set by the launcher (launch.py)
    cpu_from_torchrun: bool = False  # ``cpu`` records the threads torchrun gave (not applied again)
    busy_share: float = 0.0  # share of the machine's CPU taken from the ranks by busy processes (--busy)
    profile_steps: int = 0  # each entry's last warm-up steps profiled by stage (stage_profile.py; 0: none)

    def pipeline_runs(self) -> list[PipelineRun]:
        """The run's pipelines, in ``pipeline`` order (raises PipelineUnavailable as the CLI does)."""
        return parse_pipelines(self.pipeline, self.embedding_staleness, BENCH_DEVICE)

    def entries(self) -> list["Entry"]:
        """Every configuration under every pipeline, configuration by configuration."""
        runs = self.pipeline_runs()
        return [Entry(entry_name(c, r, len(runs) > 1), c, r) for c in self.config_names for r in runs]

    @property
    def local_world_size(self) -> int:
        return self.host_of_rank.count(0)

    @property
    def link_bytes_per_s(self) -> float:
        """The network the ``planned`` configurations price, per rank with every rank sending: what the
        plugin's planner measured on this run's group (``network["links"]``, the link the ranks cross:
        between hosts when there are several, :func:`probed_bytes_per_s`), as a user's planner would; where
        the probe gave none, the emulated link's rate, or loopback's stated figure (LOOPBACK_BYTES_PER_S)."""
        measured = probed_bytes_per_s(self.network)
        if measured is not None:
            return measured
        if self.network.get("mode") == "emulated":
            return self.network["gbit"] * 1e9 / 8
        return LOOPBACK_BYTES_PER_S


@dataclass(frozen=True)
class Entry:
    """A configuration trained under a pipeline: one row of the results.

    Attributes:
        name: ``config`` alone when the run has one pipeline, else ``config@label``
            (:func:`~torchrec_het_bench.pipelines.entry_name`).
        config: the configuration's name.
        run: the pipeline and its embedding staleness.
    """

    name: str
    config: str
    run: PipelineRun


@dataclass
class RankRecord:
    """What one rank measured for one entry."""

    name: str
    sharding_types: list[str]
    step_seconds: list[float] = field(default_factory=list)
    step_parts: list[tuple[float, ...]] = field(default_factory=list)  # seconds of TIMED_PARTS per step
    losses: list[float] = field(default_factory=list)
    comm: list = field(default_factory=list)  # one CommTotals per round
    peak_rss_mb: float = 0.0
    state_mb: float = 0.0
    scores: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    cache_stats: dict | None = None  # per table, for configurations with a HET cache
    replication: dict | None = None  # hot fraction, replica memory and sync counters (row-replicated)
    curve: list = field(default_factory=list)  # (trained steps, scores, labels) per evaluation, the final one last
    staleness_gauge: dict | None = None  # the pipeline's, if it keeps one (hybrid)
    predicted: dict | None = None  # the step model's prediction for the entry's plan (rank 0; prediction.py)
    stage_profile: dict | None = None  # where its profiled warm-up steps' time went (stage_profile.py)
    not_run: str | None = None  # why the pipeline refused the entry


def rank_budget(spec) -> CpuBudget:
    """This rank's share of the machine (:mod:`torchrec_het.integration.cpu_budget`): the budget the launcher
    recorded in ``spec.cpu``, else each of ``spec.world_size`` ranks on this machine (spawned here,
    every rank of the run, every emulated host's included, shares this machine's cores)."""
    return spec.cpu if spec.cpu is not None else budget_for(spec.world_size)


def apply_rank_budget(spec) -> CpuBudget:
    """Gives this rank the threads of :func:`rank_budget`, unless torchrun gave them (``spec.cpu``
    then only records them: a real multi-host launch keeps torchrun's rule), and a steady allocator
    (:mod:`~torchrec_het_bench.allocator`)."""
    budget = rank_budget(spec)
    if not spec.cpu_from_torchrun:
        apply_budget(budget)
    hold_allocator_steady()  # every entry's step timed under the same allocator thresholds
    return budget


def _workload(name: str) -> str:
    return bench_configs.CONFIGS[name].workload


@dataclass
class _Trainee:
    """One entry while the run goes: its model, its loop and the batches queued for it."""

    entry: Entry
    sharded: ShardedModel
    feed: BatchFeed
    loop: object  # PlainLoop | TorchRecLoop
    queued_rounds: int = 0  # rounds of batches (then the tail) appended to the feed so far
    regroup: dict = field(default_factory=dict)  # FAE regrouping counters of measured rounds
    steps_done: int = 0  # batches trained so far, warm-up included
    eval_batches: list = field(default_factory=list)  # the workload's held-out batches of this rank

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def config(self) -> str:
        return self.entry.config

    @property
    def lookahead(self) -> int:
        return self.entry.run.lookahead


class _RoundBatches:
    """Each workload's batches of a round (the tail past the last round: up to ``lookahead``
    batches, fewer where the data ends), built once."""

    def __init__(self, spec: RunSpec, sources: dict, lookahead: int) -> None:
        self._spec, self._sources, self._lookahead = spec, sources, lookahead
        self._built: dict[tuple[str, int], list] = {}

    def steps(self, round_index: int) -> range:
        preset = self._spec.preset
        first = preset.warmup_steps + round_index * preset.steps_per_round
        if round_index == preset.rounds:
            return range(first, first + self._lookahead)
        return range(first, first + preset.steps_per_round)

    def get(self, workload: str, round_index: int) -> list:
        key = (workload, round_index)
        if key not in self._built:
            rank, source, batches = dist.get_rank(), self._sources[workload], []
            for step in self.steps(round_index):
                try:
                    batches.append(source.batch(step, rank, "train"))
                except DataExhaustedError:  # only the tail may run past the data (a pipeline then drains)
                    if round_index < self._spec.preset.rounds:
                        raise
                    break
            self._built[key] = batches
        return self._built[key]

    def release_before(self, round_index: int) -> None:
        for key in [k for k in self._built if k[1] < round_index]:
            del self._built[key]


def _top_up(trainee: _Trainee, rounds: _RoundBatches, spec: RunSpec, steps: int, lookahead: int) -> None:
    """Queues whole rounds until the feed holds the ``steps`` about to run plus ``lookahead``
    (building or regrouping a round happens here, off the clock)."""
    last = spec.preset.rounds  # index of the tail
    while len(trainee.feed) < steps + lookahead and trainee.queued_rounds <= last:
        index = trainee.queued_rounds
        batches = rounds.get(_workload(trainee.config), index)
        if index < last:
            batches = _regrouped(trainee.config, trainee.sharded, batches, trainee.regroup)
        trainee.feed.extend(batches)
        trainee.queued_rounds += 1
        if index == last:
            trainee.feed.close()


def _model_inputs(spec: RunSpec, source, workload: str):
    """What the step model predicts the workload's entries from (a collective); None for the
    sequence workload, which it does not model yet."""
    if workload != "dlrm":
        return None
    return model_inputs(spec, source, table_configs(spec.preset, source.feature_names))


def _build(
    spec: RunSpec, entry: Entry, source, base_rss: float, rounds: _RoundBatches, eval_batches: list, inputs=None
) -> tuple[_Trainee | None, RankRecord]:
    """Builds and warms up an entry; no trainee when its pipeline refuses the model (the record says why)."""
    config = bench_configs.CONFIGS[entry.config]
    before = rss_mb()
    reset_peak_rss()
    sharded = shard_workload(
        config, spec.preset, source, spec.embedding_optimizer, spec.local_world_size, spec.seed, spec.link_bytes_per_s
    )
    attach_ddp_hooks(sharded.model)
    instrument(sharded.model)
    rank = dist.get_rank()
    record = RankRecord(name=entry.name, sharding_types=sharded.sharding_types)
    if inputs is not None and rank == 0:  # before training: from the plan, the profile and the probes
        tables = table_configs(spec.preset, source.feature_names)
        record.predicted = predict_entry(sharded, tables, inputs, spec, entry.run.name, spec.preset.batch_size)
    record.not_run = entry.run.refusal(sharded)  # the same on every rank: it depends on the plan only
    if record.not_run is not None:
        return None, record
    feed = BatchFeed()
    feed.extend(source.batch(step, rank, "train") for step in range(spec.preset.warmup_steps))
    trainee = _Trainee(entry, sharded, feed, entry.run.make(sharded, feed, BENCH_DEVICE), eval_batches=eval_batches)
    # The warm-up's last steps read ahead into round 0 under a pipeline: queue it (regrouped).
    _top_up(trainee, rounds, spec, spec.preset.warmup_steps, trainee.lookahead)
    warmup, profiled_steps = spec.preset.warmup_steps, min(spec.profile_steps, spec.preset.warmup_steps)
    try:
        for _ in range(warmup - profiled_steps):
            _train(trainee, record, spec)
        if profiled_steps:
            with stage_profile.profiled(profiled_steps) as record.stage_profile:
                for _ in range(profiled_steps):
                    _train(trainee, record, spec)
                trainee.loop.settle()
    except PipelineRefused as refused:
        record.not_run = str(refused)
        return None, record
    trainee.loop.settle()  # nothing of this entry runs while the next one builds
    het = het_module(sharded)
    if het is not None:
        het.reset_cache_stats()  # count measured steps only
    # The configuration's own footprint: what building and warming it added, on top of
    # a process that holds nothing else (the other configurations are alive too).
    record.peak_rss_mb = base_rss + max(0.0, peak_rss_mb() - before)
    record.state_mb = state_mb(sharded.model, sharded.optimizer)
    replicated = replicated_module(sharded)
    if replicated is not None:  # replica kernels are not in the state dict: count them here
        record.state_mb += replicated.replica_nbytes() / 2**20
        record.replication = {
            "hot_fraction": hot_fraction(sharded.model),
            "replica_mb": replicated.replica_nbytes() / 2**20,
        }
        replicated.reset_replication_stats()  # count measured steps only
    return trainee, record


def het_module(sharded: ShardedModel):
    """The DLRM's sharded embedding module if it has a HET cache, else None (also for other workloads)."""
    sparse_arch = getattr(sharded.model.module.model, "sparse_arch", None)
    ebc = getattr(sparse_arch, "embedding_bag_collection", None)
    return ebc if hasattr(ebc, "het_lookups") and ebc.het_lookups() else None


def replicated_module(sharded: ShardedModel):
    """The model's sharded embedding module if it has row-replicated tables, else None."""
    for module in sharded.model.modules():
        if hasattr(module, "replicated_lookups") and module.replicated_lookups():
            return module
    return None


def _collect_cache_stats(spec: RunSpec, sources: dict, trainees: dict, records: dict) -> None:
    preset, rank, memo = spec.preset, dist.get_rank(), {}
    batches = None
    for name, trainee in trainees.items():
        sharded = trainee.sharded
        het = het_module(sharded)
        if het is None:
            continue
        if batches is None:
            source = sources[_workload(trainee.config)]
            batches = [source.batch(step, rank, "train") for step in range(preset.total_steps)]
        ideal = ideal_lru(het, [b.sparse_features for b in batches], preset.warmup_steps, memo)
        records[name].cache_stats = rank_cache_stats(het, ideal)


def _progress(spec: RunSpec, total: int):
    if not (spec.progress and dist.get_rank() == 0):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="step", leave=False)


class _DropLogRecords(logging.Filter):
    """Drops the records whose message starts with ``prefix`` and that were logged from ``path_suffix``."""

    def __init__(self, prefix: str, path_suffix: str) -> None:
        super().__init__()
        self.prefix, self.path_suffix = prefix, path_suffix

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.pathname.endswith(self.path_suffix) and record.getMessage().startswith(self.prefix))


# Warnings TorchRec (or torch, about TorchRec's code) gives for what the benchmark must do, one
# filter each, by message and origin: (logger, message prefix, the file that logs it, why it is dropped).
_TORCHREC_LOG_NOISE = (
    (
        "torchrec.distributed.utils",
        "Sharding Type is data_parallel, caching params will be ignored",
        "torchrec/distributed/utils.py",
        # logged for every data_parallel table whether or not it has caching params (ours have none)
    ),
    (
        "",  # the root logger
        "Sharding spec not found for ",
        "torchrec/distributed/planner/planners.py",
        # validate_rank_assignment: a data_parallel table has no sharding spec, by design
    ),
    (
        "torch.fx._symbolic_trace",
        "is_fx_tracing will return true for both fx.symbolic_trace and torch.export",
        "torch/fx/_symbolic_trace.py",
        # torch's note about TorchRec's own calls of is_fx_tracing()
    ),
)


def quiet_torchrec() -> None:
    """Drops the few warnings TorchRec gives about what the benchmark legitimately does (data_parallel
    tables, TorchRec's own DDP arguments), each by its message and origin; every other warning shows."""
    for logger_name, prefix, path_suffix in _TORCHREC_LOG_NOISE:
        logging.getLogger(logger_name).addFilter(_DropLogRecords(prefix, path_suffix))
    # DistributedModelParallel and ShardedEmbeddingBagCollection (data_parallel tables) build their
    # DDP with broadcast_buffers=False themselves; torch deprecates the argument.
    warnings.filterwarnings(
        "ignore",
        message="`broadcast_buffers` is deprecated",
        category=FutureWarning,
        module=r"torchrec\.distributed\.(model_parallel|embeddingbag)$",
    )
    # TorchRec's own collectives (comm_ops, batched_embedding_kernel) still call these (the warning comes
    # from c10d's logging wrapper).
    warnings.filterwarnings(
        "ignore",
        message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated",
        category=FutureWarning,
        module=r"torch\.distributed\.c10d_logger$",
    )
    # TorchRec's dense kernel of data_parallel tables calls this fbgemm-gpu-cpu 1.8 op, which registers no
    # autograd kernel; torch warns at the first backward. Nothing here can change it but not running the type.
    warnings.filterwarnings(
        "ignore",
        message="fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel was not registered",
        category=UserWarning,
        module=r"torch\.autograd\.graph$",
    )


def run_benchmark(spec: RunSpec) -> list[dict[str, RankRecord]] | None:
    """Runs on every rank of an initialized gloo group; rank 0 gets all ranks' records."""
    quiet_torchrec()
    apply_rank_budget(spec)
    entries = spec.entries()
    rank = dist.get_rank()
    preset = spec.preset
    workloads = list(dict.fromkeys(_workload(name) for name in spec.config_names))  # in order of first use
    sources = {w: open_workload_source(w, preset, spec.world_size, spec.seed, spec.data_path) for w in workloads}
    eval_batches = {
        w: [source.batch(i, rank, "eval") for i in range(preset.eval_batches_of(w))] for w, source in sources.items()
    }
    rounds = _RoundBatches(spec, sources, max(entry.run.lookahead for entry in entries))
    base_rss = rss_mb()
    bar = _progress(spec, len(entries) * preset.total_steps)
    trainees: dict[str, _Trainee] = {}
    records: dict[str, RankRecord] = {}
    inputs = {w: _model_inputs(spec, source, w) for w, source in sources.items()}
    with CommAccountant() as accountant, timing_installed(), replica_sync_as_backward():
        accountant.enabled = False
        for entry in entries:
            workload = _workload(entry.config)
            trainee, records[entry.name] = _build(
                spec, entry, sources[workload], base_rss, rounds, eval_batches[workload], inputs[workload]
            )
            if trainee is not None:
                trainees[entry.name] = trainee
            if bar:
                bar.update(preset.warmup_steps if trainee is not None else preset.total_steps)
        for round_index in range(preset.rounds):
            for name in _rotated(list(trainees), round_index):  # no entry always follows the same one
                trainee = trainees[name]
                _top_up(trainee, rounds, spec, preset.steps_per_round, trainee.lookahead)
                try:
                    _measure_window(trainee, preset.steps_per_round, records[name], accountant, spec)
                except PipelineRefused as refused:  # a run without warm-up meets the refusal here
                    records[name] = RankRecord(name, records[name].sharding_types, not_run=str(refused))
                    del trainees[name]
                if bar:
                    bar.update(preset.steps_per_round)
            rounds.release_before(round_index + 1)
        if bar:
            bar.close()
        for name, trainee in trainees.items():
            records[name].staleness_gauge = trainee.loop.staleness_gauge()
            trainee.loop.finish()  # the models' own forwards back, for evaluation
        _collect_cache_stats(spec, sources, trainees, records)
        for name, trainee in trainees.items():
            replicated = replicated_module(trainee.sharded)
            if replicated is not None:
                records[name].replication.update(replicated.replication_stats())
                records[name].replication.update(trainee.regroup)
        for name, trainee in trainees.items():
            scores, labels = zip(*(predict(trainee.sharded.model, b) for b in trainee.eval_batches))
            records[name].scores, records[name].labels = torch.cat(scores), torch.cat(labels)
            records[name].curve.append((trainee.steps_done, records[name].scores, records[name].labels))
        gathered: list[dict[str, RankRecord]] | None = [None] * spec.world_size if rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(records, gathered, dst=0)
    return gathered


def _rotated(names: list[str], round_index: int) -> list[str]:
    """``names`` rotated by ``round_index``: round r starts with entry r (mod the entries)."""
    shift = round_index % len(names) if names else 0
    return names[shift:] + names[:shift]


def _regrouped(name: str, sharded: ShardedModel, batches: list, stats: dict) -> list:
    """A round's batches as the configuration trains them: regrouped by FAE's
    :class:`~torchrec_het.replication.all_hot.AllHotBatches` when it asks for it (off the clock,
    as a data loader would do it; the count of all-hot batches and the seconds go to ``stats``)."""
    window = bench_configs.CONFIGS[name].params.get("all_hot_window")
    if window is None:
        return batches
    start = time.perf_counter()
    wrapper = AllHotBatches(batches, read_here_of(sharded.model), window=window)
    out = list(wrapper)
    stats["all_hot_batches"] = stats.get("all_hot_batches", 0) + wrapper.stats["all_hot_batches"]
    stats["regroup_seconds"] = stats.get("regroup_seconds", 0.0) + time.perf_counter() - start
    return out


def _train(trainee: _Trainee, record: RankRecord, spec: RunSpec) -> float:
    """Trains one unmeasured step of the entry (then evaluates if due); returns its local loss."""
    loss = trainee.loop.step()
    _after_step(trainee, record, spec, None)
    return loss


def _eval_due(spec: RunSpec, steps_done: int) -> bool:
    """Whether held-out AUC is evaluated after ``steps_done`` trained steps (not after the last:
    the run's end does that one)."""
    every = spec.preset.eval_every
    return bool(every) and steps_done % every == 0 and steps_done < spec.preset.total_steps


def _after_step(trainee: _Trainee, record: RankRecord, spec: RunSpec, accountant: CommAccountant | None) -> None:
    """Counts the step; evaluates held-out AUC when it is due (off the clock, and off the byte count:
    the accountant is paused once the step's own work has settled, so its bytes still count)."""
    trainee.steps_done += 1
    done = trainee.steps_done
    if not _eval_due(spec, done):
        return
    trainee.loop.settle()
    counting = accountant is not None and accountant.enabled
    if counting:
        accountant.enabled = False
    scores, labels = zip(*trainee.loop.evaluate(trainee.eval_batches))
    record.curve.append((done, torch.cat(scores), torch.cat(labels)))
    if counting:
        accountant.enabled = True


def _measure_window(
    trainee: _Trainee, steps: int, record: RankRecord, accountant: CommAccountant, spec: RunSpec
) -> None:
    dist.barrier()
    accountant.reset()
    accountant.enabled = True
    for index in range(steps):
        CLOCK.start()
        loss = trainee.loop.step()
        if index == steps - 1 or _eval_due(spec, trainee.steps_done + 1):
            # Before the next entry's steps (and its barrier), or an evaluation, nothing of this one
            # may still run beside the main thread: the step waits for its own embedding backward
            # (the hybrid pipeline's), on the clock, as the next step would have.
            trainee.loop.settle()
        parts = CLOCK.stop()
        record.losses.append(loss)
        record.step_seconds.append(parts["total"])
        record.step_parts.append(tuple(parts[p] for p in TIMED_PARTS))
        _after_step(trainee, record, spec, accountant)
    accountant.enabled = False
    record.comm.append(accountant.totals())

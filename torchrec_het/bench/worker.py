"""The benchmark's rank body: every configuration trained on the same data, interleaved.

Each rank builds all selected configurations, warms each up, then runs ``rounds``
rounds; in a round every configuration trains ``steps_per_round`` steps on the same
batches (those of its workload: configurations of one workload share them), in turn,
so machine noise hits all configurations alike. Bytes of every
collective are counted during measured steps only. Rank 0 gathers the per-rank
records and returns them.

Every configuration trains under the run's pipeline (``RunSpec.pipeline``, see
:mod:`~torchrec_het.bench.pipelines`): one loop per configuration for the whole run, fed
from a :class:`~torchrec_het.bench.pipelines.BatchFeed` that holds the next round's batches
(and, after the last round, ``lookahead`` batches past the end) before a round starts, so
a pipeline that reads ahead never finds it empty and batch building stays off the clock.
Under ``sparse_dist`` a step issues the next batch's input dist, so the bytes counted in a
round are those of that round's steps shifted by one batch; the last measured step issues
the input dist of batch ``total_steps``, which is never trained (fixed-size batches: the
same bytes). Each step's time is split into parts by :mod:`~torchrec_het.bench.step_time`.
"""

import logging
import os
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from torchrec_het.bench import configs as bench_configs
from torchrec_het.bench.het_stats import ideal_lru, rank_cache_stats
from torchrec_het.bench.memory import peak_rss_mb, reset_peak_rss, rss_mb, state_mb
from torchrec_het.bench.model import BENCH_DEVICE, ShardedModel, predict
from torchrec_het.bench.pipelines import DEFAULT_PIPELINE, BatchFeed, PipelineKind, check_pipeline
from torchrec_het.bench.presets import BenchPreset
from torchrec_het.bench.replicated_configs import hot_fraction
from torchrec_het.bench.step_time import CLOCK, TIMED_PARTS, instrument, timing_installed
from torchrec_het.bench.workloads import open_workload_source, shard_workload
from torchrec_het.comm import CommAccountant, attach_ddp_hooks
from torchrec_het.data import DataExhaustedError
from torchrec_het.replication.all_hot import AllHotBatches, read_here_of


# What configurations that plan for the network assume of gloo over loopback: ~2 GB/s for
# the benchmark's message sizes on this kind of VM (a stated figure, not measured per run).
LOOPBACK_BYTES_PER_S = 2e9


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
    pipeline: str = DEFAULT_PIPELINE

    @property
    def local_world_size(self) -> int:
        return self.host_of_rank.count(0)

    @property
    def link_bytes_per_s(self) -> float:
        """The network between ranks: the emulated link's rate, or loopback's (stated, see LOOPBACK_BYTES_PER_S)."""
        if self.network.get("mode") == "emulated":
            return self.network["gbit"] * 1e9 / 8
        return LOOPBACK_BYTES_PER_S


@dataclass
class RankRecord:
    """What one rank measured for one configuration."""

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


def _threads_per_rank(spec: RunSpec) -> int:
    return max(1, (os.cpu_count() or 1) // spec.local_world_size)


def _workload(name: str) -> str:
    return bench_configs.CONFIGS[name].workload


@dataclass
class _Trainee:
    """One configuration while the run goes: its model, its loop and the batches queued for it."""

    name: str
    sharded: ShardedModel
    feed: BatchFeed
    loop: object  # PlainLoop | TorchRecLoop
    queued_rounds: int = 0  # rounds of batches (then the tail) appended to the feed so far
    regroup: dict = field(default_factory=dict)  # FAE regrouping counters of measured rounds


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
        batches = rounds.get(_workload(trainee.name), index)
        if index < last:
            batches = _regrouped(trainee.name, trainee.sharded, batches, trainee.regroup)
        trainee.feed.extend(batches)
        trainee.queued_rounds += 1
        if index == last:
            trainee.feed.close()


def _build(
    spec: RunSpec, name: str, source, base_rss: float, kind: PipelineKind, rounds: _RoundBatches
) -> tuple[_Trainee, RankRecord]:
    config = bench_configs.CONFIGS[name]
    before = rss_mb()
    reset_peak_rss()
    sharded = shard_workload(
        config, spec.preset, source, spec.embedding_optimizer, spec.local_world_size, spec.seed, spec.link_bytes_per_s
    )
    attach_ddp_hooks(sharded.model)
    instrument(sharded.model)
    rank = dist.get_rank()
    feed = BatchFeed()
    feed.extend(source.batch(step, rank, "train") for step in range(spec.preset.warmup_steps))
    trainee = _Trainee(name, sharded, feed, kind.make(sharded, feed, BENCH_DEVICE))
    # The warm-up's last steps read ahead into round 0 under a pipeline: queue it (regrouped).
    _top_up(trainee, rounds, spec, spec.preset.warmup_steps, kind.lookahead)
    for _ in range(spec.preset.warmup_steps):
        trainee.loop.step()
    record = RankRecord(name=name, sharding_types=sharded.sharding_types)
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
        record.replication = {"hot_fraction": hot_fraction(sharded.model), "replica_mb": replicated.replica_nbytes() / 2**20}
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


def _collect_cache_stats(spec: RunSpec, sources: dict, models: dict, records: dict) -> None:
    preset, rank, memo = spec.preset, dist.get_rank(), {}
    batches = None
    for name, sharded in models.items():
        het = het_module(sharded)
        if het is None:
            continue
        if batches is None:
            source = sources[_workload(name)]
            batches = [source.batch(step, rank, "train") for step in range(preset.total_steps)]
        ideal = ideal_lru(het, [b.sparse_features for b in batches], preset.warmup_steps, memo)
        records[name].cache_stats = rank_cache_stats(het, ideal)


def _progress(spec: RunSpec, total: int):
    if not (spec.progress and dist.get_rank() == 0):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="bench", unit="step", leave=False)


def quiet_torchrec() -> None:
    """Silences TorchRec's and torch's deprecation chatter so the benchmark's output stays readable."""
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def run_benchmark(spec: RunSpec) -> list[dict[str, RankRecord]] | None:
    """Runs on every rank of an initialized gloo group; rank 0 gets all ranks' records."""
    quiet_torchrec()
    torch.set_num_threads(_threads_per_rank(spec))
    kind = check_pipeline(spec.pipeline, BENCH_DEVICE)
    rank = dist.get_rank()
    preset = spec.preset
    workloads = list(dict.fromkeys(_workload(name) for name in spec.config_names))  # in order of first use
    sources = {
        w: open_workload_source(w, preset, spec.world_size, spec.seed, spec.data_path) for w in workloads
    }
    rounds = _RoundBatches(spec, sources, kind.lookahead)
    base_rss = rss_mb()
    bar = _progress(spec, len(spec.config_names) * preset.total_steps)
    trainees: dict[str, _Trainee] = {}
    records: dict[str, RankRecord] = {}
    with CommAccountant() as accountant, timing_installed():
        accountant.enabled = False
        for name in spec.config_names:
            trainees[name], records[name] = _build(spec, name, sources[_workload(name)], base_rss, kind, rounds)
            if bar:
                bar.update(preset.warmup_steps)
        for round_index in range(preset.rounds):
            for name, trainee in trainees.items():
                _top_up(trainee, rounds, spec, preset.steps_per_round, kind.lookahead)
                _measure_window(trainee, preset.steps_per_round, records[name], accountant)
                if bar:
                    bar.update(preset.steps_per_round)
            rounds.release_before(round_index + 1)
        if bar:
            bar.close()
        models = {name: trainee.sharded for name, trainee in trainees.items()}
        for trainee in trainees.values():
            trainee.loop.finish()  # the models' own forwards back, for evaluation
        _collect_cache_stats(spec, sources, models, records)
        for name, trainee in trainees.items():
            replicated = replicated_module(trainee.sharded)
            if replicated is not None:
                records[name].replication.update(replicated.replication_stats())
                records[name].replication.update(trainee.regroup)
        for workload, source in sources.items():
            eval_batches = [source.batch(i, rank, "eval") for i in range(preset.eval_batches_of(workload))]
            for name, sharded in models.items():
                if _workload(name) != workload:
                    continue
                scores, labels = zip(*(predict(sharded.model, b) for b in eval_batches))
                records[name].scores, records[name].labels = torch.cat(scores), torch.cat(labels)
        gathered: list[dict[str, RankRecord]] | None = [None] * spec.world_size if rank == 0 else None  # type: ignore[list-item]
        dist.gather_object(records, gathered, dst=0)
    return gathered


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


def _measure_window(trainee: _Trainee, steps: int, record: RankRecord, accountant: CommAccountant) -> None:
    dist.barrier()
    accountant.reset()
    accountant.enabled = True
    for _ in range(steps):
        CLOCK.start()
        record.losses.append(trainee.loop.step())
        parts = CLOCK.stop()
        record.step_seconds.append(parts["total"])
        record.step_parts.append(tuple(parts[p] for p in TIMED_PARTS))
    accountant.enabled = False
    record.comm.append(accountant.totals())

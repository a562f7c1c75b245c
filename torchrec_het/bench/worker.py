"""The benchmark's rank body: every configuration trained on the same data, interleaved.

Each rank builds all selected configurations, warms each up, then runs ``rounds``
rounds; in a round every configuration trains ``steps_per_round`` steps on the same
batches (those of its workload: configurations of one workload share them), in turn,
so machine noise hits all configurations alike. Bytes of every
collective are counted during measured steps only. Rank 0 gathers the per-rank
records and returns them.
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
from torchrec_het.bench.model import ShardedModel, predict, train_step
from torchrec_het.bench.presets import BenchPreset
from torchrec_het.bench.replicated_configs import hot_fraction
from torchrec_het.bench.workloads import open_workload_source, shard_workload
from torchrec_het.comm import CommAccountant, attach_ddp_hooks
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


def _build(spec: RunSpec, name: str, source, base_rss: float) -> tuple[ShardedModel, RankRecord]:
    config = bench_configs.CONFIGS[name]
    before = rss_mb()
    reset_peak_rss()
    sharded = shard_workload(
        config, spec.preset, source, spec.embedding_optimizer, spec.local_world_size, spec.seed, spec.link_bytes_per_s
    )
    attach_ddp_hooks(sharded.model)
    rank = dist.get_rank()
    for step in range(spec.preset.warmup_steps):
        train_step(sharded, source.batch(step, rank, "train"))
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
    return sharded, record


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
    rank = dist.get_rank()
    preset = spec.preset
    workloads = list(dict.fromkeys(_workload(name) for name in spec.config_names))  # in order of first use
    sources = {
        w: open_workload_source(w, preset, spec.world_size, spec.seed, spec.data_path) for w in workloads
    }
    base_rss = rss_mb()
    bar = _progress(spec, len(spec.config_names) * preset.total_steps)
    models: dict[str, ShardedModel] = {}
    records: dict[str, RankRecord] = {}
    with CommAccountant() as accountant:
        accountant.enabled = False
        for name in spec.config_names:
            models[name], records[name] = _build(spec, name, sources[_workload(name)], base_rss)
            if bar:
                bar.update(preset.warmup_steps)
        for round_index in range(preset.rounds):
            first = preset.warmup_steps + round_index * preset.steps_per_round
            steps = range(first, first + preset.steps_per_round)
            batches = {w: [source.batch(step, rank, "train") for step in steps] for w, source in sources.items()}
            for name, sharded in models.items():
                window = _regrouped(name, sharded, batches[_workload(name)], records[name])
                _measure_window(sharded, window, records[name], accountant)
                if bar:
                    bar.update(preset.steps_per_round)
            del batches
        if bar:
            bar.close()
        _collect_cache_stats(spec, sources, models, records)
        for name, sharded in models.items():
            replicated = replicated_module(sharded)
            if replicated is not None:
                records[name].replication.update(replicated.replication_stats())
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


def _regrouped(name: str, sharded: ShardedModel, batches: list, record: RankRecord) -> list:
    """The round's batches as the configuration trains them: regrouped by FAE's
    :class:`~torchrec_het.replication.all_hot.AllHotBatches` when it asks for it (off the clock,
    as a data loader would do it; the seconds are recorded)."""
    window = bench_configs.CONFIGS[name].params.get("all_hot_window")
    if window is None:
        return batches
    start = time.perf_counter()
    wrapper = AllHotBatches(batches, read_here_of(sharded.model), window=window)
    out = list(wrapper)
    stats = record.replication
    stats["all_hot_batches"] = stats.get("all_hot_batches", 0) + wrapper.stats["all_hot_batches"]
    stats["regroup_seconds"] = stats.get("regroup_seconds", 0.0) + time.perf_counter() - start
    return out


def _measure_window(sharded: ShardedModel, batches: list, record: RankRecord, accountant: CommAccountant) -> None:
    dist.barrier()
    accountant.reset()
    accountant.enabled = True
    for batch in batches:
        start = time.perf_counter()
        record.losses.append(train_step(sharded, batch))
        record.step_seconds.append(time.perf_counter() - start)
    accountant.enabled = False
    record.comm.append(accountant.totals())

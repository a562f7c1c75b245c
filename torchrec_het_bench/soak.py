"""The benchmark's soak mode (``--soak STEPS``): does a long run hold its memory?

Each entry (a configuration under a pipeline, as in the benchmark) trains ``steps`` steps
alone, one entry after the other in the same ranks, on the workload's data from step 0 on.
Every ``sample_every`` steps, at the end of the warm-up and after the last step, each rank
settles the pipeline (nothing runs beside the main thread) and records its resident set size
(``VmRSS``), its peak since the entry started (``VmHWM``, reset when the entry starts), the C heap's
bytes in use and freed-but-kept (glibc's ``mallinfo2``: RSS that grows while the bytes in use stay
flat is the allocator keeping freed memory, not live data) and the wall time and mean loss of the steps since the previous sample; from the end of the warm-up on
also the objects that survive a full garbage collection: torch tensors and all gc-tracked
objects (:func:`~torchrec_het_bench.memory.live_objects`). The counts by type at the end of the
warm-up and after the last step give the types that grew most. What a leak looks like: a live
count that climbs with the steps (last turn's exchange leak kept 6 tensors a step), and a
peak RSS that keeps rising after warm-up.

No bytes are counted, no step is timed in parts and nothing is evaluated: the entry trains as
a user's job would. Batches are built ``sample_every`` at a time at the sample points (off the
step clock), so the batches queued are the same number at every sample. Before an entry starts,
the previous one is dropped, collected and the allocator's free pages handed back to the kernel
(``malloc_trim``), so one entry's freed memory does not hide the next one's growth; an entry's
RSS still includes the process (torch, TorchRec, the data) and what earlier entries left.
"""

import gc
import itertools
import time
from dataclasses import dataclass, field

import torch.distributed as dist

from torchrec_het.replication.all_hot import AllHotBatches, read_here_of
from torchrec_het_bench import configs as bench_configs
from torchrec_het_bench.data import DataExhaustedError
from torchrec_het_bench.memory import (
    heap_mb,
    live_objects,
    peak_rss_mb,
    release_free_memory,
    reset_peak_rss,
    rss_mb,
    type_name,
)
from torchrec_het_bench.model import BENCH_DEVICE
from torchrec_het_bench.pipelines import BatchFeed, PipelineRefused
from torchrec_het_bench.worker import Entry, RunSpec, apply_rank_budget, quiet_torchrec
from torchrec_het_bench.workloads import open_workload_source, shard_workload

GROWN_TYPES = 8  # types listed as the ones whose live count grew most after warm-up


@dataclass(frozen=True)
class SoakSpec:
    """How long each entry trains and when it is sampled.

    Attributes:
        steps: steps each entry trains, warm-up included.
        warmup_steps: steps before live objects are counted and growth is measured from.
        sample_every: steps between samples (also sampled: the end of the warm-up, the last step).
    """

    steps: int
    warmup_steps: int
    sample_every: int

    def __post_init__(self) -> None:
        if not 1 <= self.warmup_steps < self.steps:
            raise ValueError(f"soak: warm-up must be >= 1 and below the {self.steps} steps, got {self.warmup_steps}")
        if self.sample_every < 1:
            raise ValueError(f"soak: samples every >= 1 steps, got {self.sample_every}")

    @classmethod
    def of(cls, steps: int, warmup_steps: int | None = None, sample_every: int | None = None) -> "SoakSpec":
        """The defaults: warm-up a fifth of the steps (the allocator settles; the smoke preset's RSS stops
        rising after about 500 steps), about 40 samples."""
        warmup = max(1, steps // 5) if warmup_steps is None else warmup_steps
        every = max(1, steps // 40) if sample_every is None else sample_every
        return cls(steps, warmup, every)

    def next_sample(self, step: int) -> int:
        """The first sampled step after ``step``."""
        return next(s for s in range(step + 1, self.steps + 1) if self.sampled(s))

    def sampled(self, step: int) -> bool:
        """Whether the rank samples after trained step ``step`` (1-based)."""
        return step % self.sample_every == 0 or step in (self.warmup_steps, self.steps)


@dataclass
class SoakRecord:
    """One rank's series for one entry: one element per sample, in step order.

    Lists of numbers only (appending adds no gc-tracked object, so the record does not count
    itself); ``None`` where live objects were not counted (warm-up).
    """

    name: str
    sharding_types: list[str]
    step: list[int] = field(default_factory=list)
    rss_mb: list[float] = field(default_factory=list)
    peak_rss_mb: list[float] = field(default_factory=list)
    heap_in_use_mb: list[float | None] = field(default_factory=list)  # the C heap (glibc's mallinfo2), None elsewhere
    heap_free_mb: list[float | None] = field(default_factory=list)  # freed, kept by the allocator
    live_tensors: list[int | None] = field(default_factory=list)
    gc_objects: list[int | None] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # wall time of the steps since the previous sample
    loss: list[float] = field(default_factory=list)  # their mean loss (this rank's)
    grown_types: list[tuple[str, int]] = field(default_factory=list)  # most grown live types after warm-up
    peak_reset: bool = False  # whether VmHWM could be reset when the entry started
    not_run: str | None = None  # why the pipeline refused the entry


def run_soak(spec: RunSpec, soak: SoakSpec) -> list[dict[str, SoakRecord]] | None:
    """Runs on every rank of an initialized gloo group; rank 0 gets all ranks' records."""
    quiet_torchrec()
    apply_rank_budget(spec)
    sources: dict = {}
    records: dict[str, SoakRecord] = {}
    bar = _progress(spec, len(spec.entries()) * soak.steps)
    live_objects(by_type=True)  # the first count by type fills caches of its own (~100 objects): not an entry's growth
    for entry in spec.entries():
        workload = bench_configs.CONFIGS[entry.config].workload
        if workload not in sources:
            sources[workload] = open_workload_source(workload, spec.preset, spec.world_size, spec.seed, spec.data_path)
        records[entry.name] = _soak_entry(spec, soak, entry, sources[workload], bar)
        dist.barrier()
    if bar is not None:
        bar.close()
    gathered: list | None = [None] * spec.world_size if dist.get_rank() == 0 else None
    dist.gather_object(records, gathered, dst=0)
    return gathered


def _progress(spec: RunSpec, total: int):
    if not (spec.progress and dist.get_rank() == 0):
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="soak", unit="step", leave=False)


def _batches(entry: Entry, sharded, source, needed: int):
    """This rank's training batches from step 0 on, regrouped as the configuration asks (FAE); they go on
    past the ``needed`` ones where the data does, so what a regrouping window holds at the last sample is
    what it held at the others."""
    rank = dist.get_rank()

    def stream():
        for step in itertools.count():
            try:
                yield source.batch(step, rank, "train")
            except DataExhaustedError:
                if step < needed:
                    raise
                return

    window = bench_configs.CONFIGS[entry.config].params.get("all_hot_window")
    return iter(stream() if window is None else AllHotBatches(stream(), read_here_of(sharded.model), window=window))


def _refill(feed: BatchFeed, batches, pulled: int, target: int) -> int:
    """Pulls batches into the feed until ``target`` were pulled in all (fewer where they run out: the
    feed is then closed); returns how many were pulled."""
    while pulled < target:
        batch = next(batches, None)
        if batch is None:
            feed.close()
            break
        feed.extend([batch])
        pulled += 1
    return pulled


def _soak_entry(spec: RunSpec, soak: SoakSpec, entry: Entry, source, bar) -> SoakRecord:
    """Trains one entry ``soak.steps`` steps and samples it (the entry is dropped when this returns)."""
    gc.collect()  # the previous entry (its model and pipeline hold reference cycles)
    release_free_memory()
    config = bench_configs.CONFIGS[entry.config]
    sharded = shard_workload(
        config, spec.preset, source, spec.embedding_optimizer, spec.local_world_size, spec.seed, spec.link_bytes_per_s
    )
    record = SoakRecord(entry.name, sharded.sharding_types)
    record.not_run = entry.run.refusal(sharded)  # the same on every rank: it depends on the plan only
    if record.not_run is not None:
        return record
    record.peak_reset = reset_peak_rss()
    lookahead = entry.run.lookahead
    batches = _batches(entry, sharded, source, soak.steps + lookahead)
    feed = BatchFeed()
    loop = entry.run.make(sharded, feed, BENCH_DEVICE)
    # Batches up to the next sample point and the pipeline's lookahead: at every sample the feed is
    # empty and the pipeline holds the same batches ahead, so the counts compare.
    pulled = _refill(feed, batches, 0, soak.next_sample(0) + lookahead)
    at_warmup = None
    seconds, losses = 0.0, 0.0
    try:
        for step in range(1, soak.steps + 1):
            start = time.perf_counter()
            losses += loop.step()
            if bar is not None:
                bar.update(1)
            if not soak.sampled(step):
                seconds += time.perf_counter() - start
                continue
            loop.settle()  # nothing of the entry runs beside the main thread while it is counted
            seconds += time.perf_counter() - start  # the settling on the clock of the window's last step
            window = step - (record.step[-1] if record.step else 0)
            record.step.append(step)
            record.seconds.append(seconds)
            record.loss.append(losses / window)
            record.rss_mb.append(round(rss_mb(), 1))
            record.peak_rss_mb.append(round(peak_rss_mb(), 1))
            heap = heap_mb()
            record.heap_in_use_mb.append(None if heap is None else round(heap[0], 1))
            record.heap_free_mb.append(None if heap is None else round(heap[1], 1))
            if step >= soak.warmup_steps:
                tensors, objects, by_type = live_objects(by_type=step in (soak.warmup_steps, soak.steps))
                record.live_tensors.append(tensors)
                record.gc_objects.append(objects)
                if step == soak.warmup_steps:
                    at_warmup = by_type
                elif step == soak.steps:
                    grown = (by_type - at_warmup).most_common(GROWN_TYPES)
                    record.grown_types = [(type_name(kind), count) for kind, count in grown]
            else:
                record.live_tensors.append(None)
                record.gc_objects.append(None)
            seconds, losses = 0.0, 0.0
            if step < soak.steps:
                pulled = _refill(feed, batches, pulled, soak.next_sample(step) + lookahead)
    except PipelineRefused as refused:  # its first step: the same on every rank
        record = SoakRecord(entry.name, sharded.sharding_types, not_run=str(refused))
    loop.finish()
    return record

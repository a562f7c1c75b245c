"""Microbenchmark: one sharded EmbeddingBagCollection alone, per sharding type.

    python -m torchrec_het_bench.micro                     # default preset: 26 tables, batch 1024 per rank
    python -m torchrec_het_bench.micro --preset smoke --out /tmp/micro

Spawns ``--world-size`` gloo ranks (2) like the benchmark. Each rank shards the preset's
tables (the DLRM's, in one ``EmbeddingBagCollection``, nothing else in the model) once per
type of :data:`MICRO_TYPES`, with the sharders and plan of the benchmark configuration it
names and row-wise Adagrad fused into backward, as users train. A step is what the module
costs a user's training step: forward (input dist, lookup, output dist, waiting for the
pooled embeddings), backward of a fixed gradient (the dense network's stand-in; the fused
optimizer updates rows here), ``optimizer.step()`` and ``zero_grad()``, on the benchmark's
data (Zipf ids, the preset's alpha). After a warm-up, types are measured in rounds on the
same batches in turn. Reported per type: ms per step (median, p10, p90; a step lasts as
long as its slowest rank), collectives issued per step per rank (counted by
:class:`~torchrec_het_bench.comm.CommAccountant`, by collective family) and embedding bytes per
step; the runtime files one more step runs (``batch_files``: a batch's way through the type); and
the ids one rank's batch holds per step (``ids_per_step_per_rank``, which
``python -m torchrec_het_bench.calibrate`` divides by). Writes ``micro.json`` and
``micro.md`` into ``--out`` and prints the table.
"""

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import record_function
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_het.integration.cpu_budget import CpuBudget
from torchrec_het_bench import configs as bench_configs
from torchrec_het_bench import stage_profile
from torchrec_het_bench.busy import busy_machine
from torchrec_het_bench.comm import COLLECTIVE_FAMILIES, CommAccountant, CommTotals, sum_totals
from torchrec_het_bench.flags import BUSY_HELP, cpu_share, int_at_least
from torchrec_het_bench.launch import spawn
from torchrec_het_bench.model import shard_module, table_configs
from torchrec_het_bench.presets import MIN_ROUNDS, PRESETS, get_preset
from torchrec_het_bench.replicated_configs import hot_fraction
from torchrec_het_bench.report import cpu_line
from torchrec_het_bench.results import percentile, versions
from torchrec_het_bench.worker import LOOPBACK_BYTES_PER_S, apply_rank_budget, quiet_torchrec
from torchrec_het_bench.workloads import open_workload_source, training_sample

# Row name -> the benchmark configuration whose sharders and plan the type is built with.
MICRO_TYPES: dict[str, str] = {
    "table_wise": "stock_table_wise",
    "row_wise": "stock_row_wise",
    "het_cached_s0": "het_het_s0_c10",  # HET cache, exact (s_read = s_write = 0), 10% of rows
    "het_cached_s10": "het_het_s10_c10",  # HET cache, s_read = s_write = 10
    "het_replicated_s1": "rep_m100_s1",  # row replication, hot rows of a 5% profile, exact sync
    "het_replicated_s10": "rep_m100_s10",  # the same, replicas synced every 10 steps
    "het_replicated_rows": "rep_m100_s1_rows",  # het_replicated_s1 whose cold ids fetch rows, pooled by the reader
}
EMBEDDING_OPTIMIZER = "rowwise_adagrad"


@dataclass(frozen=True)
class MicroSpec:
    """What every rank of the microbenchmark needs; picklable."""

    preset_name: str
    types: tuple[str, ...]
    world_size: int
    out_dir: str
    warmup_steps: int | None = None
    steps_per_round: int | None = None
    rounds: int | None = None
    seed: int = 0
    network: dict = field(default_factory=lambda: {"mode": "loopback"})
    cpu: CpuBudget | None = None  # the ranks' share of the machine (set by the launcher)
    cpu_from_torchrun: bool = False
    busy_share: float = 0.0  # share of the machine's CPU taken from the ranks by busy processes (--busy)
    profile_steps: int = 0  # steps of each type profiled by stage after the measured rounds (0: none)

    @property
    def preset(self):
        return get_preset(
            self.preset_name, warmup_steps=self.warmup_steps, steps_per_round=self.steps_per_round, rounds=self.rounds
        )


@dataclass
class MicroRecord:
    """What one rank measured for one type."""

    name: str
    config: str
    sharding_types: list[str]
    step_seconds: list[float] = field(default_factory=list)
    comm: list[CommTotals] = field(default_factory=list)
    hot_fraction: float | None = None
    ids_per_step: list[int] = field(default_factory=list)  # ids of this rank's batch, per measured step
    stage_profile: dict | None = None  # --profile-steps: where the profiled steps' time went (stage_profile.py)
    batch_files: list[str] = field(default_factory=list)  # runtime files whose code one more step ran


class EmbeddingsOnly(nn.Module):
    """A model that is one EmbeddingBagCollection (the module the planner and DMP shard)."""

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, features):
        return self.ebc(features)


def _shard(spec: MicroSpec, type_name: str, source):
    preset = spec.preset
    config = bench_configs.CONFIGS[MICRO_TYPES[type_name]]
    tables = table_configs(preset, source.feature_names)
    torch.manual_seed(spec.seed)
    model = EmbeddingsOnly(EmbeddingBagCollection(tables=tables, device=torch.device("meta")))
    return shard_module(
        config,
        preset,
        model,
        "ebc",
        tables,
        batch_size=preset.batch_size,
        learning_rate=preset.learning_rate,
        embedding_optimizer=EMBEDDING_OPTIMIZER,
        local_world_size=spec.world_size,
        seed=spec.seed,
        sample=training_sample(source, preset),
        link_bytes_per_s=LOOPBACK_BYTES_PER_S,
    )


def _step(sharded, features, grad: torch.Tensor) -> None:
    with record_function("## forward ##"):
        pooled = sharded.model(features).values()  # waits for the output dist
    with record_function("## backward ##"):
        pooled.backward(grad)  # the fused optimizer updates the rows in here
    with record_function("## optimizer ##"):
        sharded.optimizer.step()
        sharded.optimizer.zero_grad()


def run_micro(spec: MicroSpec) -> list[dict[str, MicroRecord]] | None:
    """Runs on every rank of an initialized gloo group; rank 0 gets all ranks' records."""
    quiet_torchrec()
    apply_rank_budget(spec)
    preset, rank = spec.preset, dist.get_rank()
    source = open_workload_source("dlrm", preset, spec.world_size, spec.seed)
    models, records = {}, {}
    for name in spec.types:
        models[name] = _shard(spec, name, source)
        records[name] = MicroRecord(name, MICRO_TYPES[name], models[name].sharding_types)
    width = preset.embedding_dim * len(preset.table_sizes)
    grad = torch.randn(preset.batch_size, width, generator=torch.Generator().manual_seed(spec.seed * 1000 + rank))
    with CommAccountant() as accountant:
        accountant.enabled = False
        for step in range(preset.warmup_steps):
            features = source.batch(step, rank, "train").sparse_features
            for sharded in models.values():
                _step(sharded, features, grad)
        for round_index in range(preset.rounds):
            first = preset.warmup_steps + round_index * preset.steps_per_round
            batches = [
                source.batch(s, rank, "train").sparse_features for s in range(first, first + preset.steps_per_round)
            ]
            for name, sharded in models.items():
                dist.barrier()
                accountant.reset()
                accountant.enabled = True
                for features in batches:
                    start = time.perf_counter()
                    _step(sharded, features, grad)
                    records[name].step_seconds.append(time.perf_counter() - start)
                    records[name].ids_per_step.append(features.values().numel())
                accountant.enabled = False
                records[name].comm.append(accountant.totals())
        for name, sharded in models.items():
            if spec.profile_steps:  # after the measured rounds, on the last round's batches again
                dist.barrier()
                with stage_profile.profiled(spec.profile_steps) as records[name].stage_profile:
                    for index in range(spec.profile_steps):
                        _step(sharded, batches[index % len(batches)], grad)
            if "het_row_replicated" in sharded.sharding_types:
                records[name].hot_fraction = hot_fraction(sharded.model)
            dist.barrier()
            records[name].batch_files = files_run(lambda s=sharded: _step(s, batches[0], grad))
        gathered: list | None = [None] * spec.world_size if rank == 0 else None
        dist.gather_object(records, gathered, dst=0)
    return gathered


RUNTIME = ("torchrec_het", "sharders")  # the plugin's runtime packages (the benchmark and its tests are not)


def files_run(step) -> list[str]:
    """The runtime files (under :data:`RUNTIME`) whose code ``step()`` ran, its backward included:
    a batch's way through a type, counted as files."""
    root = Path(__file__).resolve().parent.parent
    seen: set[str] = set()

    def profile(frame, event, arg):  # noqa: ARG001
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        with torch.autograd.set_multithreading_enabled(False):  # the backward runs on this thread
            step()
    finally:
        sys.setprofile(None)
    files = []
    for name in seen:
        path = Path(name).resolve()
        if path.is_relative_to(root) and path.relative_to(root).parts[0] in RUNTIME:
            files.append(str(path.relative_to(root)))
    return sorted(files)


def summarize(spec: MicroSpec, gathered: list[dict[str, MicroRecord]]) -> dict:
    """The micro.json document."""
    preset = spec.preset
    types, ids = [], []
    for name in spec.types:
        per_rank = [ranks[name] for ranks in gathered]
        steps = len(per_rank[0].step_seconds)
        ids += [n for r in per_rank for n in r.ids_per_step]
        ms = [1e3 * max(s) for s in zip(*(r.step_seconds for r in per_rank))]  # the slowest rank's step
        totals = sum_totals([t for r in per_rank for t in r.comm])
        per_rank_step = spec.world_size * steps
        by_family = {
            family: sum(n for (_, f), n in totals.calls.items() if f == family) / per_rank_step
            for family in COLLECTIVE_FAMILIES
        }
        summary = totals.summary()
        types.append(
            {
                "name": name,
                "config": per_rank[0].config,
                "sharding_types": per_rank[0].sharding_types,
                "params": bench_configs.CONFIGS[per_rank[0].config].params,
                "ms_per_step": {
                    "median": statistics.median(ms),
                    "p10": percentile(ms, 0.1),
                    "p90": percentile(ms, 0.9),
                },
                "collectives_per_step": {
                    "total": sum(by_family.values()),
                    "by_family": by_family,
                    "by_phase": {p: n / per_rank_step for p, n in summary["calls"].items()},
                },
                "embedding_cross_rank_bytes_per_step": round(summary["phases"]["embedding_cross_rank"] / steps),
                "hot_fraction": per_rank[0].hot_fraction,
                "measured_steps": steps,
                "batch_files": sorted({f for r in per_rank for f in r.batch_files}),
                **(
                    {"stage_profile": stage_profile.merge_ranks([r.stage_profile for r in per_rank])}
                    if per_rank[0].stage_profile is not None
                    else {}
                ),
            }
        )
    return {
        "preset": preset.name,
        "world_size": spec.world_size,
        "cpu_budget": spec.cpu.as_dict() if spec.cpu is not None else None,
        "busy_share": spec.busy_share,
        "tables": len(preset.table_sizes),
        "table_sizes": list(preset.table_sizes),
        "embedding_dim": preset.embedding_dim,
        "batch_size_per_rank": preset.batch_size,
        "alpha": preset.alpha,
        "embedding_optimizer": EMBEDDING_OPTIMIZER,
        "ids_per_step_per_rank": statistics.fmean(ids) if ids else None,  # one rank's batch, all tables
        "warmup_steps": preset.warmup_steps,
        "steps_per_round": preset.steps_per_round,
        "rounds": preset.rounds,
        "types": types,
        "versions": versions(),
    }


def _count(n: float) -> str:
    return f"{n:.2f}".rstrip("0").rstrip(".")


def markdown_table(results: dict) -> str:
    """One row per type: ms per step, collectives per step per rank (by family), embedding bytes."""
    lines = [
        f"sharded EmbeddingBagCollection alone: preset `{results['preset']}` ({results['tables']} tables, dim "
        f"{results['embedding_dim']}, batch {results['batch_size_per_rank']} per rank, alpha {results['alpha']}), "
        f"{results['world_size']} ranks; forward + backward + fused {results['embedding_optimizer']}; "
        "collectives are calls per step per rank; " + cpu_line(results.get("cpu_budget"), results.get("busy_share")),
        "",
        "| type | config | ms/step median [p10, p90] | collectives/step | by family | embedding MiB/step | hot rows |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in results["types"]:
        ms, calls = t["ms_per_step"], t["collectives_per_step"]
        families = ", ".join(f"{f} {_count(n)}" for f, n in calls["by_family"].items() if n)
        hot = "-" if t["hot_fraction"] is None else f"{t['hot_fraction']:.2%}"
        lines.append(
            f"| {t['name']} | {t['config']} | {ms['median']:.2f} [{ms['p10']:.2f}, {ms['p90']:.2f}] "
            f"| {_count(calls['total'])} | {families} | {t['embedding_cross_rank_bytes_per_step'] / 2**20:.2f} | {hot} |"
        )
    stages = stage_profile.markdown(results["types"])
    if stages:
        lines += ["", *stages]
    return "\n".join(lines) + "\n"


def write_outputs(spec: MicroSpec, gathered: list[dict[str, MicroRecord]]) -> None:
    results = summarize(spec, gathered)
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "micro.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown_table(results)
    (out / "micro.md").write_text(table)
    print(table, flush=True)
    print(f"wrote {out / 'micro.json'}, {out / 'micro.md'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchrec_het_bench.micro", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--types", default="", help=f"comma-separated types (default all: {','.join(MICRO_TYPES)})")
    parser.add_argument(
        "--world-size", type=int_at_least(2), default=2, help="ranks, >= 2 (sharding across ranks is what is measured)"
    )
    parser.add_argument("--out", default="micro_out", help="directory for micro.json and micro.md")
    parser.add_argument("--warmup-steps", type=int_at_least(0), help="unmeasured steps per type (overrides the preset)")
    parser.add_argument(
        "--steps-per-round", type=int_at_least(1), help="measured steps per type per round (overrides the preset)"
    )
    parser.add_argument(
        "--rounds",
        type=int_at_least(MIN_ROUNDS),
        help=f"rounds of interleaved measurement, >= {MIN_ROUNDS} (overrides the preset)",
    )
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument("--busy", type=cpu_share, default=0.0, metavar="SHARE", help=BUSY_HELP)
    parser.add_argument(
        "--profile-steps", type=int_at_least(0), default=0, metavar="N",
        help="after the measured rounds, profile N more steps of each type with torch.profiler, stage by stage",
    )  # fmt: skip
    args = parser.parse_args(argv)
    types = tuple(t.strip() for t in args.types.split(",") if t.strip()) or tuple(MICRO_TYPES)
    unknown = [t for t in types if t not in MICRO_TYPES]
    if unknown:
        parser.error(f"--types: unknown type(s) {unknown}; choose from {list(MICRO_TYPES)}")
    spec = MicroSpec(
        preset_name=args.preset,
        types=types,
        world_size=args.world_size,
        out_dir=args.out,
        warmup_steps=args.warmup_steps,
        steps_per_round=args.steps_per_round,
        rounds=args.rounds,
        seed=args.seed,
        busy_share=args.busy,
        profile_steps=args.profile_steps,
    )
    spec.preset  # noqa: B018  (bad overrides fail here, before any rank starts)
    with busy_machine(args.busy):
        spawn(spec, write_outputs, body=run_micro)
    return 0


if __name__ == "__main__":
    sys.exit(main())

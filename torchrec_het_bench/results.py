"""Turns the ranks' records into results.json (the shape later versions compare against).

Per entry (a configuration under a pipeline) it has the speed, bytes, memory and quality
fields, the pipeline (``pipeline``, ``embedding_staleness``, also in ``params``), the held-out
AUC curve (``auc_curve``: ``[[trained steps, auc], ...]``, the final AUC last), the hybrid
pipeline's ``staleness_gauge``, and ``convergence`` against stock table_wise
(:func:`convergence`). An entry its pipeline refused has ``not_run`` (the reason) instead of
measurements.
"""

import json
import os
import platform
import statistics
import subprocess
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch

from torchrec_het_bench import configs as bench_configs
from torchrec_het_bench import report, stage_profile, versus
from torchrec_het_bench.allocator import steady_allocator_available
from torchrec_het_bench.comm import EMBEDDING_PHASES, sum_totals
from torchrec_het_bench.data import binary_auc
from torchrec_het_bench.het_stats import summarize_cache
from torchrec_het_bench.prediction import prediction_error
from torchrec_het_bench.speed_intervals import counted_steps, noise_floor, round_rates
from torchrec_het_bench.step_time import STEP_PARTS, TIMED_PARTS
from torchrec_het_bench.worker import RankRecord, RunSpec
from torchrec_het_testing import warm_start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _samples_per_s(per_rank: list[RankRecord], samples_per_step: int, steps_per_round: int) -> dict:
    """Median, p10 and p90 over the counted steps, and each round's median (``rounds``,
    :mod:`~torchrec_het_bench.speed_intervals`: every window's re-warm left out)."""
    # Ranks move in lockstep (every step has collectives): a step lasts as long as its slowest rank.
    step_seconds = [max(steps) for steps in zip(*(r.step_seconds for r in per_rank))]
    rates = [samples_per_step / s for s in counted_steps(step_seconds, steps_per_round)]
    return {
        "median": statistics.median(rates),
        "p10": percentile(rates, 0.10),
        "p90": percentile(rates, 0.90),
        "rounds": round_rates(step_seconds, steps_per_round, samples_per_step),
    }


def step_ms(per_rank: list[RankRecord]) -> dict[str, float]:
    """Median over measured steps of each part of a step (mean over ranks per step), in ms.

    Parts as :mod:`torchrec_het_bench.step_time` defines them. Each part's median is taken on
    its own, so the parts' medians need not add up to the median ``total``; every one is at
    most ``total``'s, since a step's part never exceeds its total.
    """
    ranks = len(per_rank)
    per_step = []
    for steps in zip(*(zip(r.step_seconds, r.step_parts) for r in per_rank)):
        parts = {p: sum(rank_parts[i] for _, rank_parts in steps) / ranks for i, p in enumerate(TIMED_PARTS)}
        parts["total"] = sum(total for total, _ in steps) / ranks
        parts["dense"] = max(0.0, parts["total"] - sum(parts[p] for p in TIMED_PARTS))
        per_step.append(parts)
    return {p: 1e3 * statistics.median(step[p] for step in per_step) for p in STEP_PARTS}


def _bytes(
    per_rank: list[RankRecord], steps: int, host_of_rank: list[int] | None
) -> tuple[dict, dict, int | None, int | None]:
    totals = sum_totals([t for r in per_rank for t in r.comm])
    summary = totals.summary(host_of_rank)
    per_step = {k: int(round(v / steps)) for k, v in summary["phases"].items()}
    by_collective = {k: int(round(v / steps)) for k, v in summary["by_collective"].items()}
    inter = None if host_of_rank is None else int(round(summary["inter_host"] / steps))
    inter_embedding = (
        None if host_of_rank is None else int(round(totals.inter_host(host_of_rank, EMBEDDING_PHASES) / steps))
    )
    return per_step, by_collective, inter, inter_embedding


def _version(dist_name: str) -> str:
    try:
        return version(dist_name)
    except PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    fbgemm = _version("fbgemm-gpu-cpu")
    if fbgemm == "not installed":
        fbgemm = _version("fbgemm-gpu")
    return {
        "torch": torch.__version__,
        "torchrec": _version("torchrec"),
        "fbgemm_gpu": fbgemm,
        "torchrec_het": _version("torchrec-het"),
    }


def provenance() -> dict[str, str]:
    """The commit the run's code came from (with ``+dirty`` when its tree had changes) and the UTC
    date: which code a results file measured. ``unknown`` commit outside a git checkout."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        commit += "+dirty" if dirty else ""
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return {"commit": commit, "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"), "machine": machine()}


def machine() -> dict:
    """The CPU model and count: the math libraries pick their code path by CPU, so float rounding, and
    through it a run's exact losses, may differ between machines (docs/measuring.md); and whether torch's
    large buffers were backed by transparent huge pages (:data:`~torchrec_het_testing.warm_start.THP_ENV`)
    and whether the ranks' allocator thresholds were fixed (:mod:`~torchrec_het_bench.allocator`)."""
    cpu = platform.processor() or "unknown"
    try:
        names = [
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    thp = os.environ.get(warm_start.THP_ENV, "0") == "1"
    return {"cpu": cpu, "cpus": os.cpu_count(), "huge_pages": thp, "steady_allocator": steady_allocator_available()}


# The reference of ``convergence``: stock table_wise of the entry's workload.
STOCK_REFERENCE = {"dlrm": "stock_table_wise", "sequence": "seq_stock_table_wise"}
PLATEAU_FRACTION = 0.995
SYNC_PIPELINE = "sparse_dist"  # the reference's pipeline when the entry's own has no stock entry


# Why mid-run evaluation is not neutral for an entry, by sharding type (the benchmark's evaluation
# leaves every other entry's training unchanged: tests/bench/test_bench_pipelines.py).
EVALUATION_CAVEATS = {
    "het_cached_row_wise": "het_cached_row_wise lookups treat an evaluation forward as a step (their clock "
    "advances, the rows read enter the cache), so evaluating mid-run changes this entry's training",
}


def evaluation_caveat(sharding_types: list[str], curve: list) -> str | None:
    """Why this entry's mid-run evaluations (curve points before the last) changed its training, or None."""
    if len(curve) < 2:
        return None
    notes = [EVALUATION_CAVEATS[t] for t in sharding_types if t in EVALUATION_CAVEATS]
    return "; ".join(notes) or None


def _curve(per_rank: list[RankRecord]) -> list[list]:
    """``[[step, auc], ...]`` over every rank's held-out samples at each evaluation."""
    points = []
    for evaluations in zip(*(r.curve for r in per_rank)):
        step = evaluations[0][0]
        scores = torch.cat([scores for _, scores, _ in evaluations])
        labels = torch.cat([labels for _, _, labels in evaluations])
        points.append([step, binary_auc(scores, labels)])
    return points


def _gauge(per_rank: list[RankRecord]) -> dict | None:
    """The pipeline's staleness gauge: rank 0's (every rank trains the same batches in the same
    order), with ``max`` the largest over ranks and each rank's max beside it."""
    if per_rank[0].staleness_gauge is None:
        return None
    return dict(
        per_rank[0].staleness_gauge,
        max=max(r.staleness_gauge["max"] for r in per_rank),
        per_rank_max=[r.staleness_gauge["max"] for r in per_rank],
    )


def steps_to_reach(curve: list[list], target: float) -> int | None:
    """The first evaluated step whose AUC is at least ``target`` (None: none is)."""
    return next((step for step, auc in curve if auc >= target), None)


def _against(entry: dict, reference: dict) -> dict:
    plateau = max(auc for _, auc in reference["auc_curve"])
    target = PLATEAU_FRACTION * plateau
    return {
        "reference": reference["name"],
        "reference_pipeline": reference["pipeline_label"],
        "auc_minus_reference": entry["auc"] - reference["auc"],
        "plateau_auc": plateau,
        "target_auc": target,
        "steps_to_target": steps_to_reach(entry["auc_curve"], target),
        "reference_steps_to_target": steps_to_reach(reference["auc_curve"], target),
    }


def convergence(entries: list[dict]) -> None:
    """Adds ``convergence`` to every entry that ran: its final AUC minus stock table_wise's, and the
    steps it needs to reach 99.5% of stock's plateau AUC (``plateau_auc``: the largest AUC on stock's
    curve, its final point included; ``steps_to_target``: the first evaluated step at or above
    ``target_auc``, so known to ``eval_every`` steps; None: never reached).

    The reference is stock table_wise of the entry's workload under the entry's own pipeline, or
    under ``sparse_dist`` when that pipeline has no stock table_wise entry (``reference`` names it);
    none: no ``convergence``. When the reference is not under ``sparse_dist`` and stock table_wise
    under ``sparse_dist`` ran, ``convergence_vs_sparse_dist`` compares with it too (what a stale
    pipeline costs against synchronous stock).
    """
    ran = [e for e in entries if "not_run" not in e]
    stock = {(e["workload"], e["pipeline_label"]): e for e in ran if e["config"] == STOCK_REFERENCE.get(e["workload"])}
    for entry in ran:
        own = stock.get((entry["workload"], entry["pipeline_label"]))
        sync = stock.get((entry["workload"], SYNC_PIPELINE))
        reference = own or sync
        if reference is None:
            continue
        entry["convergence"] = _against(entry, reference)
        if sync is not None and reference is not sync:
            entry["convergence_vs_sparse_dist"] = _against(entry, sync)


def network_record(spec: RunSpec) -> dict:
    """The run's network as results.json records it (``mode``, and the emulated link's figures or None)."""
    emulated = spec.network["mode"] == "emulated"
    return {
        "mode": spec.network["mode"],
        "gbit": spec.network.get("gbit") if emulated else None,
        "hosts": spec.network.get("hosts", 1) if emulated else 1,
        "delay_ms": spec.network.get("delay_ms") if emulated else None,
        "delay_ms_effective": spec.network.get("delay_ms_effective") if emulated else None,
        "tcp": spec.network.get("tcp") if emulated else None,  # bulk TCP over the link (netem_measure)
        "links": spec.network.get("links"),  # what the plugin's planner measures (run_links)
    }


def summarize(spec: RunSpec, gathered: list[dict[str, RankRecord]]) -> dict:
    """The results.json document for a finished run."""
    preset = spec.preset
    emulated = spec.network["mode"] == "emulated"
    host_of_rank = list(spec.host_of_rank) if emulated else None
    entries, held_out = [], {}  # held_out: entry name -> (scores, labels), for auc_vs_stock
    for entry in spec.entries():
        name = entry.name
        per_rank = [ranks[name] for ranks in gathered]
        config = bench_configs.CONFIGS[entry.config]
        params = dict(
            config.params,
            embedding_optimizer=spec.embedding_optimizer,
            pipeline=entry.run.name,
            embedding_staleness=entry.run.embedding_staleness,
        )
        head = {
            "name": name,
            "config": entry.config,
            "pipeline": entry.run.name,
            "pipeline_label": entry.run.label,
            "embedding_staleness": entry.run.embedding_staleness,
            "stock": config.stock,
            "workload": config.workload,
            "sharding_types": per_rank[0].sharding_types,
            "params": params,
        }
        refused = next((r.not_run for r in per_rank if r.not_run), None)
        if refused is not None:
            entries.append(dict(head, not_run=refused))
            continue
        steps = len(per_rank[0].step_seconds)
        per_step, by_collective, inter_host, inter_host_embedding = _bytes(per_rank, steps, host_of_rank)
        scores = torch.cat([r.scores for r in per_rank])
        labels = torch.cat([r.labels for r in per_rank])
        held_out[name] = scores, labels
        last_round = slice(-preset.steps_per_round, None)
        batch_size = preset.batch_size_of(config.workload)
        entries.append(
            {
                **head,
                "batch_size_per_rank": batch_size,
                "samples_per_s": _samples_per_s(per_rank, batch_size * spec.world_size, preset.steps_per_round),
                "step_ms": step_ms(per_rank),
                "bytes_per_step": per_step,
                "embedding_cross_rank_by_collective": by_collective,
                "inter_host_bytes": inter_host,
                "inter_host_embedding_bytes": inter_host_embedding,
                "auc": binary_auc(scores, labels),
                "loss": statistics.fmean(loss for r in per_rank for loss in r.losses[last_round]),
                "losses": [statistics.fmean(step) for step in zip(*(r.losses for r in per_rank))],  # per measured step
                "peak_rss_mb": [round(r.peak_rss_mb, 1) for r in per_rank],
                "state_mb": [round(r.state_mb, 1) for r in per_rank],
                "measured_steps": steps,
                "auc_curve": _curve(per_rank),
            }
        )
        caveat = evaluation_caveat(per_rank[0].sharding_types, entries[-1]["auc_curve"])
        if caveat is not None:
            entries[-1]["auc_curve_caveat"] = caveat
        if per_rank[0].predicted is not None:
            entries[-1]["predicted"] = per_rank[0].predicted
            entries[-1]["prediction_error"] = prediction_error(entries[-1])
        if per_rank[0].stage_profile is not None:
            entries[-1]["stage_profile"] = stage_profile.merge_ranks([r.stage_profile for r in per_rank])
        gauge = _gauge(per_rank)
        if gauge is not None:
            entries[-1]["staleness_gauge"] = gauge
        if per_rank[0].cache_stats is not None:
            entries[-1]["cache"] = summarize_cache([r.cache_stats for r in per_rank], steps)
        if per_rank[0].replication is not None:
            entries[-1]["params"]["hot_fraction"] = round(per_rank[0].replication["hot_fraction"], 6)
            entries[-1]["replication"] = {
                key: [r.replication[key] for r in per_rank] for key in sorted(per_rank[0].replication)
            }
    results = {
        "preset": preset.name,
        "world_size": spec.world_size,
        "network": network_record(spec),
        "cpu_budget": spec.cpu.as_dict() if spec.cpu is not None else None,
        "busy_share": spec.busy_share,
        "alpha": preset.alpha,
        "batch_size_per_rank": preset.batch_size,
        "embedding_dim": preset.embedding_dim,
        "table_sizes": list(preset.table_sizes),
        "pipeline": ",".join(run.name for run in spec.pipeline_runs()),
        "pipelines": [run.label for run in spec.pipeline_runs()],
        "embedding_staleness": spec.embedding_staleness,
        "rounds": preset.rounds,
        "steps_per_round": preset.steps_per_round,
        "warmup_steps": preset.warmup_steps,
        "eval_samples": preset.eval_batches * preset.batch_size * spec.world_size,
        "eval_every": preset.eval_every,
        "data": spec.data_path or "synthetic",
        "seed": spec.seed,
        "configs": entries,
        "versions": versions(),
        **provenance(),
    }
    convergence(entries)
    versus.add_auc_vs_stock(entries, held_out)
    versus.add_speed_vs_stock(entries)
    results["noise_floor"] = noise_floor(entries)
    # The fields above the configs describe the DLRM workload; the sequence workload's own
    # sizes follow when the run has any of its configurations.
    if preset.sequence is not None and any(e["workload"] == "sequence" for e in entries):
        s = preset.sequence
        results["sequence"] = {
            "item_rows": s.item_rows,
            "category_rows": s.category_rows,
            "history_length": s.history_length,
            "min_history_length": s.min_history_length if s.min_history_length is not None else s.history_length,
            "embedding_dim": s.embedding_dim,
            "batch_size_per_rank": s.batch_size,
            "eval_samples": s.eval_batches * s.batch_size * spec.world_size,
            "data": "synthetic",
        }
    return results


def write_outputs(spec: RunSpec, gathered: list[dict[str, RankRecord]]) -> None:
    """Writes results.json, results.md and results.png into ``spec.out_dir`` and prints the table."""
    write_results(summarize(spec, gathered), Path(spec.out_dir))


def write_results(results: dict, out: Path) -> None:
    """Writes ``results`` (results.json), its tables (results.md, printed too) and plots into ``out``:
    first every entry against stock (ratios, AUC difference with its interval, verdicts), then the rest."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = versus.section(results) + report.markdown_table(results)
    (out / "results.md").write_text(table)
    report.plot(results, out / "results.png")
    if report.plot_het_tradeoff(results, out / "het_tradeoff.png"):
        print(f"wrote {out / 'het_tradeoff.png'}", flush=True)
    if report.plot_bytes_vs_memory(results, out / "bytes_vs_memory.png"):
        print(f"wrote {out / 'bytes_vs_memory.png'}", flush=True)
    if report.plot_auc_curves(results, out / "auc_curve.png"):
        print(f"wrote {out / 'auc_curve.png'}", flush=True)
    print(table, flush=True)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'results.png'}", flush=True)

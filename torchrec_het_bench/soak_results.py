"""Turns the ranks' soak series (:mod:`~torchrec_het_bench.soak`) into results.json, a verdict per entry,
a printed table and ``soak.png``.

The verdict of an entry, on every rank, from the end of the warm-up on:

- ``peak_rss_growth_pct``: how much the peak RSS (``VmHWM`` since the entry started) grew from the end
  of the warm-up to the last step, in percent of its value at the end of the warm-up; within
  :data:`RSS_GROWTH_LIMIT_PCT` it holds.
- ``heap_in_use_mb`` and ``heap_free_mb`` (glibc): the C heap's bytes in use and freed-but-kept at the end of
  the warm-up and at the end, which tell a leak (in use grows) from the allocator keeping freed memory.
- live objects (torch tensors, all gc-tracked objects): their counts at the end of the warm-up, at the
  midpoint of the measured steps and at the end, and their least-squares slope per 1,000 steps. They are
  flat when the count at the end exceeds the midpoint's by at most :data:`LIVE_SLACK`: a leak keeps
  growing in the second half, while a cache filling or a first-time initialization early on does not.
  (Last turn's exchange leak grew by 7 tensors a step: 900 over the second half of a 300-step run.)
"""

import json
from pathlib import Path

from torchrec_het_bench import configs as bench_configs
from torchrec_het_bench.results import network_record, provenance, versions
from torchrec_het_bench.soak import SoakRecord, SoakSpec
from torchrec_het_bench.worker import RunSpec

RSS_GROWTH_LIMIT_PCT = 5.0
LIVE_SLACK = {"live_tensors": 32, "gc_objects": 512}
SERIES = (
    "step",
    "rss_mb",
    "peak_rss_mb",
    "heap_in_use_mb",
    "heap_free_mb",
    "live_tensors",
    "gc_objects",
    "seconds",
    "loss",
)


def slope_per_1k_steps(steps: list[int], counts: list[float]) -> float:
    """Least-squares slope of ``counts`` against ``steps``, per 1,000 steps (0 for fewer than 2 points)."""
    if len(steps) < 2:
        return 0.0
    mean_s, mean_c = sum(steps) / len(steps), sum(counts) / len(counts)
    var = sum((s - mean_s) ** 2 for s in steps)
    return 1000 * sum((s - mean_s) * (c - mean_c) for s, c in zip(steps, counts)) / var if var else 0.0


def _live(series: list[dict], key: str, warmup: int, steps: int) -> dict:
    """Counts of ``key`` per rank at the warm-up's end, the midpoint and the end, and their slope."""
    midpoint_step = warmup + (steps - warmup) / 2
    out: dict = {"warmup": [], "midpoint": [], "end": [], "per_1k_steps": []}
    for rank in series:
        measured = [(s, c) for s, c in zip(rank["step"], rank[key]) if s >= warmup]
        out["warmup"].append(measured[0][1])
        out["midpoint"].append(next(c for s, c in measured if s >= midpoint_step))
        out["end"].append(measured[-1][1])
        out["per_1k_steps"].append(round(slope_per_1k_steps(*map(list, zip(*measured))), 2))
    out["flat"] = all(end - mid <= LIVE_SLACK[key] for end, mid in zip(out["end"], out["midpoint"]))
    return out


def verdict(series: list[dict], soak: SoakSpec) -> dict:
    """The entry's verdict (see the module docstring) from its per-rank series."""
    at_warmup = [rank["peak_rss_mb"][rank["step"].index(soak.warmup_steps)] for rank in series]
    at_end = [rank["peak_rss_mb"][-1] for rank in series]
    growth = [round(100 * (end - start) / start, 2) for start, end in zip(at_warmup, at_end)]
    tensors = _live(series, "live_tensors", soak.warmup_steps, soak.steps)
    objects = _live(series, "gc_objects", soak.warmup_steps, soak.steps)
    rss_ok = max(growth) <= RSS_GROWTH_LIMIT_PCT
    warmup_index = [rank["step"].index(soak.warmup_steps) for rank in series]
    heap = {
        key: {
            "warmup": [rank[key][i] for rank, i in zip(series, warmup_index)],
            "end": [rank[key][-1] for rank in series],
        }
        for key in ("heap_in_use_mb", "heap_free_mb")
        if all(rank.get(key) and None not in rank[key] for rank in series)  # glibc only
    }
    return {
        "peak_rss_mb": {"warmup": at_warmup, "end": at_end},
        "peak_rss_growth_pct": growth,
        **heap,
        "rss_within_limit": rss_ok,
        "live_tensors": tensors,
        "gc_objects": objects,
        "live_flat": tensors["flat"] and objects["flat"],
        "holds": rss_ok and tensors["flat"] and objects["flat"],
    }


def summarize(spec: RunSpec, soak: SoakSpec, gathered: list[dict[str, SoakRecord]]) -> dict:
    """The results.json document of a soak run."""
    preset = spec.preset
    entries = []
    for entry in spec.entries():
        per_rank = [ranks[entry.name] for ranks in gathered]
        config = bench_configs.CONFIGS[entry.config]
        head = {
            "name": entry.name,
            "config": entry.config,
            "pipeline": entry.run.name,
            "pipeline_label": entry.run.label,
            "embedding_staleness": entry.run.embedding_staleness,
            "stock": config.stock,
            "workload": config.workload,
            "sharding_types": per_rank[0].sharding_types,
            "params": dict(config.params, embedding_optimizer=spec.embedding_optimizer, pipeline=entry.run.name),
        }
        refused = next((r.not_run for r in per_rank if r.not_run), None)
        if refused is not None:
            entries.append(dict(head, not_run=refused))
            continue
        series = [{key: getattr(r, key) for key in SERIES} for r in per_rank]
        entries.append(
            dict(
                head,
                series=series,
                verdict=verdict(series, soak),
                grown_types=[r.grown_types for r in per_rank],
                peak_reset=[r.peak_reset for r in per_rank],
            )
        )
    return {
        "mode": "soak",
        "preset": preset.name,
        "world_size": spec.world_size,
        "network": network_record(spec),
        "alpha": preset.alpha,
        "batch_size_per_rank": preset.batch_size,
        "embedding_dim": preset.embedding_dim,
        "table_sizes": list(preset.table_sizes),
        "pipeline": ",".join(run.name for run in spec.pipeline_runs()),
        "pipelines": [run.label for run in spec.pipeline_runs()],
        "embedding_staleness": spec.embedding_staleness,
        "data": spec.data_path or "synthetic",
        "soak": {
            "steps": soak.steps,
            "warmup_steps": soak.warmup_steps,
            "sample_every": soak.sample_every,
            "rss_growth_limit_pct": RSS_GROWTH_LIMIT_PCT,
            "live_slack": LIVE_SLACK,
        },
        "configs": entries,
        "versions": versions(),
        **provenance(),
    }


def _ranks(values: list, fmt: str = "{:.0f}") -> str:
    return "/".join(fmt.format(v) for v in values)


def _ms_per_step(entry: dict, warmup: int) -> float:
    """Wall ms per step after warm-up: the windows between samples (slowest rank each), summed."""
    steps = entry["series"][0]["step"]
    trained, seconds = 0, 0.0
    for i in range(1, len(steps)):
        if steps[i - 1] >= warmup:
            trained += steps[i] - steps[i - 1]
            seconds += max(rank["seconds"][i] for rank in entry["series"])
    return 1e3 * seconds / trained if trained else 0.0


def _heap(v: dict) -> str:
    """MiB of the C heap in use and freed-but-kept at the warm-up's end and at the end, per rank; - without glibc."""
    if "heap_in_use_mb" not in v:
        return "-"
    use, free = v["heap_in_use_mb"], v["heap_free_mb"]
    return f"in use {_ranks(use['warmup'])} -> {_ranks(use['end'])}; free {_ranks(free['warmup'])} -> {_ranks(free['end'])}"


def _verdict_words(v: dict) -> str:
    problems = []
    if not v["rss_within_limit"]:
        words = f"peak RSS +{max(v['peak_rss_growth_pct']):.1f}% > {RSS_GROWTH_LIMIT_PCT:g}%"
        if "heap_in_use_mb" in v:
            use = [end - start for start, end in zip(v["heap_in_use_mb"]["warmup"], v["heap_in_use_mb"]["end"])]
            free = [end - start for start, end in zip(v["heap_free_mb"]["warmup"], v["heap_free_mb"]["end"])]
            words += f" (heap in use {_ranks(use, '{:+.1f}')} MiB, freed but kept {_ranks(free, '{:+.1f}')} MiB)"
        problems.append(words)
    for key, what in (("live_tensors", "tensors"), ("gc_objects", "gc objects")):
        if not v[key]["flat"]:
            problems.append(f"live {what} grow")
    return "holds" if not problems else "; ".join(problems)


def markdown_table(results: dict) -> str:
    """The verdict per entry (values per rank, ``rank0/rank1/...``), then the series at a few steps."""
    soak = results["soak"]
    lines = [
        f"soak: preset `{results['preset']}`, {results['world_size']} ranks, every entry trained {soak['steps']} steps "
        f"alone, warm-up {soak['warmup_steps']}, sampled every {soak['sample_every']}; growth from the end of the "
        f"warm-up; live objects flat: end - midpoint <= {soak['live_slack']['live_tensors']} tensors and "
        f"<= {soak['live_slack']['gc_objects']} gc objects on every rank; peak RSS growth limit "
        f"{soak['rss_growth_limit_pct']:g}%",
        "",
        "| entry | sharding | peak RSS MiB warm-up -> end | peak RSS growth % | C heap MiB warm-up -> end "
        "| live tensors warm-up -> mid -> end | tensors / 1k steps | gc objects warm-up -> end | gc objects / 1k steps "
        "| ms/step | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["configs"]:
        if "not_run" in c:
            continue
        v = c["verdict"]
        t, g = v["live_tensors"], v["gc_objects"]
        lines.append(
            f"| {c['name']} | {'+'.join(c['sharding_types'])} "
            f"| {_ranks(v['peak_rss_mb']['warmup'])} -> {_ranks(v['peak_rss_mb']['end'])} "
            f"| {_ranks(v['peak_rss_growth_pct'], '{:+.2f}')} | {_heap(v)} "
            f"| {_ranks(t['warmup'])} -> {_ranks(t['midpoint'])} -> {_ranks(t['end'])} | {_ranks(t['per_1k_steps'], '{:+.1f}')} "
            f"| {_ranks(g['warmup'])} -> {_ranks(g['end'])} | {_ranks(g['per_1k_steps'], '{:+.1f}')} "
            f"| {_ms_per_step(c, soak['warmup_steps']):.1f} | {_verdict_words(v)} |"
        )
    for c in results["configs"]:
        if "not_run" in c:
            lines += ["", f"not run: {c['name']}: {c['not_run']}"]
        elif not c["verdict"]["live_flat"]:
            grown = ", ".join(f"{name} +{count}" for name, count in c["grown_types"][0])
            lines += ["", f"{c['name']}: live types grown most after warm-up (rank 0): {grown}"]
    return "\n".join(lines + ["", *over_time(results)]) + "\n"


def over_time(results: dict, points: int = 7) -> list[str]:
    """Lines of a table: peak RSS MiB and live tensors (max over ranks) at ``points`` sampled steps."""
    ran = [c for c in results["configs"] if "not_run" not in c]
    if not ran:
        return []
    steps = ran[0]["series"][0]["step"]
    chosen = sorted({steps[round(i * (len(steps) - 1) / (points - 1))] for i in range(points)})
    lines = [
        "peak RSS MiB / live tensors (max over ranks) by trained step (warm-up: tensors not counted, -)",
        "",
        "| step | " + " | ".join(c["name"] for c in ran) + " |",
        "|---|" + "---|" * len(ran),
    ]
    for step in chosen:
        cells = []
        for c in ran:
            at = [r["step"].index(step) for r in c["series"]]
            peak = max(r["peak_rss_mb"][i] for r, i in zip(c["series"], at))
            tensors = [r["live_tensors"][i] for r, i in zip(c["series"], at)]
            cells.append(f"{peak:.0f} / {'-' if None in tensors else max(tensors)}")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return lines


def plot(results: dict, path: Path) -> bool:
    """Peak RSS (max over ranks) and the change of live tensors since the warm-up against trained steps,
    one line per entry; False (nothing written) when no entry ran."""
    ran = [c for c in results["configs"] if "not_run" not in c]
    if not ran:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from torchrec_het_bench.report import save_figure

    fig, (ax_rss, ax_live) = plt.subplots(1, 2, figsize=(12, 4.5))
    warmup = results["soak"]["warmup_steps"]
    for c in ran:
        series = c["series"]
        steps = series[0]["step"]
        ax_rss.plot(steps, [max(v) for v in zip(*(r["peak_rss_mb"] for r in series))], label=c["name"])
        # Each rank's count minus its own at the end of the warm-up; the larger change of the ranks.
        changes = [
            [n - r["live_tensors"][r["step"].index(warmup)] for n in r["live_tensors"] if n is not None] for r in series
        ]
        counted = [s for s in steps if s >= warmup]
        ax_live.plot(counted, [max(v, key=abs) for v in zip(*changes)], marker="o", markersize=2, label=c["name"])
    for ax in (ax_rss, ax_live):
        ax.axvline(warmup, color="gray", linestyle=":", linewidth=1)
        ax.set_xlabel("trained steps (dotted: end of warm-up)")
        ax.legend(fontsize=7)
    ax_rss.set_ylabel("peak RSS MiB (max over ranks)")
    ax_rss.set_title("peak RSS")
    ax_live.set_ylabel("live torch tensors - at end of warm-up")
    ax_live.set_title("live tensors since warm-up (rank of the larger change)")
    fig.suptitle(f"soak: preset {results['preset']}, {results['world_size']} ranks, {results['soak']['steps']} steps")
    save_figure(fig, path)
    return True


def write_outputs(spec: RunSpec, gathered: list[dict[str, SoakRecord]], soak: SoakSpec) -> None:
    """Writes results.json, results.md and soak.png into ``spec.out_dir`` and prints the table."""
    results = summarize(spec, soak, gathered)
    out = Path(spec.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    table = markdown_table(results)
    (out / "results.md").write_text(table)
    written = ["results.json", "results.md"] + (["soak.png"] if plot(results, out / "soak.png") else [])
    print(table)
    print(f"wrote {', '.join(str(out / name) for name in written)}")

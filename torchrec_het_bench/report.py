"""Human-readable outputs of a benchmark run: markdown tables and PNG plots.

Rows are entries (a configuration under a pipeline); entries a pipeline refused are listed
under the first table with the reason, and left out of the others and of the plots.
"""

from pathlib import Path

from torchrec_het_bench import stage_profile

PHASES = ("fwd_ids", "fwd_emb", "bwd_grad", "dense_allreduce", "other")


def format_mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def cpu_line(budget: dict | None, busy_share: float | None, network: dict | None = None) -> str:
    """One line: how the ranks shared the machine's cores, and the share busy processes took from them."""
    if budget is None:
        line = "not recorded (a run before the one CPU budget: each rank took cores // ranks per host threads"
        emulated = network is not None and network.get("mode") == "emulated"
        return line + (", so the ranks of emulated hosts oversubscribed the cores)" if emulated else ")")
    line = (f"{budget['ranks_on_machine']} ranks x {budget['threads_per_rank']} intra-op thread(s) on "
            f"{budget['cores']} cores")  # fmt: skip
    if budget.get("oversubscribed"):
        line += " (oversubscribed: speeds depend on what else runs)"
    if busy_share:
        line += f"; busy processes took {busy_share:.0%} of every core (--busy)"
    return line


def links_line(network: dict) -> str | None:
    """One line for the report: the measured figures beside the emulated link's rate (None: not recorded)."""
    links = network.get("links")
    if links is None:
        return None
    parts = []
    for kind, where in (("intra", "within a host"), ("inter", "between hosts")):
        if links[f"{kind}_source"] == "measured":
            parts.append(f"{where} {links[f'{kind}_gbit']:.3g} Gbit/s")
    one_way = links.get("probe", {}).get("inter_one_way")
    if one_way is not None:
        parts.append(f"one way between hosts {one_way['gbit']:.3g} Gbit/s")
    line = "links measured at plan time (per rank, all ranks sending at once): " + (
        ", ".join(parts) or "nothing to measure"
    )
    if network.get("mode") == "emulated":
        line += f"; emulated link {network['gbit']:g} Gbit/s each way"
        tcp = network.get("tcp")
        if tcp is not None:
            line += f", bulk TCP {tcp['one_way_gbit']:.3g} Gbit/s one way, {tcp['both_ways_gbit']:.3g} each way both at once"
    return line


def by_workload(configs: list[dict]) -> list[dict]:
    """The entries that ran, grouped by workload (workloads in order of first appearance, entries in run order)."""
    configs = ran(configs)
    order = list(dict.fromkeys(c.get("workload", "dlrm") for c in configs))
    return [c for w in order for c in configs if c.get("workload", "dlrm") == w]


def ran(configs: list[dict]) -> list[dict]:
    """The entries that ran (not those their pipeline refused)."""
    return [c for c in configs if "not_run" not in c]


def network_words(net: dict) -> str:
    """``loopback`` or ``2 emulated hosts at 1.25 Gbit/s`` (a results.json ``network``)."""
    return "loopback" if net["mode"] == "loopback" else f"{net['hosts']} emulated hosts at {net['gbit']} Gbit/s"


def pipeline_words(results: dict) -> str:
    """``pipeline `sparse_dist``` for a run with one pipeline, else the list with k."""
    labels = results.get("pipelines") or [results.get("pipeline", "plain")]
    if len(labels) == 1:
        return f"pipeline `{labels[0]}`"
    return "pipelines " + ", ".join(f"`{label}`" for label in labels) + " (entries are config@pipeline)"


def het_hit_rate(entry: dict) -> str:
    """The HET cache's hit rate over distinct remote ids, the ideal LRU's in parentheses; blank without a HET cache."""
    cache = entry.get("cache")
    if cache is None:
        return ""
    return f"{cache['hit_rate_unique']:.1%} ({cache['ideal_lru_hit_rate_unique']:.1%})"


def hot_row_share(entry: dict) -> str:
    """The share of rows replicated as hot (``het_row_replicated``); blank for other types."""
    share = entry["params"].get("hot_fraction")
    return "" if share is None else f"{share:.2%}"


def markdown_table(results: dict, curve_plot: str | None = "auc_curve.png") -> str:
    """One row per configuration, grouped by workload: speed, bytes per step (MiB, summed over ranks), the HET
    cache's hit rate and the replicated share of rows (blank where the entry has neither), quality, memory.

    Args:
        curve_plot: the AUC curves' plot the convergence table cites (written beside results.md), or None
            where no plot goes with the table (docs/benchmarks.md shows the curves as a table instead).
    """
    net = results["network"]
    where = network_words(net)
    lines = [
        f"preset `{results['preset']}`, {results['world_size']} ranks, {where}, {pipeline_words(results)}; "
        "bytes are MiB per step summed over ranks (cross-rank, without a rank's chunk to itself)",
        "",
        "CPU: " + cpu_line(results.get("cpu_budget"), results.get("busy_share"), net),
        "",
        "| workload | config | sharding | samples/s median [p10, p90] | fwd ids | fwd emb | bwd grad | dense allreduce "
        "| other | embedding cross-rank | inter-host | HET hit rate (ideal LRU) | hot rows | AUC | loss | peak RSS MiB/rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    links = links_line(net)
    if links is not None:
        lines[1:1] = ["", links]
    for c in by_workload(results["configs"]):
        b = c["bytes_per_step"]
        sps = c["samples_per_s"]
        rss = "/".join(f"{m:.0f}" for m in c["peak_rss_mb"])
        lines.append(
            f"| {c.get('workload', 'dlrm')} | {c['name']} | {'+'.join(c['sharding_types'])} "
            f"| {sps['median']:.0f} [{sps['p10']:.0f}, {sps['p90']:.0f}] "
            + "| "
            + " | ".join(format_mib(b[p]) for p in PHASES)
            + f" | {format_mib(b['embedding_cross_rank'])} | {format_mib(c['inter_host_bytes'])}"
            f" | {het_hit_rate(c)} | {hot_row_share(c)} | {c['auc']:.4f} | {c['loss']:.4f} | {rss} |"
        )
    refused = [c for c in results["configs"] if "not_run" in c]
    if refused:
        lines.append("")
        lines += [f"not run: {c['name']}: {c['not_run']}" for c in refused]
    lines += ["", *step_time_table(results)]
    stages = stage_profile.markdown(results["configs"])
    if stages:
        lines += ["", *stages]
    lines += ["", *convergence_table(results, curve_plot)]
    if "sequence" in results:
        s = results["sequence"]
        lines += [
            "",
            f"sequence workload: item table {s['item_rows']} rows, category table {s['category_rows']} rows, "
            f"dim {s['embedding_dim']}, histories of {s['min_history_length']}..{s['history_length']} ids, "
            f"batch {s['batch_size_per_rank']} per rank",
        ]
    return "\n".join(lines) + "\n"


STEP_COLUMNS = (
    ("emb_fwd", "emb fwd"),
    ("emb_bwd", "emb bwd"),
    ("dense", "dense"),
    ("comm_wait", "comm wait"),
    ("total", "total"),
)


def step_time_table(results: dict) -> list[str]:
    """Lines of the step-time table: ms per step per part (median over measured steps, mean over ranks)."""
    lines = [
        f"step time, ms per step (median over measured steps of the mean over ranks; {pipeline_words(results)}; "
        "each part's median on its own, so parts need not add up to total)",
        "",
        "| workload | config | " + " | ".join(title for _, title in STEP_COLUMNS) + " |",
        "|---|---|" + "---|" * len(STEP_COLUMNS),
    ]
    for c in by_workload(results["configs"]):
        ms = c.get("step_ms")
        cells = " | ".join("-" if ms is None else f"{ms[key]:.2f}" for key, _ in STEP_COLUMNS)
        lines.append(f"| {c.get('workload', 'dlrm')} | {c['name']} | {cells} |")
    return lines


def format_auc(value: float | None) -> str:
    """An AUC to 4 decimals, ``-`` where there is none."""
    return "-" if value is None else f"{value:.4f}"


def _delta(value: float | None) -> str:
    return "-" if value is None else f"{value:+.4f}"


def _steps(value: int | None) -> str:
    return "never" if value is None else str(value)


def _against(c: dict, key: str) -> tuple[str, str, str]:
    """(reference, final AUC minus its, steps to 99.5% of its plateau (its own steps)) of ``c[key]``."""
    conv = c.get(key)
    if conv is None:
        return "-", "-", "-"
    steps = f"{_steps(conv['steps_to_target'])} ({_steps(conv['reference_steps_to_target'])})"
    delta = _delta(conv["auc_minus_reference"])
    if "auc_half_width" in conv:  # the 95% interval's half-width (torchrec_het_bench.versus)
        delta += f" ± {conv['auc_half_width']:.4f}"
    return conv["reference"], delta, steps


def convergence_table(results: dict, curve_plot: str | None = "auc_curve.png") -> list[str]:
    """Lines of the convergence table: final AUC, the hybrid pipeline's staleness gauge (max), and per entry
    its final AUC minus stock table_wise's and the steps to 99.5% of stock's plateau AUC (``curve_plot``: as
    for :func:`markdown_table`)."""
    every = results.get("eval_every") or 0
    curves = has_auc_curves(results)
    lines = [
        "convergence: held-out AUC "
        + (f"every {every} trained steps and after the last" if every else "after the last step")
        + (f" (auc_curve, {curve_plot})" if curves and curve_plot else " (auc_curve)")
        + "; plateau = the largest AUC on stock table_wise's curve; steps to 99.5% = "
        "the first evaluated step at or above 99.5% of that plateau (stock's own in parentheses); reference: "
        "stock table_wise under the entry's pipeline, or under sparse_dist when that pipeline has none; "
        "the last two columns compare with stock table_wise under sparse_dist where the reference is another "
        "pipeline's; AUC differences ± the half-width of their 95% interval where recorded (as in the table against "
        "stock); staleness max: the most embedding updates a trained batch's read missed (hybrid's gauge)",
        "",
        "| workload | entry | pipeline | k | staleness max | final AUC | reference | AUC - ref | steps to 99.5% "
        "| AUC - sparse_dist stock | steps to 99.5% (sparse_dist) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    caveats = []
    for c in by_workload(results["configs"]):
        gauge = c.get("staleness_gauge")
        reference, delta, steps = _against(c, "convergence")
        _, sync_delta, sync_steps = _against(c, "convergence_vs_sparse_dist")
        mark = " *" if "auc_curve_caveat" in c else ""
        if mark:
            caveats.append(f"* {c['name']}: {c['auc_curve_caveat']}")
        lines.append(
            f"| {c.get('workload', 'dlrm')} | {c['name']}{mark} | {c.get('pipeline', '-')} | {c.get('embedding_staleness', '-')} "
            f"| {'-' if gauge is None else gauge['max']} | {format_auc(c['auc'])} | {reference} | {delta} | {steps} "
            f"| {sync_delta} | {sync_steps} |"
        )
    return lines + ([""] + caveats if caveats else [])


def plot(results: dict, path: Path) -> None:
    """Bytes per step by phase (stacked) and samples/s, one bar per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = by_workload(results["configs"])
    names = [c["name"] for c in configs]
    fig, (ax_bytes, ax_speed) = plt.subplots(1, 2, figsize=(4 + 1.6 * len(names), 4.5))
    bottom = [0.0] * len(names)
    for phase in PHASES:
        heights = [c["bytes_per_step"][phase] / 2**20 for c in configs]
        ax_bytes.bar(names, heights, bottom=bottom, label=phase)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax_bytes.set_ylabel("MiB per step (cross-rank, all ranks)")
    ax_bytes.set_title("bytes per phase (lower is better)")
    # Explicit headroom: autoscaling ends the axis at the tallest stack (its top edge clipped), and the
    # legend (one row of columns above the bars) needs room of its own.
    ax_bytes.set_ylim(0, max(bottom, default=0.0) * 1.3 or 1.0)
    ax_bytes.legend(fontsize=8, ncols=3, loc="upper center")
    medians = [c["samples_per_s"]["median"] for c in configs]
    low = [m - c["samples_per_s"]["p10"] for m, c in zip(medians, configs)]
    high = [c["samples_per_s"]["p90"] - m for m, c in zip(medians, configs)]
    ax_speed.bar(names, medians, yerr=[low, high], capsize=4, color="tab:gray")
    ax_speed.set_ylim(0, max((c["samples_per_s"]["p90"] for c in configs), default=0.0) * 1.1 or 1.0)
    ax_speed.set_ylabel("samples/s (median, p10-p90)")
    ax_speed.set_title("throughput (higher is better)")
    for ax in (ax_bytes, ax_speed):
        ax.tick_params(axis="x", rotation=30)
    net = results["network"]
    where = "loopback" if net["mode"] == "loopback" else f"{net['hosts']} hosts @ {net['gbit']} Gbit/s"
    fig.suptitle(f"preset {results['preset']}, {results['world_size']} ranks, {where}")
    save_figure(fig, path)


def save_figure(fig, path: Path) -> None:
    """Lays the figure out, writes it to ``path`` and frees it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _staleness_size(bound: int) -> float:
    """Marker area (points^2) of a HET entry with staleness bound ``bound``: grows with its square root."""
    return 30 + 48 * min(bound, 100) ** 0.5


def plot_het_tradeoff(results: dict, path: Path) -> bool:
    """Embedding bytes vs AUC of the HET configurations (marker size: staleness bound), stock as lines;
    better is up and left (higher AUC, fewer bytes).

    Returns False (and writes nothing) when the run has no HET configuration.
    """
    het = [c for c in ran(results["configs"]) if c["params"].get("sharding") == "het_cached_row_wise"]
    if not het:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for protocol, marker in (("het", "o"), ("lease", "s")):
        for capacity, color in ((0.01, "tab:orange"), (0.1, "tab:blue")):
            group = [c for c in het if c["params"]["protocol"] == protocol and c["params"]["capacity"] == capacity]
            if not group:
                continue
            xs = [c["bytes_per_step"]["embedding_cross_rank"] / 2**20 for c in group]
            ys = [c["auc"] for c in group]
            sizes = [_staleness_size(c["params"]["s_read"]) for c in group]
            ax.scatter(
                xs, ys, s=sizes, marker=marker, color=color, alpha=0.8, label=f"{protocol}, {capacity:.0%} cache"
            )
            for c, x, y in zip(group, xs, ys):
                ax.annotate(f"s={c['params']['s_read']}", (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
    for bound in (0, 10, 100):  # the size key, as empty gray markers
        ax.scatter(
            [], [], s=_staleness_size(bound), facecolors="none", edgecolors="gray", label=f"staleness bound s={bound}"
        )
    for c in ran(results["configs"]):
        if c["stock"] and c.get("workload", "dlrm") == "dlrm":
            ax.axvline(c["bytes_per_step"]["embedding_cross_rank"] / 2**20, color="gray", linestyle=":", linewidth=1)
            ax.axhline(c["auc"], color="gray", linestyle=":", linewidth=1)
            ax.annotate(c["name"], (c["bytes_per_step"]["embedding_cross_rank"] / 2**20, c["auc"]), fontsize=7)
    ax.set_xlim(left=0)
    ax.set_xlabel("embedding bytes per step, MiB (cross-rank, all ranks; fewer is better)")
    ax.set_ylabel("held-out AUC (higher is better)")
    ax.set_title(f"HET: bytes vs AUC, better up and left (preset {results['preset']}, alpha {results.get('alpha')})")
    ax.legend(fontsize=8, labelspacing=1.2, borderpad=0.8)
    save_figure(fig, path)
    return True


_MARKERS = "osD^vP*Xhp<>"


def plot_bytes_vs_memory(results: dict, path: Path) -> bool:
    """Embedding bytes per step against model state per rank (max over ranks), one panel per workload,
    for every entry of a run where one has row-replicated tables (the planner's choice included); better is
    down and left.

    Each entry has its own marker in the legend (entries of equal memory sit on top of each other,
    so their names are not written beside the points). The axes start at 0, so an entry's distance
    from another reads as a share of its memory and bytes.

    Returns False (and writes nothing) when no entry has row-replicated tables.
    """
    configs = ran(results["configs"])
    if not any("het_row_replicated" in c["sharding_types"] for c in configs):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({c.get("workload", "dlrm") for c in configs})
    fig, axes = plt.subplots(1, len(workloads), figsize=(7.5 * len(workloads), 5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        entries = [c for c in configs if c.get("workload", "dlrm") == workload]
        for index, c in enumerate(entries):
            x, y = max(c["state_mb"]), c["bytes_per_step"]["embedding_cross_rank"] / 2**20
            replicated = "het_row_replicated" in c["sharding_types"]
            ax.scatter(
                [x],
                [y],
                marker=_MARKERS[index % len(_MARKERS)],
                s=60,
                alpha=0.75,
                label=c["name"] + (" (hot rows on every rank)" if replicated else ""),
            )
        ax.set_xlim(0, max(max(c["state_mb"]) for c in entries) * 1.15 or 1.0)
        ax.set_ylim(0, max(c["bytes_per_step"]["embedding_cross_rank"] for c in entries) / 2**20 * 1.15 or 1.0)
        ax.legend(fontsize=8, loc="lower left")
        ax.set_xlabel(
            "model state per rank, MiB (max over ranks; less is better)\nweights + optimizer state, replicas included"
        )
        ax.set_ylabel("embedding bytes per step, MiB (fewer is better)\ncross-rank, summed over ranks")
        ax.set_title(f"{workload}: bytes vs memory, better down and left (preset {results['preset']})")
    save_figure(fig, path)
    return True


def has_auc_curves(results: dict) -> bool:
    """Whether an entry has two AUC points or more: then :func:`plot_auc_curves` writes auc_curve.png."""
    return any(len(c.get("auc_curve", [])) >= 2 for c in ran(results["configs"]))


def plot_auc_curves(results: dict, path: Path) -> bool:
    """Held-out AUC against trained steps, one line per entry (legend), one panel per workload; stock
    table_wise's plateau and 99.5% of it as horizontal lines where the run has it.

    Returns False (and writes nothing) when no entry has two points or more.
    """
    if not has_auc_curves(results):
        return False
    configs = [c for c in by_workload(results["configs"]) if len(c.get("auc_curve", [])) >= 2]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(c.get("workload", "dlrm") for c in configs))
    fig, axes = plt.subplots(1, len(workloads), figsize=(7.5 * len(workloads), 5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        plateaus = {}
        for c in (c for c in configs if c.get("workload", "dlrm") == workload):
            steps, aucs = zip(*c["auc_curve"])
            ax.plot(steps, aucs, marker="o", markersize=3, linewidth=1.2, label=c["name"])
            conv = c.get("convergence")
            if conv is not None:
                plateaus[conv["reference"]] = conv["plateau_auc"], conv["target_auc"]
        for reference, (plateau, target) in plateaus.items():
            ax.axhline(plateau, color="gray", linestyle="--", linewidth=0.8)
            ax.axhline(target, color="gray", linestyle=":", linewidth=0.8)
            ax.annotate(
                f"{reference} plateau (dashed), 99.5% (dotted)",
                (0, plateau),
                fontsize=7,
                xytext=(2, 3),
                textcoords="offset points",
                color="gray",
            )
        ax.set_xlabel("trained steps (warm-up included)")
        ax.set_ylabel("held-out AUC (higher is better)")
        ax.set_title(f"{workload}: held-out AUC (preset {results['preset']})")
        ax.legend(fontsize=7)
    save_figure(fig, path)
    return True

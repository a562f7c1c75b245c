"""The first screen of docs/benchmarks.md: each setting's current claim and a picture of it.

A setting is a preset, a network and the pipelines it ran under. Its *current* run is the latest in
page order that measured its own noise (results.json ``noise_floor``: the A/A pairs). Each entry of that
run gets its speed over stock table_wise and over the fastest stock entry (quantized comms included),
paired round by round with the 95% interval, and the range of its ratio to stock table_wise over every
run of the setting that has both.
"""

from pathlib import Path

from torchrec_het_bench import report, versus
from torchrec_het_bench.auc_intervals import verdict_word
from torchrec_het_bench.docs_ranges import STOCK, pair_speed, setting_of, span, stock_of
from torchrec_het_bench.speed_intervals import SpeedRatio, is_twin


def current_runs(runs: list[dict]) -> list[dict]:
    """The latest run of each setting that recorded its A/A pairs, in the order the settings first appear."""
    latest: dict[tuple, dict] = {}
    for results in runs:
        if results.get("noise_floor") and not results.get("busy_share"):
            latest[setting_of(results)] = results
    return list(latest.values())


def _setting_title(results: dict) -> str:
    return f"{report.network_words(results['network'])}, {results['preset']} preset, {report.pipeline_words(results)}"


def ratios_over_runs(runs: list[dict], setting: tuple, name: str) -> list[float]:
    """The entry's ratio to stock table_wise in every run of ``setting`` (not slowed) that has both."""
    out = []
    for results in runs:
        if setting_of(results) != setting or results.get("busy_share") or results.get("mode") == "soak":
            continue
        ratio = pair_speed(results, name, stock_of(results))[0]
        if ratio is not None:
            out.append(ratio)
    return out


def claims(results: dict, runs: list[dict]) -> list[dict]:
    """One row per entry of the current run but stock table_wise and the twins: ``name``, ``vs_stock``
    (:class:`SpeedRatio` or None), ``best`` (the fastest stock entry's name, or None where it is the
    entry itself), ``vs_best`` and ``over_runs`` (the ratios to stock table_wise over the setting's runs)."""
    stock = stock_of(results)
    entries = {c["name"]: c for c in report.ran(results["configs"])}
    rows = []
    for c in report.by_workload(results["configs"]):
        name = c["name"]
        if name == stock or name not in entries or is_twin(c.get("config", name)):
            continue
        fastest = versus.fastest_stock(results, c)
        best = None if fastest is None or fastest["name"] in (name, stock) else fastest["name"]
        rows.append(
            {
                "name": name,
                "stock": bool(c.get("stock")),
                "vs_stock": pair_speed(results, name, stock)[1],
                "best": best,
                "vs_best": None if best is None else pair_speed(results, name, best)[1],
                "over_runs": ratios_over_runs(runs, setting_of(results), name),
            }
        )
    return rows


def _text(ratio: SpeedRatio | None) -> str:
    return "-" if ratio is None else f"{ratio.text()} {ratio.word()}"


def _range(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{span(values)} ({len(values)} run{'s' if len(values) > 1 else ''})"


def render_claims(runs: list[dict], picture: str | None) -> str:
    """The section (empty when no run recorded its A/A pairs); ``picture``: the image beside the page."""
    current = current_runs(runs)
    if not current:
        return ""
    lines = [
        "## Current claims",
        "",
        "Each setting's latest run that measured its own noise. Speeds are samples/s ratios, paired round by "
        "round, with their 95% interval; *faster* or *slower* where the interval excludes 1. The A/A pairs are "
        "the same configuration measured twice in the run: a ratio inside their spread is not a claim. "
        "How they are measured: [measuring.md](measuring.md#speed-ratios-their-intervals-and-the-runs-noise-floor).",
    ]
    for results in current:
        noise = "; ".join(f"{n['twin']} {SpeedRatio(n['ratio'], n['low'], n['high'], n['rounds']).text()}"
                          for n in results["noise_floor"])  # fmt: skip
        lines += [
            "",
            f"### {_setting_title(results)}",
            "",
            f"Run of {results.get('commit', '?')} ({results.get('date', '?')}), {results['rounds']} rounds; A/A: {noise}.",
            "",
            f"| entry | × {stock_of(results)} | × the fastest stock entry | × {STOCK} over runs |",
            "|---|---|---|---|",
        ]
        for row in claims(results, runs):
            best = "-" if row["best"] is None else f"{_text(row['vs_best'])} ({row['best']})"
            lines.append(f"| {row['name']} | {_text(row['vs_stock'])} | {best} | {_range(row['over_runs'])} |")
    if picture:
        lines += ["", f"![Current claims: each entry's speed over stock table_wise]({picture})"]
    return "\n".join(lines) + "\n"


def render_trained_auc(runs: list[dict]) -> str:
    """The latest converge-preset run over several seeds: each entry's held-out AUC where training ends,
    against stock table_wise (paired over the seeds; empty without such a run)."""
    trained = [r for r in runs if r.get("preset") == "converge" and len(r.get("seeds") or ()) > 1]
    if not trained:
        return ""
    results = trained[-1]
    steps = results["warmup_steps"] + results["rounds"] * results["steps_per_round"]
    lines = [
        "## AUC where training ends",
        "",
        f"The converge preset, {steps} steps, seeds {', '.join(map(str, results['seeds']))}, run of "
        f"{results.get('commit', '?')} ({results.get('date', '?')}): mean held-out AUC, and its difference from "
        f"{STOCK}'s with the 95% interval paired over the seeds (*equal* where it holds 0). An early AUC (the "
        "default preset's, after a few hundred steps) says less about where a codec ends up.",
        "",
        f"| entry | tables | AUC | AUC − {STOCK} |",
        "|---|---|---|---|",
    ]
    for c in report.ran(results["configs"]):
        diff = versus.auc_difference(c)
        text = "-" if diff is None else f"{versus.signed(diff.difference)} ± {diff.half_width:.4f} {verdict_word(diff)}"
        lines.append(f"| {c['name']} | {', '.join(c.get('sharding_types', []))} | {c['auc']:.4f} | {text} |")
    return "\n".join(lines) + "\n"


def plot_claims(runs: list[dict], path: Path) -> bool:
    """Draws the current claims (one panel per setting: each entry's ratio to stock table_wise with its
    interval, earlier runs' ratios as dots, the A/A intervals shaded) to ``path``; False when none."""
    current = current_runs(runs)
    if not current:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heights = [len(claims(r, runs)) for r in current]
    fig, axes = plt.subplots(len(current), 1, figsize=(7.5, 1.0 + 0.38 * sum(heights) + 0.6 * len(current)),
                             gridspec_kw={"height_ratios": [h + 1.5 for h in heights]}, squeeze=False)  # fmt: skip
    for ax, results in zip(axes[:, 0], current):
        rows = claims(results, runs)
        low = min((n["low"] for n in results["noise_floor"]), default=1.0)
        high = max((n["high"] for n in results["noise_floor"]), default=1.0)
        ax.axvspan(low, high, color="0.85", label="A/A intervals")
        ax.axvline(1.0, color="0.4", lw=0.8)
        for y, row in enumerate(rows):
            for value in row["over_runs"]:
                ax.plot(value, y, "o", color="0.6", ms=3)
            ratio = row["vs_stock"]
            if ratio is not None:
                colour = "tab:gray" if row["stock"] else "tab:blue"
                ax.errorbar(ratio.ratio, y, xerr=[[ratio.ratio - ratio.low], [ratio.high - ratio.ratio]],
                            fmt="s", color=colour, capsize=3)  # fmt: skip
        ax.set_yticks(range(len(rows)), [r["name"] for r in rows])
        ax.invert_yaxis()
        ax.set_title(_setting_title(results).replace("`", ""), fontsize=9)
        ax.set_xlabel(f"samples/s × {stock_of(results)} (this run: square and 95% interval; earlier runs: dots)",
                      fontsize=8)  # fmt: skip
        ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True

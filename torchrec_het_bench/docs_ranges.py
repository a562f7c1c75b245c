"""Claims as ranges (docs/benchmarks.md): every entry against stock table_wise over consecutive runs of
one setting, beside the same runs on a busier machine and each entry trained alone.

A *series* is the runs of one setting (preset, network, pipelines, entries) taken under the one CPU
budget (``cpu_budget`` recorded): those with ``busy_share`` 0 give the range a user gets, those with
``busy_share`` > 0 the slowed figure. Runs of a single entry on the same network are that entry
*alone*; an alone run of an entry over the alone run of stock table_wise taken next to it is what a
user running only that entry gets against stock, compared with the entry's ratio in company.
"""

from torchrec_het_bench import report, versus
from torchrec_het_bench.speed_intervals import speed_over

STOCK = "stock_table_wise"


def setting_of(results: dict) -> tuple:
    net = results.get("network") or {}
    return (
        results.get("preset"),
        net.get("mode"),
        net.get("hosts"),
        net.get("gbit"),
        tuple(results.get("pipelines") or []),
    )


def pair_speed(results: dict, name: str, base: str) -> tuple:
    """:func:`~torchrec_het_bench.speed_intervals.speed_over` of the run's entries ``name`` and ``base``
    ((None, None) where the run lacks one): paired over rounds where recorded, as the run's verdicts."""
    entries = {c["name"]: c for c in report.ran(results["configs"])}
    if name not in entries or base not in entries:
        return None, None
    return speed_over(entries[name], entries[base])


def _ratio(results: dict, name: str, base: str = STOCK) -> float | None:
    """The entry's samples/s over ``base``'s (stock table_wise) in the same run."""
    return pair_speed(results, name, base)[0]


def _cell(results: dict, name: str, base: str) -> str:
    """One run's ratio as the table shows it, with its 95% interval where the run recorded its rounds."""
    ratio, paired = pair_speed(results, name, base)
    if paired is not None:
        return paired.text()
    return "-" if ratio is None else f"{ratio:.2f}×"


def stock_of(results: dict) -> str:
    """The entry the run's ratios are taken against: stock table_wise, under TorchRec's
    ``TrainPipelineSparseDist`` where entries are config@pipeline."""
    names = {c["name"] for c in report.ran(results["configs"])}
    for name in (STOCK, f"{STOCK}@sparse_dist"):
        if name in names:
            return name
    return next((n for n in sorted(names) if n.startswith(f"{STOCK}@")), STOCK)


def _same_codecs_rows(results: dict) -> list[tuple[str, str]]:
    """(plugin entry, stock table_wise under the same quantized comms) of a run's entries run under codecs."""
    out = []
    for c in report.ran(results["configs"]):
        peer = None if c.get("stock") else versus.same_codecs_stock(results, c)
        if peer is not None:
            out.append((c["name"], peer["name"]))
    return out


def _speed(results: dict) -> float:
    (entry,) = report.ran(results["configs"])
    return entry["samples_per_s"]["median"]


def span(values: list[float]) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:.2f}×" if round(low, 2) == round(high, 2) else f"{low:.2f}–{high:.2f}×"


def series(runs: list[dict]) -> list[list[dict]]:
    """Groups of budgeted runs of one setting with two or more entries (page order)."""
    groups: dict[tuple, list[dict]] = {}
    for results in runs:
        if results.get("mode") == "soak" or results.get("cpu_budget") is None or len(results["configs"]) < 2:
            continue
        key = (setting_of(results), tuple(sorted(c["name"] for c in results["configs"])))
        groups.setdefault(key, []).append(results)
    return list(groups.values())


def alone_pairs(runs: list[dict], setting: tuple) -> dict[str, list[float]]:
    """Per entry: the ratio of each of its alone runs to the alone run of stock table_wise taken next
    to it (the nearest in page order, the earlier on a tie; same setting, not slowed)."""
    alone = [r for r in runs if r.get("cpu_budget") is not None and len(r["configs"]) == 1 and setting_of(r) == setting
             and not r.get("busy_share")]  # fmt: skip
    stock = [i for i, r in enumerate(alone) if r["configs"][0]["name"] == STOCK]
    out: dict[str, list[float]] = {}
    for i, results in enumerate(alone):
        if i in stock or not stock:
            continue
        nearest = min(stock, key=lambda j: (abs(j - i), j))
        out.setdefault(results["configs"][0]["name"], []).append(_speed(results) / _speed(alone[nearest]))
    return out


def render_ranges(runs: list[dict]) -> str:
    """The section (empty when no series has two or more normal runs)."""
    sections = []
    for group in series(runs):
        normal = [r for r in group if not r.get("busy_share")]
        slowed = [r for r in group if r.get("busy_share")]
        if len(normal) < 2:
            continue
        stock = stock_of(normal[0])
        names = [(c["name"], stock) for c in report.by_workload(normal[0]["configs"]) if c["name"] != stock]
        names += _same_codecs_rows(normal[0])
        alone = alone_pairs(runs, setting_of(normal[0]))
        budget = normal[0]["cpu_budget"]
        busy = ", ".join(f"{r['busy_share']:.0%}" for r in slowed) or "-"
        lines = [
            f"### {report.pipeline_words(normal[0])}, {normal[0]['preset']} preset, "
            f"{report.network_words(normal[0]['network'])}",
            "",
            f"{len(normal)} consecutive runs ({', '.join(r.get('commit', '?') for r in normal)}), "
            f"{report.cpu_line(budget, None)}; slowed: busy processes took {busy} of every core (`--busy`); "
            "alone: the entry's run of its own over the alone run of stock table_wise taken next to it.",
            "",
            "| entry | "
            + " | ".join(f"run {i + 1}" for i in range(len(normal)))
            + " | range | slowed | alone | in company − alone |",
            "|---|" + "---|" * (len(normal) + 4),
        ]
        for name, base in names:
            ratios = [_ratio(r, name, base) for r in normal]
            known = [x for x in ratios if x is not None]
            slow = [x for x in (_ratio(r, name, base) for r in slowed) if x is not None]
            solo = alone.get(name, []) if base == stock else []
            company = sum(known) / len(known) if known else None
            gap = "-" if not solo or company is None else f"{(company / (sum(solo) / len(solo)) - 1):+.1%}"
            cells = [_cell(r, name, base) for r in normal]
            label = name if base == stock else f"{name} × {base} (same codecs)"
            lines.append(
                f"| {label} | " + " | ".join(cells) + f" | {span(known)} | {span(slow)} | {span(solo)} | {gap} |"
            )
        sections.append("\n".join(lines))
    if not sections:
        return ""
    return (
        "## Claims as ranges\n\n"
        "Every entry's samples/s over stock table_wise's (an entry run under quantized comms also over stock "
        "table_wise's under the same codecs), per run of one setting under the one CPU budget "
        "([measuring.md](measuring.md#cpu-budget)); a claim holds over the whole range and on the slowed "
        "machine. A run that recorded its rounds gives its ratio paired round by round with the 95% interval "
        "over them ([measuring.md](measuring.md#speed-ratios-their-intervals-and-the-runs-noise-floor)).\n\n"
        + "\n\n".join(sections)
        + "\n"
    )

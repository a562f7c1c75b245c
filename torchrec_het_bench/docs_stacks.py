"""One table of the same benchmark run on each supported TorchRec stack (docs/benchmarks.md).

Runs on different stacks are different processes at different times, so their samples/s are not
compared directly: each stack's entries are shown as ratios of that run's own stock table_wise, beside
the bytes and AUC, which do not depend on the machine's load.
"""

from torchrec_het_bench import report


def _key(results: dict) -> tuple:
    """What must match for two runs to sit side by side: preset, network, pipelines, entries."""
    return (
        results.get("preset"),
        results.get("world_size"),
        (results.get("network") or {}).get("mode"),
        tuple(results.get("pipelines") or [results.get("pipeline")]),
        tuple(sorted(c["name"] for c in results["configs"])),
    )


def stack_groups(runs: list[dict]) -> list[list[dict]]:
    """Groups of runs that differ only in their TorchRec version (two or more stacks each), in page order."""
    groups: dict[tuple, list[dict]] = {}
    for results in runs:
        if results.get("mode") == "soak":
            continue
        groups.setdefault(_key(results), []).append(results)
    return [g for g in groups.values() if len({r.get("versions", {}).get("torchrec") for r in g}) > 1]


def _stock(results: dict, entry: dict) -> dict | None:
    """The stock table_wise entry ``entry`` is compared with (as on the rest of the page)."""
    name = (entry.get("convergence_vs_sparse_dist") or entry.get("convergence") or {}).get("reference")
    return next((c for c in results["configs"] if c["name"] == name), None) or next(
        (c for c in results["configs"] if c["config"] == "stock_table_wise"), None
    )


def side_by_side(group: list[dict]) -> list[str]:
    """Lines of one table: per entry, per stack, samples/s as a ratio of that run's stock table_wise,
    embedding bytes per step and AUC."""
    stacks = [
        f"torchrec {r['versions'].get('torchrec')}, torch {r['versions'].get('torch')}, "
        f"fbgemm {r['versions'].get('fbgemm_gpu')}"
        for r in group
    ]
    head = (
        "| entry | sharding | "
        + " | ".join(f"samples/s ({s.split(',')[0]}) | x stock | MiB/step | AUC" for s in stacks)
        + " |"
    )
    lines = ["stacks: " + "; ".join(f"{i + 1}. {s}" for i, s in enumerate(stacks)), "", head]
    lines.append("|---|---|" + "---|---|---|---|" * len(group))
    names = [c["name"] for c in report.by_workload(group[0]["configs"])]
    for name in names:
        cells, sharding = [], "-"
        for results in group:
            entry = next(c for c in results["configs"] if c["name"] == name)
            stock = _stock(results, entry)
            sharding = "+".join(entry["sharding_types"])
            sps, ref = entry["samples_per_s"]["median"], stock and stock["samples_per_s"]["median"]
            ratio = "-" if not ref else f"{sps / ref:.2f}x"
            cells.append(
                f"{sps:.0f} | {ratio} | {report.format_mib(entry['bytes_per_step']['embedding_cross_rank'])} | {report.format_auc(entry['auc'])}"
            )
        lines.append(f"| {name} | {sharding} | " + " | ".join(cells) + " |")
    return lines


def render_stacks(runs: list[dict]) -> str:
    """The page section comparing stacks, empty when no two runs differ only in their stack."""
    groups = stack_groups(runs)
    if not groups:
        return ""
    lines = [
        "## The supported TorchRec stacks side by side",
        "",
        "The same command on each stack (the sections below hold each run whole). The runs were made at "
        "different times on a shared machine: compare samples/s within a run (x stock: the ratio to the run's own "
        "stock table_wise); across runs only where a section's note says the machine was quiet.",
    ]
    for group in groups:
        lines += [
            "",
            f"preset `{group[0].get('preset')}`, {group[0].get('world_size')} ranks, "
            f"{(group[0].get('network') or {}).get('mode')}:",
            "",
            *side_by_side(group),
        ]
    return "\n".join(lines) + "\n"

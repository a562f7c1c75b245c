"""Regenerates the planner's compute-cost table (``compute_costs.json``) from a microbenchmark run.

    python -m torchrec_het_bench.micro --out /tmp/micro
    python -m torchrec_het_bench.calibrate /tmp/micro/micro.json --command "<the micro command>"

Each plugin type's extra seconds per id per step is ``(ms/step of the type - ms/step of
table_wise) / 1000 / ids per step per rank``, from micro's medians (why table_wise:
:mod:`torchrec_het.planner.compute_costs`). The microbenchmark measures
pooled tables (an EmbeddingBagCollection); sequence tables are priced with the same figures.
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

from torchrec_het.planner.compute_costs import (
    CALIBRATED_TYPES,
    COSTS_PATH,
    SETTING_CLASSES,
    VERSION,
    load_compute_costs,
)
from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED

REFERENCE = "table_wise"  # the stock type the figures are measured against


def setting_class(sharding_type: str, params: dict) -> str:
    """ "exact" or "stale" for a microbenchmark type's configuration ``params``."""
    if sharding_type == HET_CACHED_ROW_WISE:
        bound = max(params.get("s_read", 0), params.get("s_write", params.get("s_read", 0)))
        return "exact" if bound == 0 else "stale"
    if params.get("cold_rows"):
        return "rows"
    return "exact" if params.get("replica_sync_every", 1) <= 1 else "stale"


def costs_from_micro(micro: dict, measured_with: str, measured_on: str | None = None) -> dict:
    """The compute-cost table (a JSON document) derived from a ``micro.json`` document.

    Ids per step per rank are micro's ``ids_per_step_per_rank``; a micro.json from before
    that field gets ``batch_size_per_rank x tables`` (the benchmark's one id per feature
    per sample).

    Raises:
        ValueError: micro.json lacks table_wise or a plugin type's exact or stale class.
    """
    by_type = {t["name"]: t for t in micro["types"]}
    reference = next((t for t in micro["types"] if t["sharding_types"] == [REFERENCE]), None)
    if reference is None:
        raise ValueError(f"micro.json has no {REFERENCE} type: the costs are relative to it")
    ids = micro.get("ids_per_step_per_rank")
    ids_source = "measured (micro.json ids_per_step_per_rank)"
    if not ids:
        ids = micro["batch_size_per_rank"] * micro["tables"]
        ids_source = "batch_size_per_rank x tables (one id per feature per sample)"
    reference_ms = reference["ms_per_step"]["median"]
    measured: dict[str, dict[str, list]] = {t: {c: [] for c in SETTING_CLASSES} for t in CALIBRATED_TYPES}
    measured[HET_ROW_REPLICATED]["rows"] = []  # optional: fetched cold rows (priced as "exact" without it)
    for t in by_type.values():
        if len(t["sharding_types"]) != 1 or t["sharding_types"][0] not in CALIBRATED_TYPES:
            continue
        sharding_type = t["sharding_types"][0]
        measured[sharding_type][setting_class(sharding_type, t["params"])].append(t)
    extra, basis = {}, {}
    for sharding_type, classes in measured.items():
        extra[sharding_type], basis[sharding_type] = {}, {}
        for cls, entries in classes.items():
            if not entries and cls == "rows":
                continue
            if not entries:
                raise ValueError(f"micro.json measures no {cls} {sharding_type} type; run micro with all its types")
            ms = sum(e["ms_per_step"]["median"] for e in entries) / len(entries)
            extra[sharding_type][cls] = (ms - reference_ms) / 1e3 / ids
            basis[sharding_type][cls] = {"micro_types": [e["name"] for e in entries], "ms_per_step": ms}
    return {
        "version": VERSION,
        "device": "cpu",
        "measured_with": measured_with,
        "measured_on": measured_on or datetime.date.today().isoformat(),
        "unit": f"seconds per id per step per rank, beyond stock {REFERENCE} (forward + backward + fused optimizer)",
        "lookups": "pooled (EmbeddingBagCollection); sequence tables are priced with the same figures",
        "preset": micro["preset"],
        "world_size": micro["world_size"],
        "tables": micro["tables"],
        "embedding_dim": micro["embedding_dim"],
        "batch_size_per_rank": micro["batch_size_per_rank"],
        "alpha": micro["alpha"],
        "embedding_optimizer": micro.get("embedding_optimizer"),
        "ids_per_step_per_rank": ids,
        "ids_source": ids_source,
        "reference": REFERENCE,
        "reference_ms_per_step": reference_ms,
        "reference_seconds_per_id": reference_ms / 1e3 / ids,
        "extra_seconds_per_id": extra,
        "basis": basis,
        "versions": micro.get("versions"),
    }


def _previous_revision(path: Path) -> int:
    """The revision of the table at ``path`` (a table without one is revision 1); 0 when there is none."""
    try:
        return int(json.loads(path.read_text()).get("revision", 1))
    except (OSError, ValueError, AttributeError, TypeError):
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchrec_het_bench.calibrate",
        description="Regenerate the planner's compute-cost table from a microbenchmark's micro.json.",
    )
    parser.add_argument("micro_json", help="micro.json written by python -m torchrec_het_bench.micro")
    parser.add_argument(
        "--command", default="python -m torchrec_het_bench.micro", help="the micro command that wrote it (recorded)"
    )
    parser.add_argument("--measured-on", help="date of the micro run (default: today)")
    parser.add_argument("--out", default=str(COSTS_PATH), help=f"where to write the table (default {COSTS_PATH})")
    parser.add_argument(
        "--revision", type=int, help="the table's revision (default: one more than the table at --out, else 1)"
    )
    parser.add_argument("--why", default="", help="why it was measured again (recorded)")
    args = parser.parse_args(argv)
    try:
        micro = json.loads(Path(args.micro_json).read_text())
        table = costs_from_micro(micro, args.command, args.measured_on)
    except (OSError, ValueError, KeyError) as error:
        parser.error(f"{args.micro_json}: {error!r}")
    table["revision"] = args.revision if args.revision is not None else _previous_revision(Path(args.out)) + 1
    if args.why:
        table["why"] = args.why
    Path(args.out).write_text(json.dumps(table, indent=2) + "\n")
    load_compute_costs(args.out)  # what was written reads back
    for sharding_type, classes in table["extra_seconds_per_id"].items():
        figures = ", ".join(f"{c} {v * 1e9:+.1f} ns/id" for c, v in classes.items())
        print(f"{sharding_type}: {figures}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

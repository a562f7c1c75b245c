"""``python -m torchrec_het.plan``: what-if plans for a cluster you describe, no process group needed.

    python -m torchrec_het.plan --tables 26x1000000x64 --alpha 1.1 --batch 1024 \\
        --world-size 64 --ranks-per-host 8 --intra-gbit 400 --inter-gbit 100
    python -m torchrec_het.plan --tables my_tables.py --profile profile.pt --world-size 16 --inter-gbit 25
    python -m torchrec_het.plan --tables 26x1000000x64 --alpha 1.1 --sweep --out sweep/

``--tables``: ``COUNTxROWSxDIM``, or a Python file that defines ``tables``, a list of
``EmbeddingBagConfig``. Reads: ``--profile`` (an access profile of one rank's batches, from
``torchrec_het_bench.profile`` or ``AccessProfiler``), else the Zipf exponent ``--alpha``
(0: uniform). Prints stock's best plan and the plugin's (exact and at ``--staleness``): the
types chosen, bytes per rank per step, memory per rank, and the predicted step and samples/s.
``--sweep`` runs world sizes 2 to 1,024 at each of ``--sweep-gbit`` inter-host speeds and writes
``sweep.json``, ``sweep.md`` and ``sweep.svg`` (speed-up against world size) into ``--out``.

The model and its assumptions: :mod:`torchrec_het.planner.step_model`.
"""

import argparse
import json
import runpy
import sys
import time
from pathlib import Path

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_het.planner import whatif
from torchrec_het.planner.compute_costs import default_compute_costs, load_compute_costs
from torchrec_het.planner.step_model import OVERLAP, Cluster, Compute, Links
from torchrec_het.planner.whatif import GBIT, compare, tables_from_configs
from torchrec_het.replication.profile import load_profile

SWEEP_WORLD_SIZES = tuple(2**k for k in range(1, 11))  # 2 .. 1,024
SWEEP_GBIT = (1.25, 10.0, 100.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m torchrec_het.plan", description=__doc__.splitlines()[0])
    p.add_argument("--tables", required=True, help="COUNTxROWSxDIM, or a .py file defining `tables`")
    p.add_argument("--profile", help="access profile (reads per row) of one rank's batches")
    p.add_argument("--alpha", type=float, default=None, help="Zipf exponent of the ids without a profile (0: uniform)")
    p.add_argument("--batch", type=int, default=1024, help="samples per rank per step")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--ranks-per-host", type=int, default=1)
    p.add_argument("--intra-gbit", type=float, default=None, help="between ranks of a host (default: --inter-gbit)")
    p.add_argument("--inter-gbit", type=float, default=10.0, help="between hosts, Gbit/s per rank")
    p.add_argument("--latency-ms", type=float, default=0.05, help="per collective")
    p.add_argument("--lookup-ns-per-id", type=float, default=None,
                   help="a stock lookup's forward, backward and update per id (default: the calibration table's)")  # fmt: skip
    p.add_argument("--dense-us-per-sample", type=float, default=0.0, help="the dense part's compute per sample")
    p.add_argument("--dense-params", type=int, default=0, help="parameters of the dense all-reduce")
    p.add_argument("--pipeline", choices=sorted(OVERLAP), default="sparse_dist")
    p.add_argument("--staleness", type=int, nargs="*", default=[10], help="plugin staleness settings besides exact")
    p.add_argument(
        "--compute-costs", help="a calibration table (default: $TORCHREC_HET_COMPUTE_COSTS, else the shipped one)"
    )
    p.add_argument("--sweep", action="store_true", help="world sizes 2..1,024 at each --sweep-gbit")
    p.add_argument("--sweep-gbit", type=lambda s: tuple(float(x) for x in s.split(",")), default=SWEEP_GBIT)
    p.add_argument("--out", default="whatif_out", help="where --sweep writes its files")
    args = p.parse_args(argv)
    if args.world_size < 1 or args.world_size % args.ranks_per_host:
        p.error(f"--world-size {args.world_size} must be a positive multiple of --ranks-per-host {args.ranks_per_host}")
    return args


def table_configs(spec: str) -> list[EmbeddingBagConfig]:
    """``COUNTxROWSxDIM`` tables of one feature each, or those a Python file names ``tables``."""
    if spec.endswith(".py"):
        found = runpy.run_path(spec).get("tables")
        if not found or not all(isinstance(t, EmbeddingBagConfig) for t in found):
            raise SystemExit(f"--tables {spec}: the file must define `tables`, a list of EmbeddingBagConfig")
        return list(found)
    try:
        count, rows, dim = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--tables {spec!r}: expected COUNTxROWSxDIM (e.g. 26x1000000x64) or a .py file") from None
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows, feature_names=[f"f{i}"])
            for i in range(count)]  # fmt: skip


def compute_figures(args) -> Compute:
    costs = load_compute_costs(args.compute_costs) if args.compute_costs else default_compute_costs()
    lookup = args.lookup_ns_per_id * 1e-9 if args.lookup_ns_per_id is not None else costs.reference_seconds_per_id
    if lookup is None:
        raise SystemExit(
            f"the calibration table {costs.source} records no reference lookup cost: give --lookup-ns-per-id"
        )
    return Compute(lookup, args.dense_us_per_sample * 1e-6, costs.extra_seconds_per_id, str(costs.source))


def links(args, inter_gbit: float | None = None) -> Links:
    inter = (inter_gbit or args.inter_gbit) * GBIT
    intra = args.intra_gbit * GBIT if args.intra_gbit else inter
    return Links(intra, inter, args.latency_ms * 1e-3, "stated")


def one(args, shapes, world_size: int, inter_gbit: float | None = None) -> list:
    cluster = Cluster(world_size, min(args.ranks_per_host, world_size), args.batch)
    return compare(
        shapes, cluster, links(args, inter_gbit), compute_figures(args), (0, *args.staleness), args.pipeline,
        args.dense_params,
    )  # fmt: skip


def report(plans, cluster: Cluster) -> str:
    base = plans[0].prediction
    lines = [
        f"{cluster.world_size} ranks ({cluster.local_world_size} per host), {cluster.batch} samples per rank",
        "| plan | types | MiB/rank/step | memory GiB/rank | step ms | samples/s | x stock |",
        "|---|---|---|---|---|---|---|",
    ]
    for plan in plans:
        step = plan.prediction
        types = ", ".join(f"{k} {v}" for k, v in sorted(plan.types.items()))
        lines.append(
            f"| {plan.label} | {types} | {step.bytes.total / cluster.world_size / 2**20:.2f} "
            f"| {plan.memory_per_rank / 2**30:.2f} | {step.total * 1e3:.2f} | {step.samples_per_s(cluster):,.0f} "
            f"| {base.total / step.total:.2f} |"
        )
    return "\n".join(lines)


def sweep(args, shapes) -> dict:
    rows = whatif.sweep(
        shapes, args.batch, compute_figures(args), SWEEP_WORLD_SIZES, args.sweep_gbit, args.ranks_per_host,
        args.intra_gbit, args.latency_ms * 1e-3, tuple(args.staleness), args.pipeline, args.dense_params,
    )  # fmt: skip
    return {"tables": args.tables, "batch": args.batch, "ranks_per_host": args.ranks_per_host,
            "pipeline": args.pipeline, "rows": rows}  # fmt: skip


def sweep_markdown(result: dict) -> str:
    labels = list(result["rows"][0]["plans"]) if result["rows"] else []
    head = "| ranks | Gbit/s | " + " | ".join(f"{label} ms" for label in labels) + " | "
    head += " | ".join(f"{label} x" for label in labels[1:]) + " |"
    lines = [head, "|" + "---|" * (2 + 2 * len(labels) - 1)]
    for row in result["rows"]:
        plans = row["plans"]
        cells = [f"{plans[label]['step_ms']:.2f}" for label in labels] + [
            f"{plans[label]['speedup']:.2f}" for label in labels[1:]
        ]
        lines.append(f"| {row['world_size']} | {row['inter_gbit']:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep_svg(result: dict, points: list[tuple[float, float, str]] = ()) -> str:
    """Speed-up over stock against world size (log2), one line per plugin setting and link speed;
    ``points``: measured (world size, speed-up, label) drawn as dots."""
    from torchrec_het.planner.svg_plot import line_plot

    series = whatif.speedup_series(result["rows"])
    return line_plot(series, points, x_label="ranks", y_label="speed-up over stock's best plan", log2_x=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile = load_profile(args.profile) if args.profile else None
    shapes = tables_from_configs(table_configs(args.tables), args.batch, args.alpha, profile)
    if not args.sweep:
        cluster = Cluster(args.world_size, args.ranks_per_host, args.batch)
        print(report(one(args, shapes, args.world_size), cluster))
        print(f"links: {links(args).source}; pipeline {args.pipeline}: {OVERLAP[args.pipeline]}")
        return 0
    start = time.perf_counter()
    result = sweep(args, shapes)
    result["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=1))
    (out / "sweep.md").write_text(sweep_markdown(result) + "\n")
    (out / "sweep.svg").write_text(sweep_svg(result))
    print(sweep_markdown(result))
    print(f"{len(result['rows'])} points in {result['seconds']:.1f} s; wrote {out}/sweep.json, sweep.md, sweep.svg")
    return 0


if __name__ == "__main__":
    sys.exit(main())

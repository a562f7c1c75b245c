"""Several seeds of one benchmark run, merged: AUC as a mean over seeds with a paired interval.

``--seeds N`` runs the whole benchmark N times, with seeds ``--seed``, ``--seed`` + 1, ...
(each seed is another data stream, planted label model, held-out set and initialization), each
run into ``<out>/seed_<s>/`` with all its outputs, then writes the merge into ``<out>``
(:func:`merge`): every entry's ``auc`` and ``auc_curve`` are means over the seeds (the per-seed
values beside them), ``auc_vs_stock`` is a paired t interval over the per-seed differences from
stock (:func:`torchrec_het_bench.auc_intervals.paired_t`), and ``convergence`` is recomputed on
the mean curves. Speed, bytes, memory and step times are the first seed's run (``measured_seed``):
seeds change the data, not the work.
"""

import copy
import json
import statistics
from dataclasses import replace
from pathlib import Path

from torchrec_het_bench.auc_intervals import paired_t
from torchrec_het_bench.results import convergence, write_results
from torchrec_het_bench.versus import add_convergence_intervals, reference_name
from torchrec_het_bench.worker import RunSpec

# What must agree between the runs merged (everything but the seed, the provenance and the measurements).
_SAME = (
    "preset",
    "world_size",
    "alpha",
    "table_sizes",
    "pipeline",
    "embedding_staleness",
    "rounds",
    "steps_per_round",
    "warmup_steps",
    "eval_every",
    "data",
)


def seed_dir(out: str | Path, seed: int) -> Path:
    """Where the run of ``seed`` writes its own outputs."""
    return Path(out) / f"seed_{seed}"


def run_seeds(spec: RunSpec, count: int, launch) -> dict | None:
    """Runs ``spec`` with ``count`` seeds from ``spec.seed`` (``launch(spec)`` runs one) and, where the
    outputs were written (rank 0, or the spawning process), writes and returns the merge."""
    seeds = [spec.seed + i for i in range(count)]
    for seed in seeds:
        launch(replace(spec, seed=seed, out_dir=str(seed_dir(spec.out_dir, seed))))
    written = [seed_dir(spec.out_dir, seed) / "results.json" for seed in seeds]
    if not all(path.is_file() for path in written):
        return None  # another rank of a torchrun job: rank 0 merges
    merged = merge([json.loads(path.read_text()) for path in written])
    write_results(merged, Path(spec.out_dir))
    return merged


def merge(runs: list[dict]) -> dict:
    """One results document from the runs of several seeds (see the module docstring).

    Raises:
        ValueError: fewer than 2 runs, runs that differ in more than their seed, a repeated seed,
            or entries whose curves were evaluated at different steps.
    """
    if len(runs) < 2:
        raise ValueError(f"merging seeds needs at least 2 runs, got {len(runs)}")
    seeds = [run.get("seed", 0) for run in runs]
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"runs share a seed: {seeds}")
    for key in _SAME:
        values = {json.dumps(run.get(key)) for run in runs}
        if len(values) > 1:
            raise ValueError(f"runs differ in {key!r} ({sorted(values)}); only the seed may differ")
    names = [[c["name"] for c in run["configs"]] for run in runs]
    if any(n != names[0] for n in names):
        raise ValueError(f"runs differ in their entries: {names}")
    merged = copy.deepcopy(runs[0])
    merged.update(seeds=seeds, measured_seed=seeds[0], seed=seeds[0])
    per_seed = [{c["name"]: c for c in run["configs"]} for run in runs]
    for entry in merged["configs"]:
        if "not_run" in entry:
            continue
        _merge_entry(entry, [by_name[entry["name"]] for by_name in per_seed])
    for entry in merged["configs"]:
        entry.pop("convergence", None)
        entry.pop("convergence_vs_sparse_dist", None)
        entry.pop("auc_vs_stock", None)
    convergence(merged["configs"])
    for entry in merged["configs"]:
        reference = reference_name(entry) if "not_run" not in entry else None
        if reference is None or reference == entry["name"]:
            continue
        differences = _differences(per_seed, entry["name"], reference)
        entry["auc_vs_stock"] = dict(paired_t(differences, seeds).as_dict(), reference=reference, by_seed=differences)
        add_convergence_intervals(
            entry, lambda ref, name=entry["name"]: paired_t(_differences(per_seed, name, ref)).half_width
        )
    return merged


def _differences(per_seed: list[dict], name: str, reference: str) -> list[float]:
    """Per seed, entry ``name``'s AUC minus ``reference``'s (``per_seed``: each seed's entries by name)."""
    return [by_name[name]["auc"] - by_name[reference]["auc"] for by_name in per_seed]


def _merge_entry(entry: dict, runs: list[dict]) -> None:
    """``entry`` (the first seed's) with its AUC fields replaced by means over ``runs`` (one per seed)."""
    if any("not_run" in run for run in runs):
        raise ValueError(f"{entry['name']} ran under some seeds only")
    steps = [[step for step, _ in run["auc_curve"]] for run in runs]
    if any(s != steps[0] for s in steps):
        raise ValueError(f"{entry['name']}: the seeds' AUC curves were evaluated at different steps")
    entry["auc_by_seed"] = [run["auc"] for run in runs]
    entry["auc"] = statistics.fmean(entry["auc_by_seed"])
    entry["auc_spread"] = statistics.stdev(entry["auc_by_seed"])  # sample standard deviation over seeds
    entry["auc_curve_by_seed"] = [run["auc_curve"] for run in runs]
    entry["auc_curve"] = [
        [step, statistics.fmean(run["auc_curve"][i][1] for run in runs)] for i, step in enumerate(steps[0])
    ]
    entry["loss_by_seed"] = [run["loss"] for run in runs]


def main(argv: list[str] | None = None) -> int:
    """``python -m torchrec_het_bench.seeds OUT``: merges ``OUT/seed_*/results.json`` again into ``OUT``
    (after a change to the merge or the report; the runs are not repeated)."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m torchrec_het_bench.seeds", description=main.__doc__.splitlines()[0]
    )
    parser.add_argument("out", type=Path, help="the --out folder of a --seeds run")
    args = parser.parse_args(argv)
    paths = sorted(args.out.glob("seed_*/results.json"), key=lambda p: int(p.parent.name.removeprefix("seed_")))
    if len(paths) < 2:
        parser.error(f"{args.out} holds {len(paths)} seed_*/results.json; merging needs at least 2")
    write_results(merge([json.loads(path.read_text()) for path in paths]), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

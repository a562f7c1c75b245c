"""``python -m torchrec_het_bench.adoption``: an unchanged trainer through the launcher vs. without it.

    python -m torchrec_het_bench.adoption --out adoption/            # ~200 steps, 3 repeats
    python -m torchrec_het_bench.adoption --out /tmp/a --quick       # a smoke check
    python -m torchrec_het_bench.adoption --out /tmp/d --sizes smoke default   # also at the default preset's sizes
    python -m torchrec_het_bench.adoption --out /tmp/e --network emulated --hosts 2 --gbit 1.25

The trainer is the recipe ``torchrec_het_bench.recipes.train_dlrm`` (stock planner,
``get_default_sharders()``, ``TrainPipelineSparseDist``), as a user would start it, at the
``--sizes`` asked for (the trainer's own ``--preset``, the benchmark's presets' sizes):

- ``smoke`` (default): 26 tables of 1k..20k rows, dim 16, 256 samples per rank, MLPs 64-16 / 64-1.
- ``default``: the benchmark's ``default`` preset, where bytes matter: 26 tables of 100k..1M rows
  (7.3M rows, 1.9 GB of fp32 weights), dim 64, 1024 samples per rank, MLPs 256-64 / 256-128-1. A
  step takes ~0.1-0.4 s on 2 ranks of a 2-core machine (0.1-0.2 s idle, ~0.3 s under load), so
  the 200 steps of a run take 20-80 s of training, plus start-up and planning (~1 min).

Every case runs at every size, with the same ``--steps``. On loopback (default): 2 ranks,
``torchrun --nproc-per-node 2 -m ...`` (arm ``stock``) or
``python -m torchrec_het.launch --nproc-per-node 2 -m ...`` (arm ``launcher``). With
``--network emulated``: one rank on each of ``--hosts`` emulated hosts joined at ``--gbit``,
each started by its own torchrun (or launcher) in its host's namespace, with a multi-node
rendezvous at host 0 (:mod:`torchrec_het_bench.adoption_hosts`). Cases:

- ``uniform``: ids uniform (``--alpha 0`` of the trainer); the launcher has no profile.
- ``zipf``: Zipf(``--alpha``, 1.1) ids; the launcher gets ``TORCHREC_HET_PROFILE``, a profile
  of the same batches (same sizes: ``--preset`` of the run's sizes) made first with
  ``python -m torchrec_het_bench.profile``.
- ``uniform_fp16``, ``zipf_fp16`` (``_int8``, ``_mx4``): the same with TorchRec's quantized comms,
  the codec pairs of :mod:`torchrec_het_bench.qcomms` (``fp16/bf16``, ...): both arms run the
  trainer with ``--fwd-comm-precision fp16 --bwd-comm-precision bf16``, so the launcher's run is
  compared with stock under the same codecs; the report shows the codecs the trainer says it ran
  (on CPU TorchRec runs bf16 as fp16).

Repeats interleave (uniform stock, uniform launcher, zipf stock, zipf launcher, each size in
turn, again...).
On loopback every run is a fresh process tree in a network namespace of its own (one emulated
host of :mod:`torchrec_het_bench.netem`), so its loopback carries this run's traffic and nothing
else: the kernel's ``lo`` counters there are the bytes the ranks, their rendezvous store and
torchrun's agent exchanged (TCP payload plus TCP/IP headers; each packet counted once).
Without root or ``ip`` the runs go on in this namespace and bytes are not reported. On emulated
hosts every run gets fresh hosts, and the wire bytes are what the hosts' links carried (the
sum of their ``eth0`` transmit counters).

Per run: the trainer's own ``trained N steps in S s (X it/s)`` (training loop only), a
steady rate from the times its step lines arrive (from step N/10 to the last), the bytes of
the whole run and of that steady window, the sharding types of the printed plan, and the
final held-out AUC. ``results.json`` and ``results.md`` in ``--out`` hold the runs, medians
and launcher/stock ratios per case and sizes (``cases`` keyed ``<case>/<sizes>``, e.g.
``zipf/default``; ``sizes`` says what each size is); ``logs/`` holds every run's stdout and stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from torchrec_het.integration.cpu_budget import budget_for
from torchrec_het_bench import qcomms
from torchrec_het_bench.adoption_runs import TRAINER, Case, codec_flags, trainer_args, watch
from torchrec_het_bench.flags import float_above, int_at_least
from torchrec_het_bench.networks import emulation_unavailable
from torchrec_het_bench.report import cpu_line

WORLD_SIZE = 2  # on loopback; on emulated hosts one rank per host
PLUGIN_PREFIX = "het_"
NETNS_PREFIX = "trhadopt"
# Runs of one plan differ by ~0.05% in bytes (store polls, TCP acks and retransmits vary):
# "no more bytes" allows 0.2%.
BYTES_TOLERANCE = 0.002
QUICK = {"steps": 20, "repeats": 1, "eval_batches": 1}
CASES = tuple(base + suffix for base in ("uniform", "zipf") for suffix in ("", *map(qcomms.suffix, qcomms.PAIRS)))
FULL = {"steps": 200, "repeats": 3, "eval_batches": 4}
SIZES = ("smoke", "default")  # the trainer's --preset; the benchmark's presets of the same names (same sizes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torchrec_het_bench.adoption", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for results.json, results.md, logs/ and the profile")
    parser.add_argument("--steps", type=int_at_least(2), default=None, help=f"training steps per run ({FULL['steps']})")
    parser.add_argument(
        "--repeats", type=int_at_least(1), default=None, help=f"runs per case and arm ({FULL['repeats']})"
    )
    parser.add_argument("--alpha", type=float_above(0), default=1.1, help="Zipf exponent of the skewed case (1.1)")
    parser.add_argument(
        "--eval-batches", type=int_at_least(1), default=None, help="held-out batches per rank for the AUC"
    )
    parser.add_argument("--profile-every", type=int_at_least(1), default=4, help="the profile counts every N-th batch")
    parser.add_argument(
        "--cases", nargs="+", choices=CASES, default=["uniform", "zipf"], metavar="CASE",
        help=f"cases to run, of {', '.join(CASES)} (_fp16 etc.: both arms with those quantized comms; "
        "default: uniform zipf)",
    )  # fmt: skip
    parser.add_argument(
        "--sizes", nargs="+", choices=SIZES, default=["smoke"], metavar="SIZES",
        help="model and batch sizes to run every case at (the trainer's --preset): smoke (26 tables of 1k..20k rows, "
        "dim 16, batch 256) or default (the benchmark's default preset: 100k..1M rows, dim 64, batch 1024, "
        "~0.1-0.4 s a step); several run interleaved (default: smoke)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"a smoke check: {QUICK} unless given")
    parser.add_argument(
        "--network",
        choices=("loopback", "emulated"),
        default="loopback",
        help="loopback: 2 ranks on this host; emulated: one rank per emulated host (needs root and ip)",
    )
    parser.add_argument("--hosts", type=int_at_least(2), default=2, help="emulated hosts, one rank each (2)")
    parser.add_argument(
        "--gbit", type=float_above(0), default=1.25, help="the emulated hosts' link rate, Gbit/s (1.25)"
    )
    parser.add_argument(
        "--launcher-env", action="append", default=[], metavar="TORCHREC_HET_X=VALUE",
        help="a setting for the launcher arm only (repeatable), e.g. TORCHREC_HET_COMPUTE_COSTS=table.json; "
        "no other TORCHREC_HET_* variable of this shell reaches either arm",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.network == "emulated":
        unavailable = namespace_unavailable()
        if unavailable is not None:
            parser.error(f"--network emulated is not possible here: {unavailable}")
    if len(set(args.sizes)) < len(args.sizes):
        parser.error(f"--sizes: each at most once, got {' '.join(args.sizes)}")
    for setting in args.launcher_env:
        key, eq, _value = setting.partition("=")
        if not eq or not key.startswith("TORCHREC_HET_"):
            parser.error(f"--launcher-env: expected TORCHREC_HET_X=VALUE, got {setting!r}")
    for name, value in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


# ---- network namespace and its counters --------------------------------------------------------


def namespace_unavailable() -> str | None:
    """Why runs cannot get a namespace of their own here (None: they can)."""
    return emulation_unavailable()


def namespace_loopback_bytes(netns: str) -> int:
    """Bytes sent over ``lo`` in the named namespace (``ip -s``)."""
    from torchrec_het_bench.netem import run_command

    (link,) = json.loads(run_command("ip", "-j", "-s", "-n", netns, "link", "show", "lo"))
    return int(link["stats64"]["tx"]["bytes"])


# ---- one run ------------------------------------------------------------------------------------


def case_named(name: str, alpha: float, sizes: str = "smoke") -> Case:
    """The case ``name`` of :data:`CASES`: ``uniform`` or ``zipf`` (Zipf ``alpha``), with the codec pair its
    suffix names, at ``sizes`` (of :data:`SIZES`)."""
    base, _, codec = name.partition("_")
    pair = next(p for p in qcomms.PAIRS if qcomms.suffix(p) == f"_{codec}") if codec else None
    return Case(name, alpha if base == "zipf" else 0.0, base == "zipf", pair, sizes)


def sizes_of(name: str) -> dict:
    """What the sizes ``name`` are: the benchmark preset's tables, dim, MLPs and batch per rank (the trainer's
    ``--preset`` of that name has the same; tests/bench/test_adoption.py checks)."""
    from torchrec_het_bench.presets import get_preset

    preset = get_preset(name)
    rows = preset.table_sizes
    return {"tables": len(rows), "rows_min": min(rows), "rows_max": max(rows), "rows_total": sum(rows),
            "embedding_dim": preset.embedding_dim, "batch_size": preset.batch_size,
            "dense_arch": list(preset.dense_arch), "over_arch": list(preset.over_arch)}  # fmt: skip


def describe_sizes(name: str, sizes: dict) -> str:
    """``smoke: 26 tables of 1000..20000 rows (...), dim 16, batch 256 per rank, MLPs 64-16 / 64-1``."""
    weights_mb = sizes["rows_total"] * sizes["embedding_dim"] * 4 / 1e6
    return (f"{name}: {sizes['tables']} tables of {sizes['rows_min']}..{sizes['rows_max']} rows "
            f"({sizes['rows_total']} rows, {weights_mb:,.0f} MB fp32), dim {sizes['embedding_dim']}, "
            f"batch {sizes['batch_size']} per rank, MLPs {'-'.join(map(str, sizes['dense_arch']))} / "
            f"{'-'.join(map(str, sizes['over_arch']))}")  # fmt: skip


def world_size(args: argparse.Namespace) -> int:
    """Ranks of a run: 2 on loopback, one per emulated host."""
    return args.hosts if args.network == "emulated" else WORLD_SIZE


def command(arm: str, case: Case, args: argparse.Namespace) -> list[str]:
    """The command line of one arm on loopback: torchrun, or the plugin's launcher, running the unchanged trainer."""
    head = ["-m", "torch.distributed.run"] if arm == "stock" else ["-m", "torchrec_het.launch"]
    return [
        sys.executable,
        *head,
        "--nproc-per-node",
        str(WORLD_SIZE),
        *trainer_args(case, args.steps, args.eval_batches),
    ]


def run_env(
    arm: str, case: Case, profile: Path | None, in_netns: bool, launcher_env: list[str], ranks: int
) -> dict[str, str]:
    """The caller's environment without any ``TORCHREC_HET_*`` setting, plus, for the launcher,
    ``launcher_env`` and on skewed ids the profile; ranks in a namespace of their own talk over its loopback.

    Both arms get the same CPU budget (:mod:`torchrec_het.integration.cpu_budget`): the ``ranks`` of a run all
    run on this machine, emulated hosts' too, so each gets ``cores // ranks`` intra-op threads
    (``OMP_NUM_THREADS``; torchrun with one worker per node would leave every core to each)."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TORCHREC_HET_")}
    env.update(budget_for(ranks).env())
    if arm == "launcher":
        env.update(setting.partition("=")[::2] for setting in launcher_env)
        if case.with_profile:
            env["TORCHREC_HET_PROFILE"] = str(profile)
    if in_netns:
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def run_once(arm: str, case: Case, args: argparse.Namespace, profile: Path | None, log: Path, in_netns: bool) -> dict:
    """Runs the trainer once (in a namespace of its own when ``in_netns``); returns its record."""
    warm_step = max(1, args.steps // 10)
    if args.network == "emulated":
        from torchrec_het_bench.adoption_hosts import run_on_hosts

        env = run_env(arm, case, profile, False, args.launcher_env, world_size(args))
        return run_on_hosts(arm, case, args, env, log, warm_step, NETNS_PREFIX)
    argv = command(arm, case, args)
    env = run_env(arm, case, profile, in_netns, args.launcher_env, world_size(args))
    if not in_netns:
        return watch([(argv, env)], args.steps, warm_step, log, None)
    from torchrec_het_bench.netem import EmulatedHosts, LinkSpec

    with EmulatedHosts(1, LinkSpec(gbit=100.0, delay_ms=0.0), name_prefix=NETNS_PREFIX) as hosts:
        netns = hosts.host_netns(0)
        argv = ["ip", "netns", "exec", netns, *argv]
        return watch([(argv, env)], args.steps, warm_step, log, lambda: namespace_loopback_bytes(netns))


def make_profile(case: Case, args: argparse.Namespace, out: Path) -> Path:
    """Profiles rank 0's training batches of the case's data with the profile CLI."""
    path = out / f"profile_{case.name}_{case.sizes}.pt"
    argv = [sys.executable, "-m", "torchrec_het_bench.profile", "--preset", case.sizes, "--alpha", f"{case.alpha:g}",
            "--steps", str(args.steps), "--every", str(args.profile_every), "--world-size", str(world_size(args)),
            "--out", str(path)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"profile failed: {' '.join(argv)}\n{done.stderr[-2000:]}")
    print(done.stdout.strip(), flush=True)
    return path


# ---- summary ------------------------------------------------------------------------------------


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize_arm(runs: list[dict]) -> dict:
    plans = [run["plan"] for run in runs]
    types = sorted({kind for plan in plans for kind in plan})
    keys = ("it_per_s", "steady_it_per_s", "wire_bytes_run", "wire_bytes_per_step", "auc", "prediction_error")
    return {
        **{f"median_{key}": _median([run.get(key) for run in runs]) for key in keys},
        "qcomms_ran": sorted({run["qcomms"] for run in runs if run.get("qcomms")}),  # the trainer's own line
        "plan_types": types,
        "plugin_types_planned": any(kind.startswith(PLUGIN_PREFIX) for kind in types),
        "plan_same_every_run": all(plan == plans[0] for plan in plans),
        "runs": runs,
    }


def summarize_case(case: Case, arms: dict[str, list[dict]]) -> dict:
    stock, launcher = summarize_arm(arms["stock"]), summarize_arm(arms["launcher"])
    ratios = {
        key: _ratio(launcher[f"median_{key}"], stock[f"median_{key}"])
        for key in ("it_per_s", "steady_it_per_s", "wire_bytes_run", "wire_bytes_per_step")
    }
    ratios["it_per_s_paired"] = _median(  # each repeat's launcher run over the stock run just before it
        [b["it_per_s"] / a["it_per_s"] for a, b in zip(arms["stock"], arms["launcher"], strict=True)]
    )
    ratios["auc_difference"] = None if launcher["median_auc"] is None else launcher["median_auc"] - stock["median_auc"]
    if case.with_profile:  # issue 12: plugin types planned, bytes <= 0.75x, no slower
        targets = {"plugin_types_planned": launcher["plugin_types_planned"],
                   "wire_bytes_at_most_0.75x": _at_most(ratios["wire_bytes_run"], 0.75),
                   "no_slower": _at_least(ratios["it_per_s"], 1.0)}  # fmt: skip
    else:  # within 5% of stock's speed, no more bytes (than identical plans differ by)
        targets = {"within_5pct_of_stock_speed": _at_least(ratios["it_per_s"], 0.95),
                   "no_more_wire_bytes": _at_most(ratios["wire_bytes_run"], 1.0 + BYTES_TOLERANCE)}  # fmt: skip
    targets["never_loses_0.97x_paired"] = _at_least(ratios["it_per_s_paired"], 0.97)  # issue 35
    return {"case": case.name, "sizes": case.sizes, "alpha": case.alpha, "launcher_profile": case.with_profile,
            "qcomms": case.qcomms, "stock": stock, "launcher": launcher, "launcher_over_stock": ratios,
            "targets": targets}  # fmt: skip


def _at_most(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def _at_least(value: float | None, bound: float) -> bool | None:
    return None if value is None else value >= bound


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _where(results: dict) -> str:
    net = results.get("network", {"mode": "loopback"})
    if net["mode"] == "loopback":
        return f"{results['world_size']} ranks (gloo) on loopback"
    return (
        f"{results['world_size']} ranks (gloo), one on each of {net['hosts']} emulated hosts at {net['gbit']:g} Gbit/s"
    )


def _case_words(case: dict) -> str:
    """``alpha 1.1`` and, under quantized comms, ``qcomms fp16/bf16``."""
    return f"alpha {case['alpha']:g}" + (f", qcomms {case['qcomms']}" if case.get("qcomms") else "")


def _codec_lines(results: dict) -> list[str]:
    """What each case with quantized comms asked for and what each arm's trainer said it ran."""
    lines = []
    for key, case in results["cases"].items():
        if case.get("qcomms"):
            flags = " ".join(codec_flags(case["qcomms"]))
            ran = "; ".join(f"{arm}: {', '.join(case[arm]['qcomms_ran']) or 'n/a'}" for arm in ("stock", "launcher"))
            lines.append(f"- {key}: both arms `{flags}`; ran ({ran})")
    return ["", "Quantized comms (the trainer's flags, the codecs it printed per collective, forward/backward):", "",
            *lines] if lines else []  # fmt: skip


def _sizes_lines(results: dict) -> list[str]:
    """One line per sizes run: what each means (the trainer's --preset)."""
    return ["Sizes (the trainer's `--preset`):", "",
            *[f"- {describe_sizes(name, sizes)}" for name, sizes in results["sizes"].items()], ""]  # fmt: skip


def markdown(results: dict) -> str:
    lines = [
        "# An unchanged trainer through the launcher vs. without it",
        "",
        f"`{results['command']}` at {results['provenance']['commit']}, {results['provenance']['date']}; "
        f"{results['steps']} steps, {results['repeats']} repeat(s) per arm, {_where(results)}, "
        f"sizes {', '.join(results['sizes'])}. "
        f"Load average {results['loadavg_start']:.1f} before, {results['loadavg_end']:.1f} after, "
        f"on {os.cpu_count()} cores: speeds are noisy on a shared machine. Both arms: "
        + cpu_line(results.get("cpu_budget"), None)
        + ".",
        "",
        *_sizes_lines(results),
        f"Wire bytes: {results['wire_bytes']}",
        "",
        *([f"Link: {results['network']['link']}", ""] if results.get("network", {}).get("link") else []),
        f"Launcher settings: {', '.join(results['launcher_env']) or 'none'} (+ TORCHREC_HET_PROFILE on zipf cases).",
        "",
        "| case | sizes | arm | it/s (trainer) | it/s (steady) | wire MB (run) | wire KB/step | AUC | planned types "
        "| plan's predicted step / measured - 1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in results["cases"].values():
        name, sizes = case["case"], case["sizes"]
        for arm in ("stock", "launcher"):
            s = case[arm]
            run_mb = None if s["median_wire_bytes_run"] is None else s["median_wire_bytes_run"] / 1e6
            step_kb = None if s["median_wire_bytes_per_step"] is None else s["median_wire_bytes_per_step"] / 1e3
            plan = ", ".join(f"{kind} {n}" for kind, n in s["runs"][0]["plan"].items())
            lines.append(f"| {name} ({_case_words(case)}) | {sizes} | {arm} | {_fmt(s['median_it_per_s'], '.2f')} "
                         f"| {_fmt(s['median_steady_it_per_s'], '.2f')} | {_fmt(run_mb, '.1f')} | {_fmt(step_kb, '.1f')} "
                         f"| {_fmt(s['median_auc'], '.4f')} | {plan}{'' if s['plan_same_every_run'] else ' (varied)'} "
                         f"| {_fmt(s['median_prediction_error'], '+.1%')} |")  # fmt: skip
    lines += ["", "Medians over the repeats. Launcher / stock (paired: the median of each repeat's own ratio):", "",
              "| case | sizes | it/s | it/s paired | steady it/s | wire bytes (run) | wire bytes/step | AUC diff "
              "| targets (issue 12) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for case in results["cases"].values():
        name, sizes = case["case"], case["sizes"]
        r = case["launcher_over_stock"]
        targets = ", ".join(
            f"{key}: {'n/a' if ok is None else ('met' if ok else 'MISSED')}" for key, ok in case["targets"].items()
        )
        lines.append(f"| {name} | {sizes} | {_fmt(r['it_per_s'], '.3f')} | {_fmt(r['it_per_s_paired'], '.3f')} "
                     f"| {_fmt(r['steady_it_per_s'], '.3f')} "
                     f"| {_fmt(r['wire_bytes_run'], '.4f')} | {_fmt(r['wire_bytes_per_step'], '.4f')} "
                     f"| {_fmt(r['auc_difference'], '+.4f')} | {targets} |")  # fmt: skip
    lines += _codec_lines(results)
    notes = sorted(
        {note for case in results["cases"].values() for run in case["launcher"]["runs"] for note in run["notes"]}
    )
    if notes:
        lines += ["", "The launcher said (stderr):", "", *[f"- `{note}`" for note in notes]]
    return "\n".join(lines) + "\n"


# ---- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from torchrec_het_bench.results import provenance

    out = Path(args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    unavailable = namespace_unavailable()
    if unavailable is None:
        from torchrec_het_bench.netem import remove_stale

        remove_stale(NETNS_PREFIX)  # namespaces a killed earlier run of this command left
    network = {"mode": args.network}
    if args.network == "emulated":
        from torchrec_het_bench.adoption_hosts import describe_link, measure_link

        network.update(hosts=args.hosts, gbit=args.gbit, tcp=measure_link(args, NETNS_PREFIX))
        network["link"] = describe_link(network)
    cases = [case_named(name, args.alpha, sizes) for sizes in args.sizes for name in args.cases]
    profiles = {case.key: make_profile(case, args, out) for case in cases if case.with_profile}
    loadavg_start = os.getloadavg()[0]
    runs: dict[str, dict[str, list[dict]]] = {case.key: {"stock": [], "launcher": []} for case in cases}
    for repeat in range(args.repeats):
        for case in cases:
            for arm in ("stock", "launcher"):  # interleaved: A, B, A, B, ...
                log = out / "logs" / f"{case.name}_{case.sizes}_{arm}_{repeat}"
                record = run_once(arm, case, args, profiles.get(case.key), log, unavailable is None)
                runs[case.key][arm].append(record)
                print(f"[{repeat + 1}/{args.repeats}] {case.key} {arm}: {record['it_per_s']:.2f} it/s, "
                      f"auc {record['auc']:.4f}, wire {record['wire_bytes_run']} B, plan {record['plan']}", flush=True)  # fmt: skip
    results = {
        "command": "python -m torchrec_het_bench.adoption " + " ".join(sys.argv[1:] if argv is None else argv),
        "provenance": provenance(),
        "steps": args.steps,
        "repeats": args.repeats,
        "sizes": {name: sizes_of(name) for name in args.sizes},  # the trainer's --preset of each
        "world_size": world_size(args),
        "cpu_budget": budget_for(world_size(args)).as_dict(),  # both arms' (run_env)
        "network": network,
        "trainer": TRAINER,
        "launcher_env": args.launcher_env,
        "wire_bytes": (
            "kernel counters of the hosts' links (the sum of every host's eth0 transmit bytes: what crossed the "
            "emulated network, TCP/IP headers included, each packet once; traffic within a host is not counted). "
            "'run': launch to exit; 'per step': from the step N/10 line to the last step line."
            if args.network == "emulated"
            else "kernel counters of the loopback of a network namespace made for each run (all of that run's "
            "traffic: ranks, rendezvous store, torchrun agent; TCP/IP headers included; each packet once). "
            "'run': launch to exit; 'per step': from the step N/10 line to the last step line. "
            f"'No more bytes' allows {BYTES_TOLERANCE:.1%}, more than runs of one plan differ."
            if unavailable is None
            else f"not measured: {unavailable}"
        ),
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg()[0],
        "cases": {case.key: summarize_case(case, runs[case.key]) for case in cases},  # "<case>/<sizes>"
    }
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "results.md").write_text(markdown(results))
    print(markdown(results), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

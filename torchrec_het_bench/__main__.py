"""DLRM benchmark: stock TorchRec and the plugin's configurations, side by side.

python -m torchrec_het_bench --preset default --out bench_out
python -m torchrec_het_bench --list
python -m torchrec_het_bench --network emulated --hosts 2 --gbit 1
python -m torchrec_het_bench --network auto      # loopback, then emulated hosts where possible (make bench)
python -m torchrec_het_bench --preset converge --seeds 3   # AUC over 3 seeds, differences with a t interval
python -m torchrec_het_bench --pipeline plain     # default: TorchRec's TrainPipelineSparseDist
python -m torchrec_het_bench --pipeline sparse_dist,hybrid,semi_sync --embedding-staleness 2
python -m torchrec_het_bench --preset converge --configs stock_table_wise,planned_s10 --pipeline sparse_dist,hybrid
python -m torchrec_het_bench --soak 3000 --preset smoke --configs het_het_s10_c1,rep_m100_s1 --pipeline sparse_dist,hybrid
"""

import argparse
import functools
import os
import sys

from torchrec_het_testing import warm_start

if __name__ == "__main__" and "RANK" not in os.environ and "--list" not in sys.argv:
    # the ranks' server imports TorchRec while this process does (under torchrun: no server); the tables
    # in huge pages: a first touch of fresh memory costs ~4 s per GB here in 4 KB pages, and every
    # entry of a run holds its own (docs/measuring.md#huge-pages)
    warm_start.start_early(huge_pages=True)

from torchrec_het_bench import configs as bench_configs
from torchrec_het_bench.busy import busy_machine
from torchrec_het_bench.flags import BUSY_HELP, cpu_share, float_above, int_at_least
from torchrec_het_bench.launch import launched_by_torchrun, run_under_torchrun, spawn
from torchrec_het_bench.model import BENCH_DEVICE, EMBEDDING_OPTIMIZERS
from torchrec_het_bench.networks import NETWORK_MODES, plan_networks
from torchrec_het_bench.pipelines import (
    DEFAULT_EMBEDDING_STALENESS,
    DEFAULT_PIPELINE,
    PIPELINES,
    PipelineUnavailable,
    check_embedding_staleness,
    parse_pipelines,
)
from torchrec_het_bench.presets import MIN_ROUNDS, PRESETS, REFERENCE_GBIT, get_preset
from torchrec_het_bench.results import write_outputs
from torchrec_het_bench.seeds import run_seeds
from torchrec_het_bench.soak import SoakSpec, run_soak
from torchrec_het_bench.soak_results import write_outputs as write_soak_outputs
from torchrec_het_bench.worker import RunSpec, run_benchmark


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="torchrec-het-bench", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument(
        "--configs",
        default="",
        help="comma-separated configuration names (default: the stock ones that apply, planned, planned_s10)",
    )
    parser.add_argument("--list", action="store_true", help="print the configuration names and exit")
    parser.add_argument("--world-size", type=int_at_least(1), default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--out", default="bench_out", help="directory for results.json, results.md, results.png")
    parser.add_argument(
        "--alpha",
        type=float_above(0, inclusive=True),
        help="Zipf exponent of the ids, >= 0 (0: uniform; overrides the preset)",
    )
    parser.add_argument(
        "--rounds",
        type=int_at_least(MIN_ROUNDS),
        help=f"rounds of interleaved measurement, >= {MIN_ROUNDS} (overrides the preset)",
    )
    parser.add_argument("--steps-per-round", type=int_at_least(1), help="measured steps per configuration per round")
    parser.add_argument(
        "--warmup-steps", type=int_at_least(0), help="unmeasured steps per configuration before round 1"
    )
    parser.add_argument("--embedding-optimizer", choices=sorted(EMBEDDING_OPTIMIZERS), default="rowwise_adagrad")
    parser.add_argument(
        "--pipeline",
        default=DEFAULT_PIPELINE,
        help="training loop(s), comma-separated: every configuration trains under each, as its own entry "
        "(named config@pipeline when there are several), interleaved in the same rounds; "
        + "; ".join(f"{name}: {kind.description}" for name, kind in PIPELINES.items())
        + f" (default {DEFAULT_PIPELINE})",
    )
    parser.add_argument(
        "--embedding-staleness",
        type=_staleness,
        default=DEFAULT_EMBEDDING_STALENESS,
        metavar="K",
        help="k of --pipeline hybrid: the most embedding updates a batch's read may miss, an int >= 0 "
        f"(default {DEFAULT_EMBEDDING_STALENESS}; 0 trains exactly as sparse_dist)",
    )
    parser.add_argument(
        "--eval-every",
        type=int_at_least(0),
        metavar="N",
        help="held-out AUC every N trained steps besides the final one, for the AUC curve (overrides the preset; 0: final only)",
    )
    parser.add_argument("--data", help="Criteo data (TSV file/dir or npy day files); default: built-in synthetic data")
    parser.add_argument(
        "--network",
        choices=NETWORK_MODES,
        default="loopback",
        help="auto: loopback into OUT/loopback, then emulated hosts into OUT/emulated where this machine allows "
        "them (root, iproute2), else one line says why not",
    )
    parser.add_argument("--hosts", type=int_at_least(1), default=2, help="emulated hosts (with --network emulated)")
    parser.add_argument(
        "--gbit",
        type=float_above(0),
        default=REFERENCE_GBIT,
        help=f"emulated link rate, Gbit/s (default {REFERENCE_GBIT}: where stock table_wise spends about half its step communicating)",
    )
    parser.add_argument(
        "--delay-ms", type=float_above(0, inclusive=True), default=0.05, help="emulated one-way link latency, ms"
    )
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument(
        "--seeds",
        type=int_at_least(1),
        default=1,
        metavar="N",
        help="run N times, seeds SEED..SEED+N-1 (into OUT/seed_<s>), and merge: AUC as the mean over seeds, "
        "AUC differences from stock with a paired t interval",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--busy", type=cpu_share, default=0.0, metavar="SHARE", help=BUSY_HELP)
    parser.add_argument(
        "--profile-steps",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="profile each entry's last N warm-up steps with torch.profiler, stage by stage (results.json "
        "stage_profile, a table in results.md; docs/measuring.md#stage-profile; default 0: none)",
    )
    parser.add_argument(
        "--soak",
        type=int_at_least(2),
        metavar="STEPS",
        help="soak mode: every entry trains STEPS steps alone; per rank RSS, peak RSS and, after the warm-up "
        "(--warmup-steps, default STEPS/5), live tensors and gc objects are sampled; results.json gets the series "
        "and a verdict per entry (peak RSS growth after warm-up, live-object slope)",
    )
    parser.add_argument(
        "--soak-every",
        type=int_at_least(1),
        metavar="N",
        help="with --soak: trained steps between samples (default STEPS/40)",
    )
    args = parser.parse_args(argv)
    args.soak_spec = _soak(parser, args)
    if args.network != "loopback" and args.world_size % args.hosts:
        parser.error(f"--world-size {args.world_size} is not a multiple of --hosts {args.hosts}")
    # Checked here, in the parent, before any rank starts: argparse exits with code 2 and the message
    # names the flag, the bad value and the valid ones.
    args.chosen = [] if args.list else _configs(parser, args)
    try:
        args.runs = parse_pipelines(args.pipeline, args.embedding_staleness, BENCH_DEVICE)
    except PipelineUnavailable as error:  # its message names the flag
        parser.error(str(error))
    return args


def _configs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list:
    """``--configs``: the configurations named, in order, or the preset's defaults."""
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    try:
        return bench_configs.select(names, get_preset(args.preset))
    except ValueError as error:
        parser.error(f"argument --configs: {error}")


def _soak(parser: argparse.ArgumentParser, args: argparse.Namespace) -> SoakSpec | None:
    """``--soak`` and its flags (None: not a soak run); the flags that only a measured run takes are refused."""
    if args.soak is None:
        if args.soak_every is not None:
            parser.error("argument --soak-every: only with --soak")
        return None
    for flag in ("rounds", "steps_per_round", "eval_every"):
        if getattr(args, flag) is not None:
            parser.error(
                f"argument --{flag.replace('_', '-')}: not with --soak (a soak trains each entry --soak steps)"
            )
    if args.seeds > 1:
        parser.error("argument --seeds: not with --soak (a soak measures memory, not AUC; run one --seed at a time)")
    try:
        return SoakSpec.of(args.soak, args.warmup_steps, args.soak_every)
    except ValueError as error:
        parser.error(f"argument --warmup-steps: {error}")


def _staleness(text: str) -> int:
    """``--embedding-staleness``: argparse names the flag in its error."""
    try:
        return check_embedding_staleness(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}") from None


def _host_of_rank(args: argparse.Namespace, network: dict) -> tuple[int, ...]:
    if network["mode"] == "loopback":
        return (0,) * args.world_size
    per_host = args.world_size // args.hosts
    return tuple(rank // per_host for rank in range(args.world_size))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    preset = get_preset(
        args.preset,
        alpha=args.alpha,
        rounds=args.rounds,
        steps_per_round=args.steps_per_round,
        warmup_steps=args.warmup_steps,
        eval_every=args.eval_every,
    )
    if args.list:
        for config in bench_configs.CONFIGS.values():
            mark = "" if config.applies(preset) else f"  (does not apply to preset {preset.name})"
            print(f"{config.name:24s} {config.description}{mark}")
        return 0
    chosen, runs = args.chosen, args.runs
    mode = (
        "loopback" if args.network == "auto" and launched_by_torchrun() else args.network
    )  # torchrun placed the ranks
    networks, skipped = plan_networks(mode, args.out, args.hosts, args.gbit, args.delay_ms)
    body, on_done = run_benchmark, write_outputs
    if args.soak_spec is not None:
        body = functools.partial(run_soak, soak=args.soak_spec)
        on_done = functools.partial(write_soak_outputs, soak=args.soak_spec)
    for run in networks:
        spec = RunSpec(
            preset=preset,
            config_names=tuple(c.name for c in chosen),
            world_size=args.world_size,
            host_of_rank=_host_of_rank(args, run.network),
            network=run.network,
            embedding_optimizer=args.embedding_optimizer,
            data_path=args.data,
            out_dir=run.out_dir,
            seed=args.seed,
            progress=not args.no_progress,
            pipeline=",".join(r.name for r in runs),
            embedding_staleness=args.embedding_staleness,
            busy_share=args.busy,
            profile_steps=args.profile_steps,
        )
        launch = functools.partial(run_under_torchrun if launched_by_torchrun() else spawn, on_done=on_done, body=body)
        with busy_machine(args.busy) as busy:
            if args.seeds > 1:
                run_seeds(spec, args.seeds, launch)
            else:
                launch(spec)
        if busy["share"]:
            print(
                f"busy processes took {busy['taken']:.0%} of {busy['cores']} cores (asked {busy['share']:.0%})",
                flush=True,
            )
    if skipped is not None:
        print(skipped, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m torchrec_het_bench.plan_time``: how long planning takes with the link probe and without.

    python -m torchrec_het_bench.plan_time                                   # 2 ranks, loopback
    python -m torchrec_het_bench.plan_time --network emulated --gbit 1.25    # one rank on each of 2 hosts

Each rank builds the recipe trainer's DLRM (``recipes/train_dlrm.py``, ``--preset``), installs the
plugin as the launcher does (with a profile of its data when ``--profile`` is given) and times
``EmbeddingShardingPlanner(...).collective_plan(...)`` as the trainer calls it: a fresh planner each
time, the probe on (``link_probe=True``) and off, interleaved, ``--repeats`` times each. Prints the
median seconds of each (the slowest rank's), their difference, and the figures the planner priced.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist

from torchrec_het_bench.flags import float_above, int_at_least
from torchrec_het_testing import warm_start


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m torchrec_het_bench.plan_time", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("smoke", "default"), default="smoke")
    parser.add_argument("--repeats", type=int_at_least(1), default=3)
    parser.add_argument("--profile", default=None, help="an access profile of the data (TORCHREC_HET_PROFILE)")
    parser.add_argument("--network", choices=("loopback", "emulated"), default="loopback")
    parser.add_argument("--gbit", type=float_above(0), default=1.25, help="the emulated link (with --network emulated)")
    return parser.parse_args(argv)


def _rank(rank: int, args: argparse.Namespace, envs: list[dict[str, str]], netns: list[str] | None) -> None:
    if netns is not None:
        from torchrec_het_bench.netem import join_host

        join_host(netns[rank])
    os.environ.update(envs[rank])
    dist.init_process_group("gloo", rank=rank, world_size=len(envs))
    import torchrec_het

    torchrec_het.install(profile=args.profile)  # first, as the launcher does: then the trainer's imports
    from torchrec.distributed.model_parallel import get_default_sharders
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from torchrec_het_bench.data import DataConfig, open_source
    from torchrec_het_bench.recipes.train_dlrm import PRESETS, build_model

    preset = PRESETS[args.preset]()
    source = open_source(None, DataConfig(table_sizes=preset.table_sizes, batch_size=preset.batch_size), len(envs))
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.repeats):
        for probe in (True, False):
            model = build_model(preset, source.feature_names, source.num_dense)
            topology = Topology(
                world_size=len(envs), local_world_size=int(os.environ["LOCAL_WORLD_SIZE"]), compute_device="cpu"
            )
            dist.barrier()
            start = time.perf_counter()
            planner = EmbeddingShardingPlanner(topology=topology, batch_size=preset.batch_size, link_probe=probe)
            planner.collective_plan(model, get_default_sharders(), dist.GroupMember.WORLD)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[probe].append(float(elapsed))
            if rank == 0 and probe:
                print(f"probe on: {planner.links.describe()}", flush=True)
    if rank == 0:
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"collective_plan, median of {args.repeats}: probe on {on:.2f} s {times[True]}, probe off {off:.2f} s "
              f"{times[False]}; the probe adds {on - off:.2f} s", flush=True)  # fmt: skip
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.network == "loopback":
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = str(free.getsockname()[1])
        envs = [dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, LOCAL_WORLD_SIZE="2") for _ in range(2)]
        warm_start.start_processes(_rank, (args, envs, None), 2)
        return 0
    from torchrec_het_bench.netem import EmulatedHosts, LinkSpec

    with EmulatedHosts(2, LinkSpec(args.gbit, 0.0), name_prefix="trhplantime") as hosts:
        envs = [dict(hosts.rank_env(rank, [0, 1]), MASTER_PORT="29517") for rank in range(2)]
        warm_start.start_processes(_rank, (args, envs, [hosts.host_netns(h) for h in (0, 1)]), 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

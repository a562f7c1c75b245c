"""The adoption check on emulated hosts (``python -m torchrec_het_bench.adoption --network emulated``).

One rank on each emulated host (:mod:`torchrec_het_bench.netem`): every host starts its own
``torchrun`` (arm ``stock``) or ``python -m torchrec_het.launch`` (arm ``launcher``) with
``--nnodes H --nproc-per-node 1 --node-rank h --master-addr <host 0> --master-port`` inside its
network namespace, as a user would start a job on H machines; gloo talks over the hosts' shaped
links. Every run gets fresh hosts; the wire bytes are the sum of the hosts' ``eth0`` transmit
counters (what crossed the emulated network). Links are shaped in rate only (no added latency).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchrec_het_bench.adoption_runs import Case, trainer_args, watch
from torchrec_het_bench.netem import EmulatedHosts, LinkSpec, run_command
from torchrec_het_bench.netem_measure import link_truth

RENDEZVOUS_PORT = 29400  # in host 0's fresh namespace nothing else listens


def host_command(arm: str, case: Case, args: argparse.Namespace, host: int, master_addr: str) -> list[str]:
    """Host ``host``'s command line: torchrun, or the plugin's launcher, for one node of ``args.hosts``."""
    head = ["-m", "torch.distributed.run"] if arm == "stock" else ["-m", "torchrec_het.launch"]
    node = ["--nnodes", str(args.hosts), "--nproc-per-node", "1", "--node-rank", str(host),
            "--master-addr", master_addr, "--master-port", str(RENDEZVOUS_PORT)]  # fmt: skip
    return [sys.executable, *head, *node, *trainer_args(case, args.steps, args.eval_batches)]


def link_bytes(hosts: EmulatedHosts) -> int:
    """Bytes every host has sent over its link so far (the hosts' ``eth0`` transmit counters, summed)."""
    total = 0
    for host in range(hosts.num_hosts):
        shown = run_command("ip", "-j", "-s", "-n", hosts.host_netns(host), "link", "show", hosts.interface(host))
        (link,) = json.loads(shown)
        total += int(link["stats64"]["tx"]["bytes"])
    return total


def link_spec(args: argparse.Namespace) -> LinkSpec:
    return LinkSpec(gbit=args.gbit, delay_ms=0.0)


def run_on_hosts(
    arm: str, case: Case, args: argparse.Namespace, env: dict[str, str], log: Path, warm_step: int, prefix: str
) -> dict:
    """Runs the trainer once, one rank per emulated host; returns the run's record (rank 0's output,
    the bytes the links carried)."""
    with EmulatedHosts(args.hosts, link_spec(args), name_prefix=prefix) as hosts:
        runs = []
        for host in range(args.hosts):
            argv = [
                "ip",
                "netns",
                "exec",
                hosts.host_netns(host),
                *host_command(arm, case, args, host, hosts.host_address(0)),
            ]
            runs.append((argv, dict(env, GLOO_SOCKET_IFNAME=hosts.interface(host))))
        return watch(runs, args.steps, warm_step, log, lambda: link_bytes(hosts))


def measure_link(args: argparse.Namespace, prefix: str) -> dict[str, float]:
    """What bulk TCP gets over the runs' link (``netem_measure.link_truth``), on hosts made for it."""
    with EmulatedHosts(2, link_spec(args), name_prefix=prefix) as hosts:
        return link_truth(hosts)


def describe_link(network: dict) -> str:
    """One line: the shaped rate and what bulk TCP got over it."""
    tcp = network["tcp"]
    return (f"{network['hosts']} hosts, links shaped to {network['gbit']:g} Gbit/s each way (no added latency); "
            f"bulk TCP {tcp['one_way_gbit']:.3g} Gbit/s one way, {tcp['both_ways_gbit']:.3g} each way both at once")  # fmt: skip

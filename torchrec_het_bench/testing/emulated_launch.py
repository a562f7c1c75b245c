"""A job started with ``python -m torchrec_het.launch`` on every emulated host, as on a cluster.

Each host runs its own launcher (torchrun) inside its namespace (``ip netns exec``), with
``--nproc-per-node`` ranks, a c10d rendezvous hosted by host 0's launcher at its address, and
gloo on the host's link (``GLOO_SOCKET_IFNAME``). So every byte between hosts, the rendezvous
store's included, crosses the emulated links, and a cut link
(:func:`torchrec_het_bench.netem_faults.link_cut`) cuts them all.
"""

import sys
from collections.abc import Sequence
from pathlib import Path

from torchrec_het_bench.netem import EmulatedHosts
from torchrec_het_testing.launched import LaunchedRun

RDZV_PORT = 29400  # any port: a fresh namespace has no listeners


def host_launch_argv(
    hosts: EmulatedHosts,
    host: int,
    nproc_per_node: int,
    launcher_args: Sequence[str],
    target: Sequence[str],
    rdzv_id: str = "emulated",
) -> list[str]:
    """The command that runs host ``host``'s launcher in its namespace (``target``: SCRIPT ARGS or -m MODULE ARGS)."""
    return [
        "ip", "netns", "exec", hosts.host_netns(host),
        sys.executable, "-m", "torchrec_het.launch",
        "--nproc-per-node", str(nproc_per_node), "--nnodes", str(hosts.num_hosts),
        "--rdzv-endpoint", f"{hosts.host_address(0)}:{RDZV_PORT}", "--rdzv-id", rdzv_id,
        "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", hosts.host_address(host),
        *launcher_args, *target,
    ]  # fmt: skip


def launch_on_hosts(
    hosts: EmulatedHosts,
    nproc_per_node: int,
    launcher_args: Sequence[str],
    target: Sequence[str],
    cwd: str | Path,
    log_dir: Path,
    env: dict[str, str],
) -> list[LaunchedRun]:
    """Starts one launcher per host; returns their runs, host 0's first (its stdout has rank 0's lines).

    Args:
        hosts: the entered emulated hosts.
        nproc_per_node: ranks per host.
        launcher_args: more launcher options (e.g. ``--max-restarts 1``).
        target: SCRIPT ARGS or ``-m`` MODULE ARGS.
        cwd: working directory of every launcher.
        log_dir: where each host's stderr goes (``host<h>.stderr``).
        env: the environment of every launcher (the host's ``GLOO_SOCKET_IFNAME`` is added).
    """
    runs = []
    try:
        for host in range(hosts.num_hosts):
            argv = host_launch_argv(hosts, host, nproc_per_node, launcher_args, target)
            host_env = dict(env, GLOO_SOCKET_IFNAME=hosts.interface(host))
            runs.append(LaunchedRun(argv, cwd, log_dir / f"host{host}.stderr", host_env))
    except BaseException:
        for run in runs:
            run.kill()
        raise
    return runs

"""Starts the benchmark's ranks: spawned here (loopback or emulated hosts) or under torchrun."""

import faulthandler
import os
import socket
from dataclasses import replace

import torch.distributed as dist

from torchrec_het.integration.cpu_budget import budget_for, current_budget, stated_ranks_on_machine
from torchrec_het_bench.run_links import measure_run_links
from torchrec_het_bench.worker import RunSpec, run_benchmark
from torchrec_het_testing import warm_start

_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched_by_torchrun() -> bool:
    """True inside a process started by torchrun / torchx (the rank env is already set)."""
    return all(key in os.environ for key in _LAUNCHER_ENV)


def rank_env(rank: int, host_of_rank: tuple[int, ...]) -> dict[str, str]:
    """The rank variables torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) for
    ``rank`` of ranks placed on hosts by ``host_of_rank``: TorchRec reads LOCAL_WORLD_SIZE."""
    host = host_of_rank[rank]
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(len(host_of_rank)),
        "LOCAL_RANK": str(host_of_rank[:rank].count(host)),
        "LOCAL_WORLD_SIZE": str(host_of_rank.count(host)),
    }


def with_cpu_budget(spec):
    """``spec`` with the budget of ``spec.world_size`` ranks spawned on this machine (``spec.cpu``)."""
    return replace(spec, cpu=budget_for(spec.world_size), cpu_from_torchrun=False)


def say_if_oversubscribed(budget) -> None:
    """One line when the ranks' threads exceed this machine's cores."""
    warning = budget.warning()
    if warning is not None:
        print(f"torchrec_het_bench: {warning}", flush=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _rank_main(
    rank: int,
    spec: RunSpec,
    env_of_rank: list[dict[str, str]],
    netns_of_rank: list[str] | None,
    on_done,
    body=run_benchmark,
) -> None:
    faulthandler.enable()  # a rank killed by a signal (a native abort) prints its Python stacks first
    if netns_of_rank is not None:
        from torchrec_het_bench.netem import join_host

        join_host(netns_of_rank[rank])
    os.environ.update(env_of_rank[rank])
    dist.init_process_group("gloo", rank=rank, world_size=spec.world_size)
    try:
        if isinstance(spec, RunSpec):  # the microbenchmark plans nothing, so it measures no link
            spec = _with_links(spec)
        gathered = body(spec)
        if rank == 0:
            on_done(spec, gathered)
        dist.barrier()  # no rank closes its connections while another still reads from them
    finally:
        dist.destroy_process_group()


def _with_links(spec: RunSpec) -> RunSpec:
    """``spec`` with the links the planner measures on this run's group (``network["links"]``)."""
    return replace(spec, network=dict(spec.network, links=measure_run_links(spec.world_size, spec.local_world_size)))


def spawn(spec: RunSpec, on_done, body=run_benchmark) -> None:
    """Runs ``body(spec)`` (default: the benchmark) on ``spec.world_size`` spawned ranks; ``on_done(spec, gathered)``
    runs on rank 0 with what ``body`` returned there.

    Every spawned rank runs on this machine, emulated hosts' too: they share its cores by one
    budget (``spec.cpu``, :func:`~torchrec_het.integration.cpu_budget.budget_for` the world size)."""
    port = str(_free_port())
    spec = with_cpu_budget(spec)
    say_if_oversubscribed(spec.cpu)
    if spec.network["mode"] == "loopback":
        env = [
            dict(rank_env(rank, (0,) * spec.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=port, **spec.cpu.env())
            for rank in range(spec.world_size)
        ]  # one host
        warm_start.start_processes(_rank_main, (spec, env, None, on_done, body), spec.world_size)
        return
    from torchrec_het_bench.netem import EmulatedHosts, LinkSpec, remove_stale
    from torchrec_het_bench.netem_measure import link_truth

    remove_stale()  # namespaces left by an earlier run that was killed
    link = LinkSpec(gbit=spec.network["gbit"], delay_ms=spec.network["delay_ms"])
    with EmulatedHosts(spec.network["hosts"], link) as hosts:
        # Record what the link really adds (kernels without sch_netem get rate shaping only) and what
        # bulk TCP gets over it, beside which the planner's measured figures are recorded.
        tcp = link_truth(hosts) if spec.network["hosts"] > 1 else None
        spec = replace(spec, network=dict(spec.network, delay_ms_effective=hosts.effective_delay_ms, tcp=tcp))
        host_of_rank = list(spec.host_of_rank)
        env = [
            dict(hosts.rank_env(r, host_of_rank), MASTER_PORT=port, **spec.cpu.env()) for r in range(spec.world_size)
        ]
        netns = [hosts.host_netns(h) for h in host_of_rank]
        warm_start.start_processes(_rank_main, (spec, env, netns, on_done, body), spec.world_size)


def run_under_torchrun(spec: RunSpec, on_done, body=run_benchmark) -> None:
    """Runs this process as one rank of a torchrun / torchx job (``body``: as for :func:`spawn`)."""
    world_size = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    spec = replace(spec, world_size=world_size, host_of_rank=tuple(r // local for r in range(world_size)))
    stated = stated_ranks_on_machine()  # ranks of emulated hosts started by hand say so; else torchrun's threads stay
    budget = budget_for(stated) if stated is not None else current_budget(local)
    spec = replace(spec, cpu=budget, cpu_from_torchrun=stated is None)
    if int(os.environ["RANK"]) == 0:
        say_if_oversubscribed(budget)
    dist.init_process_group("gloo")
    try:
        if isinstance(spec, RunSpec):  # the microbenchmark plans nothing, so it measures no link
            spec = _with_links(spec)
        gathered = body(spec)
        if dist.get_rank() == 0:
            on_done(spec, gathered)
        dist.barrier()  # no rank closes its connections while another still reads from them
    finally:
        dist.destroy_process_group()

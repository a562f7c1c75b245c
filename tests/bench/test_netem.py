"""Emulated hosts: namespaces, shaping, cleanup, and a gloo job across them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch.multiprocessing as mp

from torchrec_het_bench import netem
from torchrec_het_bench.netem import (
    EmulatedHosts,
    LinkSpec,
    NetworkCommandError,
    NetworkEmulationUnavailable,
    check_available,
    hosts_for,
    join_host,
    remove_stale,
    run_command,
)
from torchrec_het_bench.netem_measure import link_truth, transfer_seconds
from torchrec_het_bench.testing.netem_ranks import collectives_rank, planner_links_rank

PREFIX = "trhtest"


def _unavailable_reason() -> str | None:
    try:
        check_available()
    except NetworkEmulationUnavailable as error:
        return str(error)
    return None


_REASON = _unavailable_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=f"network emulation unavailable here: {_REASON}")


def _our_namespaces() -> list[str]:
    """Namespaces this test process (or its children) made with the test prefix."""
    mine = f"{PREFIX}-{os.getpid()}-"
    return [name for name in netem._netns_names() if name.startswith(mine)]


def _hosts(num_hosts: int, gbit: float, delay_ms: float = 0.0) -> EmulatedHosts:
    return EmulatedHosts(num_hosts, LinkSpec(gbit, delay_ms), name_prefix=PREFIX)


def _qdiscs(netns: str) -> dict[str, dict]:
    """The root qdisc of each device of a namespace, from ``tc -j qdisc show``."""
    shown = json.loads(run_command("tc", "-j", "-n", netns, "qdisc", "show"))
    return {q["dev"]: q for q in shown if q.get("root")}


def _tx_bytes(netns: str, device: str) -> int:
    (link,) = json.loads(run_command("ip", "-j", "-s", "-n", netns, "link", "show", "dev", device))
    return link["stats64"]["tx"]["bytes"]


# --- no privileges needed ---------------------------------------------------


def test_link_spec_validates_and_sizes_queues() -> None:
    for bad in (dict(gbit=0), dict(gbit=-1), dict(gbit=1, delay_ms=-0.1), dict(gbit=float("nan"))):
        with pytest.raises(ValueError):
            LinkSpec(**bad)
    slow, fast = LinkSpec(1.0), LinkSpec(10.0)
    assert slow.rate_arg() == "1000000000bit" and fast.rate_arg() == "10000000000bit"
    assert slow.burst_bytes() == 131072 and fast.burst_bytes() == 625000
    # A queue holds a few milliseconds at line rate, never less than a few GSO packets.
    assert 2e-3 <= fast.queue_limit_bytes() / fast.bytes_per_s <= 5e-3
    assert slow.queue_limit_bytes() >= 4 * 65536


def test_hosts_for_is_contiguous_and_validated() -> None:
    assert hosts_for(4, 2) == [0, 0, 1, 1]
    assert hosts_for(3, 1) == [0, 0, 0]
    assert hosts_for(3, 3) == [0, 1, 2]
    for world_size, num_hosts in ((3, 2), (0, 1), (2, 0)):
        with pytest.raises(ValueError):
            hosts_for(world_size, num_hosts)


def test_names_addresses_and_rank_env() -> None:
    hosts = EmulatedHosts(3, LinkSpec(1.0))
    assert [hosts.host_address(h) for h in range(3)] == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    names = [hosts.host_netns(h) for h in range(3)] + [hosts.switch_netns]
    assert len(set(names)) == 4 and all(n.startswith(f"trh-{os.getpid()}-") for n in names)
    env = hosts.rank_env(3, [0, 0, 1, 1], master_port=29500)
    assert env == {
        "MASTER_ADDR": "198.18.0.1",
        "MASTER_PORT": "29500",
        "GLOO_SOCKET_IFNAME": hosts.interface(1),
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
    }
    with pytest.raises(ValueError):
        hosts.host_address(3)
    with pytest.raises(ValueError):
        hosts.rank_env(0, [0, 5])
    with pytest.raises(ValueError):
        EmulatedHosts(2, LinkSpec(1.0), name_prefix="bad-prefix")


def test_command_errors_name_the_command() -> None:
    with pytest.raises(NetworkCommandError, match=r"`ip netns delete trhtest-no-such-ns` failed"):
        run_command("ip", "netns", "delete", "trhtest-no-such-ns")


def test_join_host_of_missing_namespace_is_a_clear_error() -> None:
    with pytest.raises(FileNotFoundError, match="trhtest-no-such-ns"):
        join_host("trhtest-no-such-ns")


def test_uplink_with_delay_puts_the_rate_limit_under_netem(monkeypatch) -> None:
    issued = []
    monkeypatch.setattr(netem, "run_command", lambda *args: issued.append(list(args)) or "")
    link = LinkSpec(1.0, 0.5)
    netem._shape_uplink("trhtest-ns", link, with_delay=True)
    add = ["tc", "-n", "trhtest-ns", "qdisc", "add", "dev", "eth0"]
    assert issued == [
        [*add, "root", "handle", "1:", "netem", "delay", "0.5ms", "limit", str(link.delay_limit_packets())],
        [
            *add,
            "parent",
            "1:1",
            "handle",
            "10:",
            "tbf",
            "rate",
            "1000000000bit",
            "burst",
            str(link.burst_bytes()),
            "limit",
            str(link.queue_limit_bytes()),
        ],
    ]


# --- namespaces ---------------------------------------------------------------


@needs_netns
def test_builds_namespaces_addresses_and_qdiscs_then_removes_them() -> None:
    with _hosts(2, gbit=2.0) as hosts:
        assert sorted(_our_namespaces()) == sorted([hosts.switch_netns, hosts.host_netns(0), hosts.host_netns(1)])
        for host in range(2):
            netns, device = hosts.host_netns(host), hosts.interface(host)
            links = {link["ifname"]: link for link in json.loads(run_command("ip", "-j", "-n", netns, "addr", "show"))}
            assert set(links) == {"lo", device}
            assert "UP" in links["lo"]["flags"]
            assert [(a["family"], a["local"]) for a in links[device]["addr_info"]] == [
                ("inet", hosts.host_address(host))
            ]
            uplink = _qdiscs(netns)[device]
            assert uplink["kind"] == "tbf" and uplink["options"]["rate"] == 250_000_000  # bytes/s
            downlink = _qdiscs(hosts.switch_netns)[hosts.bridge_port(host)]
            assert downlink["kind"] == "tbf" and downlink["options"]["rate"] == 250_000_000
    assert _our_namespaces() == []


@needs_netns
def test_without_netem_the_delay_is_reported_as_not_added(monkeypatch) -> None:
    monkeypatch.setattr(netem, "_netem_support", False)
    with pytest.warns(RuntimeWarning, match="latency is not added"):
        with _hosts(1, gbit=1.0, delay_ms=0.5) as hosts:
            assert hosts.effective_delay_ms == 0.0
            assert _qdiscs(hosts.host_netns(0))[hosts.interface(0)]["kind"] == "tbf"


@needs_netns
def test_removes_namespaces_when_the_body_raises() -> None:
    with pytest.raises(KeyError):
        with _hosts(2, gbit=1.0):
            assert len(_our_namespaces()) == 3
            raise KeyError("boom")
    assert _our_namespaces() == []


@needs_netns
def test_removes_namespaces_when_building_fails_half_way(monkeypatch) -> None:
    real = netem._shape_downlink

    def fail_on_second_host(switch_netns: str, port: str, link: LinkSpec) -> None:
        if port.endswith("1"):
            run_command("tc", "-n", switch_netns, "qdisc", "add", "dev", port, "root", "no-such-qdisc")
        real(switch_netns, port, link)

    monkeypatch.setattr(netem, "_shape_downlink", fail_on_second_host)
    with pytest.raises(NetworkCommandError, match="no-such-qdisc"):
        with _hosts(3, gbit=1.0):
            pytest.fail("the body must not run")
    assert _our_namespaces() == []


_HOLDER = """
import signal, sys
# A job started in the background of a non-interactive shell (as CI may start this suite)
# inherits SIGINT ignored; the holder stands for an interactive program, where it is not.
signal.signal(signal.SIGINT, signal.default_int_handler)
from torchrec_het_bench.netem import EmulatedHosts, LinkSpec
with EmulatedHosts(2, LinkSpec(1.0, 0.0), name_prefix=sys.argv[1]) as hosts:
    print(hosts.switch_netns, flush=True)
    sys.stdin.readline()
"""


@needs_netns
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_removes_namespaces_then_acts_as_default(signum: int) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, PREFIX],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        switch = holder.stdout.readline().strip()
        assert switch.startswith(f"{PREFIX}-{holder.pid}-"), holder.stderr.read()
        assert switch in netem._netns_names()
        holder.send_signal(signum)
        # SIGTERM kills; SIGINT raises KeyboardInterrupt, which, unhandled, ends Python by SIGINT too.
        try:
            code = holder.wait(timeout=20)
        except subprocess.TimeoutExpired:
            holder.kill()
            raise AssertionError(
                f"holder still alive 20 s after signal {signum}: {holder.communicate()[1][-2000:]}"
            ) from None
        assert code == -signum
    finally:
        holder.kill()
        holder.wait()
    assert [n for n in netem._netns_names() if n.startswith(f"{PREFIX}-{holder.pid}-")] == []


@needs_netns
def test_remove_stale_deletes_only_namespaces_of_dead_owners() -> None:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    dead = f"{PREFIX}-{finished.pid}-0-h0"
    alive = f"{PREFIX}-{os.getpid()}-999-h0"
    for name in (dead, alive):
        run_command("ip", "netns", "add", name)
    try:
        assert dead in remove_stale(PREFIX)
        names = netem._netns_names()
        assert dead not in names and alive in names
    finally:
        for name in (dead, alive):
            if name in netem._netns_names():
                run_command("ip", "netns", "delete", name)


# --- traffic --------------------------------------------------------------------


@needs_netns
def test_gloo_job_on_two_hosts_of_two_ranks() -> None:
    world_size, num_hosts = 4, 2
    host_of_rank = hosts_for(world_size, num_hosts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no netem: rate only
        with _hosts(num_hosts, gbit=1.0, delay_ms=0.05) as hosts:
            # A fresh namespace has no listeners, so any port is free in it.
            envs = [hosts.rank_env(rank, host_of_rank, master_port=29500) for rank in range(world_size)]
            netns_of_rank = [hosts.host_netns(host) for host in host_of_rank]
            mp.start_processes(collectives_rank, args=(envs, netns_of_rank), nprocs=world_size, start_method="spawn")
    assert _our_namespaces() == []


@needs_netns
def test_link_rate_slows_cross_host_but_not_same_host_traffic() -> None:
    nbytes = 25_000_000
    link = LinkSpec(0.2, 0.0)
    with _hosts(2, gbit=link.gbit) as hosts:
        cross = transfer_seconds(hosts, 0, 1, nbytes)
        before = _tx_bytes(hosts.host_netns(0), hosts.interface(0))
        same = transfer_seconds(hosts, 0, 0, nbytes)
        crossed_the_link = _tx_bytes(hosts.host_netns(0), hosts.interface(0)) - before
    theoretical = nbytes * 8 / (link.gbit * 1e9)  # 1.0 s
    assert cross >= 0.5 * theoretical, f"{cross:.3f} s across hosts, link allows no less than {theoretical:.2f} s"
    assert cross <= 4 * theoretical, f"{cross:.3f} s across hosts, expected about {theoretical:.2f} s"
    assert same < cross / 4, f"same host {same:.3f} s vs across hosts {cross:.3f} s"
    assert crossed_the_link < 1_000_000, f"same-host transfer sent {crossed_the_link} bytes over the host's link"


@needs_netns
def test_the_planners_probe_measures_the_emulated_link(tmp_path) -> None:
    out = tmp_path / "links.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no netem: rate only
        with _hosts(2, gbit=1.25, delay_ms=0.05) as hosts:
            truth = link_truth(hosts)  # bulk TCP: one way, and each way with both at once
            envs = [hosts.rank_env(rank, [0, 1], master_port=29500) for rank in range(2)]
            netns_of_rank = [hosts.host_netns(host) for host in (0, 1)]
            mp.start_processes(planner_links_rank, args=(envs, netns_of_rank, str(out)), nprocs=2, start_method="spawn")
    links = json.loads(out.read_text())
    one_way = links["probe"]["inter_one_way"]["gbit"]
    assert abs(one_way / truth["best_gbit"] - 1) <= 0.25, (links, truth)  # the link's rate, as TCP sees it
    # What the planner prices: every rank sending at once. The link is full duplex (TCP gets ~the same both
    # ways), gloo's pair gets less of it both ways than one way (~0.5-0.7x here): never more than the link.
    assert links["inter_source"] == "measured" and links["intra_source"] == "assumed"
    assert 0.25 * truth["both_ways_gbit"] <= links["inter_gbit"] <= 1.25 * truth["both_ways_gbit"], (links, truth)
    assert links["probe"]["rounds"] <= 2 * links_budget_rounds()
    assert _our_namespaces() == []


def links_budget_rounds() -> int:
    from torchrec_het.planner.link_probe import ProbeBudget

    return ProbeBudget().max_rounds


@needs_netns
def test_an_ignored_sigint_stays_ignored_and_keeps_the_namespaces() -> None:
    script = _HOLDER.replace(
        "signal.signal(signal.SIGINT, signal.default_int_handler)", "signal.signal(signal.SIGINT, signal.SIG_IGN)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", script, PREFIX],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        switch = holder.stdout.readline().strip()
        assert switch.startswith(f"{PREFIX}-{holder.pid}-"), holder.stderr.read()
        holder.send_signal(signal.SIGINT)
        with pytest.raises(subprocess.TimeoutExpired):
            holder.wait(timeout=2)  # still running, as a process that ignores SIGINT should
        assert switch in netem._netns_names()
        holder.send_signal(signal.SIGTERM)
        assert holder.wait(timeout=20) == -signal.SIGTERM
    finally:
        holder.kill()
        holder.wait()
    assert [n for n in netem._netns_names() if n.startswith(f"{PREFIX}-{holder.pid}-")] == []

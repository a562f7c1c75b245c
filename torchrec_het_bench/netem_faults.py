"""Link cuts on emulated hosts (:class:`~torchrec_het_bench.netem.EmulatedHosts`).

A cut takes down the switch-side end of a host's link (its bridge port, in the switch
namespace): as if its cable were pulled at the switch. From then on every frame to or from the
host is lost; the host's interface, address, routes and shaping stay as they were, so its
open TCP connections (gloo's, the rendezvous store's) survive and retransmit, and carry on
once the link is restored, unless something gave up on them first (the process group timeout).

This kernel has no ``netem`` qdisc (no loss to emulate with it), no tc classifier or action
modules (no drop-all filter) and no nftables/iptables; setting a bridge port's STP state is
ignored with STP off. A port taken down is what works here, and what a cluster sees when a
link or a switch port fails.

    with EmulatedHosts(2, LinkSpec(1.25)) as hosts:
        ...                                  # ranks running on the hosts
        with link_cut(hosts, 1):             # host 1 cut off from the switch
            time.sleep(3)
        # restored: forwarding again
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

from torchrec_het_bench.netem import EmulatedHosts, run_command

__all__ = ["cut_link", "link_cut", "link_is_up", "restore_link"]

RESTORE_TIMEOUT_S = 5.0


def cut_link(hosts: EmulatedHosts, host: int) -> None:
    """Cuts ``host`` off the switch: its bridge port goes down and every frame to or from it is lost.

    Raises:
        ValueError: ``host`` is not one of ``hosts``.
        NetworkCommandError: ``ip`` failed (the message has its stderr).
    """
    run_command("ip", "-n", hosts.switch_netns, "link", "set", "dev", hosts.bridge_port(host), "down")


def restore_link(hosts: EmulatedHosts, host: int, timeout_s: float = RESTORE_TIMEOUT_S) -> None:
    """Brings ``host``'s bridge port up again and waits until it forwards (a no-op on an uncut link).

    Raises:
        TimeoutError: the port does not forward within ``timeout_s``.
    """
    run_command("ip", "-n", hosts.switch_netns, "link", "set", "dev", hosts.bridge_port(host), "up")
    deadline = time.monotonic() + timeout_s
    while not link_is_up(hosts, host):
        if time.monotonic() > deadline:
            raise TimeoutError(f"host {host}'s link does not forward {timeout_s} s after it was restored")
        time.sleep(0.01)


def link_is_up(hosts: EmulatedHosts, host: int) -> bool:
    """Whether ``host``'s link carries frames: its interface up and its bridge port forwarding."""
    (host_side,) = json.loads(
        run_command("ip", "-j", "-n", hosts.host_netns(host), "link", "show", "dev", hosts.interface(host))
    )
    (port,) = json.loads(
        run_command("ip", "-j", "-d", "-n", hosts.switch_netns, "link", "show", "dev", hosts.bridge_port(host))
    )
    state = port.get("linkinfo", {}).get("info_slave_data", {}).get("state")
    return host_side.get("operstate") == "UP" and port.get("operstate") == "UP" and state == "forwarding"


@contextmanager
def link_cut(hosts: EmulatedHosts, host: int) -> Iterator[None]:
    """Cuts ``host``'s link for the ``with`` block; restores it on leaving, also on an exception."""
    cut_link(hosts, host)
    try:
        yield
    finally:
        restore_link(hosts, host)

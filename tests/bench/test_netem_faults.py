"""Cutting and restoring an emulated host's link: frames stop both ways, open TCP connections survive."""

import os
import select
import socket
import warnings

import pytest

from torchrec_het_bench import netem
from torchrec_het_bench.netem import (
    EmulatedHosts,
    LinkSpec,
    NetworkEmulationUnavailable,
    check_available,
    socket_in_host,
)
from torchrec_het_bench.netem_faults import cut_link, link_cut, link_is_up, restore_link

PREFIX = "trhtestcut"


def _unavailable_reason() -> str | None:
    try:
        check_available()
    except NetworkEmulationUnavailable as error:
        return str(error)
    return None


_REASON = _unavailable_reason()
needs_netns = pytest.mark.skipif(_REASON is not None, reason=f"network emulation unavailable here: {_REASON}")


def _our_namespaces() -> list[str]:
    return [name for name in netem._netns_names() if name.startswith(f"{PREFIX}-{os.getpid()}-")]


def _connected(hosts: EmulatedHosts) -> tuple[socket.socket, socket.socket]:
    """(host 1's client, host 0's accepted end) of one TCP connection across the link."""
    server = socket_in_host(hosts.host_netns(0))
    server.bind((hosts.host_address(0), 5000))
    server.listen()
    client = socket_in_host(hosts.host_netns(1))
    client.connect((hosts.host_address(0), 5000))
    accepted, _ = server.accept()
    server.close()
    return client, accepted


def _arrives(sender: socket.socket, receiver: socket.socket, payload: bytes, timeout_s: float) -> bool:
    sender.sendall(payload)
    receiver.settimeout(timeout_s)
    try:
        return receiver.recv(len(payload)) == payload
    except TimeoutError:
        return False


@needs_netns
def test_a_cut_stops_traffic_both_ways_and_the_connection_carries_on_after_restore() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with EmulatedHosts(2, LinkSpec(1.0, 0.0), name_prefix=PREFIX) as hosts:
            client, server = _connected(hosts)
            assert _arrives(client, server, b"a", 5) and link_is_up(hosts, 1)
            cut_link(hosts, 1)
            assert not link_is_up(hosts, 1)
            assert not _arrives(client, server, b"b", 1.0), "a byte crossed a cut link"
            assert not _arrives(server, client, b"c", 1.0), "a byte crossed a cut link"
            restore_link(hosts, 1)
            assert link_is_up(hosts, 1)
            # TCP retransmits what the cut lost, on the same connection, in order
            assert _readable(client), "host 1 never got the byte sent during the cut"
            assert client.recv(1) == b"c"
            assert _readable(server), "host 0 never got the byte sent during the cut"
            assert server.recv(1) == b"b"
            assert _arrives(client, server, b"d", 5)
            client.close()
            server.close()
    assert _our_namespaces() == []


def _readable(sock: socket.socket, timeout_s: float = 10) -> bool:
    return bool(select.select([sock], [], [], timeout_s)[0])


@needs_netns
def test_link_cut_restores_the_link_when_the_block_raises() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with EmulatedHosts(2, LinkSpec(1.0, 0.0), name_prefix=PREFIX) as hosts:
            with pytest.raises(KeyError):
                with link_cut(hosts, 0):
                    assert not link_is_up(hosts, 0) and link_is_up(hosts, 1)
                    raise KeyError("boom")
            assert link_is_up(hosts, 0)
            with pytest.raises(ValueError, match="host 2 outside"):
                cut_link(hosts, 2)
    assert _our_namespaces() == []

"""Measures emulated links with plain TCP sockets: bulk throughput and round-trip time.

``python -m torchrec_het_bench.netem_measure --gbit 1 10`` prints, for each
rate, the throughput and round trip between two hosts and within one host, and the
throughput each way when one connection carries data both ways at once.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from torchrec_het_bench.netem import EmulatedHosts, LinkSpec, check_available, socket_in_host

CHUNK_BYTES = 1 << 20
CONNECT_TIMEOUT_S = 10.0


@contextmanager
def connected_pair(
    hosts: EmulatedHosts, client_host: int, server_host: int
) -> Iterator[tuple[socket.socket, socket.socket]]:
    """A TCP connection from ``client_host`` to ``server_host``'s address, as (client, server) sockets.

    Between two ranks of the same host the connection goes through the
    host's loopback, exactly as gloo's would.
    """
    listener = socket_in_host(hosts.host_netns(server_host))
    client = socket_in_host(hosts.host_netns(client_host))
    try:
        listener.bind((hosts.host_address(server_host), 0))
        listener.listen(1)
        listener.settimeout(CONNECT_TIMEOUT_S)
        client.settimeout(CONNECT_TIMEOUT_S)
        client.connect(listener.getsockname())
        server, _ = listener.accept()
    finally:
        listener.close()
    try:
        for sock in (client, server):
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        yield client, server
    finally:
        client.close()
        server.close()


def _send(sock: socket.socket, nbytes: int) -> None:
    chunk = memoryview(bytearray(CHUNK_BYTES))
    remaining = nbytes
    while remaining:
        step = min(remaining, CHUNK_BYTES)
        sock.sendall(chunk[:step])
        remaining -= step


def _receive(sock: socket.socket, nbytes: int) -> None:
    buffer = memoryview(bytearray(CHUNK_BYTES))
    remaining = nbytes
    while remaining:
        got = sock.recv_into(buffer, min(remaining, CHUNK_BYTES))
        if not got:
            raise ConnectionError(f"peer closed with {remaining} bytes still expected")
        remaining -= got


def transfer_seconds(hosts: EmulatedHosts, sender_host: int, receiver_host: int, nbytes: int) -> float:
    """Seconds to move ``nbytes`` over one TCP connection from one host to another (or the same).

    Timed from the first byte sent to the last byte received, on an
    established connection.
    """
    with connected_pair(hosts, sender_host, receiver_host) as (client, server):
        failure: list[BaseException] = []

        def send() -> None:
            try:
                _send(client, nbytes)
            except BaseException as error:  # reported below
                failure.append(error)

        sender = threading.Thread(target=send, name="netem-send")
        start = time.perf_counter()
        sender.start()
        _receive(server, nbytes)
        elapsed = time.perf_counter() - start
        sender.join()
    if failure:
        raise failure[0]
    return elapsed


def both_ways_seconds(hosts: EmulatedHosts, host_a: int, host_b: int, nbytes: int) -> float:
    """Seconds until ``nbytes`` have crossed one TCP connection in each direction at once
    (the link is full duplex: each direction has its own shaper)."""
    with connected_pair(hosts, host_a, host_b) as (client, server):
        failure: list[BaseException] = []

        def run(work, *args) -> None:
            try:
                work(*args)
            except BaseException as error:  # reported below
                failure.append(error)

        threads = [threading.Thread(target=run, args=(work, sock, nbytes), name=f"netem-{work.__name__}")
                   for work in (_send, _receive) for sock in (client, server)]  # fmt: skip
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
    if failure:
        raise failure[0]
    return elapsed


def link_truth(hosts: EmulatedHosts, seconds: float = 0.25, repeats: int = 3) -> dict[str, float]:
    """The link between hosts 0 and 1 as bulk TCP sees it, best of ``repeats`` transfers of about
    ``seconds`` each: ``one_way_gbit`` (what the shaping gives one direction), ``both_ways_gbit``
    (each direction, one connection carrying data both ways at once) and ``best_gbit``, the most
    one direction carried in any of them (on a loaded machine a transfer is only ever slowed)."""
    nbytes = max(1 << 20, round(hosts.link.bytes_per_s * seconds))
    one_way = nbytes * 8 / min(transfer_seconds(hosts, 0, 1, nbytes) for _ in range(repeats)) / 1e9
    both_ways = nbytes * 8 / min(both_ways_seconds(hosts, 0, 1, nbytes) for _ in range(repeats)) / 1e9
    return {"one_way_gbit": one_way, "both_ways_gbit": both_ways, "best_gbit": max(one_way, both_ways)}


def round_trip_ms(hosts: EmulatedHosts, host_a: int, host_b: int, rounds: int = 200) -> float:
    """Median round trip of a 1-byte TCP ping-pong between two hosts (or within one), in ms."""
    with connected_pair(hosts, host_a, host_b) as (client, server):
        failure: list[BaseException] = []

        def echo() -> None:
            try:
                for _ in range(rounds):
                    server.sendall(server.recv(1))
            except BaseException as error:  # reported below
                failure.append(error)

        echoer = threading.Thread(target=echo, name="netem-echo")
        echoer.start()
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            client.sendall(b"x")
            if client.recv(1) != b"x":
                raise ConnectionError("echo peer went away")
            samples.append(time.perf_counter() - start)
        echoer.join()
    if failure:
        raise failure[0]
    return statistics.median(samples) * 1e3


def measure(link: LinkSpec, nbytes: int, repeats: int) -> dict[str, float]:
    """Throughput (Gbit/s, best of ``repeats``) and median round trip (ms), across hosts and within one."""
    with EmulatedHosts(2, link) as hosts:
        best = {
            where: min(transfer_seconds(hosts, 0, peer, nbytes) for _ in range(repeats))
            for where, peer in (("cross", 1), ("same", 0))
        }
        both = min(both_ways_seconds(hosts, 0, 1, nbytes) for _ in range(repeats))
        return {
            "cross_gbit": nbytes * 8 / best["cross"] / 1e9,
            "cross_both_ways_gbit": nbytes * 8 / both / 1e9,
            "same_gbit": nbytes * 8 / best["same"] / 1e9,
            "cross_rtt_ms": round_trip_ms(hosts, 0, 1),
            "same_rtt_ms": round_trip_ms(hosts, 0, 0),
            "delay_added_ms": hosts.effective_delay_ms,
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gbit", type=float, nargs="+", default=[1.0, 10.0])
    parser.add_argument("--delay-ms", type=float, default=0.05)
    parser.add_argument("--megabytes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    check_available()
    print(
        "| link Gbit/s | delay ms (set / added) | cross-host Gbit/s | cross-host both ways, each | same-host Gbit/s "
        "| cross RTT ms | same RTT ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for gbit in args.gbit:
        result = measure(LinkSpec(gbit, args.delay_ms), args.megabytes << 20, args.repeats)
        print(
            f"| {gbit:g} | {args.delay_ms:g} / {result['delay_added_ms']:g} | {result['cross_gbit']:.3f} "
            f"| {result['cross_both_ways_gbit']:.3f} | {result['same_gbit']:.2f} | {result['cross_rtt_ms']:.3f} "
            f"| {result['same_rtt_ms']:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

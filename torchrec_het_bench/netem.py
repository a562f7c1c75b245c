"""Emulated multi-host network for benchmarks: one network namespace per host.

Each emulated host is a Linux network namespace with one veth interface whose
other end is a port of a bridge living in a "switch" namespace of its own. The
host side of every link is shaped with ``tc``: a token bucket (``tbf``) limits
the uplink (host-side veth egress) and the downlink (bridge-port egress toward
the host) to the link rate, and ``netem``, where the kernel has it, adds the
one-way latency on the uplink. Ranks placed on the same host talk to the host's
own address, which goes through the namespace's loopback, unshaped.

Nothing is created in the caller's (root) namespace: no interface, route or
firewall rule. Namespace names are ``<prefix>-<owner pid>-<serial>-<role>`` so
that :func:`remove_stale` can find the leftovers of a crashed run.

Typical use with ``torch.multiprocessing``::

    host_of_rank = hosts_for(world_size, num_hosts)
    with EmulatedHosts(num_hosts, LinkSpec(gbit=10.0)) as hosts:
        envs = [hosts.rank_env(r, host_of_rank, master_port=port) for r in range(world_size)]
        netns = [hosts.host_netns(h) for h in host_of_rank]
        mp.start_processes(rank_main, args=(envs, netns), nprocs=world_size, start_method="spawn")

    def rank_main(rank, envs, netns):
        join_host(netns[rank])          # first, before any socket exists
        os.environ.update(envs[rank])
        dist.init_process_group("gloo")
"""

from __future__ import annotations

import atexit
import ctypes
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = [
    "EmulatedHosts",
    "LinkSpec",
    "NetworkCommandError",
    "NetworkEmulationUnavailable",
    "check_available",
    "hosts_for",
    "join_host",
    "netem_available",
    "remove_stale",
    "socket_in_host",
]

NETNS_DIR = "/var/run/netns"
HOST_INTERFACE = "eth0"
BRIDGE = "br0"
SUBNET = ipaddress.IPv4Network("198.18.0.0/24")  # RFC 2544 benchmarking range
MAX_HOSTS = SUBNET.num_addresses - 2
CLONE_NEWNET = 0x40000000
READY_TIMEOUT_S = 5.0

_serials = itertools.count()
_netem_support: bool | None = None
_T = TypeVar("_T")


class NetworkEmulationUnavailable(RuntimeError):
    """This machine or process cannot build emulated hosts; the message says why."""


class NetworkCommandError(RuntimeError):
    """An ``ip`` or ``tc`` command failed; the message has the command and its stderr."""

    def __init__(self, command: list[str], returncode: int, stderr: str):
        self.command = command
        self.returncode = returncode
        self.stderr = stderr.strip()
        super().__init__(f"`{' '.join(command)}` failed (exit {returncode}): {self.stderr or '(no stderr)'}")


def run_command(*args: str) -> str:
    """Runs one ``ip`` / ``tc`` command and returns its stdout.

    Args:
        *args: The command and its arguments, e.g. ``"ip", "netns", "add", name``.

    Raises:
        NetworkCommandError: The command exited non-zero.
    """
    command = list(args)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetworkCommandError(command, done.returncode, done.stderr)
    return done.stdout


# ---------------------------------------------------------------------------
# Availability


def check_available() -> None:
    """Checks that emulated hosts can be built here.

    Raises:
        NetworkEmulationUnavailable: Not root, ``ip`` or ``tc`` missing, network
            namespaces not permitted, or veth / bridge / tbf missing in the kernel.
    """
    if os.geteuid() != 0:
        raise NetworkEmulationUnavailable(f"not root (euid {os.geteuid()}): network namespaces need root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetworkEmulationUnavailable(f"{' and '.join(missing)} not found on PATH (install iproute2)")
    probe = f"{_owned_prefix('trhprobe')}-probe"
    try:
        run_command("ip", "netns", "add", probe)
    except NetworkCommandError as error:
        raise NetworkEmulationUnavailable(f"network namespaces not permitted: {error}") from None
    try:
        _probe_kernel_features(probe)
    finally:
        _delete_netns(probe)


def _probe_kernel_features(netns: str) -> None:
    steps = [
        ("bridge devices", ("ip", "-n", netns, "link", "add", "trhbr", "type", "bridge")),
        ("veth devices", ("ip", "-n", netns, "link", "add", "trhv0", "type", "veth", "peer", "name", "trhv1")),
        (
            "the tbf qdisc",
            (
                "tc",
                "-n",
                netns,
                "qdisc",
                "add",
                "dev",
                "trhv0",
                "root",
                "tbf",
                "rate",
                "1gbit",
                "burst",
                "131072",
                "limit",
                "1048576",
            ),
        ),
    ]
    for feature, command in steps:
        try:
            run_command(*command)
        except NetworkCommandError as error:
            raise NetworkEmulationUnavailable(f"kernel does not support {feature}: {error}") from None


def netem_available() -> bool:
    """True when the kernel has the ``netem`` qdisc (needed to add latency).

    Checked once per process in a throwaway namespace. Without netem, emulated
    links are rate-limited but add no latency.
    """
    global _netem_support
    if _netem_support is None:
        probe = f"{_owned_prefix('trhprobe')}-netem"
        run_command("ip", "netns", "add", probe)
        try:
            run_command("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
            _netem_support = True
        except NetworkCommandError:
            _netem_support = False
        finally:
            _delete_netns(probe)
    return _netem_support


# ---------------------------------------------------------------------------
# Link shaping


@dataclass(frozen=True)
class LinkSpec:
    """One host's link to the switch.

    Attributes:
        gbit: Link rate in Gbit/s, each direction.
        delay_ms: One-way latency added between two hosts, in milliseconds (0: none).
    """

    gbit: float
    delay_ms: float = 0.05

    def __post_init__(self) -> None:
        if not self.gbit > 0 or self.gbit > 400:
            raise ValueError(f"LinkSpec.gbit must be in (0, 400], got {self.gbit!r}")
        if not 0 <= self.delay_ms <= 10_000:
            raise ValueError(f"LinkSpec.delay_ms must be in [0, 10000], got {self.delay_ms!r}")

    @property
    def bytes_per_s(self) -> float:
        """The link rate in bytes per second."""
        return self.gbit * 1e9 / 8

    def rate_arg(self) -> str:
        """The rate in the form ``tc`` takes (bits per second)."""
        return f"{round(self.gbit * 1e9)}bit"

    def burst_bytes(self) -> int:
        """Token bucket depth: 0.5 ms at line rate, at least two 64 KiB GSO packets.

        A bucket smaller than a GSO packet makes tbf split every segment, and one
        much deeper than a millisecond lets bursts run at veth speed.
        """
        return max(2 * 65536, round(self.bytes_per_s * 0.5e-3))

    def queue_limit_bytes(self) -> int:
        """Bytes the shaper may queue: the bucket plus 2 ms at line rate plus a round trip.

        Enough that bulk TCP (cubic or bbr) keeps the link busy without tail
        drops, small enough that a full queue adds only a few milliseconds.
        """
        round_trip_s = 2 * self.delay_ms * 1e-3
        return self.burst_bytes() + max(4 * 65536, round(self.bytes_per_s * (2e-3 + round_trip_s)))

    def delay_limit_packets(self) -> int:
        """Packets netem may hold while delaying: twice the bandwidth-delay product in 1500 B packets."""
        in_flight = self.bytes_per_s * self.delay_ms * 1e-3
        return max(1000, 2 * round(in_flight / 1500))


def _tbf_args(link: LinkSpec) -> list[str]:
    return ["tbf", "rate", link.rate_arg(), "burst", str(link.burst_bytes()), "limit", str(link.queue_limit_bytes())]


def _shape_uplink(netns: str, link: LinkSpec, with_delay: bool) -> None:
    tc = ["tc", "-n", netns, "qdisc", "add", "dev", HOST_INTERFACE]
    if not with_delay:
        run_command(*tc, "root", "handle", "1:", *_tbf_args(link))
        return
    run_command(
        *tc, "root", "handle", "1:", "netem", "delay", f"{link.delay_ms}ms", "limit", str(link.delay_limit_packets())
    )
    run_command(*tc, "parent", "1:1", "handle", "10:", *_tbf_args(link))


def _shape_downlink(switch_netns: str, port: str, link: LinkSpec) -> None:
    run_command("tc", "-n", switch_netns, "qdisc", "add", "dev", port, "root", "handle", "1:", *_tbf_args(link))


# ---------------------------------------------------------------------------
# Namespaces


def _owned_prefix(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_serials)}"


def _validate_prefix(prefix: str) -> None:
    if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", prefix):
        raise ValueError(f"name prefix must be 1-16 lowercase letters/digits starting with a letter, got {prefix!r}")


def _netns_names() -> list[str]:
    return [line.split()[0] for line in run_command("ip", "netns", "list").splitlines() if line.strip()]


def _delete_netns(name: str) -> None:
    run_command("ip", "netns", "delete", name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(prefix: str = "trh") -> list[str]:
    """Deletes the namespaces of ``prefix`` whose owner process is gone.

    Args:
        prefix: The ``name_prefix`` the crashed run used.

    Returns:
        The names of the namespaces deleted.
    """
    _validate_prefix(prefix)
    owned = re.compile(rf"{re.escape(prefix)}-(\d+)-")
    removed = []
    for name in _netns_names():
        match = owned.match(name)
        if match and not _pid_alive(int(match.group(1))):
            _delete_netns(name)
            removed.append(name)
    return removed


def _netns_fd(netns_name: str) -> int:
    path = os.path.join(NETNS_DIR, netns_name)
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise FileNotFoundError(f"no network namespace {netns_name!r} ({path} missing)") from None


def _setns(fd: int) -> None:
    if hasattr(os, "setns"):
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns(CLONE_NEWNET) failed: {os.strerror(errno)}")


def _enter_netns(netns_name: str) -> None:
    fd = _netns_fd(netns_name)
    try:
        _setns(fd)
        if os.stat("/proc/thread-self/ns/net").st_ino != os.fstat(fd).st_ino:
            raise OSError(f"setns into {netns_name!r} did not take effect")
    finally:
        os.close(fd)


def join_host(netns_name: str) -> None:
    """Moves the calling thread (and every thread or socket it creates later) into a host's namespace.

    Call it first thing in a freshly spawned rank process, before any socket
    exists (``init_process_group`` and the TCP store create theirs later, in the
    namespace). Sockets created earlier stay in the old namespace.

    Args:
        netns_name: A name from :meth:`EmulatedHosts.host_netns`.
    """
    _enter_netns(netns_name)


def _run_in_netns(netns_name: str, fn: Callable[[], _T]) -> _T:
    """Runs ``fn`` on a short-lived thread that has joined ``netns_name``."""
    outcome: dict[str, object] = {}

    def body() -> None:
        try:
            _enter_netns(netns_name)
            outcome["value"] = fn()
        except BaseException as error:  # handed to the caller
            outcome["error"] = error

    thread = threading.Thread(target=body, name=f"netns:{netns_name}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def socket_in_host(netns_name: str, kind: int = socket.SOCK_STREAM) -> socket.socket:
    """An IPv4 socket that lives in a host's namespace, usable from any thread of this process.

    Args:
        netns_name: A name from :meth:`EmulatedHosts.host_netns`.
        kind: The socket type.
    """
    return _run_in_netns(netns_name, lambda: socket.socket(socket.AF_INET, kind))


def hosts_for(world_size: int, num_hosts: int) -> list[int]:
    """The host of each rank, contiguous: rank ``r`` on host ``r // (world_size // num_hosts)``.

    Raises:
        ValueError: A size below one, or ``world_size`` not a multiple of ``num_hosts``.
    """
    if world_size < 1 or num_hosts < 1:
        raise ValueError(f"world_size and num_hosts must be >= 1, got {world_size} and {num_hosts}")
    if world_size % num_hosts:
        raise ValueError(f"world_size {world_size} is not a multiple of num_hosts {num_hosts}")
    per_host = world_size // num_hosts
    return [rank // per_host for rank in range(world_size)]


# ---------------------------------------------------------------------------
# Cleanup on exit and signals


class _CleanupGuard:
    """Runs a cleanup at interpreter exit or on SIGINT/SIGTERM while installed.

    On a signal the cleanup runs first, then whatever handled the signal before
    (the default: SIGINT raises KeyboardInterrupt, SIGTERM ends the process).
    A process forked from the owner inherits the handlers but never cleans up.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, cleanup: Callable[[], object]):
        self._cleanup = cleanup
        self._owner_pid = os.getpid()
        self._previous: dict[int, object] = {}

    def install(self) -> None:
        self._owner_pid = os.getpid()
        atexit.register(self._cleanup_if_owner)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in self.SIGNALS:
            if signal.getsignal(signum) == signal.SIG_IGN:
                continue  # an ignored signal stays ignored: the process goes on, so must its namespaces
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def uninstall(self) -> None:
        atexit.unregister(self._cleanup_if_owner)
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, previous)
        self._previous.clear()

    def _on_signal(self, signum: int, frame) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
        self._cleanup_if_owner()
        self.uninstall()
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _cleanup_if_owner(self) -> None:
        if os.getpid() == self._owner_pid:
            self._cleanup()


# ---------------------------------------------------------------------------
# Emulated hosts


class EmulatedHosts:
    """Network namespaces for ``num_hosts`` hosts behind one shaped switch; a context manager.

    Entering builds everything; leaving (also on an exception, SIGINT, SIGTERM
    or interpreter exit) deletes every namespace it made, which deletes the
    veth pairs and qdiscs with them.

    Args:
        num_hosts: How many hosts, 1 to 254.
        link: Rate and latency of every host's link.
        name_prefix: First part of the namespace names; see :func:`remove_stale`.
    """

    def __init__(self, num_hosts: int, link: LinkSpec, name_prefix: str = "trh"):
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be in [1, {MAX_HOSTS}], got {num_hosts}")
        _validate_prefix(name_prefix)
        self.num_hosts = num_hosts
        self.link = link
        self.name_prefix = name_prefix
        self._base = _owned_prefix(name_prefix)
        self._created: list[str] = []
        self._guard = _CleanupGuard(self._destroy)
        self.delay_emulated = False

    # Names and addresses -------------------------------------------------

    @property
    def switch_netns(self) -> str:
        """The namespace holding the bridge."""
        return f"{self._base}-sw"

    def host_netns(self, host: int) -> str:
        """The namespace of ``host``."""
        self._check_host(host)
        return f"{self._base}-h{host}"

    def host_address(self, host: int) -> str:
        """The IPv4 address of ``host``: 198.18.0.(host + 1)."""
        self._check_host(host)
        return str(SUBNET.network_address + host + 1)

    def interface(self, host: int) -> str:
        """The host's veth inside its namespace (the value for ``GLOO_SOCKET_IFNAME``)."""
        self._check_host(host)
        return HOST_INTERFACE

    def bridge_port(self, host: int) -> str:
        """The switch-side veth of ``host``'s link, inside :attr:`switch_netns`."""
        self._check_host(host)
        return f"port{host}"

    @property
    def effective_delay_ms(self) -> float:
        """The one-way latency actually added: ``link.delay_ms``, or 0 without netem."""
        return self.link.delay_ms if self.delay_emulated else 0.0

    def rank_env(self, rank: int, host_of_rank: list[int], master_port: int | None = None) -> dict[str, str]:
        """Environment for ``rank`` of a job whose ranks sit on ``host_of_rank``.

        Sets MASTER_ADDR (the address of rank 0's host), GLOO_SOCKET_IFNAME,
        RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE, and MASTER_PORT when
        given.
        """
        if not 0 <= rank < len(host_of_rank):
            raise ValueError(f"rank {rank} outside a world of {len(host_of_rank)}")
        for host in host_of_rank:
            self._check_host(host)
        host = host_of_rank[rank]
        env = {
            "MASTER_ADDR": self.host_address(host_of_rank[0]),
            "GLOO_SOCKET_IFNAME": self.interface(host),
            "RANK": str(rank),
            "WORLD_SIZE": str(len(host_of_rank)),
            "LOCAL_RANK": str(host_of_rank[:rank].count(host)),
            "LOCAL_WORLD_SIZE": str(host_of_rank.count(host)),
        }
        if master_port is not None:
            env["MASTER_PORT"] = str(master_port)
        return env

    def _check_host(self, host: int) -> None:
        if not 0 <= host < self.num_hosts:
            raise ValueError(f"host {host} outside [0, {self.num_hosts})")

    # Lifecycle -------------------------------------------------------------

    def __enter__(self) -> EmulatedHosts:
        if self._created:
            raise RuntimeError("EmulatedHosts is not re-entrant")
        check_available()
        with_delay = self.link.delay_ms > 0 and netem_available()
        if self.link.delay_ms > 0 and not with_delay:
            warnings.warn(
                f"the kernel has no netem qdisc: emulated links are limited to {self.link.gbit} Gbit/s "
                f"but the {self.link.delay_ms} ms latency is not added",
                RuntimeWarning,
                stacklevel=2,
            )
        self._guard.install()
        try:
            self._build(with_delay)
        except BaseException:
            self._guard.uninstall()
            self._destroy()
            raise
        self.delay_emulated = with_delay
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        self._guard.uninstall()
        failures = self._destroy()
        if failures and exc is None:
            raise NetworkCommandError(["ip", "netns", "delete", *failures], 1, "could not delete these namespaces")

    def _destroy(self) -> list[str]:
        """Deletes every namespace made so far (hosts first); returns those that would not go.

        Safe to re-enter from a signal handler: each name is popped before it is deleted.
        """
        failures = []
        while self._created:
            name = self._created.pop()
            try:
                _delete_netns(name)
            except NetworkCommandError:
                if os.path.exists(os.path.join(NETNS_DIR, name)):
                    failures.append(name)
        return failures

    def _add_netns(self, name: str) -> None:
        self._created.append(name)  # first, so that an interrupt right after the add still removes it
        run_command("ip", "netns", "add", name)
        run_command("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self, with_delay: bool) -> None:
        switch = self.switch_netns
        self._add_netns(switch)
        run_command("ip", "-n", switch, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        run_command("ip", "-n", switch, "link", "set", BRIDGE, "up")
        for host in range(self.num_hosts):
            self._add_host(host, with_delay)
        self._wait_until_ready()

    def _add_host(self, host: int, with_delay: bool) -> None:
        netns, port, switch = self.host_netns(host), self.bridge_port(host), self.switch_netns
        self._add_netns(netns)
        run_command(
            "ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", HOST_INTERFACE, "netns", netns
        )
        run_command("ip", "-n", switch, "link", "set", port, "master", BRIDGE, "up")
        run_command("ip", "-n", netns, "link", "set", HOST_INTERFACE, "addrgenmode", "none")
        run_command(
            "ip", "-n", netns, "addr", "add", f"{self.host_address(host)}/{SUBNET.prefixlen}", "dev", HOST_INTERFACE
        )
        run_command("ip", "-n", netns, "link", "set", HOST_INTERFACE, "up")
        _shape_uplink(netns, self.link, with_delay)
        _shape_downlink(switch, port, self.link)

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = set(range(self.num_hosts))
        while pending:
            pending = {host for host in pending if not self._link_ready(host)}
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"links of hosts {sorted(pending)} not up after {READY_TIMEOUT_S} s")
            if pending:
                time.sleep(0.005)

    def _link_ready(self, host: int) -> bool:
        (host_side,) = json.loads(
            run_command("ip", "-j", "-n", self.host_netns(host), "link", "show", "dev", HOST_INTERFACE)
        )
        (port,) = json.loads(
            run_command("ip", "-j", "-d", "-n", self.switch_netns, "link", "show", "dev", self.bridge_port(host))
        )
        port_state = port.get("linkinfo", {}).get("info_slave_data", {}).get("state")
        return host_side.get("operstate") == "UP" and port_state == "forwarding"

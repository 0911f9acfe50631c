"""Two "hosts" on one machine, for `demo --hosts`, `bench --hosts`, `soak --hosts` and the cross-host tests:
a pair of fresh network namespaces joined by a veth pair with one address each (`NamespacePair`), which
side each kind of process runs on with the secret they share (`Hosts`), and spawned children that enter one
of them before anything else runs (`in_netns`, by setns through ctypes). Rules: every `ip` call
has a timeout; every namespace made here is deleted, and checked gone, even when the body raised; traffic only
flows between the pair's two addresses (or a namespace's own loopback). Needs root and iproute2."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import psutil

from llm_datadist._puller import remote as _remote
from llm_datadist._runtime import ENV_RUNTIME_DIR, runtime_dir
from llm_datadist._wire.auth import ENV_SECRET

IP_TIMEOUT_S = 10.0
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
# The pair's /30 is drawn from here; the namespaces are fresh, so no address in them can clash, and the
# range is never routed outside them.
PAIR_RANGE = ipaddress.IPv4Network("10.200.0.0/16")
# The veth ends are created straight inside their namespaces, so these fixed names never meet another
# run's interfaces in the root namespace.
VETH_A = "veth-a"
VETH_B = "veth-b"


def _ip(*args: str, timeout_s: float = IP_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def netns_list() -> set[str]:
    """Names `ip netns list` shows (each line is `name` or `name (id: N)`)."""
    out = _ip("netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _unique_prefix() -> str:
    # pid + random: unique across concurrent runs and across pairs of one run; short enough that
    # NETNS_DIR paths stay readable.
    return f"llmdd-{os.getpid()}-{secrets.token_hex(3)}"


_OURS = re.compile(r"llmdd-(\d+)-[0-9a-f]{6}-[ab]")


def remove_stale_namespaces() -> list[str]:
    """Delete the namespaces of pairs whose maker died without deleting them (a SIGKILLed demo, bench or
    test run: their names carry its pid); the names deleted. Nothing without root or `ip`."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    removed = []
    for name in sorted(netns_list()):
        match = _OURS.fullmatch(name)
        if match is None or psutil.pid_exists(int(match.group(1))):
            continue
        if _ip("netns", "delete", name, check=False).returncode == 0:
            removed.append(name)
    return removed


@functools.cache
def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can. Probed once per process by making (and
    deleting) a real pair of namespaces joined by a veth pair, since a container may allow one but not
    the other."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (euid is not 0)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if not os.path.exists("/proc/self/ns/net"):
        return "/proc/self/ns/net is missing: the kernel has no network namespaces"
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.setns  # noqa: B018 (an attribute lookup is the probe)
    except (OSError, AttributeError) as exc:
        return f"libc has no setns: {exc}"
    prefix = _unique_prefix() + "-probe"
    names = [f"{prefix}-a", f"{prefix}-b"]
    made: list[str] = []
    try:
        for name in names:
            proc = _ip("netns", "add", name, check=False)
            if proc.returncode != 0:
                return f"`ip netns add` failed: {proc.stderr.strip()}"
            made.append(name)
        proc = _ip(
            *("link", "add", VETH_A, "netns", names[0]),
            *("type", "veth", "peer", "name", VETH_B, "netns", names[1]),
            check=False,
        )
        if proc.returncode != 0:
            return f"cannot create a veth pair between namespaces: {proc.stderr.strip()}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"`ip` could not be run: {exc}"
    finally:
        for name in made:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                _ip("netns", "delete", name, check=False)
    return None


def hosts_unavailable() -> str | None:
    """Why `--hosts` (of demo, bench and soak) cannot run here: no network namespaces, or no transfer
    engine to move bytes between them; None when it can."""
    reason = netns_unavailable()
    if reason is not None:
        return f"cannot make two network namespaces here: {reason}"
    reason = _remote.engine_available()
    if reason is not None:
        return f"cannot move bytes between hosts: {reason}"
    return None


def enter_netns(name: str) -> None:
    """Move the calling thread into namespace `name` (sockets it opens later live there; so do threads it
    starts later). Call it first thing in a fresh process: threads started before stay where they were.

    The process also gets a runtime directory of that namespace's own (below the one it had): it plays a
    host of its own, and a host sees no other host's sockets, so its links to the other namespace go over
    TCP and its bytes through the transfer engine, as between two machines."""
    os.environ[ENV_RUNTIME_DIR] = str(runtime_dir() / name)
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def _run_in_netns(netns: str, env: dict[str, str], target: Callable[..., object], *args: Any) -> None:
    os.environ.update(env)
    enter_netns(netns)
    target(*args)


def in_netns(netns: str, target: Callable[..., object], env: Mapping[str, str] | None = None) -> Any:
    """`target` as a spawned process's target that first sets `env` (on top of the environment spawn
    passes on) and enters namespace `netns`, then calls `target(*args)`. Picklable when `target` is a
    module-level function, as spawn needs."""
    return functools.partial(_run_in_netns, netns, dict(env or {}), target)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While inside, SIGTERM raises SystemExit(143) in the main thread (Python's default dies on the spot),
    so that the `with NamespacePair()` around it still deletes its namespaces. A no-op off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def leave(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, leave)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class NamespacePair:
    """Two fresh namespaces `ns_a`, `ns_b` joined by veth ends with `ip_a`, `ip_b` of a random /30 of
    PAIR_RANGE, made on enter (`add_address` gives a side more). On exit `_stop_processes` runs first (a
    subclass stops what it started in them), then both namespaces are deleted and checked gone, even when
    the body raised; RuntimeError if anything of that failed."""

    def __init__(self) -> None:
        prefix = _unique_prefix()
        self.ns_a = f"{prefix}-a"
        self.ns_b = f"{prefix}-b"
        self._subnet = PAIR_RANGE.network_address + 4 * secrets.randbelow(PAIR_RANGE.num_addresses // 4)
        self.ip_a = str(self._subnet + 1)
        self.ip_b = str(self._subnet + 2)
        self._made: list[str] = []
        self._extra: list[tuple[str, str]] = []  # (side, ip) of the addresses add_address gave

    def __enter__(self) -> NamespacePair:
        remove_stale_namespaces()  # what an earlier run killed before its cleanup left behind
        try:
            for name in (self.ns_a, self.ns_b):
                _ip("netns", "add", name)
                self._made.append(name)
            _ip(
                *("link", "add", VETH_A, "netns", self.ns_a),
                *("type", "veth", "peer", "name", VETH_B, "netns", self.ns_b),
            )
            for ns, dev, ip in ((self.ns_a, VETH_A, self.ip_a), (self.ns_b, VETH_B, self.ip_b)):
                # The namespaces are fresh: nothing but lo exists, so any address of the range is free.
                _ip("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", dev, "up")
            self._wait_link("UP")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _links(self) -> tuple[tuple[str, str], ...]:
        return ((self.ns_a, VETH_A), (self.ns_b, VETH_B))

    def _wait_link(self, state: str, timeout_s: float = IP_TIMEOUT_S) -> None:
        """Until both veth ends report operational `state` (a veth is UP once both ends are up)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [
                _ip("-n", ns, "-o", "link", "show", "dev", dev).stdout.split(" state ")[1].split()[0]
                for ns, dev in self._links()
            ]
            if all(s == state for s in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"veth pair of {self.ns_a}/{self.ns_b} is {states}, not {state}")
            time.sleep(0.01)

    def add_address(self, side: str) -> str:
        """Another address for side "a" or "b" (a /32 of PAIR_RANGE outside the pair's /30) on its veth
        end, routed to from the other side: one host with two addresses, or two hosts behind one link."""
        taken = {ip for _, ip in self._extra}
        while True:
            address = PAIR_RANGE.network_address + 1 + secrets.randbelow(PAIR_RANGE.num_addresses - 2)
            ip = str(address)
            if not 0 <= int(address) - int(self._subnet) < 4 and ip not in taken:
                break
        (ns, dev), _ = self._sides(side)
        _ip("-n", ns, "addr", "add", f"{ip}/32", "dev", dev)
        self._extra.append((side, ip))
        self._route_extra(side, ip)
        return ip

    def _sides(self, side: str) -> tuple[tuple[str, str], tuple[str, str]]:
        """((namespace, veth end) of `side`, the same of the other side)."""
        if side not in ("a", "b"):
            raise ValueError(f"side is 'a' or 'b', not {side!r}")
        ends = self._links()
        return (ends[0], ends[1]) if side == "a" else (ends[1], ends[0])

    def _route_extra(self, side: str, ip: str) -> None:
        _, (other_ns, other_dev) = self._sides(side)
        _ip("-n", other_ns, "route", "replace", f"{ip}/32", "dev", other_dev)

    def drop_link(self) -> None:
        """Both veth ends down: the routes between the namespaces go, new connects fail and in-flight TCP
        stalls (retransmits) until `restore_link`."""
        for ns, dev in self._links():
            _ip("-n", ns, "link", "set", dev, "down")

    def restore_link(self) -> None:
        """Both veth ends up again (addresses stay on a down link, so they come back as they were)."""
        for ns, dev in self._links():
            _ip("-n", ns, "link", "set", dev, "up")
        self._wait_link("UP")
        for side, ip in self._extra:  # a link that went down took the routes through it along
            self._route_extra(side, ip)

    def _stop_processes(self) -> list[str]:
        """Stop what lives in the namespaces before they are deleted (a namespace outlives `ip netns
        delete` while a process is still in it); the errors, as text. Nothing here: the base class
        starts no process."""
        return []

    def close(self) -> None:
        """Delete both namespaces (idempotent); RuntimeError when one is left or stopping failed."""
        errors = self._stop_processes()
        for name in self._made:
            try:
                proc = _ip("netns", "delete", name, check=False)
            except (OSError, subprocess.SubprocessError) as exc:  # still try the other one
                errors.append(f"{name}: {exc}")
                continue
            if proc.returncode != 0:
                errors.append(f"{name}: {proc.stderr.strip()}")
        left = netns_list() & set(self._made) if self._made else set()
        self._made.clear()
        if left or errors:
            raise RuntimeError(f"pair teardown failed: namespaces left {sorted(left)}, errors {errors}")


@dataclass(frozen=True)
class Hosts:
    """Across hosts: the namespace and address of each side, and what the children of both sides add to
    their environment (the shared secret) before they enter their namespace."""

    prompt_netns: str
    prompt_ip: str
    decoder_netns: str
    decoder_ip: str
    env: dict[str, str]

    @classmethod
    def of(cls, pair: NamespacePair) -> Hosts:
        """Prompts on the pair's side a, Decoders on side b, with a fresh random secret."""
        return cls(pair.ns_a, pair.ip_a, pair.ns_b, pair.ip_b, {ENV_SECRET: secrets.token_hex(32)})

"""Two "hosts" on one machine for cross-host tests: a pair of network namespaces joined by a veth pair
(`HostPair`), each host a spawned Python child living in one namespace and running the source text the
test sends it (`HostProcess`). Rules: every subprocess call and every wait has a timeout, every child is
reaped (SIGKILL as the last resort), every namespace made here is deleted and checked gone, and traffic
only flows between the pair's two addresses (or a namespace's own loopback)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import ipaddress
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import subprocess
import time
import traceback
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any, Literal

IP_TIMEOUT_S = 10.0
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
# The pair's /30 is drawn from here; the namespaces are fresh, so no address in them can clash, and the
# range is never routed outside them.
PAIR_RANGE = ipaddress.IPv4Network("10.200.0.0/16")
# The veth ends are created straight inside their namespaces, so these fixed names never meet another
# run's interfaces in the root namespace.
VETH_A = "veth-a"
VETH_B = "veth-b"


class HostError(AssertionError):
    """Source run in a host raised; `traceback` is the child's traceback text."""

    def __init__(self, message: str, child_traceback: str) -> None:
        super().__init__(f"{message}\n--- child traceback ---\n{child_traceback}")
        self.traceback = child_traceback


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


def require_netns() -> None:
    """pytest.skip (with the reason, shown by `-ra`) where namespaces cannot be made."""
    reason = netns_unavailable()
    if reason is not None:
        import pytest

        pytest.skip(f"network namespaces unavailable: {reason}")


def _enter_netns(name: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}) failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def _host_main(conn: Connection, netns: str, env: dict[str, str]) -> None:
    """The child: env first (nothing but stdlib has been imported yet), then the namespace, then a loop
    exec'ing source in one persistent dict. EOF on the pipe (the parent died or closed it) ends it."""
    os.environ.update(env)
    try:
        _enter_netns(netns)
    except BaseException:
        conn.send(("err", 0, traceback.format_exc()))
        return
    conn.send(("ok", 0, os.getpid()))
    namespace: dict[str, Any] = {"__name__": "__host__"}
    while True:
        try:
            kind, seq, payload = conn.recv()
        except (EOFError, OSError):
            return
        if kind == "stop":
            with contextlib.suppress(OSError):
                conn.send(("ok", seq, None))
            return
        source, values = payload
        try:
            # `result` is per call: a stale one from an earlier call must not come back as this one's.
            namespace.pop("result", None)
            namespace.update(values)
            exec(compile(source, f"<host {netns} call {seq}>", "exec"), namespace)
            reply: tuple[str, int, Any] = ("ok", seq, namespace.get("result"))
            conn.send(reply)
        except BaseException:
            # Also covers a `result` that cannot be pickled: Connection.send pickles before it writes.
            try:
                conn.send(("err", seq, traceback.format_exc()))
            except OSError:
                return


class HostProcess:
    """A spawned child inside network namespace `netns`; `run` executes source there. Use as a context
    manager (or call `stop`): the child is always reaped."""

    def __init__(
        self, netns: str, *, env: dict[str, str] | None = None, start_timeout_s: float = START_TIMEOUT_S
    ) -> None:
        self.netns = netns
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._seq = 0
        # Calls sent but not answered (a `run` timed out): the child is busy or hung.
        self._unanswered = 0
        # Spawn starts the child with the parent's os.environ (LLM_DATADIST_RUNTIME_DIR included); `env`
        # is applied on top of it in the child before anything else runs.
        self.process = ctx.Process(
            target=_host_main, args=(child_conn, netns, dict(env or {})), daemon=True, name=f"host-{netns}"
        )
        self.process.start()
        child_conn.close()  # so the parent sees EOF if the child dies
        try:
            self._reply(0, start_timeout_s, "start")
        except BaseException:
            self.kill()
            self._conn.close()
            raise
        assert self.process.pid is not None
        self.pid: int = self.process.pid

    def _reply(self, seq: int, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                raise TimeoutError(
                    f"host {self.netns} (pid {self.process.pid}) gave no reply to {what} in {timeout_s} s"
                )
            try:
                status, got, value = self._conn.recv()
            except EOFError:
                self.process.join(1.0)  # for the exit code in the message
                raise HostError(
                    f"host {self.netns} died during {what} (exit code {self.process.exitcode})", ""
                ) from None
            if got < seq:  # the late answer to a call that timed out earlier
                self._unanswered -= 1
                continue
            if status != "ok":
                raise HostError(f"host {self.netns}: {what} raised", value)
            return value

    def run(self, source: str, timeout_s: float = 30.0, **values: Any) -> Any:
        """Exec `source` in the child's persistent namespace after binding `values` (picklable) there;
        returns the value of `result` set by that source, else None. HostError if it raised,
        TimeoutError if no reply came in `timeout_s`."""
        self._seq += 1
        seq = self._seq
        self._conn.send(("run", seq, (source, values)))
        try:
            return self._reply(seq, timeout_s, f"call {seq}")
        except TimeoutError:
            self._unanswered += 1
            raise

    def kill(self) -> None:
        """SIGKILL the child and reap it."""
        if self.process.pid is not None and self.process.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(IP_TIMEOUT_S)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Ask the child to exit, wait up to `timeout_s`, then SIGKILL; the child is reaped either way.
        A child that left a call unanswered is presumed hung and killed at once."""
        if self.process.is_alive() and self._unanswered == 0 and not self._conn.closed:
            self._seq += 1
            with contextlib.suppress(OSError, TimeoutError, HostError):
                self._conn.send(("stop", self._seq, None))
                self._reply(self._seq, timeout_s, "stop")
            self.process.join(timeout_s)
        if self.process.is_alive():
            self.kill()
        else:
            self.process.join(timeout_s)
        if not self._conn.closed:
            self._conn.close()

    def __enter__(self) -> HostProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class HostPair:
    """Two fresh namespaces `ns_a`, `ns_b` joined by veth ends with `ip_a`, `ip_b` of a random /30 of
    PAIR_RANGE. `host("a" | "b")` starts a HostProcess there; on exit the hosts are reaped and both
    namespaces deleted (and checked gone), even when the body raised."""

    def __init__(self) -> None:
        prefix = _unique_prefix()
        self.ns_a = f"{prefix}-a"
        self.ns_b = f"{prefix}-b"
        subnet = PAIR_RANGE.network_address + 4 * secrets.randbelow(PAIR_RANGE.num_addresses // 4)
        self.ip_a = str(subnet + 1)
        self.ip_b = str(subnet + 2)
        self._made: list[str] = []
        self._hosts: list[HostProcess] = []

    def __enter__(self) -> HostPair:
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
            self._delete()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._delete()

    def host(self, side: Literal["a", "b"], *, env: dict[str, str] | None = None) -> HostProcess:
        """A HostProcess in namespace `ns_a` or `ns_b`, reaped (at the latest) when the pair exits."""
        host = HostProcess(self.ns_a if side == "a" else self.ns_b, env=env)
        self._hosts.append(host)
        return host

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

    def drop_link(self) -> None:
        """Both veth ends down: the routes between the hosts go, new connects fail and in-flight TCP
        stalls (retransmits) until `restore_link`."""
        for ns, dev in self._links():
            _ip("-n", ns, "link", "set", dev, "down")

    def restore_link(self) -> None:
        """Both veth ends up again (addresses stay on a down link, so they come back as they were)."""
        for ns, dev in self._links():
            _ip("-n", ns, "link", "set", dev, "up")
        self._wait_link("UP")

    def _delete(self) -> None:
        # Hosts first: a namespace outlives `ip netns delete` while a process still lives in it.
        errors = []
        for host in self._hosts:
            try:
                host.stop()
            except Exception as exc:  # still delete the namespaces; report it below
                errors.append(f"host {host.netns}: {exc!r}")
        self._hosts.clear()
        for name in self._made:
            proc = _ip("netns", "delete", name, check=False)
            if proc.returncode != 0:
                errors.append(f"{name}: {proc.stderr.strip()}")
        left = netns_list() & set(self._made)
        self._made.clear()
        if left or errors:
            raise RuntimeError(f"pair teardown failed: namespaces left {sorted(left)}, errors {errors}")

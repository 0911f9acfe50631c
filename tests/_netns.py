"""Two "hosts" on one machine for cross-host tests: `HostPair` is the tools' pair of network namespaces
joined by a veth pair (llm_datadist/_tools/netns.py), each host a spawned Python child living in one
namespace and running the source text the test sends it (`HostProcess`). Rules: every wait has a timeout,
every child is reaped (SIGKILL as the last resort) before its namespace is deleted."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any, Literal

from llm_datadist._tools.netns import IP_TIMEOUT_S, NamespacePair, enter_netns, netns_list, netns_unavailable

__all__ = ["HostError", "HostPair", "HostProcess", "netns_list", "netns_unavailable", "require_netns"]

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 5.0


class HostError(AssertionError):
    """Source run in a host raised; `traceback` is the child's traceback text."""

    def __init__(self, message: str, child_traceback: str) -> None:
        super().__init__(f"{message}\n--- child traceback ---\n{child_traceback}")
        self.traceback = child_traceback


def require_netns() -> None:
    """pytest.skip (with the reason, shown by `-ra`) where namespaces cannot be made."""
    reason = netns_unavailable()
    if reason is not None:
        import pytest

        pytest.skip(f"network namespaces unavailable: {reason}")


def _host_main(conn: Connection, netns: str, env: dict[str, str]) -> None:
    """The child: env first (before any code of the library reads it), then the namespace, then a loop
    exec'ing source in one persistent dict. EOF on the pipe (the parent died or closed it) ends it."""
    os.environ.update(env)
    try:
        enter_netns(netns)
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


class HostPair(NamespacePair):
    """The library's pair of namespaces; `host("a" | "b")` starts a HostProcess in `ns_a` or `ns_b`, and on
    exit the hosts are reaped before both namespaces are deleted (and checked gone), even when the body
    raised."""

    def __init__(self) -> None:
        super().__init__()
        self._hosts: list[HostProcess] = []

    def __enter__(self) -> HostPair:
        super().__enter__()
        return self

    def host(self, side: Literal["a", "b"], *, env: dict[str, str] | None = None) -> HostProcess:
        """A HostProcess in namespace `ns_a` or `ns_b`, reaped (at the latest) when the pair exits."""
        host = HostProcess(self.ns_a if side == "a" else self.ns_b, env=env)
        self._hosts.append(host)
        return host

    def _stop_processes(self) -> list[str]:
        errors = []
        for host in self._hosts:
            try:
                host.stop()
            except Exception as exc:  # still delete the namespaces; reported with the teardown
                errors.append(f"host {host.netns}: {exc!r}")
        self._hosts.clear()
        return errors

"""The listening server: one selector thread per process, serving every link to this process's caches.

Rules: every frame goes through `protocol.connection.Connection` (sans-IO); the server only moves frames and
hands each request to its `Service` (it never knows what a cache is). It never blocks on one peer: sockets
are non-blocking and output is buffered per connection. A request that needs the owner's index lock while
another process holds it waits in its connection's queue (`IndexBusy`) and is retried every 10 ms, in
order. Whatever goes wrong while serving one peer drops that peer's connection only, with its cause logged;
if the thread dies anyway (a bug) `check_alive` says so at once instead of letting callers time out.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from llm_datadist._protocol.connection import Closed
from llm_datadist._protocol.errors import ProtocolError

from .._errors import StatusError
from .._signals import held
from ..status import LLMStatusCode
from ..utils.log import log
from .admission import AdmissionLimits, Refusal
from .conn import ServerConn
from .door import Door, Refused
from .listeners import Listeners, bind_tcp, bind_unix
from .peer import RECV_NBYTES, ClosedService, ListenAddr, PeerInfo, Service, peer_credentials, tune_tcp
from .requests import Requests

__all__ = ["MAX_CONNECTIONS", "Server"]

MAX_CONNECTIONS = 512
# A peer that reconnects as soon as it is closed keeps a listener's queue from ever emptying: without a
# bound, accepting (and closing to make room) would be all the server thread ever did.
_ACCEPTS_PER_EVENT = 32
# How often requests waiting for the index lock are tried again.
_PARKED_RETRY_S = 0.01


class Server:
    """Serves this process's caches from one background thread, on any number of sockets."""

    def __init__(
        self,
        *,
        cluster_id: int,
        role: int,
        service: Service,
        incarnation: int = 0,
        secret: bytes | None = None,
        admission: AdmissionLimits | None = None,
    ) -> None:
        self.cluster_id = cluster_id
        self.incarnation = incarnation
        self._door = Door(
            cluster_id=cluster_id, role=role, incarnation=incarnation, secret=secret, admission=admission
        )
        self._requests = Requests(self._door, service)
        # Why the server thread stopped serving, if it died (a bug): API calls report it at once.
        self.failure: str | None = None
        self._selector = selectors.DefaultSelector()
        self._listeners = Listeners()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._conns: dict[int, ServerConn] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards _conns (read by other threads) and _pending_drops
        self._pending_drops: list[tuple[int, threading.Event]] = []  # unlinks asked by other threads
        self._next_sweep = 0.0

    @property
    def role(self) -> int:
        """The role new peers are told (a switch_role changes it for the links made after)."""
        return self._door.role

    @role.setter
    def role(self, role: int) -> None:
        self._door.role = role

    def on_refused(self, count: Callable[[str], None] | None) -> None:
        """Tell `count` the cause of every link this server refuses (`door.REFUSAL_CAUSES`)."""
        self._door.on_refused = count

    @property
    def handled(self) -> int:
        """Messages handled (read by tests: a pull through the index adds none)."""
        return self._requests.handled

    def start(self) -> None:
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(
            target=self._serve, name=f"llmdd-server-{self.cluster_id}", daemon=True
        )
        with held():  # SIGTERM and SIGINT are the program's main thread's (`_signals`)
            self._thread.start()

    # --------------------------------------------------------------- what other threads ask

    def listen(self, path: Path) -> None:
        """Serve on the Unix socket `path` too (created mode 0600). FileExistsError if a live process
        serves there."""
        self._listeners.add(path, bind_unix(path))
        self._wake()

    def listen_tcp(self, ip: str, port: int) -> int:
        """Serve TCP at `ip:port` too (port 0: any free port); returns the port. Only with a secret: every
        TCP peer proves it knows it before anything else. OSError when the address cannot be bound."""
        if self._door.secret is None:
            raise StatusError(LLMStatusCode.LLM_FAILED, "no shared secret: TCP is not served")
        listener = bind_tcp(ip, port)
        bound_port: int = listener.getsockname()[1]
        self._listeners.add((ip, bound_port), listener)
        self._wake()
        return bound_port

    def unlisten(self, addr: ListenAddr, timeout_s: float = 5.0) -> None:
        """Stop serving on `addr` and remove the socket file; links already made stay up.

        Synchronous: when this returns, the listener is closed and the file is gone, so the same address
        can be listened on again at once.
        """
        removal = self._listeners.remove(addr)
        if removal is None:
            return
        listener, done = removal
        if threading.current_thread() is self._thread:
            self._listeners.apply(self._selector)
            return
        self._wake()
        if self.failure is None and done.wait(timeout_s) and self.failure is None:
            return
        # The server thread is gone or stuck: do it here (the selector then still names a closed
        # socket, which only the dead thread would have looked at).
        self._listeners.forget(addr, listener)

    def check_alive(self) -> None:
        """Raise StatusError(LLM_FAILED) if the server thread died (nothing serves this process's caches)."""
        if self.failure is not None:
            raise StatusError(
                LLMStatusCode.LLM_FAILED,
                f"the server thread of this process stopped ({self.failure}); finalize and init again",
            )

    @property
    def listening(self) -> list[ListenAddr]:
        return self._listeners.addresses

    def peers(self) -> list[PeerInfo]:
        with self._lock:
            return [c.peer for c in self._conns.values() if c.peer is not None]

    def unproven_by_address(self) -> dict[str, int]:
        """How many TCP connections each source address holds that have not proved the secret yet."""
        with self._lock:
            hosts = [c.host for c in self._conns.values() if c.host and c.peer is None]
        return dict(Counter(hosts))

    def drop_cluster(self, cluster_id: int) -> bool:
        """End every connection from `cluster_id` (an unlink from the serving side); True if any. One that
        holds leases drains first: its peer's transfers in flight end as they would, then it closes."""
        done = threading.Event()
        with self._lock:
            self._pending_drops.append((cluster_id, done))
            found = bool(self._conns_of(cluster_id))
        self._wake()
        # The server thread closes them; wait so that the caller sees them gone (bounded, never a hang).
        done.wait(5.0)
        return found

    def conns_of(self, cluster_id: int) -> list[object]:
        """The connections from `cluster_id` (what the service knows leases and rows by)."""
        with self._lock:
            return list(self._conns_of(cluster_id))

    def close(self, timeout_s: float = 5.0, *, drain_s: float = 0.0) -> None:
        """Stop serving. With `drain_s`, first refuse new links and end every connection the way an unlink
        does, waiting up to `drain_s` for those that hold leases to drain (their peers' transfers end)."""
        if drain_s > 0 and self._thread is not None and self._thread.is_alive() and self.failure is None:
            self._door.closing = True
            deadline = time.monotonic() + drain_s
            with self._lock:
                clusters = {c.peer.cluster_id for c in self._conns.values() if c.peer is not None}
            for cluster_id in clusters:
                self.drop_cluster(cluster_id)
            while time.monotonic() < deadline:
                with self._lock:
                    draining = [c for c in self._conns.values() if c.draining]
                if not draining:
                    break
                time.sleep(0.005)
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout_s)
        for sconn in list(self._conns.values()):
            self._drop(sconn, "server closing")
        self._listeners.close()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        # The service refers back to its owner: no cycle outlives the close.
        self._requests.service = ClosedService()

    def unlink_names(self) -> None:
        """Unlink our listeners' socket files, with no lock (`Core.last_resort`)."""
        self._listeners.unlink_names()

    def abandon(self) -> None:
        """In a child forked from this process (whose server thread did not come along): close this
        process's copies of every socket, so that the parent's peers still see its connections end when the
        parent ends them, and say nothing to anyone (no Bye, no unlink, no service call)."""
        self._stop.set()
        self.failure = "this process was forked from the one that started the server"
        for sconn in list(self._conns.values()):
            sconn.closing = True
            sconn.sock.close()
        self._conns.clear()
        self._listeners.abandon()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        self._requests.service = ClosedService()

    def _conns_of(self, cluster_id: int) -> list[ServerConn]:
        return [c for c in self._conns.values() if c.peer is not None and c.peer.cluster_id == cluster_id]

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # --------------------------------------------------------------- the loop

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_pending()
                selected_at = time.monotonic()
                events = self._selector.select(timeout=_PARKED_RETRY_S if self._requests.parked else 1.0)
                for key, mask in events:
                    self._dispatch(key, mask)
                if self._requests.parked:
                    for sconn in self._requests.retry_parked():
                        self._end(sconn)
                self._sweep(selected_at)
        except BaseException as exc:
            # Not one peer's fault (those are handled in _dispatch): the loop itself broke. Say so to every
            # later API call rather than leaving peers to time out.
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("server %d: the server thread stopped", self.cluster_id)
            self._listeners.release_waiters()

    def _dispatch(self, key: selectors.SelectorKey, mask: int) -> None:
        """Serve one ready socket. The one chokepoint: whatever a peer's traffic makes go wrong, only that
        peer's connection is dropped, with the peer and the cause logged."""
        if key.data == "wake":
            with contextlib.suppress(OSError):
                self._wake_r.recv(64)
            return
        if isinstance(key.data, tuple):
            try:
                self._accept(key.fileobj)  # type: ignore[arg-type]
            except Exception:
                log.exception("server %d: accepting on %s failed", self.cluster_id, key.data[1])
            return
        sconn: ServerConn = key.data
        try:
            if mask & selectors.EVENT_READ:
                self._on_readable(sconn)
            if mask & selectors.EVENT_WRITE and sconn.sock.fileno() != -1:
                self._flush(sconn)
        except Exception as exc:
            self._requests.failed(sconn, exc)
            self._drop(sconn, sconn.ending)

    def _sweep(self, selected_at: float) -> None:
        """Close the connections that did not complete their handshake in time. Their age is taken at
        `selected_at`, when the last select began: whatever a peer had sent by then was handled before
        this runs, so a Hello that waited while the server was busy still counts."""
        # At most twice a second: the limits are seconds long, and this loop runs after every event.
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + 0.5
        for sconn in list(self._conns.values()):
            reason = "" if sconn.peer is not None else self._door.overdue(sconn, selected_at)
            if reason and sconn.host:
                self._door.refuse(sconn, Refused(reason, Refusal.OUT_OF_TIME, cause="admission"))
                self._end(sconn)
            elif reason:
                self._drop(sconn, reason)
        self._door.flush_log(now)
        try:
            self._requests.service.housekeeping()
        except Exception:
            log.exception("server %d: housekeeping failed", self.cluster_id)

    def _apply_pending(self) -> None:
        if self._listeners.changed:
            self._listeners.apply(self._selector)
        if not self._pending_drops:  # the common case, without taking the lock
            return
        with self._lock:
            drops, self._pending_drops = self._pending_drops, []
        clusters = {cluster_id for cluster_id, _ in drops}
        for sconn in list(self._conns.values()):
            if sconn.peer is not None and sconn.peer.cluster_id in clusters:
                self._drop(sconn, "unlinked by this side", drain=True)
        for _, done in drops:
            done.set()

    def _accept(self, listener: socket.socket) -> None:
        """Accept what is queued on `listener`, at most `_ACCEPTS_PER_EVENT` (the listener is reported
        again by the next select, after every other socket that is ready has been served)."""
        tcp = listener.family == socket.AF_INET
        for _ in range(_ACCEPTS_PER_EVENT):
            try:
                sock, address = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("server %d: accept failed: %s", self.cluster_id, exc)
                return
            if tcp:
                pid, uid, host = 0, -1, str(address[0])
            else:
                pid, uid, _ = peer_credentials(sock)
                host = ""
            if len(self._conns) >= MAX_CONNECTIONS:
                full = f"{len(self._conns)} connections open"
                if tcp:
                    self._door.refused_full(host, full)
                else:
                    log.warning("server %d: refusing pid %d, %s", self.cluster_id, pid, full)
                sock.close()
                continue
            if tcp:
                unproven = [c for c in self._conns.values() if c.host and c.peer is None]
                unproven.sort(key=lambda c: c.accepted_at)
                room = self._door.make_room(unproven, host)
                if room is not None:
                    victim, refused = room
                    self._door.refuse(victim, refused)
                    self._end(victim)
            sock.setblocking(False)
            sconn = ServerConn(sock, pid, uid, host=host, secret=self._door.secret if tcp else None)
            if tcp:
                tune_tcp(sock)
                sconn.send(self._door.challenge(sconn))
            with self._lock:
                self._conns[sock.fileno()] = sconn
            self._selector.register(sock, selectors.EVENT_READ, sconn)
            if tcp:
                self._flush(sconn)

    def _on_readable(self, sconn: ServerConn) -> None:
        try:
            data = sconn.sock.recv(RECV_NBYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(sconn, f"recv failed: {exc}")
            return
        try:
            sconn.conn.receive_data(data)
            while True:
                event = sconn.conn.next_event()
                if event is None:
                    break
                if isinstance(event, Closed):
                    self._drop(sconn, event.reason or "peer closed")
                    return
                sconn.handling = type(event).__name__
                self._requests.handle(sconn, event)
                sconn.handling = "its traffic"
                if sconn.closing:
                    break
        except ProtocolError as exc:
            self._door.log_protocol_error(sconn, exc)
            self._drop(sconn, f"protocol error: {exc}")
            return
        self._end(sconn)

    # --------------------------------------------------------------- writing and closing

    def _end(self, sconn: ServerConn) -> None:
        """Write what `sconn` has queued and, if it is ending, close it."""
        self._flush(sconn)
        if sconn.ending:
            self._drop(sconn, sconn.ending)

    def _flush(self, sconn: ServerConn) -> None:
        if sconn.sock.fileno() == -1:
            return
        try:
            changed = sconn.write()
        except OSError as exc:
            self._drop(sconn, f"send failed: {exc}")
            return
        if changed:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.modify(sconn.sock, sconn.events, sconn)

    def _drop(self, sconn: ServerConn, reason: str, *, drain: bool = False) -> None:
        """End a connection. `drain` (this side ends the link): one that holds leases first drains, so that
        its peer's transfers in flight end as they would; it closes when its last lease ends (or its peer
        goes). Whatever it still pins in the index stays pinned until its holder lets go or dies."""
        fd = sconn.sock.fileno()
        if fd == -1:
            return
        if drain and not sconn.closing and self._requests.service.holds_leases(sconn):
            if not sconn.draining:
                sconn.draining = reason
                log.info(
                    "server %d: pid %d: %s; waiting for its leases to end", self.cluster_id, sconn.pid, reason
                )
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sconn.sock)
        with self._lock:
            self._conns.pop(fd, None)
        sconn.closing = True
        sconn.sock.close()
        # Releases the peer sent that were never served (the lock was busy): their transfers ended well.
        released = self._requests.forget(sconn)
        # Nothing may take the server down: the connection is gone whatever this raises.
        try:
            self._requests.service.connection_ended(sconn, released)
            if sconn.peer is not None:
                self._requests.service.peer_gone(sconn.peer)
        except Exception:
            log.exception("server %d: cleaning up after pid %d failed", self.cluster_id, sconn.pid)

"""Sockets and threads: the listening server (one selector thread per process) and client links.

Rules: every frame goes through `protocol.connection.Connection` (sans-IO); this module only moves bytes.
The server never blocks on one peer: sockets are non-blocking and output is buffered per connection. A
connection that breaks the protocol is closed with a logged reason and its leases are dropped; the server
and every other link keep working. Client waits are bounded by the caller's deadline; EOF from the peer is
reported at once (`PeerGone`), a deadline as `TransferTimeout`, and either leaves the link broken.
Whatever goes wrong while serving one peer drops that peer's connection only; the server thread never
dies of it, and if it dies anyway (a bug) `Server.check_alive` says so at once instead of letting callers
time out.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from llm_datadist._protocol.connection import Closed, Connection, ConnRole, ConnState
from llm_datadist._protocol.errors import ProtocolError
from llm_datadist._protocol.frames import DEFAULT_MAX_FRAME_NBYTES
from llm_datadist._protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Announce,
    Bye,
    Challenge,
    Error,
    Hello,
    Message,
    Ping,
    Pong,
    PullDone,
    Release,
    Welcome,
)
from llm_datadist._shm.index import Index
from llm_datadist._shm.mappings import MappingCache
from llm_datadist._shm.segment import Segment

from . import _auth, _unpins
from ._admission import AdmissionLimits, Refusal, RefusalLog, make_room
from ._errors import IndexBusy, PeerGone, StatusError, TransferTimeout
from ._runtime import TEMP_SOCKET_PREFIX, remove_stale_socket
from .status import LLMStatusCode, code_2_status
from .utils.log import log

_RECV_NBYTES = 256 * 1024
# A peer on this host has this long to say Hello; a TCP peer has `AdmissionLimits.proof_timeout_s`.
_HANDSHAKE_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 512
# Replies a peer has not read yet; a peer that sends requests without reading the answers is dropped.
MAX_OUTBUF_NBYTES = 16 << 20
# A page of a Table reply stays well under the frame limit (1 MiB), whatever the caches look like.
_TABLE_PAGE_NBYTES = 512 << 10
_PEERCRED = struct.Struct("3i")
# TCP: a peer that has not proved it knows the secret sends small frames (a Hello is under 400 bytes);
# how many such peers may be open, and for how long, is `AdmissionLimits`.
_UNAUTHENTICATED_FRAME_NBYTES = 4096
# A peer that reconnects as soon as it is closed keeps a listener's queue from ever emptying: without a
# bound, accepting (and closing to make room) would be all the server thread ever did.
_ACCEPTS_PER_EVENT = 32
# TCP keepalive (idle s, interval s, probes): a vanished peer host is given up within `_KEEPALIVE_S`.
_KEEPALIVE = (5, 2, 3)
_KEEPALIVE_S = _KEEPALIVE[0] + _KEEPALIVE[1] * _KEEPALIVE[2]
_HANGUP_EVENTS = select.POLLRDHUP | select.POLLHUP | select.POLLERR
# Requests of one connection waiting for the index lock (a stopped process holds it); past this the
# connection is dropped. The server looks again this often while any wait.
MAX_PARKED = 64
_PARKED_RETRY_S = 0.01


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


# Where a server listens: a Unix socket's path, or a TCP (ip, port).
ListenAddr = Path | tuple[str, int]


@dataclass(frozen=True)
class PeerInfo:
    """Who is at the other end of a link: its cluster id, role, pid, incarnation (drawn once per
    initialised instance, so a restart at the same address is a new peer) and callback socket ("" if none)."""

    cluster_id: int
    role: int
    pid: int
    incarnation: int
    callback: str = ""
    # Over TCP: the peer's ip (its pid is then only what it claims, on another host), the port of its
    # TCP callback listener (0: none) and its transfer engine's address. "" / 0 on a Unix socket.
    host: str = ""
    callback_port: int = 0
    engine: str = ""

    @property
    def remote(self) -> bool:
        """On another host (linked over TCP): no shared memory, no pid to look at, bytes go by engine."""
        return bool(self.host)


# ===================================================================== server side


class _ServerConn:
    """One accepted connection: its socket, protocol state and unsent bytes."""

    def __init__(
        self, sock: socket.socket, pid: int, uid: int, *, host: str = "", secret: bytes | None = None
    ) -> None:
        """`host` and `secret` over TCP: the frames after the handshake are tagged, keyed from `secret`."""
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.host = host  # the peer's ip over TCP; "" on a Unix socket
        self.nonce = b""  # the Challenge's nonce (TCP)
        self.conn = (
            Connection(
                ConnRole.SERVER,
                challenge=True,
                secret=secret,
                max_frame_nbytes=_UNAUTHENTICATED_FRAME_NBYTES,
            )
            if host
            else Connection(ConnRole.SERVER)
        )
        self.outbuf = bytearray()
        self.waiting_to_write = False  # registered for EVENT_WRITE (only while outbuf did not fit)
        self.closing = False
        self.peer: PeerInfo | None = None
        self.accepted_at = time.monotonic()
        self.handling = "its traffic"  # the message being handled, for the log when handling fails
        # Messages that wait, in order, for the index lock (the first one found it busy).
        self.parked: deque[Message] = deque()
        # This side ended the link while the peer held leases: nothing but their releases is served until
        # the last one ends, then the connection closes.
        self.draining = ""


class Service(Protocol):
    """What the server hands a linked peer's requests to (the owner's `_owner.service.CacheService`).
    `conn` is the server's token for one connection: the same object for all of its calls."""

    def admit(self, conn: object, peer: PeerInfo) -> tuple[str, int, int]:
        """A peer on this host linked: (index name, row, ticket) for its Welcome ("" : no index row)."""
        ...

    def serve_remote(self, local_ip: str) -> str:
        """A peer on another host proved itself at `local_ip`: our engine's address (StatusError: refused)."""
        ...

    def answer(self, conn: object, peer: PeerInfo, msg: Message) -> Message:
        """The reply to a request; StatusError becomes an Error reply, IndexBusy parks the request."""
        ...

    def release(self, conn: object, lease_id: int, ok: bool) -> None:
        """A one-way Release (IndexBusy: retried; StatusError: logged)."""
        ...

    def holds_leases(self, conn: object) -> bool: ...

    def connection_ended(self, conn: object, released: frozenset[int]) -> None:
        """The connection is gone; `released`: the leases its peer released well in messages never read."""
        ...

    def peer_linked(self, peer: PeerInfo) -> None: ...

    def peer_gone(self, peer: PeerInfo) -> None: ...

    def housekeeping(self) -> None:
        """About twice a second, on the server thread."""
        ...


class _NoService:
    """What a closed server refers to: nothing (the service refers back to its owner)."""

    def admit(self, conn: object, peer: PeerInfo) -> tuple[str, int, int]:
        return "", 0, 0

    def serve_remote(self, local_ip: str) -> str:
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, "this side is closed")

    def answer(self, conn: object, peer: PeerInfo, msg: Message) -> Message:
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, "this side is closed")

    def release(self, conn: object, lease_id: int, ok: bool) -> None:
        return None

    def holds_leases(self, conn: object) -> bool:
        return False

    def connection_ended(self, conn: object, released: frozenset[int]) -> None:
        return None

    def peer_linked(self, peer: PeerInfo) -> None:
        return None

    def peer_gone(self, peer: PeerInfo) -> None:
        return None

    def housekeeping(self) -> None:
        return None


class Server:
    """Serves this process's caches from one background thread, on any number of Unix sockets."""

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
        self._secret = secret  # TCP links prove they know it; None: no TCP listener is allowed
        self._admission = admission or AdmissionLimits()  # for TCP peers that have not proved it yet
        # Anyone who reaches a TCP port can be refused as often as it likes: one line per address and 10 s.
        self._refusals = RefusalLog(functools.partial(log.warning, "server %d: %s", cluster_id))
        self.role = role
        self.incarnation = incarnation
        # Why the server thread stopped serving, if it died (a bug): API calls report it at once.
        self.failure: str | None = None
        self._service: Service = service
        self.handled = 0  # messages handled (read by tests: a pull through the index adds none)
        self._selector = selectors.DefaultSelector()
        self._listeners: dict[ListenAddr, socket.socket] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._conns: dict[int, _ServerConn] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Selector changes requested by other threads, applied by the server thread (selectors are not
        # thread-safe).
        self._pending: list[tuple[str, ListenAddr, socket.socket | None, threading.Event | None]] = []
        self._pending_drops: list[tuple[int, threading.Event]] = []
        self._next_sweep = 0.0
        self._parked: set[_ServerConn] = set()  # connections with messages waiting for the index lock
        self._closing = False  # finalizing: no new handshakes, connections drain

    def start(self) -> None:
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(
            target=self._serve, name=f"llmdd-server-{self.cluster_id}", daemon=True
        )
        self._thread.start()

    def listen(self, path: Path) -> None:
        """Serve on `path` too (created mode 0600). FileExistsError if a live process serves there.

        The socket is bound under a hidden temporary name and linked to `path` only once it listens: a
        name that exists is always served, so another process probing for stale sockets (a bound socket
        that refuses connections looks exactly like a dead one) never removes a live one.
        """
        remove_stale_socket(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        temporary = path.with_name(f"{TEMP_SOCKET_PREFIX}{secrets.token_hex(4)}.sock")
        try:
            listener.bind(os.fspath(temporary))
            try:
                # Before listen(): nobody can connect until the socket is private.
                os.chmod(temporary, 0o600)
                listener.listen(128)
                listener.setblocking(False)
                os.link(temporary, path)  # EEXIST if a live process took the name meanwhile
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary)
        except FileExistsError as exc:
            listener.close()
            raise FileExistsError(f"another process is already listening on {path}") from exc
        except OSError:
            listener.close()
            raise
        with self._lock:
            self._listeners[path] = listener
            self._pending.append(("add", path, listener, None))
        self._wake()

    def listen_tcp(self, ip: str, port: int) -> int:
        """Serve TCP at `ip:port` too (port 0: any free port); returns the port. Only with a secret: every
        TCP peer proves it knows it before anything else. OSError when the address cannot be bound."""
        if self._secret is None:
            raise StatusError(LLMStatusCode.LLM_FAILED, "no shared secret: TCP is not served")
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((ip, port))
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        bound_port: int = listener.getsockname()[1]
        with self._lock:
            self._listeners[(ip, bound_port)] = listener
            self._pending.append(("add", (ip, bound_port), listener, None))
        self._wake()
        return bound_port

    def unlisten(self, path: ListenAddr, timeout_s: float = 5.0) -> None:
        """Stop serving on `path` and remove the socket file; links already made stay up.

        Synchronous: when this returns, the listener is closed and the file is gone, so the same address
        can be listened on again at once.
        """
        done = threading.Event()
        with self._lock:
            listener = self._listeners.pop(path, None)
            if listener is None:
                return
            self._pending.append(("remove", path, listener, done))
        if threading.current_thread() is self._thread:
            self._apply_pending()
            return
        self._wake()
        if self.failure is None and done.wait(timeout_s) and self.failure is None:
            return
        # The server thread is gone or stuck: do it here (the selector then still names a closed
        # socket, which only the dead thread would have looked at).
        with self._lock:
            self._pending = [entry for entry in self._pending if entry[1] != path]
        _close_listener(path, listener)

    def check_alive(self) -> None:
        """Raise StatusError(LLM_FAILED) if the server thread died (nothing serves this process's caches)."""
        if self.failure is not None:
            raise StatusError(
                LLMStatusCode.LLM_FAILED,
                f"the server thread of this process stopped ({self.failure}); finalize and init again",
            )

    @property
    def listening(self) -> list[ListenAddr]:
        with self._lock:
            return list(self._listeners)

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
            found = any(c.peer is not None and c.peer.cluster_id == cluster_id for c in self._conns.values())
        self._wake()
        # The server thread closes them; wait so that the caller sees them gone (bounded, never a hang).
        done.wait(5.0)
        return found

    def conns_of(self, cluster_id: int) -> list[object]:
        """The connections from `cluster_id` (what the table knows leases and rows by)."""
        with self._lock:
            return [c for c in self._conns.values() if c.peer is not None and c.peer.cluster_id == cluster_id]

    def peer_has_leases(self, cluster_id: int) -> bool:
        """True while a connection from `cluster_id` holds a lease (a pull from us is in progress)."""
        with self._lock:
            conns = [
                c for c in self._conns.values() if c.peer is not None and c.peer.cluster_id == cluster_id
            ]
        return any(self._service.holds_leases(conn) for conn in conns)

    def close(self, timeout_s: float = 5.0, *, drain_s: float = 0.0) -> None:
        """Stop serving. With `drain_s`, first refuse new links and end every connection the way an unlink
        does, waiting up to `drain_s` for those that hold leases to drain (their peers' transfers end)."""
        if drain_s > 0 and self._thread is not None and self._thread.is_alive() and self.failure is None:
            self._closing = True
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
        with self._lock:
            listeners, self._listeners = self._listeners, {}
            pending, self._pending = self._pending, []
        for path, listener in list(listeners.items()) + [
            (p, sock) for _, p, sock, _ in pending if sock is not None
        ]:
            _close_listener(path, listener)
        for _, _, _, done in pending:
            if done is not None:
                done.set()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        self._service = _NoService()  # the service refers back to its owner: no cycle outlives the close

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # --------------------------------------------------------------- the loop

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_pending()
                selected_at = time.monotonic()
                events = self._selector.select(timeout=_PARKED_RETRY_S if self._parked else 1.0)
                for key, mask in events:
                    self._dispatch(key, mask)
                if self._parked:
                    self._retry_parked()
                self._sweep(selected_at)
        except BaseException as exc:
            # Not one peer's fault (those are handled in _dispatch): the loop itself broke. Say so to every
            # later API call rather than leaving peers to time out.
            self.failure = f"{type(exc).__name__}: {exc}"
            log.exception("server %d: the server thread stopped", self.cluster_id)
            # Whoever waits on this thread to stop listening does it itself now (see unlisten).
            with self._lock:
                waiting = [done for _, _, _, done in self._pending if done is not None]
            for done in waiting:
                done.set()

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
        sconn: _ServerConn = key.data
        try:
            if mask & selectors.EVENT_READ:
                self._on_readable(sconn)
            if mask & selectors.EVENT_WRITE and sconn.sock.fileno() != -1:
                self._flush(sconn)
        except Exception as exc:
            peer = sconn.peer
            who = f"pid {sconn.pid}" + (f", cluster {peer.cluster_id}" if peer is not None else "")
            log.error(
                "server %d: dropping the connection of %s: %s while handling %s",
                self.cluster_id,
                who,
                repr(exc),
                sconn.handling,
                exc_info=True,
            )
            self._drop(sconn, f"internal error while handling {sconn.handling}: {exc!r}")

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
            if sconn.peer is not None:
                continue
            if sconn.host and selected_at - sconn.accepted_at > self._admission.proof_timeout_s:
                timeout_s = self._admission.proof_timeout_s
                self._refuse(
                    sconn, f"no proof of the shared secret within {timeout_s:g} s", Refusal.OUT_OF_TIME
                )
            elif not sconn.host and selected_at - sconn.accepted_at > _HANDSHAKE_TIMEOUT_S:
                self._drop(sconn, "no handshake within the time limit")
        self._refusals.flush(now)
        try:
            self._service.housekeeping()
        except Exception:
            log.exception("server %d: housekeeping failed", self.cluster_id)

    def _apply_pending(self) -> None:
        if not (self._pending or self._pending_drops):  # the common case, without taking the lock
            return
        with self._lock:
            pending, self._pending = self._pending, []
            drops, self._pending_drops = self._pending_drops, []
        clusters = {cluster_id for cluster_id, _ in drops}
        for sconn in list(self._conns.values()):
            if sconn.peer is not None and sconn.peer.cluster_id in clusters:
                self._drop(sconn, "unlinked by this side", drain=True)
        for _, done in drops:
            done.set()
        for action, path, listener, listener_done in pending:
            assert listener is not None
            if action == "add":
                self._selector.register(listener, selectors.EVENT_READ, ("listen", path))
            else:
                with contextlib.suppress(KeyError, ValueError):
                    self._selector.unregister(listener)
                _close_listener(path, listener)
                if listener_done is not None:
                    listener_done.set()

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
                who = f"{host}:{address[1]}"
            else:
                pid, uid, _ = peer_credentials(sock)
                host, who = "", f"pid {pid}"
            if len(self._conns) >= MAX_CONNECTIONS:
                full = f"{len(self._conns)} connections open"
                if tcp:
                    self._refusals.refused(host, full, Refusal.FULL, time.monotonic())
                else:
                    log.warning("server %d: refusing %s, %s", self.cluster_id, who, full)
                sock.close()
                continue
            if tcp:
                self._make_room(host)
            sock.setblocking(False)
            sconn = _ServerConn(sock, pid, uid, host=host, secret=self._secret if tcp else None)
            if tcp:
                tune_tcp(sock)
                sconn.nonce = _auth.new_nonce()
                sconn.outbuf += sconn.conn.send(Challenge(PROTOCOL_VERSION, sconn.nonce))
            with self._lock:
                self._conns[sock.fileno()] = sconn
            self._selector.register(sock, selectors.EVENT_READ, sconn)
            if tcp:
                self._flush(sconn)

    def _make_room(self, source: str) -> None:
        """Before a TCP connection from `source` is admitted: refuse the unproven one it replaces, if any
        (`make_room`), so a newcomer is never turned away for what other addresses hold."""
        pending = sorted(
            (c for c in self._conns.values() if c.host and c.peer is None), key=lambda c: c.accepted_at
        )
        victim = make_room([(c.host, c) for c in pending], source, self._admission)
        if victim is not None:
            limits = self._admission
            self._refuse(
                victim,
                f"closed to make room for a newer connection ({limits.per_source} per address and "
                f"{limits.total} in all may be proving the shared secret at once)",
                Refusal.MADE_ROOM,
            )

    def _on_readable(self, sconn: _ServerConn) -> None:
        try:
            data = sconn.sock.recv(_RECV_NBYTES)
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
                if sconn.parked:
                    self._park(sconn, event)  # behind the one waiting for the lock: in order
                else:
                    self._handle(sconn, event)
                sconn.handling = "its traffic"
                if sconn.closing or sconn.sock.fileno() == -1:
                    return
        except ProtocolError as exc:
            self._log_protocol_error(sconn, exc)
            self._drop(sconn, f"protocol error: {exc}")
            return
        self._flush(sconn)

    def _handle(self, sconn: _ServerConn, msg: Message) -> None:
        """Serve one message; one that needs the index lock while it is held elsewhere waits (parked) and
        is served, in order with the connection's later messages, as soon as the lock is free."""
        try:
            self._serve_one(sconn, msg)
        except IndexBusy:
            self._park(sconn, msg)

    def _park(self, sconn: _ServerConn, msg: Message) -> None:
        if len(sconn.parked) >= MAX_PARKED:
            self._drop(sconn, f"more than {MAX_PARKED} requests waiting for the index lock")
            return
        sconn.parked.append(msg)
        self._parked.add(sconn)

    def _retry_parked(self) -> None:
        """Serve what waits for the index lock, each connection in order; stop at the first that still
        finds it busy (it is busy for every connection alike)."""
        for sconn in list(self._parked):
            try:
                while sconn.parked and not sconn.closing:
                    sconn.handling = type(sconn.parked[0]).__name__
                    try:
                        self._serve_one(sconn, sconn.parked[0])
                    except IndexBusy:
                        return
                    sconn.parked.popleft()
                self._parked.discard(sconn)
                self._flush(sconn)
            except Exception as exc:  # as in _dispatch: only this peer's connection goes
                log.error(
                    "server %d: dropping the connection of pid %d: %r while handling %s",
                    self.cluster_id,
                    sconn.pid,
                    exc,
                    sconn.handling,
                    exc_info=True,
                )
                self._drop(sconn, f"internal error while handling {sconn.handling}: {exc!r}")

    def _serve_one(self, sconn: _ServerConn, msg: Message) -> None:
        """IndexBusy (nothing done) when what the message needs waits for the index lock."""
        self.handled += 1
        if isinstance(msg, Hello):
            self._on_hello(sconn, msg)
            return
        if isinstance(msg, Ping):
            self._send(sconn, Pong(msg.seq) if not sconn.draining else self._ended_error(sconn, msg.seq))
            return
        if isinstance(msg, Release):
            # One way: nothing to answer. A lease this connection does not hold is the peer's bug, and
            # releasing nothing is the only safe response.
            try:
                self._service.release(sconn, msg.lease_id, msg.ok)
            except IndexBusy:
                raise
            except StatusError as exc:
                log.warning("server %d: pid %d: %s", self.cluster_id, sconn.pid, exc.detail)
            self._drained(sconn)
            return
        if sconn.peer is None:
            # The connection state machine admits nothing but Hello before Welcome; never trust it alone.
            raise ProtocolError(f"{type(msg).__name__} before the handshake")
        seq = getattr(msg, "seq", 0)
        if sconn.draining and not isinstance(msg, PullDone):
            self._send(sconn, self._ended_error(sconn, seq))
            return
        try:
            reply = self._answer(sconn, sconn.peer, msg)
        except IndexBusy:
            raise
        except StatusError as exc:
            reply = Error(seq, int(exc.code), exc.detail)
        self._send(sconn, reply)
        self._drained(sconn)

    @staticmethod
    def _ended_error(sconn: _ServerConn, seq: int) -> Error:
        return Error(seq, int(LLMStatusCode.LLM_LINK_FAILED), f"this side ended the link ({sconn.draining})")

    def _drained(self, sconn: _ServerConn) -> None:
        """A draining connection whose last lease just ended closes now."""
        if sconn.draining and not self._service.holds_leases(sconn):
            self._flush(sconn)
            self._drop(sconn, sconn.draining)

    def _answer(self, sconn: _ServerConn, peer: PeerInfo, msg: Message) -> Message:
        """The reply to one request of a linked peer; StatusError becomes an Error reply."""
        if isinstance(msg, Announce):
            if peer.remote:
                sconn.peer = replace(peer, callback_port=msg.tcp_port)
            else:
                sconn.peer = replace(peer, callback=msg.callback)
            return Ack(msg.seq)
        return self._service.answer(sconn, peer, msg)

    def _on_hello(self, sconn: _ServerConn, hello: Hello) -> None:
        if sconn.host:
            self._on_tcp_hello(sconn, hello)
            return
        reason = ""
        if hello.version != PROTOCOL_VERSION:
            reason = f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
        elif sconn.uid != os.getuid():
            reason = f"peer uid {sconn.uid} is not ours"
        elif hello.remote_cluster_id != self.cluster_id:
            reason = f"this side is cluster {self.cluster_id}, not {hello.remote_cluster_id}"
        elif hello.pid != sconn.pid:
            reason = f"hello claims pid {hello.pid}, socket says {sconn.pid}"
        elif hello.nonce or hello.proof or hello.engine:
            reason = "a peer on this host sends no proof and no engine"
        elif self._closing:
            reason = "this side is finalizing"
        if reason:
            self._refuse(sconn, reason)
            return
        sconn.peer = PeerInfo(hello.cluster_id, hello.role, hello.pid, hello.incarnation)
        # A row of the published index to pin through; with none free the peer asks us instead.
        index, row, ticket = self._service.admit(sconn, sconn.peer)
        welcome = Welcome(
            PROTOCOL_VERSION, self.cluster_id, self.role, os.getpid(), self.incarnation, index, row, ticket
        )
        self._send(sconn, welcome)
        self._service.peer_linked(sconn.peer)

    def _on_tcp_hello(self, sconn: _ServerConn, hello: Hello) -> None:
        """A peer on another host: it proves it knows the secret before anything else is looked at; then
        we prove it back in the Welcome. It gets no row of our index (it cannot map it): it asks us."""
        secret = self._secret
        client = (hello.cluster_id, hello.incarnation, hello.engine)
        if secret is None or not hello.nonce or not hello.proof:
            self._refuse(sconn, "no proof of the shared secret")
            return
        expected = _auth.client_proof(secret, sconn.nonce, hello.nonce, client, hello.remote_cluster_id)
        if not _auth.proofs_match(expected, hello.proof):
            self._refuse(sconn, "wrong shared secret")
            return
        reason = ""
        if hello.version != PROTOCOL_VERSION:
            reason = f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
        elif hello.remote_cluster_id != self.cluster_id:
            reason = f"this side is cluster {self.cluster_id}, not {hello.remote_cluster_id}"
        elif not hello.engine:
            reason = "the peer runs no transfer engine"
        if reason:
            self._refuse(sconn, reason)
            return
        try:
            engine = self._service.serve_remote(str(sconn.sock.getsockname()[0]))
        except StatusError as exc:
            self._refuse(sconn, exc.detail)
            return
        sconn.conn.raise_frame_limit(DEFAULT_MAX_FRAME_NBYTES)
        sconn.pid = hello.pid  # what it claims: a pid on another host, for the log only
        sconn.peer = PeerInfo(
            hello.cluster_id, hello.role, hello.pid, hello.incarnation, host=sconn.host, engine=hello.engine
        )
        server = (self.cluster_id, self.incarnation, engine)
        proof = _auth.server_proof(secret, sconn.nonce, hello.nonce, client, server)
        welcome = Welcome(
            PROTOCOL_VERSION,
            self.cluster_id,
            self.role,
            os.getpid(),
            self.incarnation,
            "",
            0,
            0,
            proof,
            engine,
        )
        self._send(sconn, welcome)
        log.info(
            "server %d: cluster %d linked from %s (engine %s)",
            self.cluster_id,
            hello.cluster_id,
            sconn.host,
            hello.engine,
        )
        self._service.peer_linked(sconn.peer)

    def _refuse(self, sconn: _ServerConn, reason: str, kind: Refusal = Refusal.HANDSHAKE) -> None:
        """Refuse a handshake: LLM_LINK_FAILED with the reason, then close. Logged at once for a peer on
        this host, through the refusal log (a line per address and interval) for one on TCP."""
        if sconn.host:
            self._refusals.refused(sconn.host, reason, kind, time.monotonic())
        else:
            log.warning("server %d: refusing link from pid %d: %s", self.cluster_id, sconn.pid, reason)
        self._send(sconn, Error(0, int(LLMStatusCode.LLM_LINK_FAILED), reason))
        sconn.closing = True
        self._flush(sconn)
        self._drop(sconn, reason)

    def _log_protocol_error(self, sconn: _ServerConn, exc: ProtocolError) -> None:
        if sconn.host and sconn.peer is None:  # anyone who reaches the port: through the refusal log
            self._refusals.refused(sconn.host, f"protocol error: {exc}", Refusal.PROTOCOL, time.monotonic())
        else:
            log.warning("server %d: closing connection from pid %d: %s", self.cluster_id, sconn.pid, exc)

    def _send(self, sconn: _ServerConn, msg: Message) -> None:
        if sconn.closing:
            return
        sconn.outbuf += sconn.conn.send(msg)
        if len(sconn.outbuf) > MAX_OUTBUF_NBYTES:
            # A peer that keeps asking and never reads would grow this without bound.
            sconn.closing = True
            self._drop(sconn, f"more than {MAX_OUTBUF_NBYTES} bytes of replies unread")

    def _flush(self, sconn: _ServerConn) -> None:
        if sconn.sock.fileno() == -1:
            return
        while sconn.outbuf:
            try:
                sent = sconn.sock.send(sconn.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._drop(sconn, f"send failed: {exc}")
                return
            del sconn.outbuf[:sent]
        want_write = bool(sconn.outbuf)
        if want_write == sconn.waiting_to_write:
            return  # no epoll_ctl when nothing changes (a reply that fit the socket buffer)
        sconn.waiting_to_write = want_write
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if want_write else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(sconn.sock, events, sconn)

    def _drop(self, sconn: _ServerConn, reason: str, *, drain: bool = False) -> None:
        """End a connection. `drain` (this side ends the link): one that holds leases first drains, so that
        its peer's transfers in flight end as they would; it closes when its last lease ends (or its peer
        goes). Whatever it still pins in the index stays pinned until its holder lets go or dies."""
        fd = sconn.sock.fileno()
        if fd == -1:
            return
        if drain and not sconn.closing and self._service.holds_leases(sconn):
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
        released = frozenset(
            msg.lease_id for msg in sconn.parked if isinstance(msg, Release | PullDone) and msg.ok
        )
        sconn.parked.clear()
        self._parked.discard(sconn)
        # Nothing may take the server down: the connection is gone whatever this raises.
        try:
            self._service.connection_ended(sconn, released)
            if sconn.peer is not None:
                self._service.peer_gone(sconn.peer)
        except Exception:
            log.exception("server %d: cleaning up after pid %d failed", self.cluster_id, sconn.pid)


def _close_listener(path: ListenAddr, listener: socket.socket) -> None:
    listener.close()
    if isinstance(path, Path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


# ===================================================================== client side


class ClientLink:
    """The Decoder's end of a link: one socket, requests answered in order, one transfer at a time."""

    def __init__(self, sock: socket.socket, conn: Connection, peer: PeerInfo, path: Path | str) -> None:
        self._sock = sock
        self._conn = conn
        self.peer = peer
        self.path = path  # the Unix socket, or "ip:port" over TCP
        self.local_ip = ""  # over TCP: the address we connect from (our engine and callback listen there)
        # Over TCP: where the peer has its segments mapped (asked once per segment; a name is never reused).
        self.segment_addrs: dict[str, int] = {}
        self.mappings = _LockedMappings()
        self.owned_segments: set[str] = set()  # segment names already checked to be the peer's own
        # What was learnt from this peer incarnation (its one-sided table, its index): it dies with the link.
        self.remote_table: object | None = None
        self.index_name = ""
        self.index_row = 0
        self.index_ticket = 0  # names this connection in its row of the peer's index
        self.index: Index | None = None  # mapped on first use (see llm_datadist._dataplane)
        self._poller: select.poll | None = None  # check_peer_alive's, registered once
        self._lock = threading.Lock()  # held by the one transfer using the link (`exclusive`)
        # `close` while a transfer holds the link: the transfer's end closes it (say_bye), so that what the
        # transfer still sends (its release) reaches the peer.
        self._close_mutex = threading.Lock()
        self._close_pending: bool | None = None
        self._seq = 0
        self.broken: str | None = None
        # Called once when the link breaks (the owner of the link uses it to clean up after a dead peer).
        self.on_broken: Callable[[ClientLink], None] | None = None
        # How bytes move to and from this peer, chosen by whoever made the link (`_links.Links`).
        self.mover: object = None

    @classmethod
    def connect(
        cls,
        path: Path,
        *,
        cluster_id: int,
        remote_cluster_id: int,
        role: int,
        deadline: float,
        callback: str = "",
        incarnation: int = 0,
    ) -> ClientLink:
        """Connect, handshake and announce our callback socket; raises StatusError(LLM_LINK_FAILED)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with _handshake_errors(sock, str(path)):
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock.connect(os.fspath(path))
            except OSError as exc:
                raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"cannot connect to {path}: {exc}") from exc
            pid, uid, _ = peer_credentials(sock)
            if uid != os.getuid():
                raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"{path} is served by uid {uid}, not by us")
            conn = Connection(ConnRole.CLIENT)
            hello = Hello(PROTOCOL_VERSION, cluster_id, remote_cluster_id, role, os.getpid(), incarnation)
            sock.sendall(conn.send(hello))
            welcome = _welcome(_receive(sock, conn, deadline), remote_cluster_id, str(path))
            if welcome.pid != pid:
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED, f"peer claims pid {welcome.pid}, socket says {pid}"
                )
            link = cls(sock, conn, PeerInfo(welcome.cluster_id, welcome.role, pid, welcome.incarnation), path)
            link.index_name, link.index_row, link.index_ticket = (
                welcome.index,
                welcome.index_row,
                welcome.index_ticket,
            )
            link._announce(Announce(link.next_seq(), callback), deadline)
            return link
        raise AssertionError("unreachable")  # _handshake_errors raises

    @classmethod
    def connect_tcp(
        cls,
        host: str,
        port: int,
        *,
        secret: bytes,
        local_ip: str,
        engine: Callable[[str], str],
        callback_port: Callable[[str], int],
        cluster_id: int,
        remote_cluster_id: int,
        role: int,
        deadline: float,
        incarnation: int,
    ) -> ClientLink:
        """Connect to a peer on another host at `host:port` (from `local_ip` when it is one of ours, else
        from the address the route to it leaves by), prove we know the shared secret, check the peer's
        proof, announce our TCP callback port. `engine(ip)` gives our transfer engine's address for the ip
        we connect from, `callback_port(ip)` the port we serve TCP on there (both start on first use).
        Raises StatusError(LLM_LINK_FAILED)."""
        where = f"{host}:{port}"
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with _handshake_errors(sock, where):
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                our_ip = local_ip or _source_ip(host, port)
                # Before connecting: starting the engine can take a second, and the peer gives a connection
                # that has not proved the secret only a round trip's worth of that.
                our_engine = engine(our_ip)
                sock.bind((our_ip, 0))
                sock.connect((host, port))
            except OSError as exc:
                raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"cannot connect to {where}: {exc}") from exc
            tune_tcp(sock)
            conn = Connection(ConnRole.CLIENT, challenge=True, secret=secret)
            challenge = _receive(sock, conn, deadline)
            if isinstance(challenge, Error):
                raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"refused by {where}: {challenge.message}")
            if not isinstance(challenge, Challenge):
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED, f"unexpected {type(challenge).__name__} from {where}"
                )
            if challenge.version != PROTOCOL_VERSION:
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED, f"{where} speaks protocol version {challenge.version}"
                )
            nonce = _auth.new_nonce()
            client = (cluster_id, incarnation, our_engine)
            proof = _auth.client_proof(secret, challenge.nonce, nonce, client, remote_cluster_id)
            hello = Hello(
                PROTOCOL_VERSION,
                cluster_id,
                remote_cluster_id,
                role,
                os.getpid(),
                incarnation,
                nonce,
                proof,
                our_engine,
            )
            sock.sendall(conn.send(hello))
            welcome = _welcome(_receive(sock, conn, deadline), remote_cluster_id, where)
            server = (welcome.cluster_id, welcome.incarnation, welcome.engine)
            expected = _auth.server_proof(secret, challenge.nonce, nonce, client, server)
            if not welcome.proof or not _auth.proofs_match(expected, welcome.proof):
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED, f"{where} did not prove it knows the shared secret"
                )
            if not welcome.engine:
                raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"{where} runs no transfer engine")
            peer = PeerInfo(
                welcome.cluster_id,
                welcome.role,
                welcome.pid,
                welcome.incarnation,
                host=host,
                engine=welcome.engine,
            )
            link = cls(sock, conn, peer, where)
            link.local_ip = our_ip
            link._announce(Announce(link.next_seq(), "", callback_port(our_ip)), deadline)
            return link
        raise AssertionError("unreachable")  # _handshake_errors raises

    def _announce(self, announce: Announce, deadline: float) -> None:
        self._sock.sendall(self._conn.send(announce))
        ack = _receive(self._sock, self._conn, deadline)
        if not isinstance(ack, Ack) or ack.seq != announce.seq:
            raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"unexpected {type(ack).__name__} to Announce")

    def exclusive(self, deadline: float, *, busy_fails: bool = False) -> _Exclusive:
        """Hold the link for one transfer; waits until `deadline` (or fails at once with `busy_fails`)."""
        return _Exclusive(self, deadline, busy_fails)

    def check_usable(self) -> None:
        if self._close_pending is not None:
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED, f"link to cluster {self.peer.cluster_id} is closing"
            )
        if self.broken is not None:
            raise StatusError(
                LLMStatusCode.LLM_LINK_FAILED,
                f"link to cluster {self.peer.cluster_id} is broken ({self.broken}); unlink and link again",
            )

    def next_seq(self) -> int:
        self._seq = (self._seq % 0xFFFFFFFF) + 1
        return self._seq

    def request(self, msg: Message, seq: int, deadline: float) -> Message:
        """Send `msg` and wait for the reply carrying `seq`; an `Error` reply raises StatusError."""
        try:
            _send_all(self._sock, self._conn.send(msg), deadline)
            reply = _receive(self._sock, self._conn, deadline)
        except TransferTimeout as exc:
            self._break(f"timed out: {exc.detail}")
            raise
        except PeerGone as exc:
            self._break(exc.detail)
            raise
        except (ProtocolError, OSError) as exc:
            self._break(str(exc))
            raise PeerGone(f"link to cluster {self.peer.cluster_id} failed: {exc}") from exc
        reply_seq = getattr(reply, "seq", None)
        if reply_seq != seq:
            self._break(f"reply out of order: {type(reply).__name__}")
            raise PeerGone(f"peer answered out of order ({type(reply).__name__})")
        if isinstance(reply, Error):
            raise StatusError(code_2_status(reply.status_code), f"remote: {reply.message}")
        return reply

    def send_only(self, msg: Message, deadline: float) -> None:
        """Send a one-way message (no reply comes) by `deadline`; a failure breaks the link."""
        try:
            _send_all(self._sock, self._conn.send(msg), deadline)
        except TransferTimeout as exc:
            self._break(f"timed out: {exc.detail}")
            raise
        except (ProtocolError, OSError) as exc:
            self._break(str(exc))
            raise PeerGone(f"link to cluster {self.peer.cluster_id} failed: {exc}") from exc

    def close(self, *, say_bye: bool) -> None:
        """Say goodbye (`say_bye`) and close. While a transfer holds the link, no new one may start, and
        the running one closes the link when it ends."""
        with self._close_mutex:
            if not self._lock.acquire(blocking=False):
                self._close_pending = say_bye or bool(self._close_pending)
                return
        try:
            self._close_now(say_bye=say_bye)
        finally:
            self._lock.release()

    def _close_now(self, *, say_bye: bool) -> None:
        if say_bye and self.broken is None and self._conn.state is ConnState.READY:
            with contextlib.suppress(OSError, ProtocolError):
                self._sock.settimeout(0.5)
                self._sock.sendall(self._conn.send(Bye("unlink")))
        self.broken = self.broken or "closed"
        self._poller = None  # it names the socket's fd, which the kernel may hand out again
        self._sock.close()
        self.mappings.clear()
        self.remote_table = None
        index, self.index = self.index, None
        if index is not None:
            _unpins.release(index)  # closed now, or once the unpins owed through it are done

    def check_peer_alive(self) -> None:
        """PeerGone if the peer's end of the socket is closed (it exited or died), without waiting or
        reading: one poll for a hang-up. A transfer that never talks to the peer (a one-sided read) asks
        this, so that it never returns what a dead process left in memory that is still mapped here. Safe
        while another thread waits on the same socket (nothing is read, the socket's mode is untouched)."""
        try:
            poller = self._poller
            if poller is None:
                poller = select.poll()
                poller.register(self._sock, _HANGUP_EVENTS)
                self._poller = poller
            try:
                events = poller.poll(0)
            except RuntimeError:  # another thread polls this link's poller right now: use one of ours
                poller = select.poll()
                poller.register(self._sock, _HANGUP_EVENTS)
                events = poller.poll(0)
        except (OSError, ValueError) as exc:  # the socket was closed under us
            self._break(f"connection failed: {exc}")
            raise PeerGone(f"link to cluster {self.peer.cluster_id} failed: {exc}") from exc
        if events:
            self._break("peer closed the connection")
            raise PeerGone(f"cluster {self.peer.cluster_id} closed the link (the process ended)")

    def fail(self, reason: str) -> None:
        """Mark the link broken from outside its socket (the peer was found gone another way)."""
        self._break(reason)

    def _break(self, reason: str) -> None:
        # The server sees EOF and drops our leases; nothing on this link can be trusted any more.
        first = self.broken is None
        self.broken = reason
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if first and self.on_broken is not None:
            self.on_broken(self)


class _LockedMappings(MappingCache):
    """A link's mappings: used by transfers and swept by the server thread (housekeeping) at once."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.RLock()  # drop_unlinked calls drop

    def get(self, name: str, *, min_nbytes: int = 0, writable: bool = False) -> Segment:
        with self._lock:
            return super().get(name, min_nbytes=min_nbytes, writable=writable)

    def drop(self, name: str) -> None:
        with self._lock:
            super().drop(name)

    def drop_unlinked(self) -> list[str]:
        with self._lock:
            return super().drop_unlinked()

    def clear(self) -> None:
        with self._lock:
            super().clear()


class _Exclusive:
    """`ClientLink.exclusive`: a class, not @contextmanager, since every transfer enters one."""

    __slots__ = ("_busy_fails", "_deadline", "_link")

    def __init__(self, link: ClientLink, deadline: float, busy_fails: bool) -> None:
        self._link = link
        self._deadline = deadline
        self._busy_fails = busy_fails

    def __enter__(self) -> None:
        lock = self._link._lock
        acquired = (
            lock.acquire(blocking=False)
            if self._busy_fails
            else lock.acquire(timeout=max(self._deadline - time.monotonic(), 0.0))
        )
        if not acquired:
            if self._busy_fails:
                raise StatusError(LLMStatusCode.LLM_LINK_BUSY, "another operation is using this link")
            raise TransferTimeout(
                LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, "timed out waiting for another transfer on this link"
            )
        try:
            self._link.check_usable()
        except BaseException:
            lock.release()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        link = self._link
        if link._close_pending is None:  # the common case, without the mutex
            link._lock.release()
            if link._close_pending is None:
                return
            # A close came between the look and the release, found the link held and left it to us.
            link.close(say_bye=link._close_pending)
            return
        with link._close_mutex:
            say_bye, link._close_pending = link._close_pending, None
            try:
                if say_bye is not None:
                    link._close_now(say_bye=say_bye)
            finally:
                link._lock.release()


def tune_tcp(sock: socket.socket) -> None:
    """No Nagle delay on requests; and keepalives, so that a peer host that vanished (powered off, cut
    off: no FIN ever comes) ends the connection within `_KEEPALIVE_S`, and with it the leases it held."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle_s, interval_s, probes = _KEEPALIVE
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, probes)
    # Unacknowledged data counts too: a peer that stopped acknowledging mid-reply is given up as well.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, _KEEPALIVE_S * 1000)


@contextlib.contextmanager
def _handshake_errors(sock: socket.socket, where: str) -> Iterator[None]:
    """Link set-up: every failure closes the socket and is StatusError(LLM_LINK_FAILED)."""
    try:
        yield
    except TransferTimeout as exc:
        sock.close()
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"handshake timed out: {exc.detail}") from exc
    except (StatusError, ProtocolError, OSError) as exc:
        sock.close()
        if isinstance(exc, StatusError):
            raise
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"handshake with {where} failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise


def _welcome(reply: Message, remote_cluster_id: int, where: str) -> Welcome:
    """The handshake's answer, checked: a refusal or anything but a matching Welcome is LLM_LINK_FAILED."""
    if isinstance(reply, Error):
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"refused by the peer: {reply.message}")
    if not isinstance(reply, Welcome):
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"unexpected {type(reply).__name__} in handshake")
    if reply.version != PROTOCOL_VERSION:
        raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"peer speaks protocol version {reply.version}")
    if reply.cluster_id != remote_cluster_id:
        raise StatusError(
            LLMStatusCode.LLM_LINK_FAILED, f"{where} is cluster {reply.cluster_id}, not {remote_cluster_id}"
        )
    return reply


def _source_ip(host: str, port: int) -> str:
    """The address of ours a connection to `host:port` leaves from (the route's source address). A UDP
    socket's connect only looks the route up: nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])


def _send_all(sock: socket.socket, data: bytes, deadline: float) -> None:
    """sendall bounded by `deadline` (not by whatever timeout the last receive left on the socket)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferTimeout(LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, "no time left to send to the peer")
    sock.settimeout(remaining)
    try:
        sock.sendall(data)
    except TimeoutError as exc:
        raise TransferTimeout(
            LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, "the peer did not take the request in time"
        ) from exc


def _receive(sock: socket.socket, conn: Connection, deadline: float) -> Message:
    """Read until one message arrives; TransferTimeout at `deadline`, PeerGone on EOF."""
    while True:
        event = conn.next_event()
        if isinstance(event, Closed):
            raise PeerGone(f"peer closed the connection{': ' + event.reason if event.reason else ''}")
        if event is not None:
            return event
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout(LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, "no answer from the peer in time")
        sock.settimeout(remaining)
        try:
            data = sock.recv(_RECV_NBYTES)
        except TimeoutError as exc:
            raise TransferTimeout(
                LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, "no answer from the peer in time"
            ) from exc
        except ConnectionResetError as exc:
            raise PeerGone(f"connection reset: {exc}") from exc
        conn.receive_data(data)

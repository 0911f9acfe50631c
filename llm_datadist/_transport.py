"""Sockets and threads: the listening server (one selector thread per process) and client links.

Rules: every frame goes through `protocol.connection.Connection` (sans-IO); this module only moves bytes.
The server never blocks on one peer: sockets are non-blocking and output is buffered per connection. A
connection that breaks the protocol is closed with a logged reason and its leases are dropped; the server
and every other link keep working. Client waits are bounded by the caller's deadline; EOF from the peer is
reported at once (`PeerGone`), a deadline as `TransferTimeout`, and either leaves the link broken.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from protocol.connection import Closed, Connection, ConnRole, ConnState
from protocol.errors import ProtocolError
from protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Bye,
    Error,
    Hello,
    Message,
    Ping,
    Pong,
    PullDone,
    PullGrant,
    PullRequest,
    Welcome,
)
from shm.mappings import MappingCache

from ._engine import CacheTable
from ._errors import PeerGone, StatusError, TransferTimeout
from ._runtime import remove_stale_socket
from .status import LLMStatusCode, code_2_status
from .utils.log import log

_RECV_NBYTES = 256 * 1024
_HANDSHAKE_TIMEOUT_S = 10.0
_MAX_CONNECTIONS = 512
_PEERCRED = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    pid, uid, gid = _PEERCRED.unpack(raw)
    return pid, uid, gid


@dataclass(frozen=True)
class PeerInfo:
    cluster_id: int
    role: int
    pid: int


# ===================================================================== server side


class _ServerConn:
    """One accepted connection: its socket, protocol state and unsent bytes."""

    def __init__(self, sock: socket.socket, pid: int, uid: int) -> None:
        self.sock = sock
        self.pid = pid
        self.uid = uid
        self.conn = Connection(ConnRole.SERVER)
        self.outbuf = bytearray()
        self.closing = False
        self.peer: PeerInfo | None = None
        self.accepted_at = time.monotonic()


class Server:
    """Serves this process's caches on a Unix socket from one background thread."""

    def __init__(self, path: Path, *, cluster_id: int, role: int, table: CacheTable) -> None:
        self.path = path
        self.cluster_id = cluster_id
        self.role = role
        self._table = table
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: dict[int, _ServerConn] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peers_lock = threading.Lock()

    def start(self) -> None:
        remove_stale_socket(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Create the socket file private from the start: no window where another user could connect.
            old_umask = os.umask(0o177)
            try:
                listener.bind(os.fspath(self.path))
            finally:
                os.umask(old_umask)
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "listen")
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(
            target=self._serve, name=f"llmdd-server-{self.cluster_id}", daemon=True
        )
        self._thread.start()

    def peers(self) -> list[PeerInfo]:
        with self._peers_lock:
            return [c.peer for c in self._conns.values() if c.peer is not None]

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout_s)
        for sconn in list(self._conns.values()):
            self._drop(sconn, "server closing")
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # --------------------------------------------------------------- the loop

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._selector.select(timeout=1.0)
            except OSError as exc:  # pragma: no cover - the selector itself failing is fatal for the server
                log.error("server %s: select failed: %s", self.path, exc)
                return
            for key, mask in events:
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    with contextlib.suppress(OSError):
                        self._wake_r.recv(64)
                else:
                    sconn: _ServerConn = key.data
                    if mask & selectors.EVENT_READ:
                        self._on_readable(sconn)
                    if mask & selectors.EVENT_WRITE and sconn.sock.fileno() != -1:
                        self._flush(sconn)
            self._sweep_handshakes()

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("server %s: accept failed: %s", self.path, exc)
                return
            pid, uid, _ = peer_credentials(sock)
            if len(self._conns) >= _MAX_CONNECTIONS:
                log.warning(
                    "server %s: refusing pid %d, %d connections open", self.path, pid, len(self._conns)
                )
                sock.close()
                continue
            sock.setblocking(False)
            sconn = _ServerConn(sock, pid, uid)
            with self._peers_lock:
                self._conns[sock.fileno()] = sconn
            self._selector.register(sock, selectors.EVENT_READ, sconn)

    def _sweep_handshakes(self) -> None:
        now = time.monotonic()
        for sconn in list(self._conns.values()):
            if sconn.peer is None and now - sconn.accepted_at > _HANDSHAKE_TIMEOUT_S:
                self._drop(sconn, "no handshake within the time limit")

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
                self._handle(sconn, event)
                if sconn.closing:
                    break
        except ProtocolError as exc:
            log.warning("server %s: closing connection from pid %d: %s", self.path, sconn.pid, exc)
            self._drop(sconn, f"protocol error: {exc}")
            return
        self._flush(sconn)

    def _handle(self, sconn: _ServerConn, msg: Message) -> None:
        if isinstance(msg, Hello):
            self._on_hello(sconn, msg)
        elif isinstance(msg, PullRequest):
            try:
                grant = self._table.resolve(
                    key_kind=msg.key_kind,
                    key_id=msg.key_id,
                    model_id=msg.model_id,
                    batch_index=msg.batch_index,
                    tensor_start=msg.tensor_start,
                    tensor_count=msg.tensor_count,
                    whole=msg.whole,
                    nbytes=msg.nbytes,
                    src_offset=msg.src_offset,
                    consume=msg.consume,
                    owner=sconn,
                )
            except StatusError as exc:
                self._send(sconn, Error(msg.seq, int(exc.code), exc.detail))
                return
            self._send(
                sconn,
                PullGrant(
                    msg.seq,
                    grant.lease_id,
                    grant.segment_name,
                    grant.segment_nbytes,
                    grant.tensor_offsets,
                    grant.nbytes,
                ),
            )
        elif isinstance(msg, PullDone):
            try:
                self._table.release(msg.lease_id, ok=msg.ok, owner=sconn)
            except StatusError as exc:
                self._send(sconn, Error(msg.seq, int(exc.code), exc.detail))
                return
            self._send(sconn, Ack(msg.seq))
        elif isinstance(msg, Ping):
            self._send(sconn, Pong(msg.seq))
        else:  # pragma: no cover - the connection state machine admits nothing else from a client
            self._drop(sconn, f"unexpected {type(msg).__name__}")

    def _on_hello(self, sconn: _ServerConn, hello: Hello) -> None:
        reason = ""
        if hello.version != PROTOCOL_VERSION:
            reason = f"protocol version {hello.version} is not {PROTOCOL_VERSION}"
        elif sconn.uid != os.getuid():
            reason = f"peer uid {sconn.uid} is not ours"
        elif hello.remote_cluster_id != self.cluster_id:
            reason = f"this side is cluster {self.cluster_id}, not {hello.remote_cluster_id}"
        elif hello.pid != sconn.pid:
            reason = f"hello claims pid {hello.pid}, socket says {sconn.pid}"
        if reason:
            log.warning("server %s: refusing link from pid %d: %s", self.path, sconn.pid, reason)
            self._send(sconn, Error(0, int(LLMStatusCode.LLM_LINK_FAILED), reason))
            sconn.closing = True
            self._flush(sconn)
            self._drop(sconn, reason)
            return
        sconn.peer = PeerInfo(hello.cluster_id, hello.role, hello.pid)
        self._send(sconn, Welcome(PROTOCOL_VERSION, self.cluster_id, self.role, os.getpid()))

    def _send(self, sconn: _ServerConn, msg: Message) -> None:
        sconn.outbuf += sconn.conn.send(msg)

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
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if sconn.outbuf else 0)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.modify(sconn.sock, events, sconn)

    def _drop(self, sconn: _ServerConn, reason: str) -> None:
        fd = sconn.sock.fileno()
        if fd == -1:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(sconn.sock)
        with self._peers_lock:
            self._conns.pop(fd, None)
        released = self._table.drop_owner(sconn)
        if released:
            log.info(
                "server %s: pid %d gone (%s), released %d leases", self.path, sconn.pid, reason, released
            )
        sconn.sock.close()


# ===================================================================== client side


class ClientLink:
    """The Decoder's end of a link: one socket, requests answered in order, one transfer at a time."""

    def __init__(self, sock: socket.socket, conn: Connection, peer: PeerInfo, path: Path) -> None:
        self._sock = sock
        self._conn = conn
        self.peer = peer
        self.path = path
        self.mappings = MappingCache()
        self._lock = threading.Lock()
        self._seq = 0
        self.broken: str | None = None

    @classmethod
    def connect(
        cls,
        path: Path,
        *,
        cluster_id: int,
        remote_cluster_id: int,
        role: int,
        deadline: float,
    ) -> ClientLink:
        """Connect and handshake; raises StatusError(LLM_LINK_FAILED) with the reason."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock.connect(os.fspath(path))
            except OSError as exc:
                raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"cannot connect to {path}: {exc}") from exc
            pid, uid, _ = peer_credentials(sock)
            if uid != os.getuid():
                raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"{path} is served by uid {uid}, not by us")
            conn = Connection(ConnRole.CLIENT)
            sock.sendall(conn.send(Hello(PROTOCOL_VERSION, cluster_id, remote_cluster_id, role, os.getpid())))
            reply = _receive(sock, conn, deadline)
            if isinstance(reply, Error):
                raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"refused by the peer: {reply.message}")
            if not isinstance(reply, Welcome):
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED, f"unexpected {type(reply).__name__} in handshake"
                )
            if reply.version != PROTOCOL_VERSION:
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED, f"peer speaks protocol version {reply.version}"
                )
            if reply.cluster_id != remote_cluster_id:
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"{path} is cluster {reply.cluster_id}, not {remote_cluster_id}",
                )
            if reply.pid != pid:
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED, f"peer claims pid {reply.pid}, socket says {pid}"
                )
            return cls(sock, conn, PeerInfo(reply.cluster_id, reply.role, pid), path)
        except TransferTimeout as exc:
            sock.close()
            raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"handshake timed out: {exc.detail}") from exc
        except (StatusError, ProtocolError, OSError) as exc:
            sock.close()
            if isinstance(exc, StatusError):
                raise
            raise StatusError(LLMStatusCode.LLM_LINK_FAILED, f"handshake with {path} failed: {exc}") from exc

    @contextlib.contextmanager
    def exclusive(self, deadline: float, *, busy_fails: bool = False) -> Iterator[None]:
        """Hold the link for one transfer; waits until `deadline` (or fails at once with `busy_fails`)."""
        acquired = (
            self._lock.acquire(blocking=False)
            if busy_fails
            else self._lock.acquire(timeout=max(deadline - time.monotonic(), 0.0))
        )
        if not acquired:
            if busy_fails:
                raise StatusError(LLMStatusCode.LLM_LINK_BUSY, "another operation is using this link")
            raise TransferTimeout(
                LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, "timed out waiting for another transfer on this link"
            )
        try:
            self.check_usable()
            yield
        finally:
            self._lock.release()

    def check_usable(self) -> None:
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
            self._sock.sendall(self._conn.send(msg))
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

    def close(self, *, say_bye: bool) -> None:
        if say_bye and self.broken is None and self._conn.state is ConnState.READY:
            with contextlib.suppress(OSError, ProtocolError):
                self._sock.settimeout(0.5)
                self._sock.sendall(self._conn.send(Bye("unlink")))
        self.broken = self.broken or "closed"
        self._sock.close()
        self.mappings.clear()

    def _break(self, reason: str) -> None:
        # The server sees EOF and drops our leases; nothing on this link can be trusted any more.
        self.broken = reason
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


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

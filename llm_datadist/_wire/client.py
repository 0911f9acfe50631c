"""The puller's end of a link (`ClientLink`): one socket, the handshake that opens it (a peer on this host,
or on another host proving the shared secret both ways), requests answered in order, one transfer at a time.

Rules: every wait is bounded by the caller's deadline; EOF from the peer is reported at once (`PeerGone`), a
deadline as `TransferTimeout`, and either leaves the link broken for good. A link closed while a transfer
holds it closes when that transfer ends, so that what the transfer still sends (its release) arrives.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from llm_datadist._protocol.connection import Closed, Connection, ConnRole, ConnState
from llm_datadist._protocol.errors import ProtocolError
from llm_datadist._protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Announce,
    Bye,
    Challenge,
    Error,
    Hello,
    Message,
    Welcome,
)

from .._errors import PeerGone, StatusError, TransferTimeout
from ..status import LLMStatusCode, code_2_status
from . import auth
from .peer import RECV_NBYTES, PeerInfo, peer_credentials, tune_tcp

__all__ = ["ClientLink"]

_HANGUP_EVENTS = select.POLLRDHUP | select.POLLHUP | select.POLLERR


class ClientLink:
    """The Decoder's end of a link: one socket, requests answered in order, one transfer at a time."""

    def __init__(self, sock: socket.socket, conn: Connection, peer: PeerInfo, path: Path | str) -> None:
        self._sock = sock
        self._conn = conn
        self.peer = peer
        self.path = path  # the Unix socket, or "ip:port" over TCP
        self.local_ip = ""  # over TCP: the address we connect from (our engine and callback listen there)
        # The row of the peer's published index this connection was given (its name, the row, the ticket
        # naming us there), from the handshake; empty over TCP.
        self.index_grant: tuple[str, int, int] = ("", 0, 0)
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
        # Called once when the link is closed for good, with True in a forked child (`abandon`): what the
        # puller's side learnt over it (mappings, the peer's index) goes with it.
        self.on_closed: Callable[[bool], None] | None = None

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
            link.index_grant = (welcome.index, welcome.index_row, welcome.index_ticket)
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
            nonce = auth.new_nonce()
            client = (cluster_id, incarnation, our_engine)
            proof = auth.client_proof(secret, challenge.nonce, nonce, client, remote_cluster_id)
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
            expected = auth.server_proof(secret, challenge.nonce, nonce, client, server)
            if not welcome.proof or not auth.proofs_match(expected, welcome.proof):
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

    def hold(self, deadline: float, *, busy_fails: bool = False) -> None:
        """Hold the link for one transfer until `let_go` (what `exclusive` does around a with-block, for
        a caller that runs on every pull): waits until `deadline`, or fails at once with `busy_fails`."""
        lock = self._lock
        acquired = lock.acquire(blocking=False) or (
            not busy_fails and lock.acquire(timeout=max(deadline - time.monotonic(), 0.0))
        )
        if not acquired:
            if busy_fails:
                raise StatusError(LLMStatusCode.LLM_LINK_BUSY, "another operation is using this link")
            raise TransferTimeout(
                LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, "timed out waiting for another transfer on this link"
            )
        if self._close_pending is not None or self.broken is not None:
            try:
                self.check_usable()
            except BaseException:
                lock.release()
                raise

    def let_go(self) -> None:
        """End a `hold`; a close that came meanwhile, and found the link held, is done now."""
        if self._close_pending is None:  # the common case, without the mutex
            self._lock.release()
            if self._close_pending is None:
                return
            # A close came between the look and the release, found the link held and left it to us.
            self.close(say_bye=self._close_pending)
            return
        with self._close_mutex:
            say_bye, self._close_pending = self._close_pending, None
            try:
                if say_bye is not None:
                    self._close_now(say_bye=say_bye)
            finally:
                self._lock.release()

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
        self._closed(abandoned=False)

    def abandon(self) -> None:
        """In a forked child: close this process's copy of the socket and of the peer's index, without a
        word to the peer and without touching its index (its pins are the parent's)."""
        self.broken = self.broken or "this process was forked from the one that made the link"
        self._poller = None
        self._sock.close()
        self._closed(abandoned=True)

    def _closed(self, *, abandoned: bool) -> None:
        on_closed, self.on_closed = self.on_closed, None
        if on_closed is not None:
            on_closed(abandoned)

    @property
    def socket_fd(self) -> int:
        """The socket's descriptor, for a poll for a hang-up made outside Python (-1 once closed)."""
        return self._sock.fileno()

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


class _Exclusive:
    """`ClientLink.exclusive`: `hold` on entry, `let_go` on exit."""

    __slots__ = ("_busy_fails", "_deadline", "_link")

    def __init__(self, link: ClientLink, deadline: float, busy_fails: bool) -> None:
        self._link = link
        self._deadline = deadline
        self._busy_fails = busy_fails

    def __enter__(self) -> None:
        self._link.hold(self._deadline, busy_fails=self._busy_fails)

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        self._link.let_go()


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
            data = sock.recv(RECV_NBYTES)
        except TimeoutError as exc:
            raise TransferTimeout(
                LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, "no answer from the peer in time"
            ) from exc
        except ConnectionResetError as exc:
            raise PeerGone(f"connection reset: {exc}") from exc
        conn.receive_data(data)

"""One accepted connection of the server (`ServerConn`): its socket, its protocol state, the replies it has
not written yet and the requests that wait for the owner's index lock.

Rules: only the server thread touches a `ServerConn`. Output is buffered here and written as the socket
takes it, never blocking. Whoever decides that a connection must go says so with `end(reason)`; the server
writes what is queued and closes it. A peer that leaves more than `MAX_OUTBUF_NBYTES` unread, or has more
than `MAX_PARKED` requests waiting, ends itself that way.
"""

from __future__ import annotations

import selectors
import socket
import time
from collections import deque

from llm_datadist._protocol.connection import Connection, ConnRole
from llm_datadist._protocol.messages import Message

from .peer import PeerInfo

__all__ = ["MAX_OUTBUF_NBYTES", "MAX_PARKED", "ServerConn"]

# Replies a peer has not read yet; a peer that sends requests without reading the answers is dropped.
MAX_OUTBUF_NBYTES = 16 << 20
# Requests of one connection waiting for the index lock (a stopped process holds it); past this the
# connection is dropped.
MAX_PARKED = 64
# TCP: a peer that has not proved it knows the secret sends small frames (a Hello is under 400 bytes).
_UNAUTHENTICATED_FRAME_NBYTES = 4096


class ServerConn:
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
        self.closing = False  # nothing more is sent (it is ending, or closed)
        self.ending = ""  # why it must close, once what is queued is written ("": it stays)
        self.peer: PeerInfo | None = None
        self.accepted_at = time.monotonic()
        self.handling = "its traffic"  # the message being handled, for the log when handling fails
        # Messages that wait, in order, for the index lock (the first one found it busy).
        self.parked: deque[Message] = deque()
        # This side ended the link while the peer held leases: nothing but their releases is served until
        # the last one ends, then the connection closes.
        self.draining = ""

    @property
    def who(self) -> str:
        """The peer as the log names it."""
        return f"pid {self.pid}" + (f", cluster {self.peer.cluster_id}" if self.peer is not None else "")

    @property
    def events(self) -> int:
        """What the selector should wait for on this socket."""
        return selectors.EVENT_READ | (selectors.EVENT_WRITE if self.waiting_to_write else 0)

    def end(self, reason: str) -> None:
        """Send nothing more; the server closes the connection once what is queued is written."""
        self.closing = True
        self.ending = self.ending or reason

    def send(self, msg: Message) -> None:
        """Queue `msg` behind what is unsent (nothing once the connection is closing). A peer that has
        left more than `MAX_OUTBUF_NBYTES` unread keeps asking and never reads: it ends."""
        if self.closing:
            return
        self.outbuf += self.conn.send(msg)
        if len(self.outbuf) > MAX_OUTBUF_NBYTES:
            self.end(f"more than {MAX_OUTBUF_NBYTES} bytes of replies unread")

    def write(self) -> bool:
        """Write what the socket takes now, without blocking. True when whether we wait to write changed
        (the selector must follow); OSError when the connection failed."""
        while self.outbuf:
            try:
                sent = self.sock.send(self.outbuf)
            except (BlockingIOError, InterruptedError):
                break
            del self.outbuf[:sent]
        want_write = bool(self.outbuf)
        if want_write == self.waiting_to_write:
            return False  # no epoll_ctl when nothing changes (a reply that fit the socket buffer)
        self.waiting_to_write = want_write
        return True

    def park(self, msg: Message) -> None:
        """Keep `msg` until the index lock is free, behind those already waiting (past `MAX_PARKED` the
        connection ends)."""
        if len(self.parked) >= MAX_PARKED:
            self.end(f"more than {MAX_PARKED} requests waiting for the index lock")
            return
        self.parked.append(msg)

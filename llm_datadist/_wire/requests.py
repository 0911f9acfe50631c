"""What one message of a connection does (`Requests`): the handshake goes to the `Door`, Ping and Announce
are answered here, Release and every request of a linked peer go to the `Service`.

Rules: replies are queued on the connection and a connection that must go is ended (`ServerConn.end`); the
server writes and closes. A message that needs the owner's index lock while another process holds it
(`IndexBusy`) waits on its connection, with every later message of that connection behind it, and is tried
again by `retry_parked`. A connection this side ended while its peer held leases (draining) gets
LLM_LINK_FAILED for anything but the ends of those leases, and ends with the last of them.
"""

from __future__ import annotations

from dataclasses import replace

from llm_datadist._protocol.errors import ProtocolError
from llm_datadist._protocol.messages import (
    Ack,
    Announce,
    Error,
    Hello,
    Message,
    Ping,
    Pong,
    Release,
)

from .._errors import IndexBusy, StatusError
from ..status import LLMStatusCode
from ..utils.log import log
from .conn import ServerConn
from .door import Door, Refused
from .peer import Service

__all__ = ["Requests"]


class Requests:
    """The messages of every connection of one server, handled on its thread."""

    def __init__(self, door: Door, service: Service) -> None:
        self.door = door
        self.service = service
        self.handled = 0  # messages handled (read by tests: a pull through the index adds none)
        self.parked: set[ServerConn] = set()  # connections with messages waiting for the index lock

    def handle(self, sconn: ServerConn, msg: Message) -> None:
        """Serve one message, or keep it behind the one of its connection that waits for the lock."""
        if sconn.parked:
            self._park(sconn, msg)  # in order
            return
        try:
            self._serve(sconn, msg)
        except IndexBusy:
            self._park(sconn, msg)

    def retry_parked(self) -> list[ServerConn]:
        """Serve what waits for the index lock, each connection in order; stop at the first that still
        finds it busy (it is busy for every connection alike). Returns the connections served."""
        served = []
        for sconn in list(self.parked):
            served.append(sconn)
            try:
                while sconn.parked and not sconn.closing:
                    sconn.handling = type(sconn.parked[0]).__name__
                    try:
                        self._serve(sconn, sconn.parked[0])
                    except IndexBusy:
                        return served
                    sconn.parked.popleft()
                self.parked.discard(sconn)
            except Exception as exc:  # as for any message: only this peer's connection goes
                self.failed(sconn, exc)
        return served

    def failed(self, sconn: ServerConn, exc: Exception) -> None:
        """Serving `sconn` raised (a bug, or a peer that broke something): it ends, with the cause logged."""
        log.error(
            "server %d: dropping the connection of %s: %r while handling %s",
            self.door.cluster_id,
            sconn.who,
            exc,
            sconn.handling,
            exc_info=True,
        )
        sconn.end(f"internal error while handling {sconn.handling}: {exc!r}")

    def forget(self, sconn: ServerConn) -> frozenset[int]:
        """`sconn` closed: drop what it had waiting. Returns the leases whose release was among it (their
        transfers ended well)."""
        released = frozenset(msg.lease_id for msg in sconn.parked if isinstance(msg, Release) and msg.ok)
        sconn.parked.clear()
        self.parked.discard(sconn)
        return released

    def _park(self, sconn: ServerConn, msg: Message) -> None:
        sconn.park(msg)
        if not sconn.closing:
            self.parked.add(sconn)

    def _serve(self, sconn: ServerConn, msg: Message) -> None:
        """IndexBusy (nothing done) when what the message needs waits for the index lock."""
        self.handled += 1
        if isinstance(msg, Hello):
            try:
                sconn.send(self.door.welcome(sconn, msg, self.service))
            except Refused as refused:
                self.door.refuse(sconn, refused)
                return
            if sconn.peer is not None:
                self.service.peer_linked(sconn.peer)
            return
        if isinstance(msg, Ping):
            sconn.send(Pong(msg.seq) if not sconn.draining else self._ended_error(sconn, msg.seq))
            return
        if isinstance(msg, Release):
            # One way: nothing to answer. A lease this connection does not hold is the peer's bug, and
            # releasing nothing is the only safe response.
            try:
                self.service.release(sconn, msg.lease_id, msg.ok)
            except IndexBusy:
                raise
            except StatusError as exc:
                log.warning("server %d: pid %d: %s", self.door.cluster_id, sconn.pid, exc.detail)
            self._drained(sconn)
            return
        peer = sconn.peer
        if peer is None:
            # The connection state machine admits nothing but Hello before Welcome; never trust it alone.
            raise ProtocolError(f"{type(msg).__name__} before the handshake")
        seq = getattr(msg, "seq", 0)
        if sconn.draining:
            sconn.send(self._ended_error(sconn, seq))
            return
        reply: Message
        if isinstance(msg, Announce):
            if peer.remote:
                sconn.peer = replace(peer, callback_port=msg.tcp_port)
            else:
                sconn.peer = replace(peer, callback=msg.callback)
            reply = Ack(msg.seq)
        else:
            try:
                reply = self.service.answer(sconn, peer, msg)
            except IndexBusy:
                raise
            except StatusError as exc:
                reply = Error(seq, int(exc.code), exc.detail)
        sconn.send(reply)
        self._drained(sconn)

    @staticmethod
    def _ended_error(sconn: ServerConn, seq: int) -> Error:
        return Error(seq, int(LLMStatusCode.LLM_LINK_FAILED), f"this side ended the link ({sconn.draining})")

    def _drained(self, sconn: ServerConn) -> None:
        """A draining connection whose last lease just ended closes now."""
        if sconn.draining and not self.service.holds_leases(sconn):
            sconn.end(sconn.draining)

"""Sans-IO connection state machine (h11-style): bytes in -> events out, messages in -> bytes out.

Owns the message order of one connection: handshake (a TCP one opens with the server's Challenge; then
client Hello, server Welcome or Error; then every frame is tagged, `integrity.py`), the messages each side
may send when READY, an orderly close (Bye, handshake Error, or EOF at a frame boundary). Who may send what
is data (`SENDABLE`). A connection that saw an invalid, out-of-order or badly tagged frame is FAILED.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NoReturn

import msgpack

from .errors import LocalProtocolError, ProtocolError, RemoteProtocolError
from .frames import DEFAULT_MAX_FRAME_NBYTES, FrameDecoder, encode_frame
from .integrity import FrameTagger, derive_frame_keys
from .messages import (
    Ack,
    Addresses,
    AddressRequest,
    Announce,
    Bye,
    Challenge,
    Error,
    Hello,
    Location,
    Message,
    Notify,
    Ping,
    PinRequest,
    Pong,
    Release,
    Table,
    TableRequest,
    Welcome,
    WriteGrant,
    WriteRequest,
    decode_message,
)

__all__ = ["SENDABLE", "Closed", "ConnPhase", "ConnRole", "ConnState", "Connection"]


class ConnRole(enum.Enum):
    CLIENT = "client"  # connects, sends Hello (the puller)
    SERVER = "server"  # listens, answers Welcome or Error (the owner of the caches)


class ConnState(enum.Enum):
    HANDSHAKE = "handshake"
    READY = "ready"
    CLOSED = "closed"  # a Bye or handshake Error went either way, or the peer hit EOF at a frame boundary
    FAILED = "failed"  # the peer broke the protocol; the connection is dead


class ConnPhase(enum.Enum):
    """How far the handshake has got; both sides agree on it, so one table serves sending and receiving."""

    AWAIT_CHALLENGE = "await_challenge"  # TCP only: the server's Challenge comes first
    AWAIT_HELLO = "await_hello"
    AWAIT_WELCOME = "await_welcome"
    READY = "ready"


@dataclass(frozen=True)
class Closed:
    """Event: the peer closed cleanly at a frame boundary. reason is "" for a plain EOF, the Bye's reason
    after a Bye, and the Error's message after an Error that refused the handshake."""

    reason: str = ""


_CLIENT, _SERVER = ConnRole.CLIENT, ConnRole.SERVER

# Which messages a side may send in each phase. The receiver checks the peer's frames against the peer's
# row for the same phase (the mirror image), so this is the whole ordering policy.
SENDABLE: dict[tuple[ConnRole, ConnPhase], frozenset[type[Message]]] = {
    (_CLIENT, ConnPhase.AWAIT_CHALLENGE): frozenset({Bye}),
    (_CLIENT, ConnPhase.AWAIT_HELLO): frozenset({Hello}),
    (_CLIENT, ConnPhase.AWAIT_WELCOME): frozenset({Bye}),
    (_CLIENT, ConnPhase.READY): frozenset(
        {
            Announce,
            PinRequest,
            WriteRequest,
            TableRequest,
            Release,
            Ping,
            AddressRequest,
            Notify,
            Bye,
        }
    ),
    (_SERVER, ConnPhase.AWAIT_CHALLENGE): frozenset({Challenge, Error}),
    # An Error here refuses a peer that is slow to say Hello, or whose slot a newer connection needs.
    (_SERVER, ConnPhase.AWAIT_HELLO): frozenset({Error}),
    (_SERVER, ConnPhase.AWAIT_WELCOME): frozenset({Welcome, Error}),
    (_SERVER, ConnPhase.READY): frozenset({Location, WriteGrant, Table, Addresses, Ack, Error, Pong, Bye}),
}

# Messages that move the phase forward.
_ADVANCES: dict[type[Message], ConnPhase] = {
    Challenge: ConnPhase.AWAIT_HELLO,
    Hello: ConnPhase.AWAIT_WELCOME,
    Welcome: ConnPhase.READY,
}


def _closes(msg: Message, phase: ConnPhase) -> bool:
    # An Error before READY refuses the handshake; once READY it only answers one request.
    return isinstance(msg, Bye) or (isinstance(msg, Error) and phase is not ConnPhase.READY)


def _close_reason(msg: Message) -> str:
    if isinstance(msg, Bye):
        return msg.reason
    assert isinstance(msg, Error)
    return msg.message


class Connection:
    """One end of a link. Feed received bytes to receive_data() (b"" at EOF) and drain next_event();
    write whatever send() returns. It never touches a socket.

    Error handling: a remote violation (bad frame, out-of-order message, EOF inside a frame) raises
    RemoteProtocolError and leaves the connection FAILED; later next_event/receive_data raise
    RemoteProtocolError again and send raises LocalProtocolError. A forbidden send raises LocalProtocolError
    and changes nothing (no bytes were produced, so the stream is still intact).
    """

    def __init__(
        self,
        role: ConnRole,
        *,
        max_frame_nbytes: int = DEFAULT_MAX_FRAME_NBYTES,
        challenge: bool = False,
        secret: bytes | None = None,
    ) -> None:
        """`challenge`: the handshake starts with the server's Challenge (TCP links, which authenticate
        with the shared secret `secret`, required with it); without it the client's Hello comes first
        (Unix sockets). With a secret, each frame after the client's Hello (client to server) and after the
        Welcome (server to client) is followed by its tag, keyed from the secret and both nonces."""
        if not isinstance(role, ConnRole):
            raise TypeError(f"role must be a ConnRole, got {type(role).__name__}")
        if challenge != (secret is not None):
            raise ValueError(
                "a TCP handshake (challenge=True) needs the shared secret, and only it takes one"
            )
        self._secret = secret
        self._server_nonce = b""  # the Challenge's, sent or received
        self._send_tagger: FrameTagger | None = None
        # The server's sending tagger, or the client's checker, that the Welcome switches on.
        self._welcome_tagger: FrameTagger | None = None
        self._role = role
        self._peer_role = _SERVER if role is _CLIENT else _CLIENT
        self._max_frame_nbytes = max_frame_nbytes
        self._decoder = FrameDecoder(max_frame_nbytes)
        self._packer = msgpack.Packer(use_bin_type=True)
        self._phase = ConnPhase.AWAIT_CHALLENGE if challenge else ConnPhase.AWAIT_HELLO
        # SENDABLE's rows for this phase, ours and the peer's (looked up on every message otherwise).
        self._may_send = SENDABLE[(role, self._phase)]
        self._peer_may_send = SENDABLE[(self._peer_role, self._phase)]
        self._sent_close = False
        self._peer_closed: Closed | None = None  # set once the peer closed; its later bytes are dropped
        self._eof = False
        self._failure: RemoteProtocolError | None = None
        self._peer_hello: Hello | None = None
        self._peer_welcome: Welcome | None = None

    @property
    def role(self) -> ConnRole:
        return self._role

    @property
    def state(self) -> ConnState:
        if self._failure is not None:
            return ConnState.FAILED
        if self._sent_close or self._peer_closed is not None:
            return ConnState.CLOSED
        if self._phase is ConnPhase.READY:
            return ConnState.READY
        return ConnState.HANDSHAKE

    @property
    def phase(self) -> ConnPhase:
        return self._phase

    @property
    def max_frame_nbytes(self) -> int:
        return self._max_frame_nbytes

    def raise_frame_limit(self, max_frame_nbytes: int) -> None:
        """Accept frames up to `max_frame_nbytes` from now on (a server keeps an unauthenticated peer to
        small frames and lifts the limit once the peer proved itself). Never lowers it."""
        if max_frame_nbytes > self._max_frame_nbytes:
            self._max_frame_nbytes = max_frame_nbytes
            self._decoder.max_frame_nbytes = max_frame_nbytes

    @property
    def peer_hello(self) -> Hello | None:
        """The Hello a server received (None on a client, or before it arrived)."""
        return self._peer_hello

    @property
    def peer_welcome(self) -> Welcome | None:
        """The Welcome a client received (None on a server, or before it arrived)."""
        return self._peer_welcome

    def send(self, msg: Message) -> bytes:
        """Return the frame to write for msg; LocalProtocolError (state unchanged) when it is not allowed."""
        if not isinstance(msg, Message):
            raise TypeError(f"send() takes a protocol message, got {type(msg).__name__}")
        state = self.state
        if state is ConnState.FAILED:
            raise LocalProtocolError(
                f"cannot send {type(msg).__name__}: the connection failed: {self._failure}"
            )
        if state is ConnState.CLOSED:
            raise LocalProtocolError(f"cannot send {type(msg).__name__}: the connection is closed")
        if type(msg) not in self._may_send:
            raise LocalProtocolError(
                f"{self._role.value} may not send {type(msg).__name__} in phase {self._phase.value}"
            )
        try:
            frame = encode_frame(msg.to_wire(), self._max_frame_nbytes, self._packer)
        except ProtocolError as exc:
            raise LocalProtocolError(f"cannot send {type(msg).__name__}: {exc}") from exc
        # State moves only once the bytes exist, so a failed send leaves everything as it was.
        if self._send_tagger is not None:
            frame += self._send_tagger.tag(frame)
        if _closes(msg, self._phase):
            self._sent_close = True
        self._advance(msg)
        if self._secret is not None:
            self._start_tags_after_sending(msg, self._secret)
        return frame

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer bytes read from the peer; b"" means the peer closed its end (EOF), so never pass an empty
        chunk otherwise. Bytes after the peer closed (Bye, handshake Error) are dropped."""
        self._raise_if_failed()
        if self._peer_closed is not None:
            return  # the peer already said goodbye; whatever trails it is irrelevant
        if self._eof:
            if data:
                raise LocalProtocolError("receive_data() got more bytes after EOF")
            return
        if not data:
            self._eof = True
            return
        try:
            self._decoder.feed(data)
        except ProtocolError as exc:  # unreachable while _failure is None, kept so a dead decoder stays fatal
            self._fail(exc)

    def next_event(self) -> Message | Closed | None:
        """The next message from the peer, Closed once it closed cleanly, or None when more bytes are needed.

        A Bye is reported as Closed(reason), never as a message; an Error refusing the handshake is delivered
        as the Error, then Closed(error.message).
        """
        if self._failure is not None:
            self._raise_if_failed()
        if self._peer_closed is not None:
            return self._peer_closed
        try:
            payload = self._decoder.next_frame()
        except ProtocolError as exc:
            self._fail(exc)
        if payload is None:
            if not self._eof:
                return None
            left_nbytes = self._decoder.buffered_nbytes
            if left_nbytes:
                self._fail(RemoteProtocolError(f"EOF inside a frame ({left_nbytes} bytes of it buffered)"))
            return self._close_by_peer("")
        try:
            msg = decode_message(payload)
        except ProtocolError as exc:
            self._fail(exc)
        if type(msg) not in self._peer_may_send:
            self._fail(
                RemoteProtocolError(
                    f"{self._peer_role.value} sent {type(msg).__name__} in phase {self._phase.value}"
                )
            )
        if isinstance(msg, Hello):
            self._peer_hello = msg
        elif isinstance(msg, Welcome):
            self._peer_welcome = msg
        if self._secret is not None:
            self._start_tags_after_receiving(msg, self._secret)
        if _closes(msg, self._phase):
            closed = self._close_by_peer(_close_reason(msg))
            return closed if isinstance(msg, Bye) else msg  # the Error itself first, Closed on the next call
        self._advance(msg)
        return msg

    def _start_tags_after_sending(self, msg: Message, secret: bytes) -> None:
        if isinstance(msg, Challenge):
            self._server_nonce = msg.nonce
        elif isinstance(msg, Hello):
            keys = derive_frame_keys(secret, self._server_nonce, msg.nonce)
            self._send_tagger, self._welcome_tagger = keys.taggers(client=True)
        elif isinstance(msg, Welcome):
            assert self._welcome_tagger is not None, "a Welcome answers a Hello, which keyed the tags"
            self._send_tagger = self._welcome_tagger

    def _start_tags_after_receiving(self, msg: Message, secret: bytes) -> None:
        if isinstance(msg, Challenge):
            self._server_nonce = msg.nonce
        elif isinstance(msg, Hello):
            keys = derive_frame_keys(secret, self._server_nonce, msg.nonce)
            self._welcome_tagger, checker = keys.taggers(client=False)
            self._decoder.expect_tags(checker)
        elif isinstance(msg, Welcome):
            assert self._welcome_tagger is not None, "a Welcome answers our Hello, which keyed the tags"
            self._decoder.expect_tags(self._welcome_tagger)

    def _advance(self, msg: Message) -> None:
        phase = _ADVANCES.get(type(msg))
        if phase is not None:
            self._phase = phase
            self._may_send = SENDABLE[(self._role, phase)]
            self._peer_may_send = SENDABLE[(self._peer_role, phase)]

    def _close_by_peer(self, reason: str) -> Closed:
        self._peer_closed = Closed(reason)
        return self._peer_closed

    def _fail(self, cause: ProtocolError) -> NoReturn:
        if isinstance(cause, RemoteProtocolError):
            self._failure = cause
            raise cause
        self._failure = RemoteProtocolError(f"{type(cause).__name__}: {cause}")
        raise self._failure from cause

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RemoteProtocolError(f"the connection failed earlier: {self._failure}") from self._failure

"""Connection state machine: handshake, allowed messages per phase and side, orderly close, EOF, and the
stickiness of a failed connection. Two Connections talk through plain bytes: no socket anywhere."""

from __future__ import annotations

import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist._protocol.connection import SENDABLE, Closed, Connection, ConnPhase, ConnRole, ConnState
from llm_datadist._protocol.errors import (
    FrameTooLarge,
    LocalProtocolError,
    MalformedFrame,
    RemoteProtocolError,
)
from llm_datadist._protocol.frames import encode_frame
from llm_datadist._protocol.messages import (
    KEY_REQ,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    RULES_V1,
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
)

HELLO = Hello(PROTOCOL_VERSION, 11, 22, 2, 4242, 1)
WELCOME = Welcome(PROTOCOL_VERSION, 22, 1, 3333, 2)
REQUEST = PinRequest(1, KEY_REQ, 7, 0, 0, 0, 3, True, 4097, 0, True, False, RULES_V1)
GRANT = Location(1, 99, 3333, "/llmdd_seg", 3 * 4097, (0, 4097, 8194), 4097, 1, 0)
DONE = Release(99, True)
LINK_FAILED = -1  # any I64 status code; the real LLMStatusCode values live in llm_datadist
SECRET = b"the-secret-of-these-tests"  # what a TCP connection keys its frame tags from

ONE_OF_EACH: dict[type[Message], Message] = {
    Hello: HELLO,
    Welcome: WELCOME,
    PinRequest: REQUEST,
    Location: GRANT,
    Ack: Ack(1),
    Error: Error(1, LINK_FAILED, "no"),
    Bye: Bye("bye"),
    Ping: Ping(5),
    Pong: Pong(5),
    Challenge: Challenge(PROTOCOL_VERSION, bytes(range(32))),
    AddressRequest: AddressRequest(2, ("/llmdd_seg",)),
    Addresses: Addresses(2, (1 << 40,)),
}


def state(conn: Connection) -> ConnState:
    # A call, not the property, so mypy does not narrow the state across the asserts of one test.
    return conn.state


def deliver(data: bytes, to: Connection) -> list[Message | Closed]:
    to.receive_data(data)
    events: list[Message | Closed] = []
    while (event := to.next_event()) is not None:
        events.append(event)
        if isinstance(event, Closed):
            break
    return events


def handshake() -> tuple[Connection, Connection]:
    client, server = Connection(ConnRole.CLIENT), Connection(ConnRole.SERVER)
    assert deliver(client.send(HELLO), server) == [HELLO]
    assert deliver(server.send(WELCOME), client) == [WELCOME]
    return client, server


def raw(msg_wire: list[object]) -> bytes:
    return encode_frame(msg_wire)


# -- handshake -----------------------------------------------------------------------------------------------


def test_handshake_success_both_sides() -> None:
    client, server = Connection(ConnRole.CLIENT), Connection(ConnRole.SERVER)
    assert state(client) is state(server) is ConnState.HANDSHAKE
    assert client.role is ConnRole.CLIENT and server.role is ConnRole.SERVER
    assert server.next_event() is None

    hello_bytes = client.send(HELLO)
    assert hello_bytes == encode_frame(HELLO.to_wire())
    assert state(client) is ConnState.HANDSHAKE and client.phase is ConnPhase.AWAIT_WELCOME
    assert deliver(hello_bytes, server) == [HELLO]
    assert server.peer_hello == HELLO and server.peer_welcome is None
    assert state(server) is ConnState.HANDSHAKE

    assert deliver(server.send(WELCOME), client) == [WELCOME]
    assert state(server) is state(client) is ConnState.READY
    assert client.peer_welcome == WELCOME and client.peer_hello is None


def test_full_conversation_then_bye() -> None:
    client, server = handshake()
    assert deliver(client.send(REQUEST), server) == [REQUEST]
    assert deliver(server.send(GRANT), client) == [GRANT]
    assert deliver(client.send(DONE), server) == [DONE]
    assert deliver(server.send(Ack(1)), client) == [Ack(1)]
    assert deliver(client.send(Ping(2)), server) == [Ping(2)]
    assert deliver(server.send(Pong(2)), client) == [Pong(2)]
    assert deliver(server.send(Error(3, LINK_FAILED, "busy")), client) == [Error(3, LINK_FAILED, "busy")]
    assert state(client) is state(server) is ConnState.READY  # an Error after the handshake closes nothing

    bye = client.send(Bye("shutting down"))
    assert state(client) is ConnState.CLOSED
    assert deliver(bye, server) == [Closed("shutting down")]
    assert state(server) is ConnState.CLOSED
    assert server.next_event() == Closed("shutting down")  # keeps returning Closed
    server.receive_data(raw(REQUEST.to_wire()) + b"\xff\xff")  # anything after Bye is dropped
    assert server.next_event() == Closed("shutting down")
    server.receive_data(b"")
    assert server.next_event() == Closed("shutting down")


def test_pipelined_messages_in_one_chunk() -> None:
    client, server = handshake()
    chunk = b"".join(client.send(m) for m in [REQUEST, Ping(1), DONE, Ping(2), Bye("")])
    assert deliver(chunk, server) == [REQUEST, Ping(1), DONE, Ping(2), Closed("")]


def test_different_version_is_delivered_not_judged() -> None:
    client, server = Connection(ConnRole.CLIENT), Connection(ConnRole.SERVER)
    hello_v2 = Hello(PROTOCOL_VERSION + 1, 1, 2, 1, 1, 1)
    assert deliver(client.send(hello_v2), server) == [hello_v2]
    welcome_v7 = Welcome(7, 2, 2, 2, 2)
    assert deliver(server.send(welcome_v7), client) == [welcome_v7]
    assert state(client) is ConnState.READY


def test_handshake_refused_with_error() -> None:
    client, server = Connection(ConnRole.CLIENT), Connection(ConnRole.SERVER)
    deliver(client.send(HELLO), server)
    refusal = Error(0, LINK_FAILED, "remote_cluster_id 22 does not match 33")
    data = server.send(refusal)
    assert state(server) is ConnState.CLOSED
    with pytest.raises(LocalProtocolError):
        server.send(WELCOME)
    assert deliver(data, client) == [refusal, Closed(refusal.message)]
    assert state(client) is ConnState.CLOSED
    assert client.next_event() == Closed(refusal.message)
    with pytest.raises(LocalProtocolError):
        client.send(Bye(""))


def test_client_gives_up_during_handshake() -> None:
    client, server = Connection(ConnRole.CLIENT), Connection(ConnRole.SERVER)
    data = client.send(HELLO) + client.send(Bye("timeout"))
    assert state(client) is ConnState.CLOSED
    assert deliver(data, server) == [HELLO, Closed("timeout")]
    assert state(server) is ConnState.CLOSED
    with pytest.raises(LocalProtocolError):
        server.send(WELCOME)


def test_bye_crossing_a_welcome() -> None:
    # The client gives up just as the server accepts: the server is READY when the Bye arrives.
    client, server = Connection(ConnRole.CLIENT), Connection(ConnRole.SERVER)
    deliver(client.send(HELLO), server)
    bye = client.send(Bye("late"))
    welcome = server.send(WELCOME)
    assert deliver(bye, server) == [Closed("late")]
    assert deliver(welcome, client) == [WELCOME]  # still delivered: the client only stopped sending
    assert state(client) is ConnState.CLOSED


def test_messages_still_arrive_after_we_said_bye() -> None:
    client, server = handshake()
    request = client.send(REQUEST)
    bye = server.send(Bye("restarting"))
    assert state(server) is ConnState.CLOSED
    assert deliver(request, server) == [REQUEST]  # in flight when we closed; the caller may ignore it
    assert deliver(bye, client) == [Closed("restarting")]


# -- EOF -----------------------------------------------------------------------------------------------------


def test_eof_at_frame_boundary_is_closed() -> None:
    client, server = handshake()
    assert deliver(client.send(Ping(1)) + client.send(Ping(2)), server) == [Ping(1), Ping(2)]
    assert deliver(b"", server) == [Closed("")]
    assert state(server) is ConnState.CLOSED
    assert server.next_event() == Closed("")
    server.receive_data(b"")  # a second EOF is harmless


def test_eof_before_anything_is_closed() -> None:
    server = Connection(ConnRole.SERVER)
    assert deliver(b"", server) == [Closed("")]


def test_buffered_frames_are_delivered_before_eof() -> None:
    client, server = handshake()
    server.receive_data(client.send(Ping(1)))
    server.receive_data(b"")
    assert server.next_event() == Ping(1)
    assert server.next_event() == Closed("")


@pytest.mark.parametrize("keep_nbytes", [1, 3, 4, 5, 12])
def test_eof_inside_a_frame_is_remote_error(keep_nbytes: int) -> None:
    client, server = handshake()
    frame = client.send(REQUEST)
    server.receive_data(frame[:keep_nbytes])
    assert server.next_event() is None
    server.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="EOF"):
        server.next_event()
    assert state(server) is ConnState.FAILED


def test_bytes_after_eof_are_a_local_bug() -> None:
    server = Connection(ConnRole.SERVER)
    server.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        server.receive_data(b"\x00")


# -- out of order from the peer ------------------------------------------------------------------------------


def _allowed_from(peer: ConnRole, phase: ConnPhase) -> set[type[Message]]:
    return set(SENDABLE[(peer, phase)])


def _at_phase(role: ConnRole, phase: ConnPhase) -> Connection:
    """A connection of `role` that has reached `phase` through a real exchange (a TCP one for
    AWAIT_CHALLENGE, which only TCP connections start in)."""
    challenge = phase is ConnPhase.AWAIT_CHALLENGE
    secret = SECRET if challenge else None
    client = Connection(ConnRole.CLIENT, challenge=challenge, secret=secret)
    server = Connection(ConnRole.SERVER, challenge=challenge, secret=secret)
    if phase not in (ConnPhase.AWAIT_HELLO, ConnPhase.AWAIT_CHALLENGE):
        deliver(client.send(HELLO), server)
    if phase is ConnPhase.READY:
        deliver(server.send(WELCOME), client)
    conn = client if role is ConnRole.CLIENT else server
    assert conn.phase is phase
    return conn


@pytest.mark.parametrize(("role", "phase"), [(r, p) for r in ConnRole for p in ConnPhase])
def test_receive_table_is_the_mirror_of_send(role: ConnRole, phase: ConnPhase) -> None:
    peer = ConnRole.SERVER if role is ConnRole.CLIENT else ConnRole.CLIENT
    for cls, msg in ONE_OF_EACH.items():
        conn = _at_phase(role, phase)
        allowed = _allowed_from(peer, phase)  # for a client that sent no Hello yet: nothing at all
        conn.receive_data(raw(msg.to_wire()))
        if cls in allowed:
            event = conn.next_event()
            assert event == (Closed("bye") if cls is Bye else msg), cls
        else:
            with pytest.raises(RemoteProtocolError, match=cls.__name__):
                conn.next_event()
            assert state(conn) is ConnState.FAILED, cls


@pytest.mark.parametrize(("role", "phase"), [(r, p) for r in ConnRole for p in ConnPhase])
def test_send_table(role: ConnRole, phase: ConnPhase) -> None:
    for cls, msg in ONE_OF_EACH.items():
        conn = _at_phase(role, phase)
        if cls in SENDABLE[(role, phase)]:
            assert conn.send(msg) == encode_frame(msg.to_wire())
        else:
            with pytest.raises(LocalProtocolError):
                conn.send(msg)
            assert conn.phase is phase and state(conn) is not ConnState.FAILED, cls


def test_sendable_tables_as_specified() -> None:
    c, s = ConnRole.CLIENT, ConnRole.SERVER
    assert SENDABLE[(c, ConnPhase.READY)] == {
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
    assert SENDABLE[(s, ConnPhase.READY)] == {
        Location,
        WriteGrant,
        Table,
        Addresses,
        Ack,
        Error,
        Pong,
        Bye,
    }
    assert SENDABLE[(c, ConnPhase.AWAIT_HELLO)] == {Hello}
    assert SENDABLE[(s, ConnPhase.AWAIT_WELCOME)] == {Welcome, Error}
    assert SENDABLE[(s, ConnPhase.AWAIT_HELLO)] == {Error}
    assert SENDABLE[(s, ConnPhase.AWAIT_CHALLENGE)] == {Challenge, Error}
    assert SENDABLE[(c, ConnPhase.AWAIT_CHALLENGE)] == {Bye}
    every_type = set().union(*SENDABLE.values())
    assert every_type == set(MESSAGE_TYPES.values())


def test_tcp_handshake_starts_with_the_challenge() -> None:
    client = Connection(ConnRole.CLIENT, challenge=True, secret=SECRET)
    server = Connection(ConnRole.SERVER, challenge=True, secret=SECRET, max_frame_nbytes=4096)
    with pytest.raises(LocalProtocolError):
        client.send(HELLO)  # not before the challenge
    challenge = Challenge(PROTOCOL_VERSION, b"n" * 16)
    assert deliver(server.send(challenge), client) == [challenge]
    hello = Hello(PROTOCOL_VERSION, 11, 22, 2, 4242, 1, b"c" * 16, b"p" * 32, "10.0.0.1:17000")
    assert deliver(client.send(hello), server) == [hello]
    welcome = Welcome(PROTOCOL_VERSION, 22, 1, 3333, 2, "", 0, 0, b"q" * 32, "10.0.0.2:17001")
    assert deliver(server.send(welcome), client) == [welcome]
    assert state(client) is state(server) is ConnState.READY


def test_hello_before_the_challenge_fails_a_tcp_server() -> None:
    server = Connection(ConnRole.SERVER, challenge=True, secret=SECRET)
    server.receive_data(raw(HELLO.to_wire()))
    with pytest.raises(RemoteProtocolError, match="Hello"):
        server.next_event()


def test_a_refused_challenge_closes_the_client() -> None:
    client = Connection(ConnRole.CLIENT, challenge=True, secret=SECRET)
    error = Error(0, LINK_FAILED, "too many unauthenticated connections")
    assert deliver(raw(error.to_wire()), client) == [error, Closed(error.message)]


def test_frame_limit_is_lifted_once_not_lowered() -> None:
    server = Connection(ConnRole.SERVER, challenge=True, secret=SECRET, max_frame_nbytes=4096)
    big = Hello(PROTOCOL_VERSION, 11, 22, 2, 4242, 1, b"c" * 16, b"p" * 32, "x" * 128)
    server.raise_frame_limit(100)
    assert server.max_frame_nbytes == 4096
    server.send(Challenge(PROTOCOL_VERSION, b"n" * 16))
    frame = raw(big.to_wire())
    small = Connection(ConnRole.SERVER, challenge=True, secret=SECRET, max_frame_nbytes=64)
    small.send(Challenge(PROTOCOL_VERSION, b"n" * 16))
    small.receive_data(frame)
    with pytest.raises(RemoteProtocolError, match="limit"):
        small.next_event()
    lifted = Connection(ConnRole.SERVER, challenge=True, secret=SECRET, max_frame_nbytes=64)
    lifted.send(Challenge(PROTOCOL_VERSION, b"n" * 16))
    lifted.raise_frame_limit(1 << 20)
    assert deliver(frame, lifted) == [big]


def test_second_hello_fails_the_server() -> None:
    _, server = handshake()
    server.receive_data(raw(HELLO.to_wire()))
    with pytest.raises(RemoteProtocolError, match="Hello"):
        server.next_event()


def test_pin_request_before_hello_fails_the_server() -> None:
    server = Connection(ConnRole.SERVER)
    server.receive_data(raw(REQUEST.to_wire()))
    with pytest.raises(RemoteProtocolError, match="PinRequest"):
        server.next_event()


def test_pin_request_before_welcome_fails_the_server() -> None:
    # The client may not pipeline requests behind its Hello: READY starts with the Welcome.
    server = Connection(ConnRole.SERVER)
    server.receive_data(raw(HELLO.to_wire()) + raw(REQUEST.to_wire()))
    assert server.next_event() == HELLO
    with pytest.raises(RemoteProtocolError):
        server.next_event()


# -- malformed input and stickiness --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "cause"),
    [
        (b"\x00\x00\x00\x01\xc1", MalformedFrame),
        (b"\x00\x00\x00\x00", MalformedFrame),
        (encode_frame({"type": 1}), MalformedFrame),
        (encode_frame([99, 1]), MalformedFrame),
        (encode_frame([6, True]), MalformedFrame),
        (encode_frame([6, -1]), MalformedFrame),
        (
            encode_frame([17, 1, 2, 3333, "/seg", 10, [8], 3, 1, 0]),
            MalformedFrame,
        ),  # grant beyond its segment
        (struct.pack(">I", (1 << 20) + 1), FrameTooLarge),  # refused from the header alone
    ],
    ids=["garbage", "empty", "map", "unknown-type", "bool-seq", "negative-seq", "grant-outside", "too-large"],
)
def test_bad_frames_fail_the_connection_stickily(data: bytes, cause: type[Exception]) -> None:
    client, _ = handshake()
    client.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        client.next_event()
    assert isinstance(info.value.__cause__, cause)
    assert state(client) is ConnState.FAILED
    for _ in range(2):
        with pytest.raises(RemoteProtocolError):
            client.next_event()
        with pytest.raises(RemoteProtocolError):
            client.receive_data(raw(Ack(1).to_wire()))
        with pytest.raises(LocalProtocolError):
            client.send(Ping(1))
        with pytest.raises(LocalProtocolError):
            client.send(Bye("x"))
    assert state(client) is ConnState.FAILED


def test_good_frames_before_a_bad_one_are_delivered() -> None:
    client, server = handshake()
    client.receive_data(server.send(Ack(1)) + server.send(Pong(2)) + b"\x00\x00\x00\x02\x01\x02")
    assert client.next_event() == Ack(1)
    assert client.next_event() == Pong(2)
    with pytest.raises(RemoteProtocolError):
        client.next_event()


def test_small_frame_limit_applies_both_ways() -> None:
    client = Connection(ConnRole.CLIENT, max_frame_nbytes=64)
    server = Connection(ConnRole.SERVER, max_frame_nbytes=4097)
    deliver(client.send(HELLO), server)
    deliver(server.send(WELCOME), client)
    big_grant = Location(1, 1, 3333, "/seg", 3333 * 100, tuple(range(0, 3333 * 100, 3333)), 3333, 1, 0)
    data = server.send(big_grant)
    assert len(data) > 64 + 4
    client.receive_data(data[:4])  # the header alone is enough to refuse it
    with pytest.raises(RemoteProtocolError) as info:
        client.next_event()
    assert isinstance(info.value.__cause__, FrameTooLarge)

    with pytest.raises(LocalProtocolError) as local:
        Connection(ConnRole.CLIENT, max_frame_nbytes=8).send(HELLO)  # its payload is 9 bytes
    assert isinstance(local.value.__cause__, FrameTooLarge)


def test_local_error_changes_nothing() -> None:
    client, server = handshake()
    with pytest.raises(LocalProtocolError):
        client.send(GRANT)
    with pytest.raises(LocalProtocolError):
        client.send(HELLO)
    assert state(client) is ConnState.READY
    assert deliver(client.send(REQUEST), server) == [REQUEST]


def test_send_rejects_non_messages() -> None:
    with pytest.raises(TypeError):
        Connection(ConnRole.CLIENT).send([1, 1, 2, 3, 1, 4])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Connection("client")  # type: ignore[arg-type]


def test_odd_sized_texts_cross_the_connection() -> None:
    client, server = handshake()
    error = Error(4097, -3333, "é" * 3333)
    assert deliver(server.send(error), client) == [error]
    assert deliver(client.send(Bye("€" * 4096)), server) == [Closed("€" * 4096)]


# -- arbitrary chunking of a whole conversation --------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_any_chunking_of_a_conversation(data: st.DataObject) -> None:
    later = data.draw(
        st.lists(
            st.sampled_from([REQUEST, DONE, Ping(1), Ping(4097), Release(2**64 - 1, False)]),
            max_size=10,
        )
    )
    client = Connection(ConnRole.CLIENT)
    stream = client.send(HELLO)
    assert deliver(encode_frame(WELCOME.to_wire()), client) == [WELCOME]
    stream += b"".join(client.send(msg) for msg in later) + client.send(Bye("done"))

    cuts = sorted(data.draw(st.sets(st.integers(1, len(stream) - 1), max_size=10)))
    bounds = [0, *cuts, len(stream)]
    server = Connection(ConnRole.SERVER)
    events: list[Message | Closed] = []
    for start, end in itertools.pairwise(bounds):
        server.receive_data(stream[start:end])  # never b"": that would mean EOF
        while (event := server.next_event()) is not None:
            events.append(event)
            if isinstance(event, Closed):
                break  # Closed is the last event; next_event would keep returning it
            if isinstance(event, Hello):
                server.send(WELCOME)  # a real server answers before reading on
    assert events == [HELLO, *later, Closed("done")]
    assert state(server) is ConnState.CLOSED

"""Frame tags of TCP links (`integrity`), without a socket: keys per connection and direction, tags that
refuse a frame altered, injected, replayed, reordered, dropped or cut short, decoding of a tagged stream
whole, one byte at a time, in any chunking and with trailing bytes, and a Connection that tags exactly
the frames after the handshake (and nothing on a Unix socket)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist._protocol.connection import Closed, Connection, ConnRole, ConnState
from llm_datadist._protocol.errors import FrameTagMismatch, RemoteProtocolError
from llm_datadist._protocol.frames import HEADER_NBYTES, FrameDecoder, encode_frame
from llm_datadist._protocol.integrity import (
    CLIENT_TO_SERVER,
    SERVER_TO_CLIENT,
    TAG_NBYTES,
    FrameTagger,
    derive_frame_keys,
)
from llm_datadist._protocol.messages import (
    KEY_REQ,
    PROTOCOL_VERSION,
    RULES_V1,
    Bye,
    Challenge,
    Error,
    Hello,
    Location,
    Message,
    Ping,
    PinRequest,
    Pong,
    Welcome,
)

SECRET = b"the-secret-of-these-tests"
SERVER_NONCE, CLIENT_NONCE = bytes(range(32)), bytes(range(32, 64))
KEYS = derive_frame_keys(SECRET, SERVER_NONCE, CLIENT_NONCE)
OBJECTS: list[object] = [[9, 1], ["x" * 3333, b"\x00\xff"], {"k": [1, 2, 3]}, 7, [b"y" * 4097]]


def _tagged_stream(objects: list[object], key: bytes = KEYS.client_to_server) -> bytes:
    tagger = FrameTagger(key, CLIENT_TO_SERVER)
    frames = [encode_frame(obj) for obj in objects]
    return b"".join(frame + tagger.tag(frame) for frame in frames)


def _checking_decoder(key: bytes = KEYS.client_to_server) -> FrameDecoder:
    decoder = FrameDecoder()
    decoder.expect_tags(FrameTagger(key, CLIENT_TO_SERVER))
    return decoder


def _decode_all(decoder: FrameDecoder) -> list[object]:
    out = []
    while (obj := decoder.next_frame()) is not None:
        out.append(obj)
    return out


def _frames_of(stream: bytes) -> list[bytes]:
    """A tagged stream cut into its frames, each with its tag."""
    frames, offset = [], 0
    while offset < len(stream):
        end = offset + HEADER_NBYTES + int.from_bytes(stream[offset : offset + 4], "big") + TAG_NBYTES
        frames.append(stream[offset:end])
        offset = end
    return frames


# -- keys ----------------------------------------------------------------------------------------------------


def test_keys_differ_per_direction_connection_and_secret() -> None:
    assert derive_frame_keys(SECRET, SERVER_NONCE, CLIENT_NONCE) == KEYS  # both ends derive the same
    keys = [
        KEYS.client_to_server,
        KEYS.server_to_client,
        derive_frame_keys(b"another-secret-of-16", SERVER_NONCE, CLIENT_NONCE).client_to_server,
        derive_frame_keys(SECRET, bytes(32), CLIENT_NONCE).client_to_server,
        derive_frame_keys(SECRET, SERVER_NONCE, bytes(32)).client_to_server,
        derive_frame_keys(SECRET, CLIENT_NONCE, SERVER_NONCE).client_to_server,  # nonces swapped
        # The nonces are length-prefixed: moving bytes from one to the other makes other keys.
        derive_frame_keys(SECRET, SERVER_NONCE + CLIENT_NONCE[:1], CLIENT_NONCE[1:]).client_to_server,
    ]
    assert all(len(key) == 32 for key in keys)
    assert len(set(keys)) == len(keys)


def test_a_tagger_takes_only_the_two_directions() -> None:
    with pytest.raises(ValueError):
        FrameTagger(KEYS.client_to_server, b"sideways")


# -- a tagged stream ----------------------------------------------------------------------------------------


def test_a_tagged_stream_decodes_whole_and_one_byte_at_a_time() -> None:
    stream = _tagged_stream(OBJECTS)
    whole = _checking_decoder()
    whole.feed(stream)
    assert _decode_all(whole) == OBJECTS
    bytewise = _checking_decoder()
    decoded = []
    for i in range(len(stream)):
        bytewise.feed(stream[i : i + 1])
        decoded.extend(_decode_all(bytewise))
    assert decoded == OBJECTS
    assert bytewise.buffered_nbytes == 0


def test_a_frame_is_not_delivered_before_its_whole_tag() -> None:
    frame = _frames_of(_tagged_stream(OBJECTS[:1]))[0]
    decoder = _checking_decoder()
    decoder.feed(frame[:-1])
    assert decoder.next_frame() is None  # the payload is all there, one byte of the tag is not
    decoder.feed(frame[-1:])
    assert decoder.next_frame() == OBJECTS[0]


def test_trailing_bytes_stay_buffered_as_the_next_frame() -> None:
    stream = _tagged_stream(OBJECTS)
    cut = len(_frames_of(stream)[0]) + 7  # the first frame, then 7 bytes of the second
    decoder = _checking_decoder()
    decoder.feed(stream[:cut])
    assert _decode_all(decoder) == OBJECTS[:1]
    assert decoder.buffered_nbytes == 7
    decoder.feed(stream[cut:])
    assert _decode_all(decoder) == OBJECTS[1:]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 5000), min_size=1, max_size=40))
def test_any_chunking_of_a_tagged_stream_decodes_the_same(sizes: list[int]) -> None:
    stream = _tagged_stream(OBJECTS)
    decoder = _checking_decoder()
    decoded, offset = [], 0
    for size in itertools.cycle(sizes):
        if offset >= len(stream):
            break
        decoder.feed(stream[offset : offset + size])
        offset += size
        decoded.extend(_decode_all(decoder))
    assert decoded == OBJECTS


def _refused(stream: bytes) -> list[object]:
    """What a checking decoder delivers of `stream` before it refuses a frame (it must refuse one)."""
    decoder = _checking_decoder()
    decoder.feed(stream)
    delivered = []
    with pytest.raises(FrameTagMismatch):
        while (obj := decoder.next_frame()) is not None:
            delivered.append(obj)
    with pytest.raises(FrameTagMismatch):  # and stays dead
        decoder.next_frame()
    return delivered


def test_a_flipped_bit_anywhere_in_a_frames_payload_or_tag_is_refused() -> None:
    first, second = _frames_of(_tagged_stream(OBJECTS[:2]))
    for position in range(HEADER_NBYTES, len(first)):
        for bit in (0x01, 0x80):
            altered = bytearray(first)
            altered[position] ^= bit
            assert _refused(bytes(altered) + second) == [], (position, bit)


def test_a_changed_length_is_refused() -> None:
    frames = _frames_of(_tagged_stream(OBJECTS))
    shorter = bytearray(frames[1])
    shorter[3] -= 1  # the frame now ends a byte early: its tag is read one byte off
    assert _refused(frames[0] + bytes(shorter) + b"".join(frames[2:])) == OBJECTS[:1]


def test_a_replayed_frame_is_refused() -> None:
    frames = _frames_of(_tagged_stream(OBJECTS))
    assert _refused(frames[0] + frames[1] + frames[1] + frames[2]) == OBJECTS[:2]
    assert _refused(frames[0] + frames[1] + frames[0]) == OBJECTS[:2]


def test_reordered_frames_are_refused() -> None:
    frames = _frames_of(_tagged_stream(OBJECTS))
    assert _refused(frames[0] + frames[2] + frames[1]) == OBJECTS[:1]


def test_a_dropped_frame_is_noticed_at_the_next() -> None:
    frames = _frames_of(_tagged_stream(OBJECTS))
    assert _refused(frames[0] + frames[2] + frames[3]) == OBJECTS[:1]


def test_frames_of_another_direction_or_connection_are_refused() -> None:
    # The server's own frames reflected back to it, a frame of another connection with the same secret, and
    # a frame tagged under the client-to-server key but labelled as the other direction.
    reflected = _tagged_stream(OBJECTS[:1], KEYS.server_to_client)
    other = derive_frame_keys(SECRET, SERVER_NONCE, bytes(32)).client_to_server
    frame = encode_frame(OBJECTS[0])
    mislabelled = frame + FrameTagger(KEYS.client_to_server, SERVER_TO_CLIENT).tag(frame)
    for stream in (reflected, _tagged_stream(OBJECTS[:1], other), mislabelled):
        assert _refused(stream) == []


def test_an_injected_untagged_frame_is_refused() -> None:
    frames = _frames_of(_tagged_stream(OBJECTS))
    # Its would-be tag is the first 16 bytes of the next frame: no match.
    assert _refused(frames[0] + encode_frame(["injected"]) + frames[1]) == OBJECTS[:1]


# -- the connection tags what follows the handshake ---------------------------------------------------------

HELLO = Hello(PROTOCOL_VERSION, 11, 22, 2, 4242, 1, CLIENT_NONCE, b"p" * 32, "10.0.0.1:17000")
WELCOME = Welcome(PROTOCOL_VERSION, 22, 1, 3333, 2, "", 0, 0, b"q" * 32, "10.0.0.2:17001")
REQUEST = PinRequest(1, KEY_REQ, 7, 0, 0, 0, 3, True, 4097, 0, True, False, RULES_V1)
GRANT = Location(1, 99, 3333, "/llmdd_seg", 3 * 4097, (0, 4097, 8194), 4097, 1, 0)


def _deliver(data: bytes, to: Connection) -> list[Message | Closed]:
    to.receive_data(data)
    events: list[Message | Closed] = []
    while (event := to.next_event()) is not None:
        events.append(event)
        if isinstance(event, Closed):
            break
    return events


def _tcp_pair(secret: bytes = SECRET) -> tuple[Connection, Connection]:
    """A client and a server through a whole TCP handshake; the handshake's frames are not tagged."""
    client = Connection(ConnRole.CLIENT, challenge=True, secret=secret)
    server = Connection(ConnRole.SERVER, challenge=True, secret=SECRET)
    challenge = Challenge(PROTOCOL_VERSION, SERVER_NONCE)
    for msg, sender, receiver in (
        (challenge, server, client),
        (HELLO, client, server),
        (WELCOME, server, client),
    ):
        data = sender.send(msg)
        assert data == encode_frame(msg.to_wire())
        assert _deliver(data, receiver) == [msg]
    return client, server


def test_after_the_handshake_every_frame_carries_its_tag_both_ways() -> None:
    client, server = _tcp_pair()
    c2s = FrameTagger(KEYS.client_to_server, CLIENT_TO_SERVER)
    s2c = FrameTagger(KEYS.server_to_client, SERVER_TO_CLIENT)
    for _ in range(3):
        data = client.send(REQUEST)
        frame = encode_frame(REQUEST.to_wire())
        assert data == frame + c2s.tag(frame)
        assert _deliver(data, server) == [REQUEST]
        data = server.send(GRANT)
        frame = encode_frame(GRANT.to_wire())
        assert data == frame + s2c.tag(frame)
        assert _deliver(data, client) == [GRANT]
    assert _deliver(client.send(Bye("done")), server) == [Closed("done")]


def test_a_frame_the_connection_did_not_tag_fails_it_for_good() -> None:
    _, server = _tcp_pair()
    server.receive_data(encode_frame(Ping(1).to_wire()) + b"\x00" * TAG_NBYTES)
    with pytest.raises(RemoteProtocolError, match="tag"):
        server.next_event()
    assert server.state is ConnState.FAILED
    with pytest.raises(RemoteProtocolError):
        server.next_event()


def test_a_tampered_reply_fails_the_client() -> None:
    client, server = _tcp_pair()
    data = bytearray(server.send(Pong(1)))
    data[-1] ^= 1
    client.receive_data(bytes(data))
    with pytest.raises(RemoteProtocolError, match="tag"):
        client.next_event()
    assert client.state is ConnState.FAILED


def test_a_client_without_the_secret_cannot_talk_after_the_handshake() -> None:
    """The proofs refuse it first in real life; even a Hello let through keys its frames wrongly."""
    client, server = _tcp_pair(secret=b"not-the-secret-of-these-tests")
    server.receive_data(client.send(Ping(1)))
    with pytest.raises(RemoteProtocolError, match="tag"):
        server.next_event()


def test_eof_between_a_frame_and_its_tag_fails_the_connection() -> None:
    client, server = _tcp_pair()
    data = client.send(Ping(1))
    server.receive_data(data[:-TAG_NBYTES])
    assert server.next_event() is None
    server.receive_data(b"")
    with pytest.raises(RemoteProtocolError, match="EOF inside a frame"):
        server.next_event()


def test_a_refusal_of_the_hello_is_not_tagged() -> None:
    client = Connection(ConnRole.CLIENT, challenge=True, secret=SECRET)
    server = Connection(ConnRole.SERVER, challenge=True, secret=SECRET)
    _deliver(server.send(Challenge(PROTOCOL_VERSION, SERVER_NONCE)), client)
    _deliver(client.send(HELLO), server)
    refusal = Error(0, -1, "wrong shared secret")
    data = server.send(refusal)
    assert data == encode_frame(refusal.to_wire())
    assert _deliver(data, client) == [refusal, Closed(refusal.message)]


def test_a_unix_connection_never_tags_and_a_tcp_one_needs_the_secret() -> None:
    client, server = Connection(ConnRole.CLIENT), Connection(ConnRole.SERVER)
    unix_hello = Hello(PROTOCOL_VERSION, 11, 22, 2, 4242, 1)
    _deliver(client.send(unix_hello), server)
    _deliver(server.send(Welcome(PROTOCOL_VERSION, 22, 1, 3333, 2)), client)
    assert client.send(Ping(1)) == encode_frame(Ping(1).to_wire())
    with pytest.raises(ValueError, match="secret"):
        Connection(ConnRole.CLIENT, challenge=True)
    with pytest.raises(ValueError, match="secret"):
        Connection(ConnRole.SERVER, secret=SECRET)

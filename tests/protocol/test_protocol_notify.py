"""Notify (protocol version 6): a HIXL engine's notify to the engine it connected to. It round-trips whole,
a byte at a time and with trailing bytes; its name and message hold at most 1024 bytes of UTF-8 each; only
a linked client sends it, and the server answers it as any request."""

from __future__ import annotations

import pytest

from llm_datadist._protocol.connection import Connection, ConnRole
from llm_datadist._protocol.errors import LocalProtocolError, MalformedFrame, RemoteProtocolError
from llm_datadist._protocol.fields import MAX_NOTIFY_NBYTES
from llm_datadist._protocol.frames import FrameDecoder, encode_frame
from llm_datadist._protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Error,
    Hello,
    Notify,
    Welcome,
    decode_message,
    encode_message,
)

NOTIFY = Notify(3333, "cache_ready", "block_0 é€😀")


def _linked() -> tuple[Connection, Connection]:
    client, server = Connection(ConnRole.CLIENT), Connection(ConnRole.SERVER)
    server.receive_data(client.send(Hello(PROTOCOL_VERSION, 1, 2, 3, 4242, 7)))
    assert isinstance(server.next_event(), Hello)
    client.receive_data(server.send(Welcome(PROTOCOL_VERSION, 2, 3, 4343, 8)))
    assert isinstance(client.next_event(), Welcome)
    return client, server


def test_version_and_type() -> None:
    assert PROTOCOL_VERSION >= 6  # Notify came with 6
    assert NOTIFY.to_wire() == [24, 3333, "cache_ready", "block_0 é€😀"]
    assert MAX_NOTIFY_NBYTES == 1024


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_round_trip_whole_byte_by_byte_and_with_trailing_bytes(chunk: int | None) -> None:
    frame = encode_frame(encode_message(NOTIFY))
    trailing = encode_frame(encode_message(Notify(1, "", "")))
    decoder = FrameDecoder()
    data = frame + trailing
    pieces = [data] if chunk is None else [data[i : i + chunk] for i in range(0, len(data), chunk)]
    frames = []
    for piece in pieces:
        decoder.feed(piece)
        while (payload := decoder.next_frame()) is not None:
            frames.append(decode_message(payload))
    assert frames == [NOTIFY, Notify(1, "", "")]


def test_fields_hold_at_most_1024_bytes_of_utf8() -> None:
    assert Notify(1, "😀" * 256, "x" * 1024).name == "😀" * 256
    for bad in ("😀" * 256 + "x", "x" * 1025, "\ud800"):
        with pytest.raises(MalformedFrame):
            Notify(1, bad, "")
        with pytest.raises(MalformedFrame):
            Notify(1, "", bad)
    with pytest.raises(MalformedFrame):
        Notify.from_wire([24, 1, "n"])
    with pytest.raises(MalformedFrame):
        Notify.from_wire([24, 1, "n", b"bytes"])


def test_only_a_linked_client_sends_it_and_the_server_answers() -> None:
    fresh = Connection(ConnRole.CLIENT)
    with pytest.raises(LocalProtocolError):
        fresh.send(NOTIFY)  # before the handshake
    client, server = _linked()
    with pytest.raises(LocalProtocolError):
        server.send(NOTIFY)  # the server never notifies on a client's connection
    server.receive_data(client.send(NOTIFY))
    assert server.next_event() == NOTIFY
    client.receive_data(server.send(Ack(3333)))
    assert client.next_event() == Ack(3333)
    server.receive_data(client.send(Notify(3334, "n", "m")))
    assert server.next_event() == Notify(3334, "n", "m")
    client.receive_data(server.send(Error(3334, 1, "no more notifies from this link")))
    assert isinstance(client.next_event(), Error)
    # A client receiving one is a peer breaking the protocol.
    client, _ = _linked()
    client.receive_data(encode_frame(NOTIFY.to_wire()))
    with pytest.raises(RemoteProtocolError):
        client.next_event()

"""Frame tags of TCP links (`integrity`), without a socket: keys per connection and direction, tags that
refuse a frame altered, injected, replayed, reordered, dropped or cut short, and decoding of a tagged
stream whole, one byte at a time, in any chunking and with trailing bytes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist._protocol.errors import FrameTagMismatch
from llm_datadist._protocol.frames import HEADER_NBYTES, FrameDecoder, encode_frame
from llm_datadist._protocol.integrity import (
    CLIENT_TO_SERVER,
    SERVER_TO_CLIENT,
    TAG_NBYTES,
    FrameTagger,
    derive_frame_keys,
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

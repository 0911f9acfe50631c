"""Frame codec: golden bytes, incremental decoding under any chunking, limits and stickiness."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist._protocol.errors import FrameTooLarge, MalformedFrame
from llm_datadist._protocol.frames import DEFAULT_MAX_FRAME_NBYTES, HEADER_NBYTES, FrameDecoder, encode_frame
from llm_datadist._protocol.messages import (
    KEY_REQ,
    PROTOCOL_VERSION,
    RULES_V1,
    Hello,
    Location,
    PinRequest,
    decode_message,
)


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def _decode_all(decoder: FrameDecoder) -> list[object]:
    out = []
    while (obj := decoder.next_frame()) is not None:
        out.append(obj)
    return out


# -- golden bytes: these pin the wire format; a change here is a protocol version bump -----------------------


def test_golden_hello() -> None:
    hello = Hello(PROTOCOL_VERSION, 0x0102030405060708, 2**64 - 1, 2, 4242, 7)
    expected = bytes.fromhex(
        "0000001f"  # payload length 31
        "9a"  # array of 10
        "01"  # TYPE 1 (Hello)
        "08"  # version 8
        "cf0102030405060708"  # cluster_id as uint64
        "cfffffffffffffffff"  # remote_cluster_id 2**64-1
        "02"  # role DECODER
        "cd1092"  # pid 4242 as uint16
        "07"  # incarnation 7
        "c400"  # nonce b"" (bin 8)
        "c400"  # proof b""
        "a0"  # engine ""
    )
    assert encode_frame(hello.to_wire()) == expected
    decoder = FrameDecoder()
    decoder.feed(expected)
    assert decode_message(decoder.next_frame()) == hello


def test_golden_location() -> None:
    grant = Location(3333, 2**32, 4242, "/llmdd.1000-77_kv", 4 * 3333 + 1, (0, 3333, 6666, 9999), 3333, 1, 0)
    expected = bytes.fromhex(
        "00000036"  # payload length 54
        "9a"  # array of 10
        "11"  # TYPE 17 (Location)
        "cd0d05"  # seq 3333
        "cf0000000100000000"  # lease_id 2**32 (needs uint64)
        "cd1092"  # pid 4242 as uint16
        "b1"
        + b"/llmdd.1000-77_kv".hex()  # segment, fixstr of 17
        + "cd3415"  # segment_nbytes 13333
        "94"  # tensor_bases: array of 4
        "00cd0d05cd1a0acd270f"  # 0, 3333, 6666, 9999
        "cd0d05"  # unit_nbytes 3333
        "01"  # num_units 1
        "00"  # slot 0
    )
    assert encode_frame(grant.to_wire()) == expected
    decoder = FrameDecoder()
    decoder.feed(expected)
    assert decode_message(decoder.next_frame()) == grant


def test_golden_pin_request() -> None:
    request = PinRequest(4097, KEY_REQ, 2**40, 0, 1, 0, 61, True, 3333, 128, True, False, RULES_V1)
    expected = bytes.fromhex(
        "0000001c"  # payload length 28
        "9e"  # array of 14
        "03"  # TYPE 3 (PinRequest)
        "cd1001"  # seq 4097
        "01"  # key_kind KEY_REQ
        "cf0000010000000000"  # key_id 2**40 (needs uint64)
        "00"  # model_id 0
        "01"  # batch_index 1
        "00"  # tensor_start 0
        "3d"  # tensor_count 61
        "c3"  # whole True
        "cd0d05"  # nbytes 3333
        "cc80"  # src_offset 128 as uint8
        "c3"  # consume True
        "c2"  # for_write False
        "01"  # rules RULES_V1
    )
    assert encode_frame(request.to_wire()) == expected
    decoder = FrameDecoder()
    decoder.feed(expected)
    assert decode_message(decoder.next_frame()) == request


# -- incremental decoding ------------------------------------------------------------------------------------

_SCALARS = st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=40) | st.binary(max_size=40)
_VALUES = st.recursive(
    st.none() | _SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)
# A frame may carry any msgpack object but nil (None is next_frame's "need more data").
_OBJECTS = st.lists(_VALUES.filter(lambda v: v is not None), min_size=1, max_size=8)


def _stream(objects: Sequence[object]) -> bytes:
    return b"".join(encode_frame(obj) for obj in objects)


@settings(max_examples=60, deadline=None)
@given(objects=_OBJECTS, data=st.data())
def test_any_chunking_decodes_the_same(objects: list[object], data: st.DataObject) -> None:
    stream = _stream(objects)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(stream)), max_size=12)))
    bounds = [0, *cuts, len(stream)]
    decoder = FrameDecoder()
    decoded: list[object] = []
    for start, end in itertools.pairwise(bounds):
        decoder.feed(stream[start:end])
        decoded.extend(_decode_all(decoder))
    assert decoded == objects
    assert decoder.buffered_nbytes == 0


@settings(max_examples=20, deadline=None)
@given(objects=_OBJECTS)
def test_whole_and_byte_at_a_time(objects: list[object]) -> None:
    stream = _stream(objects)
    whole = FrameDecoder()
    whole.feed(stream)
    assert _decode_all(whole) == objects

    bytewise = FrameDecoder()
    decoded: list[object] = []
    for i in range(len(stream)):
        bytewise.feed(stream[i : i + 1])
        decoded.extend(_decode_all(bytewise))
    assert decoded == objects


@settings(max_examples=40, deadline=None)
@given(objects=_OBJECTS, tail=st.data())
def test_trailing_partial_frame_stays_buffered(objects: list[object], tail: st.DataObject) -> None:
    next_frame = encode_frame(["next", 3333])
    keep_nbytes = tail.draw(st.integers(1, len(next_frame) - 1))
    decoder = FrameDecoder()
    decoder.feed(_stream(objects) + next_frame[:keep_nbytes])
    assert _decode_all(decoder) == objects
    assert decoder.buffered_nbytes == keep_nbytes
    assert decoder.next_frame() is None  # asking again changes nothing
    decoder.feed(next_frame[keep_nbytes:])
    assert decoder.next_frame() == ["next", 3333]
    assert decoder.buffered_nbytes == 0


def test_many_small_frames_in_one_chunk() -> None:
    # Exercises the lazy compaction of consumed bytes (a chunk far larger than the compaction threshold).
    objects = [[i, "x" * (i % 7)] for i in range(20011)]
    decoder = FrameDecoder()
    stream = _stream(objects)
    half = len(stream) // 2 + 1
    decoder.feed(stream[:half])
    first = _decode_all(decoder)
    decoder.feed(stream[half:])
    assert first + _decode_all(decoder) == objects


@pytest.mark.parametrize("payload_nbytes", [3, 255, 3333, 4097])
def test_odd_payload_sizes_at_the_limit(payload_nbytes: int) -> None:
    # bin8/bin16 header (2 or 3 bytes) + data fills the payload to exactly payload_nbytes.
    blob = b"\x5a" * (payload_nbytes - (2 if payload_nbytes - 2 < 256 else 3))
    frame = encode_frame(blob, max_frame_nbytes=payload_nbytes)
    assert len(frame) == HEADER_NBYTES + payload_nbytes
    decoder = FrameDecoder(max_frame_nbytes=payload_nbytes)
    decoder.feed(frame)
    assert decoder.next_frame() == blob
    with pytest.raises(FrameTooLarge):
        encode_frame(blob, max_frame_nbytes=payload_nbytes - 1)
    small = FrameDecoder(max_frame_nbytes=payload_nbytes - 1)
    small.feed(frame[:HEADER_NBYTES])
    with pytest.raises(FrameTooLarge):
        small.next_frame()


def test_one_byte_payload() -> None:
    decoder = FrameDecoder(max_frame_nbytes=1)
    decoder.feed(encode_frame(7, max_frame_nbytes=1))
    assert decoder.next_frame() == 7


def test_default_limit_is_one_mib() -> None:
    assert DEFAULT_MAX_FRAME_NBYTES == 1 << 20
    blob = b"\xab" * ((1 << 20) - 5)  # bin32 header is 5 bytes
    decoder = FrameDecoder()
    decoder.feed(encode_frame(blob))
    assert decoder.next_frame() == blob
    with pytest.raises(FrameTooLarge):
        encode_frame(blob + b"\x00")


# -- rejections ----------------------------------------------------------------------------------------------


def test_oversized_header_rejected_before_body() -> None:
    decoder = FrameDecoder(max_frame_nbytes=4097)
    decoder.feed(struct.pack(">I", 4097) + b"\x00")  # at the limit: fine, waits for the body
    assert decoder.next_frame() is None
    decoder = FrameDecoder(max_frame_nbytes=4097)
    decoder.feed(struct.pack(">I", 4098)[:3])
    assert decoder.next_frame() is None  # header incomplete
    decoder.feed(struct.pack(">I", 4098)[3:])  # header complete, no body byte yet
    with pytest.raises(FrameTooLarge):
        decoder.next_frame()


def test_valid_frames_before_an_oversized_one_are_delivered() -> None:
    decoder = FrameDecoder(max_frame_nbytes=3333)
    decoder.feed(encode_frame([1]) + encode_frame([2]) + struct.pack(">I", 2**32 - 1))
    assert decoder.next_frame() == [1]
    assert decoder.next_frame() == [2]
    with pytest.raises(FrameTooLarge):
        decoder.next_frame()


_BAD_PAYLOADS = {
    "reserved byte 0xc1": b"\xc1",
    "two objects": b"\x01\x02",
    "object truncated inside the frame": b"\x92\x01",
    "str header longer than the frame": b"\xdb\xff\xff\xff\xff",
    "array header longer than the frame": b"\xdd\xff\xff\xff\xff",
    "map header longer than the frame": b"\xdf\xff\xff\xff\xff",
    "bin header longer than the frame": b"\xc6\x00\x01\x00\x00abc",
    "invalid utf-8": b"\xa2\xff\xfe",
    "int map key": b"\x81\x01\x02",
    "array map key": b"\x81\x91\x01\x02",
    "ext type": b"\xd4\x01\x00",
    "empty ext": b"\xc7\x00\x05",
    "timestamp ext": b"\xd6\xff\x00\x00\x00\x00",
    "empty timestamp ext": b"\xc7\x00\xff",
    "nil": b"\xc0",
    "nesting too deep": b"\x91" * 5000 + b"\x00",
}


@pytest.mark.parametrize("payload", list(_BAD_PAYLOADS.values()), ids=list(_BAD_PAYLOADS))
def test_bad_payload_is_malformed(payload: bytes) -> None:
    decoder = FrameDecoder()
    decoder.feed(_frame(payload))
    with pytest.raises(MalformedFrame):
        decoder.next_frame()


def test_empty_payload_is_malformed() -> None:
    decoder = FrameDecoder()
    decoder.feed(b"\x00\x00\x00\x00")
    with pytest.raises(MalformedFrame):
        decoder.next_frame()


def test_strings_and_bins_decode_as_str_and_bytes() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(["é" * 3333, b"\x00\xff", {"k": None}]))
    assert decoder.next_frame() == ["é" * 3333, b"\x00\xff", {"k": None}]


@pytest.mark.parametrize(
    ("error", "first_stream"),
    [
        (FrameTooLarge, struct.pack(">I", 1 << 21)),
        (MalformedFrame, _frame(b"\xc1")),
        (MalformedFrame, b"\x00" * 4),
    ],
)
def test_decoder_errors_are_sticky(error: type[Exception], first_stream: bytes) -> None:
    decoder = FrameDecoder()
    decoder.feed(first_stream)
    with pytest.raises(error):
        decoder.next_frame()
    with pytest.raises(error):
        decoder.next_frame()
    with pytest.raises(error):
        decoder.feed(encode_frame([1]))
    with pytest.raises(error):
        decoder.next_frame()


def test_unpackable_object_is_a_caller_bug() -> None:
    with pytest.raises(TypeError):
        encode_frame(object())
    with pytest.raises(OverflowError):
        encode_frame(2**64)


@pytest.mark.parametrize("bad", [0, -1, 2**32])
def test_limit_argument_checked(bad: int) -> None:
    with pytest.raises(ValueError):
        FrameDecoder(bad)
    with pytest.raises(ValueError):
        encode_frame([1], max_frame_nbytes=bad)


def test_limit_argument_type_checked() -> None:
    with pytest.raises(TypeError):
        FrameDecoder(True)
    with pytest.raises(TypeError):
        FrameDecoder(1.5)  # type: ignore[arg-type]


def test_msgpack_is_the_payload_codec() -> None:
    # The frame is exactly header + msgpack.packb(use_bin_type=True): any msgpack implementation can speak it.
    obj = [1, "two", b"three", [4.5, None, True]]
    assert encode_frame(obj) == _frame(msgpack.packb(obj, use_bin_type=True))

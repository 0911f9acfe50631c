"""Message schemas: every type round-trips; every field refuses wrong types and out-of-range values, both
when constructed and when decoded from the wire."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist._protocol.errors import MalformedFrame
from llm_datadist._protocol.frames import FrameDecoder, encode_frame
from llm_datadist._protocol.messages import (
    KEY_BLOCKS,
    KEY_CACHE_ID,
    KEY_PREFIX,
    KEY_REQ,
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    RULES_V1,
    RULES_V2,
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
    encode_message,
)

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1

u32 = st.integers(0, U32_MAX)
u64 = st.integers(0, U64_MAX)
roles = st.sampled_from([1, 2, 3])
texts = st.text(max_size=64) | st.text(min_size=4090, max_size=4096, alphabet="aé€😀")
nonces = st.just(b"") | st.binary(min_size=16, max_size=64)
proofs = st.just(b"") | st.binary(min_size=32, max_size=32)
engines = st.just("") | st.from_regex(r"[0-9A-Za-z.:_\[\]-]{1,128}", fullmatch=True)
# A notify's name and message: at most 1024 bytes of UTF-8 (256 four-byte characters fill it).
notify_texts = st.text(max_size=64) | st.just("😀" * 256) | st.text("a", min_size=1024, max_size=1024)
segment_names = st.builds(
    lambda slash, body: slash + body,
    st.sampled_from(["", "/"]),
    st.text("ABCxyz0189._-", min_size=1, max_size=254),
)


@st.composite
def pin_requests(draw: st.DrawFn) -> PinRequest:
    """Any valid PinRequest: either rules, every key kind; nbytes and src_offset only on a v1 pull of a
    key (where nbytes > 0), for_write only under v2."""
    rules = draw(st.sampled_from([RULES_V1, RULES_V2]))
    key_kind = draw(st.sampled_from([KEY_REQ, KEY_PREFIX, KEY_CACHE_ID, KEY_BLOCKS]))
    v1_key_pull = rules == RULES_V1 and key_kind != KEY_BLOCKS
    return PinRequest(
        draw(u32),
        key_kind,
        draw(u64),
        draw(u64),
        draw(u32),
        draw(u32),
        draw(st.integers(1, U32_MAX)),
        draw(st.booleans()),
        draw(st.integers(1, U64_MAX)) if v1_key_pull else 0,
        draw(u64) if v1_key_pull else 0,
        draw(st.booleans()),
        draw(st.booleans()) if rules == RULES_V2 else False,
        rules,
    )


@st.composite
def locations(draw: st.DrawFn) -> Location:
    """Any valid Location: registered memory (segment "", bases are addresses, unbounded) or a segment
    that holds every tensor; units as large as a v1 pull's slot (up to 2**40 bytes) or as many as a blocks
    cache's blocks, up to 40 tensors."""
    unit = draw(st.integers(1, 2**40))
    units = draw(st.integers(1, 2**10))
    slot = draw(st.integers(0, units - 1))
    if draw(st.booleans()):
        bases = draw(st.lists(u64, min_size=1, max_size=40))
        return Location(draw(u32), draw(u64), draw(u32), "", draw(u64), tuple(bases), unit, units, slot)
    segment_nbytes = draw(st.integers(unit * units, U64_MAX))
    bases = draw(st.lists(st.integers(0, segment_nbytes - unit * units), min_size=1, max_size=40))
    return Location(
        draw(u32), draw(u64), draw(u32), draw(segment_names), segment_nbytes, tuple(bases), unit, units, slot
    )


TABLE_ENTRY = (7, True, (0, 1), "/llmdd.0.1.2.x", 4097 * 64, (0, 4097 * 32), 4097, 32, 3, 3333)


@st.composite
def write_requests(draw: st.DrawFn) -> WriteRequest:
    count = draw(st.integers(1, 40))
    return WriteRequest(
        draw(u32),
        tuple(draw(st.lists(u64, min_size=count, max_size=count))),
        tuple(draw(st.lists(u64, min_size=count, max_size=count))),
    )


@st.composite
def write_grants(draw: st.DrawFn) -> WriteGrant:
    segments = draw(st.lists(segment_names, min_size=1, max_size=5))
    count = draw(st.integers(1, 40))
    return WriteGrant(
        draw(u32),
        draw(u64),
        tuple(segments),
        tuple(draw(st.lists(u64, min_size=len(segments), max_size=len(segments)))),
        tuple(draw(st.lists(st.integers(0, len(segments) - 1), min_size=count, max_size=count))),
        tuple(draw(st.lists(u64, min_size=count, max_size=count))),
    )


MESSAGES: dict[type[Message], st.SearchStrategy[Message]] = {
    Hello: st.builds(Hello, u32, u64, u64, roles, u32, u64, nonces, proofs, engines),
    Welcome: st.builds(
        Welcome, u32, u64, roles, u32, u64, st.just("") | segment_names, u32, u64, proofs, engines
    ),
    Challenge: st.builds(Challenge, u32, st.binary(min_size=16, max_size=64)),
    AddressRequest: st.builds(AddressRequest, u32, st.lists(segment_names, min_size=1, max_size=64)),
    Addresses: st.builds(Addresses, u32, st.lists(u64, min_size=1, max_size=64)),
    PinRequest: pin_requests(),
    Ack: st.builds(Ack, u32),
    Error: st.builds(Error, u32, st.integers(I64_MIN, I64_MAX), texts),
    Bye: st.builds(Bye, texts),
    Ping: st.builds(Ping, u32),
    Pong: st.builds(Pong, u32),
    Announce: st.builds(
        Announce, u32, st.sampled_from(["", "llmdd-2-4242.sock", "a", "_x.y-z"]), st.integers(0, 65535)
    ),
    WriteRequest: write_requests(),
    WriteGrant: write_grants(),
    Location: locations(),
    TableRequest: st.builds(TableRequest, u32, u64),
    Notify: st.builds(Notify, u32, notify_texts, notify_texts),
    Release: st.builds(Release, u64, st.booleans()),
    Table: st.builds(
        Table,
        u32,
        u32,
        segment_names,
        st.lists(st.just(TABLE_ENTRY), max_size=3).map(tuple),  # type: ignore[arg-type]
        u64,
        u64,
    ),
}
any_message = st.one_of(*MESSAGES.values())

# PinRequest's shapes: a v1 pull of a key (the only one that names bytes of the slot), a v1 blocks pin, and
# v2 pins (a write into a blocks cache; a consuming read by prefix).
V1_KEY_PULL = PinRequest(3333, KEY_CACHE_ID, 7, 0, 4097, 1, 3333, True, 4097, 3333, False, False, RULES_V1)
V1_BLOCKS = PinRequest(4097, KEY_BLOCKS, 0, 3333, 0, 1, 4097, False, 0, 0, False, False, RULES_V1)
V2_WRITE = PinRequest(3333, KEY_BLOCKS, 0, 4097, 1, 2, 3333, False, 0, 0, False, True, RULES_V2)
V2_KEY_PIN = PinRequest(4097, KEY_PREFIX, 3333, 0, 1, 0, 1, True, 0, 0, True, False, RULES_V2)

# One valid instance per type (several for PinRequest and Location), with fields at odd, non-trivial values;
# the first of each type is the one the field tables below change.
VALID: list[Message] = [
    Hello(PROTOCOL_VERSION, 3333, 4097, 1, 4242, 2**64 - 1, b"\x00" * 33, b"\xff" * 32, "10.0.0.1:4097"),
    Welcome(PROTOCOL_VERSION, 4097, 3, 1, 3333, "", 0, 0, b"\x01" * 32, "[::1]:3333"),
    Challenge(PROTOCOL_VERSION, b"\x7f" * 64),
    AddressRequest(3333, ("/a", "llmdd_0_3333.x")),
    Addresses(4097, (0, U64_MAX)),
    V1_KEY_PULL,
    Ack(U32_MAX),
    Error(0, -(2**63), "é" * 4096),
    Bye("x" * 3333),
    Ping(0),
    Pong(4097),
    Announce(3333, "llmdd-2-4097.sock", 4097),
    V1_BLOCKS,
    WriteRequest(3333, (4097, 2**47 + 3333), (3333, 4097)),
    WriteGrant(4097, 3333, ("/a", "/b"), (3333, 4097), (1, 0, 1), (0, 3333, 4097)),
    V2_WRITE,
    V2_KEY_PIN,
    Location(1, 2, 4097, "/seg", 4097 * 3333 * 2, (0, 4097 * 3333), 4097, 3333, 3332),
    # A v1 key pull's: 3333 tensors of one 4097-byte slot, the last ending exactly at the segment's end.
    Location(1, 2, 3333, "llmdd_0_3333.x", 3333 * 4097, tuple(range(0, 3333 * 4097, 4097)), 4097, 1, 0),
    # Registered memory: no segment, the bases are addresses in process pid (nothing bounds them).
    Location(4097, 3333, 4242, "", 0, (2**47, 2**47 + 4097 * 3333), 4097, 3333, 1),
    TableRequest(4097, 1),
    Release(U64_MAX, False),
    Notify(3333, "cache_ready", "é" * 512),
    Table(
        3333, 4097, "/llmdd.0.1.2.gen", (TABLE_ENTRY, (1, False, (), "", 0, (2**47,), 3333, 1, 0, 1)), 0, 1
    ),
]


def _through_the_wire(msg: Message) -> Message:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(encode_message(msg)))
    return decode_message(decoder.next_frame())


def test_registry_is_complete() -> None:
    assert {cls.TYPE: cls for cls in MESSAGES} == MESSAGE_TYPES
    assert [Hello.TYPE, Welcome.TYPE, PinRequest.TYPE] == [1, 2, 3]
    # Retired types are never reused: PullDone's (5, gone in protocol 7); PullGrant's, BlocksRequest's,
    # BlocksGrant's and ResolveRequest's (4, 12, 13, 16, gone in protocol 8).
    assert not {4, 5, 12, 13, 16} & set(MESSAGE_TYPES)
    assert [Ack.TYPE, Error.TYPE, Bye.TYPE, Ping.TYPE, Pong.TYPE] == [6, 7, 8, 9, 10]
    assert [Location.TYPE, TableRequest.TYPE, Table.TYPE, Release.TYPE] == [17, 18, 19, 20]
    assert [Announce.TYPE, WriteRequest.TYPE, WriteGrant.TYPE] == [11, 14, 15]
    assert {type(msg) for msg in VALID} == set(MESSAGE_TYPES.values())
    assert (KEY_REQ, KEY_PREFIX, KEY_CACHE_ID, KEY_BLOCKS, PROTOCOL_VERSION) == (1, 2, 3, 4, 8)
    assert (RULES_V1, RULES_V2) == (1, 2)
    assert Notify.TYPE == 24


@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_every_type_round_trips(msg: Message) -> None:
    assert _through_the_wire(msg) == msg
    assert type(msg).from_wire(msg.to_wire()) == msg


@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_wire_shape_is_type_then_fields_in_order(msg: Message) -> None:
    wire = msg.to_wire()
    names = [f.name for f in dataclasses.fields(msg)]
    assert wire[0] == msg.TYPE
    assert wire[1:] == [list(v) if isinstance(v, tuple) else v for v in (getattr(msg, n) for n in names)]


@pytest.mark.parametrize("msg", VALID, ids=lambda m: type(m).__name__)
def test_messages_are_frozen_and_slotted(msg: Message) -> None:
    name = dataclasses.fields(msg)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(msg, name, getattr(msg, name))
    assert not hasattr(msg, "__dict__")
    hash(msg)


def test_offsets_travel_as_array_and_come_back_as_tuple() -> None:
    grant = Location(1, 2, 4242, "seg", 4097, [0, 1, 2], 3333, 1, 0)  # type: ignore[arg-type]
    assert grant.tensor_bases == (0, 1, 2)
    assert grant.to_wire()[6] == [0, 1, 2]
    back = _through_the_wire(grant)
    assert isinstance(back, Location) and back.tensor_bases == (0, 1, 2)


@settings(max_examples=150, deadline=None)
@given(msg=any_message)
def test_random_valid_messages_round_trip(msg: Message) -> None:
    assert _through_the_wire(msg) == msg


def test_largest_messages_fit_the_default_frame() -> None:
    grant = Location(U32_MAX, U64_MAX, U32_MAX, "/" + "s" * 254, U64_MAX, (U64_MAX - 1,) * 65536, 1, 1, 0)
    assert _through_the_wire(grant) == grant
    error = Error(U32_MAX, I64_MIN, "😀" * 4096)
    assert _through_the_wire(error) == error


# -- rejections ----------------------------------------------------------------------------------------------

NOT_INTS: list[Any] = [True, False, 1.0, "1", b"\x01", None, [1]]
BAD_U32 = [-1, 2**32, 2**64 - 1, *NOT_INTS]
BAD_U64 = [-1, -(2**63), *NOT_INTS]  # 2**64 itself cannot be packed; it is checked at construction below
BAD_I64 = [2**63, U64_MAX, *NOT_INTS]
BAD_BOOL = [0, 1, None, "true", 1.0]
BAD_TEXT = ["x" * 4097, "é" * 4097, b"bytes", None, 1, ["a"]]
BAD_ROLE = [0, 4, -1, True, 2.0, None]
BAD_KEY_KIND = [0, 5, *BAD_U32]
BAD_RULES = [0, 3, *BAD_U32]
BAD_SEGMENT = [
    "",
    "/",
    "a" * 256,
    "/" + "a" * 255,
    "/a/b",
    "a b",
    "a\n",
    "\n",
    "seg\x00",
    "段",
    None,
    b"seg",
    1,
]
BAD_OFFSETS = [[], [-1], [True], [1.0], [None], "abc", None, 3, [0] * 65537, {"0": 0}]

BAD_NONCE: list[Any] = [b"x" * 15, b"x" * 65, "x" * 32, None, 16, [0] * 16]
BAD_PROOF: list[Any] = [b"x", b"x" * 31, b"x" * 33, "x" * 32, None, 0]
BAD_ENGINE: list[Any] = ["a b", "a/b", "x" * 129, "é", None, 3, b"1.2.3.4:5"]
# 1025 bytes: one byte too many, in one-byte or in multi-byte characters.
BAD_NOTIFY_TEXT: list[Any] = ["x" * 1025, "é" * 512 + "x", "😀" * 257, b"n", None, 1]
BAD_VALUES: dict[type[Message], dict[str, list[Any]]] = {
    Hello: {
        "version": BAD_U32,
        "cluster_id": BAD_U64,
        "remote_cluster_id": BAD_U64,
        "role": BAD_ROLE,
        "pid": BAD_U32,
        "incarnation": BAD_U64,
        "nonce": BAD_NONCE,
        "proof": BAD_PROOF,
        "engine": BAD_ENGINE,
    },
    Challenge: {"version": BAD_U32, "nonce": [b"", *BAD_NONCE]},
    AddressRequest: {"seq": BAD_U32, "names": [None, [], ["/a"] * 65, ["a/b"], [3], "/a"]},
    Addresses: {"seq": BAD_U32, "addrs": [None, [], [0] * 65, [-1], [True], ["1"], 7]},
    Welcome: {
        "version": BAD_U32,
        "cluster_id": BAD_U64,
        "role": BAD_ROLE,
        "pid": BAD_U32,
        "incarnation": BAD_U64,
        "index": [s for s in BAD_SEGMENT if s != ""],
        "index_row": BAD_U32,
        "index_ticket": BAD_U64,
        "proof": BAD_PROOF,
        "engine": BAD_ENGINE,
    },
    # Changes to V1_KEY_PULL; what only a combination of fields breaks is in BAD_TOGETHER below.
    PinRequest: {
        "seq": BAD_U32,
        "key_kind": BAD_KEY_KIND,
        "key_id": BAD_U64,
        "model_id": BAD_U64,
        "batch_index": BAD_U32,
        "tensor_start": BAD_U32,
        "tensor_count": [0, *BAD_U32],
        "whole": BAD_BOOL,
        "nbytes": [0, *BAD_U64],  # 0: a v1 pull of a key names its bytes
        "src_offset": BAD_U64,
        "consume": BAD_BOOL,
        "for_write": BAD_BOOL,
        "rules": BAD_RULES,
    },
    Ack: {"seq": BAD_U32},
    Error: {"seq": BAD_U32, "status_code": BAD_I64, "message": BAD_TEXT},
    Bye: {"reason": BAD_TEXT},
    Ping: {"seq": BAD_U32},
    Pong: {"seq": BAD_U32},
    Announce: {
        "seq": BAD_U32,
        "callback": ["/abs", "a/b", ".hidden", "..", "a b", "x" * 256, None, 3, b"x"],
        "tcp_port": BAD_U32,
    },
    WriteRequest: {"seq": BAD_U32, "addrs": [*BAD_OFFSETS, [1]], "nbytes": [*BAD_OFFSETS, [1, 2, 3]]},
    Location: {
        "seq": BAD_U32,
        "lease_id": BAD_U64,
        "pid": BAD_U32,
        "segment": [s for s in BAD_SEGMENT if s != ""],
        "segment_nbytes": [*BAD_U64, 4097 * 3333 * 2 - 1],  # one byte too small for the last tensor
        "tensor_bases": [*BAD_OFFSETS, [1, 4097 * 3333 + 1], [0, U64_MAX]],
        "unit_nbytes": [0, 4098, *BAD_U64],
        "num_units": [0, 3334, 3332, *BAD_U64],  # 3332: the slot (3332) would be out of range
        "slot": [3333, *BAD_U32],
    },
    TableRequest: {"seq": BAD_U32, "start_cache_id": BAD_U64},
    Release: {"lease_id": BAD_U64, "ok": BAD_BOOL},
    Notify: {"seq": BAD_U32, "name": BAD_NOTIFY_TEXT, "message": BAD_NOTIFY_TEXT},
    Table: {
        "seq": BAD_U32,
        "pid": BAD_U32,
        "next_cache_id": BAD_U64,
        "version": BAD_U64,
        "generations": BAD_SEGMENT,
        "entries": [
            None,
            [[]],
            [list(TABLE_ENTRY[:9])],
            [[*TABLE_ENTRY[:9], 0]],
            [[*TABLE_ENTRY[:8], -1, 1]],
            [[-1, *TABLE_ENTRY[1:]]],
            [[TABLE_ENTRY[0], 1, *TABLE_ENTRY[2:]]],
            [[*TABLE_ENTRY[:3], "a b", *TABLE_ENTRY[4:]]],
            [[*TABLE_ENTRY[:4], 4097 * 64 - 1, *TABLE_ENTRY[5:]]],
            [[*TABLE_ENTRY[:7], 0, *TABLE_ENTRY[8:]]],
            [TABLE_ENTRY] * 4097,
        ],
    },
    WriteGrant: {
        "seq": BAD_U32,
        "lease_id": BAD_U64,
        "segments": [[], ["/a"], ["/a", "b c"], None, "/a", [1, 2]],
        "segment_nbytes": [*BAD_OFFSETS, [1]],
        "range_segments": [*BAD_OFFSETS, [0, 2, 1], [1, 0]],
        "range_offsets": [*BAD_OFFSETS, [0, 1]],
    },
}

_BY_TYPE: dict[type[Message], Message] = {}
for _msg in VALID:
    _BY_TYPE.setdefault(type(_msg), _msg)
# One test per field (looping over its bad values) keeps the run fast: each test pays for the leak fixtures.
_FIELD_CASES = [
    pytest.param(cls, name, id=f"{cls.__name__}.{name}")
    for cls, fields in BAD_VALUES.items()
    for name in fields
]


def test_every_field_has_bad_values() -> None:
    for cls in MESSAGE_TYPES.values():
        assert set(BAD_VALUES[cls]) == {f.name for f in dataclasses.fields(cls)}


@pytest.mark.parametrize(("cls", "name"), _FIELD_CASES)
def test_bad_field_refused_at_construction(cls: type[Message], name: str) -> None:
    for bad in BAD_VALUES[cls][name]:
        with pytest.raises(MalformedFrame, match=name):
            dataclasses.replace(_BY_TYPE[cls], **{name: bad})
            pytest.fail(f"{cls.__name__}.{name}={bad!r:.40} was accepted")


@pytest.mark.parametrize(("cls", "name"), _FIELD_CASES)
def test_bad_field_refused_off_the_wire(cls: type[Message], name: str) -> None:
    msg = _BY_TYPE[cls]
    index = 1 + [f.name for f in dataclasses.fields(msg)].index(name)
    for bad in BAD_VALUES[cls][name]:
        wire = msg.to_wire()
        wire[index] = bad
        decoder = FrameDecoder()
        decoder.feed(encode_frame(wire))
        obj = decoder.next_frame()
        with pytest.raises(MalformedFrame):
            decode_message(obj)
            pytest.fail(f"{cls.__name__}.{name}={bad!r:.40} was accepted off the wire")
        with pytest.raises(MalformedFrame):
            cls.from_wire(obj)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "huge"), [("cluster_id", 2**64), ("pid", 2**200), ("role", -(2**70)), ("version", 10**30)]
)
def test_ints_beyond_msgpack_refused_at_construction(name: str, huge: int) -> None:
    with pytest.raises(MalformedFrame):
        dataclasses.replace(_BY_TYPE[Hello], **{name: huge})


# PinRequest's fields together (`_check_fields_together`): each change makes a request that no single
# field's check refuses, and the refusal says which rule it breaks.
BAD_TOGETHER: list[tuple[PinRequest, dict[str, Any], str]] = [
    (V1_KEY_PULL, {"key_kind": KEY_BLOCKS}, "nbytes"),  # a blocks pin names no bytes
    (V1_KEY_PULL, {"rules": RULES_V2}, "nbytes"),  # nor does a v2 pin
    (V1_KEY_PULL, {"nbytes": 0, "src_offset": 0}, "nbytes"),  # a v1 pull of a key names its bytes
    (V1_KEY_PULL, {"for_write": True}, "WriteRequest"),  # v1 pushes go by address
    (V1_BLOCKS, {"key_kind": KEY_REQ}, "nbytes"),
    (V1_BLOCKS, {"nbytes": 1}, "nbytes"),
    (V1_BLOCKS, {"src_offset": 1}, "src_offset"),
    (V1_BLOCKS, {"for_write": True}, "WriteRequest"),
    (V2_WRITE, {"nbytes": U64_MAX}, "nbytes"),
    (V2_WRITE, {"src_offset": 4097}, "src_offset"),
    (V2_WRITE, {"rules": RULES_V1}, "WriteRequest"),
    (V2_KEY_PIN, {"nbytes": 1, "src_offset": 1}, "nbytes"),
    (V2_KEY_PIN, {"src_offset": U64_MAX}, "src_offset"),
    (V2_KEY_PIN, {"rules": RULES_V1}, "nbytes"),
]


@pytest.mark.parametrize(
    ("base", "changes", "rule"),
    BAD_TOGETHER,
    ids=[f"{i}-{'+'.join(changes)}" for i, (_, changes, _) in enumerate(BAD_TOGETHER)],
)
def test_pin_request_fields_checked_together(base: PinRequest, changes: dict[str, Any], rule: str) -> None:
    with pytest.raises(MalformedFrame, match=rule):
        dataclasses.replace(base, **changes)
        pytest.fail(f"{changes} was accepted")
    names = [f.name for f in dataclasses.fields(base)]
    wire = base.to_wire()
    for name, value in changes.items():
        wire[1 + names.index(name)] = value
    decoder = FrameDecoder()
    decoder.feed(encode_frame(wire))
    obj = decoder.next_frame()
    with pytest.raises(MalformedFrame, match=rule):
        decode_message(obj)
    with pytest.raises(MalformedFrame, match=rule):
        PinRequest.from_wire(obj)  # type: ignore[arg-type]


def test_pin_request_accepts_exactly_its_valid_combinations() -> None:
    """Every combination of rules, key kind, for_write and (no, some) nbytes and src_offset: accepted
    exactly when nbytes > 0 is a v1 pull of a key, for_write is v2's, and src_offset is a v1 key pull's."""
    accepted = 0
    for rules, key_kind, for_write, nbytes, src_offset in itertools.product(
        [RULES_V1, RULES_V2], [KEY_REQ, KEY_PREFIX, KEY_CACHE_ID, KEY_BLOCKS], [False, True], [0, 1], [0, 1]
    ):
        v1_key_pull = rules == RULES_V1 and key_kind != KEY_BLOCKS
        valid = (
            (nbytes > 0) == v1_key_pull
            and not (rules == RULES_V1 and for_write)
            and (v1_key_pull or not src_offset)
        )
        fields = (1, key_kind, 7, 8, 0, 0, 1, True, nbytes, src_offset, True, for_write, rules)
        if valid:
            accepted += 1
            msg = PinRequest(*fields)
            assert _through_the_wire(msg) == msg
        else:
            with pytest.raises(MalformedFrame, match="PinRequest"):
                PinRequest(*fields)
            with pytest.raises(MalformedFrame, match="PinRequest"):
                decode_message([PinRequest.TYPE, *fields])
    # v1 key pulls (3 kinds x 2 offsets), v1 blocks pins, v2 pins (4 kinds x 2 for_write).
    assert accepted == 6 + 1 + 8


@pytest.mark.parametrize("nbytes", [1, 3333, 4097])
@pytest.mark.parametrize("units", [1, 3])
def test_grant_may_end_exactly_at_segment_end(nbytes: int, units: int) -> None:
    span = units * nbytes
    grant = Location(1, 1, 4242, "/seg", 3 * span, (0, span, 2 * span), nbytes, units, units - 1)
    assert _through_the_wire(grant) == grant
    with pytest.raises(MalformedFrame):
        Location(1, 1, 4242, "/seg", 3 * span - 1, (0, span, 2 * span), nbytes, units, units - 1)


def test_segment_name_edges() -> None:
    for name in ["a", "/a", "a" * 255, "/" + "a" * 254, "..", "-._", "/llmdd_1000_4242_1a2b.kv"]:
        assert Location(1, 1, 4242, name, 1, (0,), 1, 1, 0).segment == name


def test_text_edges() -> None:
    assert Bye("").reason == ""
    assert Bye("x" * 4096).reason == "x" * 4096
    assert Error(0, 0, "\n\x00").message == "\n\x00"


_BAD_SHAPES: dict[str, object] = {
    "nil": None,
    "int": 1,
    "str": "hello",
    "map": {"type": 1},
    "empty array": [],
    "unknown type 0": [0],
    "unknown type 11": [11, 1],
    "unknown type u64 max": [U64_MAX, 1],
    "negative type": [-1, 1],
    "bool type": [True, 1, 2, 3, 1, 4, 5],  # True == Hello.TYPE in Python; must not pass as one
    "str type": ["1", 1, 2, 3, 1, 4, 5],
    "float type": [1.0, 1, 2, 3, 1, 4, 5],
    "nested array type": [[1], 1],
    "Hello missing a field": [1, 1, 2, 3, 1, 4],
    "Hello with an extra field": [1, 1, 2, 3, 1, 4, 5, 6],
    "Ack without seq": [6],
    "Bye with two reasons": [8, "a", "b"],
    # Protocol 7's messages that protocol 8 retired, as an old peer would send them.
    "retired PullGrant (type 4)": [4, 1, 2, "/seg", 4097, [0], 4097],
    "retired BlocksRequest (type 12)": [12, 1, 2, 0, 1, True],
    "retired BlocksGrant (type 13)": [13, 1, 2, "/seg", 4097, [0], 1, 4097],
    "retired ResolveRequest (type 16)": [16, 1, 4, 0, 2, 0, 0, 1, True, False, False],
    "protocol 7's PullRequest (type 3 without for_write and rules)": [
        3,
        1,
        1,
        7,
        0,
        0,
        0,
        1,
        True,
        8,
        0,
        False,
    ],
}


@pytest.mark.parametrize("obj", list(_BAD_SHAPES.values()), ids=list(_BAD_SHAPES))
def test_wrong_shape_is_malformed(obj: object) -> None:
    with pytest.raises(MalformedFrame):
        decode_message(obj)


def test_from_wire_checks_its_own_type() -> None:
    with pytest.raises(MalformedFrame):
        Ping.from_wire(Pong(1).to_wire())
    with pytest.raises(MalformedFrame):
        Ping.from_wire((9, 1))  # type: ignore[arg-type]
    assert Ping.from_wire([9, 1]) == Ping(1)


def test_the_inline_shortcut_admits_nothing_the_full_check_refuses() -> None:
    """Message.__post_init__ accepts exact ints in range and bools inline; everything else still goes
    through the field's check, so int subclasses stay accepted and gaps in a value set stay refused."""
    import enum

    from llm_datadist._protocol.fields import int_in

    class Role(enum.IntEnum):
        DECODER = 2

    hello = Hello(1, 7, 8, Role.DECODER, 42, 1)  # an IntEnum is an int, though not exactly one
    assert hello.role == 2
    with pytest.raises(MalformedFrame, match="role"):
        Hello(1, 7, 8, True, 42, 1)
    odd = int_in(frozenset({1, 3}), "1 or 3")
    assert odd.int_range is None  # {1, 3} is not a range: 2 must not pass inline
    assert odd.check(2) is None and odd.check(3) == 3

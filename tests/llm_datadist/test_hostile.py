"""Hostile input against a live owner (a real Prompt process), on its Unix socket and on the TCP port it
serves other hosts on: every message type, well-formed or not, in either direction, with ids drawn from
the owner's real caches, model ids and granted leases as well as from the full ranges; malformed frames;
connections that take leases and vanish; the owner registering, unregistering, allocating and freeing
caches between messages; a flood of connections past the server's limit. After each example the owner
still serves a legitimate link, holds no lease once the hostile connections are gone, and its data is
byte for byte what it wrote."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from llm_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
)
from llm_datadist._protocol.frames import DEFAULT_MAX_FRAME_NBYTES, FrameDecoder, encode_frame
from llm_datadist._protocol.integrity import FrameTagger, derive_frame_keys
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
)
from llm_datadist._puller.remote import engine_available
from llm_datadist._wire import auth as _auth
from llm_datadist._wire.client import ClientLink
from llm_datadist._wire.server import MAX_CONNECTIONS
from llm_datadist.ext import tensor_views
from tests._peer import PROMPT_IP, PromptPeer, decoder, prompt_options, tensor_views_v2

P = 1
PORT = 21500  # this file uses PORT .. PORT + 7, and TCP_PORT .. TCP_PORT + 1 on loopback
TCP_PORT = 21560
SECRET = "hostile-test-shared-secret"
_WAIT_S = 5.0  # any one answer of the owner; a test fails rather than hangs past it
_MY_PID = os.getpid()

# Shapes of the owner's caches: odd sizes on purpose. A pool cache has 2 slots of 666 bytes per tensor, a
# blocks cache 8 blocks of 98 bytes per tensor.
NUM_TENSORS = 2
SLOT_SHAPE = [2, 333]
BLOCKS_SHAPE = [8, 49]
_SLOT_NBYTES = SLOT_SHAPE[1] * 2
MAX_LIVE_CACHES = 10

# Every message the client side may send once READY, and the one reply type each gets besides Error.
_REPLY_TO: dict[type[Message], type[Message]] = {
    Announce: Ack,
    PinRequest: Location,
    WriteRequest: WriteGrant,
    TableRequest: Table,
    Ping: Pong,
    AddressRequest: Addresses,  # refused on the Unix socket: only a peer on another host may ask
    Notify: Ack,  # refused by an owner that is no HIXL engine
}
_GRANTS = (WriteGrant, Location)
# PinRequest and Location each stand for three message types of protocol 7 (a v1 pull of a key, a v1 blocks
# pull and a cache-manager pin; and their grants): drawn three times as often as another class, the programs
# send them as often as they sent those.
_WEIGHTS: dict[type[Message], int] = {PinRequest: 3, Location: 3}
# Requests that must never be refused.
_NEVER_REFUSED = (Announce, TableRequest, Ping)
_STATUS_NAMES = {int(code): code.name for code in LLMStatusCode}


def _v2_extra() -> dict[str, str]:
    return {
        "llm.EnableCacheManager": "1",
        "llm.EnableRemoteCacheAccessible": "1",
        "llm.MemPoolConfig": json.dumps({"memory_size": 64 << 20, "page_shift": 16}),
        # An unregister that meets a hostile lease gives up quickly (it waits for leases up to this).
        "llm.SyncKvCacheWaitTime": "200",
    }


# ---------------------------------------------------------------------------- strategies

_U64 = st.integers(0, 2**64 - 1)
_U32 = st.integers(0, 2**32 - 1)
_U64_POS = st.integers(1, 2**64 - 1)
_U32_POS = st.integers(1, 2**32 - 1)
_I64 = st.integers(-(2**63), 2**63 - 1)
_ROLE = st.sampled_from([1, 2, 3])
_TEXT = st.one_of(st.text(max_size=40), st.just("x" * 4096))
_SEGMENT_NAME = st.from_regex(r"/?[A-Za-z0-9._-]{1,40}", fullmatch=True)
_CALLBACK = st.from_regex(r"(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,40})?", fullmatch=True)
_SMALL_U32 = st.one_of(st.integers(0, 3), _U32)
_COUNT = st.one_of(st.integers(1, 3), _U32_POS)
_INDEX = st.integers(0, 2**16)  # picks among what the owner has, modulo its count


def _plausible(known: list[int], full: st.SearchStrategy[int]) -> st.SearchStrategy[int]:
    """A value the owner knows (a real id, a stale one) about half the time, else anything in range.

    The draw is an index into `known`, never `known` itself: what the owner knows changes from one example
    to the next, and hypothesis needs the same choices to make the same kind of draw when it replays."""
    return st.one_of(st.integers(0, 63).map(lambda i: known[i % len(known)] if known else 0), full)


@dataclass
class _Cache:
    cache_id: int
    kind: str  # "pool", "pool_blocks", "registered_blocks"
    model_id: int | None = None  # the blocks key naming it, while it does
    req_ids: list[int] = field(default_factory=list)

    @property
    def tensor_nbytes(self) -> int:
        shape = BLOCKS_SHAPE if self.kind != "pool" else SLOT_SHAPE
        return shape[0] * shape[1] * 2


@dataclass
class _View:
    """What a hostile client could know about the owner, for drawing plausible ids."""

    pid: int
    cache_ids: list[int]
    model_ids: list[int]
    req_ids: list[int]
    lease_ids: list[int]
    segments: list[str]
    tensors: list[tuple[int, int]]  # (address in the owner, nbytes) of each live tensor
    caches: list[_Cache]  # live ones and a few the owner dropped
    held: list[int]  # leases the open hostile connections hold


@st.composite
def _offsets_within(draw: st.DrawFn, extent_nbytes: int) -> tuple[list[int], int]:
    """Offsets up to `extent_nbytes` and one length (the caller sizes the segment to hold them all)."""
    nbytes = draw(st.one_of(st.integers(1, 4096), st.integers(1, 2**40)))
    offsets = draw(st.lists(st.integers(0, extent_nbytes), min_size=1, max_size=4))
    return offsets, nbytes


@st.composite
def _segment_location(draw: st.DrawFn, v: _View, max_units: int, any_slot: bool) -> Location:
    """A Location shaped as a v1 grant: each tensor's units (1 to `max_units`, of any size up to 2**40
    bytes) anywhere up to 2**40 in a named segment that holds them; the key's slot any of them
    (`any_slot`: a pull of a key's slots) or 0 (a blocks pull's blocks)."""
    offsets, unit_nbytes = draw(_offsets_within(2**40))
    num_units = draw(st.integers(1, max_units))
    segment_nbytes = max(offsets) + unit_nbytes * num_units + draw(st.integers(0, 4096))
    return Location(
        draw(_U32),
        draw(_plausible(v.lease_ids, _U64)),
        draw(_plausible([v.pid], _U32)),
        draw(_plausible_name(v)),
        segment_nbytes,
        offsets,
        unit_nbytes,
        num_units,
        draw(st.integers(0, num_units - 1)) if any_slot else 0,
    )


@st.composite
def _write_grant(draw: st.DrawFn, v: _View) -> WriteGrant:
    segments = draw(st.lists(_plausible_name(v), min_size=1, max_size=3))
    segment_nbytes = draw(st.lists(_U64, min_size=len(segments), max_size=len(segments)))
    count = draw(st.integers(1, 4))
    range_segments = draw(st.lists(st.integers(0, len(segments) - 1), min_size=count, max_size=count))
    range_offsets = draw(st.lists(_U64, min_size=count, max_size=count))
    return WriteGrant(
        draw(_U32),
        draw(_plausible(v.lease_ids, _U64)),
        segments,
        segment_nbytes,
        range_segments,
        range_offsets,
    )


@st.composite
def _location(draw: st.DrawFn, v: _View) -> Location:
    num_units = draw(st.integers(1, 64))
    unit_nbytes = draw(st.integers(1, 2**20))
    bases = draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=4))
    segment = draw(st.one_of(st.just(""), _plausible_name(v)))
    segment_nbytes = max(bases) + unit_nbytes * num_units if segment else draw(_U64)
    return Location(
        draw(_U32),
        draw(_plausible(v.lease_ids, _U64)),
        draw(_plausible([v.pid], _U32)),
        segment,
        segment_nbytes,
        bases,
        unit_nbytes,
        num_units,
        draw(st.integers(0, num_units - 1)),
    )


@st.composite
def _table_entry(draw: st.DrawFn, v: _View) -> tuple[object, ...]:
    num_units = draw(st.integers(1, 64))
    unit_nbytes = draw(st.integers(1, 2**20))
    bases = draw(st.lists(st.integers(0, 2**40), min_size=1, max_size=3))
    segment = draw(st.one_of(st.just(""), _plausible_name(v)))
    segment_nbytes = max(bases) + unit_nbytes * num_units if segment else 0
    return (
        draw(_plausible(v.cache_ids, _U64)),
        draw(st.booleans()),
        draw(st.lists(_plausible(v.model_ids, _U64), max_size=3)),
        segment,
        segment_nbytes,
        bases,
        unit_nbytes,
        num_units,
        draw(_U32),
        draw(_U64_POS),
    )


@st.composite
def _table(draw: st.DrawFn, v: _View) -> Table:
    entries = draw(st.lists(_table_entry(v), max_size=3))
    return Table(
        draw(_U32), draw(_plausible([v.pid], _U32)), draw(_plausible_name(v)), entries, draw(_U64), draw(_U64)
    )


def _any_of(strategies: dict[type[Message], st.SearchStrategy[Message]]) -> st.SearchStrategy[Message]:
    """A message of any class in `strategies`, each class equally likely but for `_WEIGHTS`."""
    classes = [cls for cls in strategies for _ in range(_WEIGHTS.get(cls, 1))]
    return st.sampled_from(classes).flatmap(strategies.__getitem__)


def _plausible_name(v: _View) -> st.SearchStrategy[str]:
    known = v.segments
    return st.one_of(
        st.integers(0, 63).map(lambda i: known[i % len(known)] if known else "seg"), _SEGMENT_NAME
    )


@st.composite
def _write_request(draw: st.DrawFn, v: _View) -> WriteRequest:
    """Ranges inside, across and beside the owner's real tensors, or anywhere. Every choice is drawn
    whatever the owner has (see `_plausible`)."""
    addrs: list[int] = []
    lengths: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        real, index, where, span = draw(st.tuples(st.booleans(), _INDEX, _INDEX, _INDEX))
        anywhere = draw(st.tuples(_U64, _U64))
        if real and v.tensors:
            base, nbytes = v.tensors[index % len(v.tensors)]
            offset = where % (nbytes + 17) - 8  # from 8 bytes before the tensor to 8 past its end
            addrs.append(max(base + offset, 0))
            lengths.append(span % (nbytes - max(offset, 0) + 9) if span % 4 else anywhere[1])
        else:
            addrs.append(anywhere[0])
            lengths.append(anywhere[1])
    return WriteRequest(draw(_U32), addrs, lengths)


# Requests aimed at what the owner really has (a cache, its keys, its blocks model id, its tensors, a lease
# it granted): most of these are granted, so the programs hold, release and abandon real leases.


def _target(v: _View, index: int) -> _Cache:
    return v.caches[index % len(v.caches)] if v.caches else _Cache(0, "pool")


@st.composite
def _tensor_range(draw: st.DrawFn) -> tuple[int, int, bool]:
    """(tensor_start, tensor_count, whole) that fit the owner's caches."""
    if draw(st.booleans()):
        return 0, NUM_TENSORS, True
    start = draw(st.integers(0, NUM_TENSORS - 1))
    return start, draw(st.integers(1, NUM_TENSORS - start)), False


@st.composite
def _aimed_pull(draw: st.DrawFn, v: _View) -> PinRequest:
    """A v1 pull of a key: a slot of a real cache, some of its bytes."""
    cache = _target(v, draw(_INDEX))
    kind = draw(st.sampled_from([KEY_REQ, KEY_CACHE_ID, KEY_PREFIX]))
    slot = draw(st.integers(0, SLOT_SHAPE[0] - 1))
    start, count, whole = draw(_tensor_range())
    offset = draw(st.integers(0, 64))
    nbytes = 1 + draw(_INDEX) % (_SLOT_NBYTES - offset)
    key_id = cache.req_ids[slot] if kind != KEY_CACHE_ID and cache.req_ids else cache.cache_id
    return PinRequest(
        draw(_U32),
        kind,
        key_id,
        0,
        slot,
        start,
        count,
        whole,
        nbytes,
        offset,
        draw(st.booleans()),
        False,
        RULES_V1,
    )


@st.composite
def _aimed_blocks(draw: st.DrawFn, v: _View) -> PinRequest:
    """A v1 pin of a blocks cache by its blocks key."""
    model_id = _target(v, draw(_INDEX)).model_id or 0
    start, count, whole = draw(_tensor_range())
    return PinRequest(
        draw(_U32), KEY_BLOCKS, 0, model_id, 0, start, count, whole, 0, 0, False, False, RULES_V1
    )


@st.composite
def _aimed_v2(draw: st.DrawFn, v: _View) -> PinRequest:
    """A cache-manager (v2) pin of a real cache, to read from or write into."""
    cache = _target(v, draw(_INDEX))
    kind = draw(st.sampled_from([KEY_REQ, KEY_CACHE_ID, KEY_BLOCKS]))
    slot = draw(st.integers(0, SLOT_SHAPE[0] - 1))
    start, count, whole = draw(_tensor_range())
    key_id = cache.req_ids[slot] if kind == KEY_REQ and cache.req_ids else cache.cache_id
    for_write, consume = draw(st.booleans()), draw(st.booleans())
    return PinRequest(
        draw(_U32),
        kind,
        key_id,
        cache.model_id or 0,
        slot,
        start,
        count,
        whole,
        0,
        0,
        consume,
        for_write,
        RULES_V2,
    )


@st.composite
def _aimed_write(draw: st.DrawFn, v: _View) -> WriteRequest:
    addrs: list[int] = []
    lengths: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        index, where, span = draw(st.tuples(_INDEX, _INDEX, _INDEX))
        base, nbytes = v.tensors[index % len(v.tensors)] if v.tensors else (0, 1)
        offset = where % nbytes
        addrs.append(base + offset)
        lengths.append(1 + span % (nbytes - offset))
    return WriteRequest(draw(_U32), addrs, lengths)


def _held(v: _View) -> st.SearchStrategy[int]:
    known = v.held
    return st.integers(0, 63).map(lambda i: known[i % len(known)] if known else 0)


def _client_requests(v: _View) -> dict[type[Message], st.SearchStrategy[Message]]:
    """What a client may send once READY (the connection's own rules admit all of these)."""
    key_ids = _plausible(sorted(set(v.req_ids) | set(v.cache_ids)), _U64)
    model_ids = _plausible([0, *v.model_ids], _U64)
    leases = _plausible(v.lease_ids, _U64)
    random: dict[type[Message], st.SearchStrategy[Message]] = {
        # A PinRequest of each of its shapes (see `_WEIGHTS`), any ids and ranges.
        PinRequest: st.one_of(
            # A v1 pull of a key: nbytes and src_offset inside the slot, past its end, or anything.
            st.builds(
                PinRequest,
                _U32,
                st.sampled_from([KEY_REQ, KEY_PREFIX, KEY_CACHE_ID]),
                key_ids,
                model_ids,
                _SMALL_U32,
                _SMALL_U32,
                _COUNT,
                st.booleans(),
                st.one_of(st.integers(1, _SLOT_NBYTES + 1), _U64_POS),
                st.one_of(st.integers(0, _SLOT_NBYTES), _U64),
                st.booleans(),
                st.just(False),
                st.just(RULES_V1),
            ),
            # A v1 blocks pin (key_id, batch_index and consume mean nothing to it: any value).
            st.builds(
                PinRequest,
                _U32,
                st.just(KEY_BLOCKS),
                key_ids,
                model_ids,
                _SMALL_U32,
                _SMALL_U32,
                _COUNT,
                st.booleans(),
                st.just(0),
                st.just(0),
                st.booleans(),
                st.just(False),
                st.just(RULES_V1),
            ),
            # A v2 pin of any key kind, to read or to write.
            st.builds(
                PinRequest,
                _U32,
                st.sampled_from([KEY_REQ, KEY_PREFIX, KEY_CACHE_ID, KEY_BLOCKS]),
                key_ids,
                model_ids,
                _SMALL_U32,
                _SMALL_U32,
                _COUNT,
                st.booleans(),
                st.just(0),
                st.just(0),
                st.booleans(),
                st.booleans(),
                st.just(RULES_V2),
            ),
        ),
        WriteRequest: _write_request(v),
        TableRequest: st.builds(TableRequest, _U32, _plausible([0, 1, *v.cache_ids], _U64)),
        Release: st.builds(Release, leases, st.booleans()),
        Announce: st.builds(Announce, _U32, _CALLBACK, st.integers(0, 65535)),
        Ping: st.builds(Ping, _U32),
        # A HIXL engine's notify: an owner that is no HIXL engine keeps none (Error), and nothing else.
        Notify: st.builds(Notify, _U32, st.text(max_size=16), st.text(max_size=16)),
        # Over a Unix socket a peer maps segments itself: the owner refuses to say where they are.
        AddressRequest: st.builds(AddressRequest, _U32, st.lists(_plausible_name(v), min_size=1, max_size=4)),
    }
    aimed: dict[type[Message], st.SearchStrategy[Message]] = {
        PinRequest: st.one_of(_aimed_pull(v), _aimed_blocks(v), _aimed_v2(v)),
        WriteRequest: _aimed_write(v),
        Release: st.builds(Release, _held(v), st.booleans()),
    }
    return {
        cls: st.one_of(aimed[cls], strategy) if cls in aimed else strategy for cls, strategy in random.items()
    }


def _hello(v: _View) -> st.SearchStrategy[Hello]:
    return st.builds(
        Hello,
        _plausible([PROTOCOL_VERSION], _U32),
        _U64,
        _plausible([P], _U64),
        _ROLE,
        _plausible([_MY_PID], _U32),
        _U64,
        # What only a TCP peer sends; a Unix peer sending any of it is refused.
        st.one_of(st.just(b""), st.binary(min_size=16, max_size=64)),
        st.one_of(st.just(b""), st.binary(min_size=32, max_size=32)),
        st.sampled_from(["", "10.0.0.1:15000"]),
    )


def _every_message(v: _View) -> dict[type[Message], st.SearchStrategy[Message]]:
    """A strategy for each class in MESSAGE_TYPES, whichever direction it normally travels."""
    strategies: dict[type[Message], st.SearchStrategy[Message]] = {
        **_client_requests(v),
        Hello: _hello(v),
        Bye: st.builds(Bye, _TEXT),
        Welcome: st.builds(Welcome, _U32, _U64, _ROLE, _plausible([v.pid], _U32), _U64),
        WriteGrant: _write_grant(v),
        Location: st.one_of(_location(v), _segment_location(v, 4, True), _segment_location(v, 1024, False)),
        Table: _table(v),
        Ack: st.builds(Ack, _U32),
        Pong: st.builds(Pong, _U32),
        Error: st.builds(Error, _U32, _I64, _TEXT),
        Challenge: st.builds(Challenge, _U32, st.binary(min_size=16, max_size=64)),
        Addresses: st.builds(Addresses, _U32, st.lists(_U64, min_size=1, max_size=4)),
    }
    assert set(strategies) == set(MESSAGE_TYPES.values()), "a message type has no strategy"
    return strategies


_WRONG_VALUES = [None, 1.5, {"k": 1}, b"\x00", [[]]]


@st.composite
def _malformed_frame(draw: st.DrawFn, v: _View) -> tuple[bytes, bool]:
    """Bytes that break the protocol, and whether the sender must also end its side (a truncated frame
    is only an error once EOF arrives)."""
    kind = draw(
        st.sampled_from(
            ["field", "arity", "type", "shape", "header", "msgpack", "nil", "ext", "truncated", "bytes"]
        )
    )
    strategies = _every_message(v)
    msg = draw(_any_of(strategies))
    wire = msg.to_wire()
    if kind == "field":
        wire[draw(st.integers(1, len(wire) - 1))] = draw(st.sampled_from(_WRONG_VALUES))
    elif kind == "arity":
        wire = wire[:-1] if draw(st.booleans()) else [*wire, 0]
    elif kind == "type":
        wire[0] = draw(st.sampled_from([0, 21, 255, -1, 2**64 - 1, "1", None, True, 1.0]))
    elif kind == "shape":
        return encode_frame(draw(st.sampled_from([[], 3, "Ping", {"0": 9}, [[9, 1]]]))), False
    elif kind == "header":
        return struct.pack("!I", draw(st.integers(DEFAULT_MAX_FRAME_NBYTES + 1, 2**32 - 1))), False
    elif kind == "msgpack":
        return struct.pack("!I", 2) + b"\x91\xc1", False  # 0xc1 is never used by msgpack
    elif kind == "nil":
        return encode_frame(None), False
    elif kind == "ext":
        return encode_frame([9, msgpack.ExtType(1, b"x")]), False
    elif kind == "truncated":
        frame = encode_frame(wire)
        return frame[: 1 + draw(_INDEX) % (len(frame) - 1)], True
    else:
        return draw(st.binary(min_size=1, max_size=200)), True
    return encode_frame(wire), False


raw_payloads = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda obj: encode_frame(obj),
        st.recursive(
            st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=20),
            lambda inner: st.lists(inner, max_size=5),
            max_leaves=12,
        ),
    ),
    st.builds(lambda n: struct.pack("!I", n), st.integers(0, 2**32 - 1)),
)


# ---------------------------------------------------------------------------- a hand-driven connection


class _Conn:
    """A raw client socket that speaks frames by hand, so it can send what a ClientLink never would.
    `where` is the owner's Unix socket, or its TCP (ip, port): a TCP server speaks first, with the
    Challenge whose nonce a Hello must prove the secret for (`challenge`), and every frame after the Hello
    carries its tag (`frames` adds them; the owner's after its Welcome are checked). `held` is the leases
    the owner granted it and it has not released."""

    def __init__(self, where: str | tuple[str, int]) -> None:
        self.decoder = FrameDecoder()
        self.held: set[int] = set()
        self.challenge = b""
        self._tagger: FrameTagger | None = None
        self._welcome_checker: FrameTagger | None = None
        if not isinstance(where, str):
            self.sock = socket.create_connection(where, timeout=_WAIT_S)
            challenge = self.receive()
            assert isinstance(challenge, Challenge) and challenge.version == PROTOCOL_VERSION, challenge
            self.challenge = challenge.nonce
            return
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(_WAIT_S)
        deadline = time.monotonic() + _WAIT_S
        while True:
            try:
                self.sock.connect(where)
                break
            except BlockingIOError:
                # A Unix socket's listen backlog is full (a flood): wait for the owner to accept.
                if time.monotonic() > deadline:
                    self.sock.close()
                    raise
                time.sleep(0.001)

    def send(self, data: bytes) -> None:
        # The owner may already have closed this connection (and said why in its log): not our failure.
        with contextlib.suppress(OSError):
            self.sock.sendall(data)

    def send_hello(self, hello: Hello) -> None:
        """Send `hello` (any fields); over TCP, key the frame tags from it as a real client does."""
        self.send(encode_frame(hello.to_wire()))
        if self.challenge:
            keys = derive_frame_keys(SECRET.encode(), self.challenge, hello.nonce)
            self._tagger, self._welcome_checker = keys.taggers(client=True)

    def frames(self, *frames: bytes) -> bytes:
        """`frames` (whole frames, or whatever bytes stand for one) as sent after the Hello: each followed by
        its tag over TCP, as they are over a Unix socket."""
        tagger = self._tagger
        if tagger is None:
            return b"".join(frames)
        return b"".join(frame + tagger.tag(frame) for frame in frames)

    def receive(self) -> Message | None:
        """The owner's next message; None once it closed the connection (at a frame boundary)."""
        while True:
            payload = self.decoder.next_frame()
            if payload is not None:
                msg = decode_message(payload)
                if isinstance(msg, Welcome) and self._welcome_checker is not None:
                    self.decoder.expect_tags(self._welcome_checker)  # the owner tags what follows
                return msg
            try:
                data = self.sock.recv(65536)
            except ConnectionResetError:
                data = b""
            except TimeoutError:
                raise AssertionError(f"the owner neither answered nor closed within {_WAIT_S} s") from None
            if not data:
                assert self.decoder.buffered_nbytes == 0, "the owner closed inside a frame"
                return None
            self.decoder.feed(data)

    def expect_close(self, after: str) -> None:
        reply = self.receive()
        assert reply is None, f"the owner answered {reply!r} to {after} instead of closing the connection"

    def drain_until_closed(self) -> None:
        """Read (and ignore) whatever comes until the owner closes the connection."""
        deadline = time.monotonic() + _WAIT_S
        while True:
            assert time.monotonic() < deadline, "the owner never closed the connection"
            try:
                if not self.sock.recv(65536):
                    return
            except ConnectionResetError:
                return
            except TimeoutError:
                raise AssertionError("the owner never closed the connection") from None

    def close(self) -> None:
        self.sock.close()


def _hello_ok(hello: Hello, challenge: bytes) -> bool:
    """Whether the owner welcomes `hello`, sent on a Unix socket (`challenge` empty) or on TCP after that
    Challenge."""
    if hello.version != PROTOCOL_VERSION or hello.remote_cluster_id != P:
        return False
    if not challenge:
        # A proof or an engine address belongs on TCP only: over a Unix socket either is refused.
        return hello.pid == _MY_PID and not (hello.nonce or hello.proof or hello.engine)
    # Over TCP the pid is only what the peer claims; it proves the secret and names its engine.
    return bool(hello.nonce) and bool(hello.engine) and hello.proof == _proof(challenge, hello)


def _proof(challenge: bytes, hello: Hello) -> bytes:
    """The proof of the secret a TCP owner expects in `hello`, sent after `challenge`."""
    client = (hello.cluster_id, hello.incarnation, hello.engine)
    return _auth.client_proof(SECRET.encode(), challenge, hello.nonce, client, hello.remote_cluster_id)


def _signed(challenge: bytes, hello: Hello) -> Hello:
    """`hello` with the proof of the secret for `challenge` (over a Unix socket: `hello` as it is)."""
    return replace(hello, proof=_proof(challenge, hello)) if challenge else hello


# ---------------------------------------------------------------------------- the owner and its model


class _Owner:
    """The Prompt under attack, what the test knows of it, its hostile connections and a legitimate
    decoder linked to it. Every check of the owner's state goes through here."""

    def __init__(
        self, peer: PromptPeer, dd: LLMDataDist, path: Path, *, v2: bool, tcp: tuple[str, int] | None = None
    ) -> None:
        self.peer = peer
        self.dd = dd
        self.path = os.fspath(path)
        # Where the hostile connections go: the Unix socket, or the TCP port a peer on another host uses.
        self.where: str | tuple[str, int] = tcp or self.path
        self.v2 = v2
        self.live: dict[int, _Cache] = {}
        self.gone: list[int] = []
        self.dropped: list[_Cache] = []
        self.model_ids: list[int] = []
        self.req_ids: list[int] = []
        self.seen_leases: set[int] = set()
        self.segments: list[str] = []
        self.tensors: list[tuple[int, int]] = []
        self.tensors_of: dict[int, list[tuple[int, int]]] = {}
        self.conns: list[_Conn] = []
        self.sent: Counter[str] = Counter()
        self.answers: Counter[str] = Counter()  # what the owner answered, by type (Error by status code)
        self.trail: deque[str] = deque(maxlen=6)  # the latest exchanges, for a failure's message
        self._next_id = 100
        self.probe = ClientLink.connect(
            path, cluster_id=88, remote_cluster_id=P, role=2, deadline=time.monotonic() + _WAIT_S
        )
        if v2:
            manager = dd.cache_manager
            self.local = manager.allocate_cache(
                CacheDesc(NUM_TENSORS, [1, SLOT_SHAPE[1]], DataType.DT_FLOAT16)
            )
            self.local_blocks = manager.allocate_blocks_cache(
                CacheDesc(NUM_TENSORS, BLOCKS_SHAPE, DataType.DT_FLOAT16), None
            )
        else:
            kvm = dd.kv_cache_manager
            self.local = kvm.allocate_cache(CacheDesc(NUM_TENSORS, [1, SLOT_SHAPE[1]], DataType.DT_FLOAT16))
            self.local_blocks = kvm.allocate_blocks_cache(
                CacheDesc(NUM_TENSORS, BLOCKS_SHAPE, DataType.DT_FLOAT16)
            )

    def close(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns.clear()
        self.probe.close(say_bye=True)

    def fresh_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def view(self) -> _View:
        leases = {lease for conn in self.conns for lease in conn.held} | self.seen_leases
        recent = max(self.seen_leases, default=0)
        return _View(
            pid=self.peer.pid,
            cache_ids=sorted({*self.live, *self.gone[-8:]}),
            model_ids=self.model_ids[-8:],
            req_ids=self.req_ids[-8:],
            lease_ids=sorted(leases | {recent + 1, recent + 2})[-16:],
            segments=self.segments,
            tensors=self.tensors,
            caches=[*self.live.values(), *self.dropped[-4:]],
            held=sorted(lease for conn in self.conns for lease in conn.held),
        )

    # ------------------------------------------------------------ what the owner does to its caches

    def owner_op(self, op: str, pick: int) -> None:
        """One cache operation of the owner; `pick` chooses which cache when it needs one."""
        self.sent[f"owner {op}"] += 1
        self.trail.append(f"owner {op}")
        kinds = {"unregister": ["registered_blocks"], "dealloc": ["pool", "pool_blocks"]}
        if op == "remove_key":
            if self.req_ids:
                self.peer.call("remove_key", (P, self.req_ids[pick % len(self.req_ids)]))
            return
        if op in kinds:
            candidates = sorted(c for c, cache in self.live.items() if cache.kind in kinds[op])
            if not candidates:
                return
            cache = self.live[candidates[pick % len(candidates)]]
            if op == "unregister":
                self._unregister(cache)
            else:
                command = "dealloc" if cache.kind == "pool" or not self.v2 else "v2_dealloc_blocks"
                self.peer.call(command, cache.cache_id)
                self._forget(cache)
        elif len(self.live) >= MAX_LIVE_CACHES:
            return
        elif op == "register":
            model_id = self.fresh_id()
            cache_id = self.peer.call("v2_register_blocks", (NUM_TENSORS, BLOCKS_SHAPE, model_id, True))
            self._add(_Cache(cache_id, "registered_blocks", model_id))
        elif op == "alloc":
            req_ids = [self.fresh_id(), self.fresh_id()]
            keys = [(P, req_id) for req_id in req_ids]
            if self.v2:
                cache_id = self.peer.call("v2_alloc", (NUM_TENSORS, SLOT_SHAPE, keys, None))
            else:
                cache_id = self.peer.alloc(NUM_TENSORS, SLOT_SHAPE, keys)
            self._add(_Cache(cache_id, "pool", req_ids=req_ids))
        else:
            assert op == "alloc_blocks", op
            model_id = self.fresh_id()
            if self.v2:
                cache_id = self.peer.call("v2_alloc", (NUM_TENSORS, BLOCKS_SHAPE, [], model_id))
            else:
                cache_id = self.peer.alloc_blocks(NUM_TENSORS, BLOCKS_SHAPE, model_id)
            self._add(_Cache(cache_id, "pool_blocks", model_id))
        self.refresh()

    def _unregister(self, cache: _Cache) -> None:
        try:
            self.peer.call("v2_unregister", cache.cache_id)
        except RuntimeError as exc:
            # It waits for the leases on the cache, up to the owner's sync timeout, then gives up with
            # its keys removed: legitimate only while a hostile connection holds a lease.
            assert "LLM_TIMEOUT" in str(exc) or "pinned" in str(exc), exc
            assert any(conn.held for conn in self.conns), f"unregister failed with no lease held: {exc}"
            self.sent["owner unregister timed out"] += 1
            cache.model_id = None
            return
        self._forget(cache)

    def _add(self, cache: _Cache) -> None:
        self.live[cache.cache_id] = cache
        if cache.model_id is not None:
            self.model_ids.append(cache.model_id)
        self.req_ids.extend(cache.req_ids)

    def _forget(self, cache: _Cache) -> None:
        del self.live[cache.cache_id]
        self.gone.append(cache.cache_id)
        self.dropped.append(cache)

    # ------------------------------------------------------------ what the owner serves

    def table(self) -> list[tuple[Any, ...]]:
        """The owner's whole table, over the legitimate probe link."""
        entries: list[tuple[Any, ...]] = []
        start = 1
        while True:
            seq = self.probe.next_seq()
            page = self.probe.request(TableRequest(seq, start), seq, time.monotonic() + _WAIT_S)
            assert isinstance(page, Table) and page.pid == self.peer.pid, page
            entries.extend(page.entries)
            if page.next_cache_id == 0:
                return entries
            start = page.next_cache_id

    def refresh(self) -> list[tuple[Any, ...]]:
        """Learn the owner's segments and tensor addresses (what a same-uid process can see in /proc), and
        check its table lists exactly the caches the test believes live."""
        entries = self.table()
        assert sorted(entry[0] for entry in entries) == sorted(self.live), (entries, self.live)
        bases = _mapped_segments(self.peer.pid)
        self.segments = sorted({entry[3] for entry in entries if entry[3]})
        self.tensors = []
        self.tensors_of = {}
        for cache_id, _, model_ids, segment, _, tensor_bases, unit_nbytes, num_units, _, _ in entries:
            cache = self.live[cache_id]
            assert list(model_ids) == ([cache.model_id] if cache.model_id is not None else []), entries
            origin = bases.get(segment.lstrip("/"), 0) if segment else 0
            self.tensors_of[cache_id] = [(origin + base, unit_nbytes * num_units) for base in tensor_bases]
            self.tensors.extend(self.tensors_of[cache_id])
        return entries

    def connect(self) -> _Conn:
        """A new connection that completed a valid handshake."""
        conn = _Conn(self.where)
        hello = Hello(PROTOCOL_VERSION, 66, P, 2, _MY_PID, 66)
        if conn.challenge:
            hello = _signed(conn.challenge, replace(hello, nonce=b"c" * 32, engine="127.0.0.1:1"))
        conn.send_hello(hello)
        welcome = conn.receive()
        assert isinstance(welcome, Welcome) and welcome.pid == self.peer.pid, welcome
        self.conns.append(conn)
        return conn

    def exchange(self, conn: _Conn, messages: list[Message]) -> None:
        """Send `messages` in one write and check each answer (or the close) against the protocol and the
        leases `conn` holds."""
        conn.send(conn.frames(*(encode_frame(m.to_wire()) for m in messages)))
        for msg in messages:
            self.sent[type(msg).__name__] += 1
            if isinstance(msg, Release):
                conn.held.discard(msg.lease_id)  # one way: only a lease of this connection ends
                continue
            if type(msg) not in _REPLY_TO:
                # Bye, a second Hello, or a message only the server may send: the owner hangs up, and
                # whatever followed it is never read.
                conn.expect_close(after=repr(msg))
                self.drop(conn)
                return
            reply = conn.receive()
            self.trail.append(f"{msg!r} -> {reply!r}")
            assert reply is not None, f"the owner closed the connection on a well-formed {msg!r}"
            self._check_reply(conn, msg, reply)

    def _check_reply(self, conn: _Conn, msg: Message, reply: Message) -> None:
        name = type(reply).__name__
        if isinstance(reply, Error):
            name = f"Error({_STATUS_NAMES.get(reply.status_code, reply.status_code)})"
        self.answers[f"{type(msg).__name__}->{name}"] += 1
        assert getattr(reply, "seq", None) == getattr(msg, "seq", None), (msg, reply)
        if isinstance(reply, Error):
            assert not isinstance(msg, _NEVER_REFUSED), (msg, reply)
            assert reply.status_code in _STATUS_NAMES, reply
            assert reply.status_code != LLMStatusCode.LLM_SUCCESS, reply
            return
        assert isinstance(reply, _REPLY_TO[type(msg)]), (msg, reply)
        if isinstance(reply, _GRANTS):
            assert reply.lease_id not in self.seen_leases, f"lease {reply.lease_id} granted twice"
            self.seen_leases.add(reply.lease_id)
            conn.held.add(reply.lease_id)
        if isinstance(reply, Location):
            assert reply.pid == self.peer.pid, reply
        if isinstance(msg, PinRequest) and isinstance(reply, Location):
            # What the pulling client checks a grant against: one base per tensor asked for; v1 reaches
            # pool memory only, and a v1 pull of a key reads its bytes inside the granted slot.
            assert len(reply.tensor_bases) == msg.tensor_count, (msg, reply)
            if msg.rules == RULES_V1:
                assert reply.segment, (msg, reply)
                if msg.key_kind != KEY_BLOCKS:
                    assert msg.src_offset + msg.nbytes <= reply.unit_nbytes, (msg, reply)
        if isinstance(reply, Table) and isinstance(msg, TableRequest):
            ids = [entry[0] for entry in reply.entries]
            assert ids == sorted(ids) and all(i >= msg.start_cache_id for i in ids), reply
            assert set(ids) <= set(self.live), (ids, self.live)

    def drop(self, conn: _Conn) -> None:
        conn.close()
        self.conns.remove(conn)

    def sync(self) -> None:
        """Every open hostile connection is still served, and the owner holds exactly their leases."""
        for conn in self.conns:
            conn.send(conn.frames(encode_frame(Ping(7).to_wire())))
            assert conn.receive() == Pong(7)
        self.settle_leases(sum(len(conn.held) for conn in self.conns))

    def settle_leases(self, expected: int) -> None:
        # A connection's leases end when the owner sees it close, which it does on its own time.
        deadline = time.monotonic() + _WAIT_S
        while True:
            leases = self.peer.call("stats")["leases"]
            if leases == expected:
                return
            trail = "\n  ".join(self.trail)
            assert time.monotonic() < deadline, (
                f"the owner holds {leases} leases, the open connections {expected}; "
                f"latest exchanges:\n  {trail}"
            )
            time.sleep(0.005)

    # ------------------------------------------------------------ the legitimate side

    def check_served_and_untouched(self, pick: int) -> None:
        """A legitimate link still works, and every live cache holds exactly what the owner wrote."""
        seq = self.probe.next_seq()
        assert self.probe.request(Ping(seq), seq, time.monotonic() + _WAIT_S) == Pong(seq)
        entries = self.refresh()
        with contextlib.ExitStack() as stack:
            shm: dict[str, Any] = {}  # the owner's segments, read as files (what a same-uid process can)
            for cache_id, _, _, segment, _, bases, unit_nbytes, num_units, _, _ in entries:
                for t in range(NUM_TENSORS):
                    expected = self.peer.expected(cache_id, t, unit_nbytes * num_units)
                    if segment:
                        name = segment.lstrip("/")
                        if name not in shm:
                            shm[name] = stack.enter_context(open(f"/dev/shm/{name}", "rb"))
                        shm[name].seek(bases[t])
                        got = np.frombuffer(shm[name].read(expected.nbytes), dtype=np.uint8)
                    else:  # registered memory: ask its owner
                        got = np.frombuffer(self.peer.call("v2_bytes", (cache_id, t)), dtype=np.uint8)
                    np.testing.assert_array_equal(got, expected, err_msg=f"cache {cache_id} tensor {t}")
        self._legitimate_pulls(pick)

    def _legitimate_pulls(self, pick: int) -> None:
        """One slot pull and one block pull through the public API (each takes and releases a lease)."""
        slots = sorted(c for c, cache in self.live.items() if cache.kind == "pool")
        blocks = sorted(c for c, cache in self.live.items() if cache.model_id is not None)
        views = tensor_views_v2 if self.v2 else _v1_views
        manager: Any = self.dd.cache_manager if self.v2 else self.dd.kv_cache_manager
        if slots:
            cache_id, slot = slots[pick % len(slots)], pick % SLOT_SHAPE[0]
            manager.pull_cache(CacheKeyByIdAndIndex(P, cache_id, slot), self.local)
            for t, got in enumerate(views(self.local)):
                whole = self.peer.expected(cache_id, t, _SLOT_NBYTES * SLOT_SHAPE[0])
                np.testing.assert_array_equal(got, whole[slot * _SLOT_NBYTES : (slot + 1) * _SLOT_NBYTES])
        if blocks:
            cache = self.live[blocks[pick % len(blocks)]]
            assert cache.model_id is not None
            src, dst = pick % BLOCKS_SHAPE[0], (pick // 3) % BLOCKS_SHAPE[0]
            manager.pull_blocks(BlocksCacheKey(P, cache.model_id), self.local_blocks, [src], [dst])
            for t, got in enumerate(views(self.local_blocks)):
                whole = self.peer.expected(cache.cache_id, t, cache.tensor_nbytes)
                np.testing.assert_array_equal(
                    got.reshape(BLOCKS_SHAPE[0], -1)[dst], whole.reshape(BLOCKS_SHAPE[0], -1)[src]
                )
        self.settle_leases(0)


def _v1_views(cache: Any) -> list[np.ndarray]:
    return [view.view(np.uint8).reshape(-1) for view in tensor_views(cache)]


def _mapped_segments(pid: int) -> dict[str, int]:
    """Shared-memory segment name -> the address process `pid` maps it at."""
    bases: dict[str, int] = {}
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if "/dev/shm/" in line:
                start = int(line.split("-", 1)[0], 16)
                name = line.split("/dev/shm/", 1)[1].split()[0]
                bases.setdefault(name, start)
    return bases


# ---------------------------------------------------------------------------- one program per example

_ACTIONS = ["request"] * 4 + ["any"] * 3 + ["malformed", "connect", "vanish", "owner", "owner"]


class _Shown:
    """How a drawn message appears in hypothesis's report of a failing program: its own short repr."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


def _draw_messages(data: st.DataObject, strategy: st.SearchStrategy[Any], label: str) -> Any:
    return data.draw(strategy.map(_Shown), label=label).value


def _run_program(owner: _Owner, data: st.DataObject) -> None:
    """A short program of hostile actions, each followed by the owner's invariants."""
    ops = ["register", "unregister", "alloc", "alloc_blocks", "dealloc", "remove_key"]
    if not owner.v2:
        ops = ["alloc", "alloc_blocks", "dealloc", "remove_key"]
    for _ in range(data.draw(st.integers(1, 8), label="steps")):
        action = data.draw(st.sampled_from(_ACTIONS), label="action")
        if action == "owner":
            owner.owner_op(data.draw(st.sampled_from(ops), label="op"), data.draw(st.integers(0, 99)))
        elif action == "connect":
            _hostile_connect(owner, data)
        elif action == "vanish":
            if owner.conns:
                _vanish(owner, owner.conns[data.draw(_INDEX) % len(owner.conns)], data)
        else:
            conn = owner.conns[data.draw(_INDEX) % len(owner.conns)] if owner.conns else owner.connect()
            v = owner.view()
            if action == "request":
                strategies = _client_requests(v)
                pick = _any_of(strategies)
                owner.exchange(conn, _draw_messages(data, st.lists(pick, min_size=1, max_size=4), "requests"))
            elif action == "any":
                every = _every_message(v)
                msg = _draw_messages(data, _any_of(every), "any")
                owner.exchange(conn, [msg])
            else:
                _malformed(owner, conn, data, v)
        owner.sync()
    # The hostile connections go, however they go; then nothing of theirs may stay pinned.
    for conn in list(owner.conns):
        _vanish(owner, conn, data)
    owner.settle_leases(0)
    owner.check_served_and_untouched(data.draw(st.integers(0, 99), label="pick"))


def _malformed(owner: _Owner, conn: _Conn, data: st.DataObject, v: _View) -> None:
    frame, then_eof = data.draw(_malformed_frame(v), label="malformed")
    ping_first = data.draw(st.booleans())
    owner.sent["malformed"] += 1
    # Valid requests in the same write are answered before the bad frame ends the connection.
    pings = [encode_frame(Ping(3).to_wire())] if ping_first else []
    # Over TCP, the bad frame behind a good tag (the owner parses it) or a tag that is wrong.
    if conn.challenge and data.draw(st.booleans(), label="wrong tag"):
        conn.send(conn.frames(*pings) + frame + bytes(16))
    else:
        conn.send(conn.frames(*pings, frame))
    if then_eof:
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_WR)
        conn.drain_until_closed()
    else:
        # The Ping's answer may be lost: a bad frame drops the connection with whatever replies to the
        # same read were still unsent (the connection is dead; nothing else was in flight).
        reply = conn.receive() if ping_first else None
        if reply is not None:
            assert reply == Pong(3), reply
            conn.expect_close(after=f"malformed frame {frame[:40]!r}")
    owner.drop(conn)


def _hostile_connect(owner: _Owner, data: st.DataObject) -> None:
    """A new connection whose first bytes are a Hello with any fields, another message, or garbage."""
    first = data.draw(st.sampled_from(["hello", "hello", "message", "garbage", "nothing"]), label="first")
    if first == "hello":
        hello = _draw_messages(data, _hello(owner.view()), "hello")
        conn = _Conn(owner.where)
        if conn.challenge and data.draw(st.booleans(), label="knows the secret"):
            if data.draw(st.booleans(), label="sends a nonce and an engine"):
                hello = replace(hello, nonce=hello.nonce or b"n" * 32, engine=hello.engine or "127.0.0.1:1")
            hello = _signed(conn.challenge, hello)
        owner.sent["Hello"] += 1
        conn.send_hello(hello)
        reply = conn.receive()
        owner.answers[f"Hello->{type(reply).__name__}"] += 1
        if _hello_ok(hello, conn.challenge):
            assert isinstance(reply, Welcome) and reply.version == PROTOCOL_VERSION, (hello, reply)
            assert reply.cluster_id == P and reply.pid == owner.peer.pid, reply
            owner.conns.append(conn)
            return
        assert isinstance(reply, Error) and reply.status_code == LLMStatusCode.LLM_LINK_FAILED, (hello, reply)
        assert reply.seq == 0, reply
        conn.expect_close(after=f"refusing {hello!r}")
        conn.close()
    elif first == "message":
        every = _every_message(owner.view())
        del every[Hello]
        msg = _draw_messages(data, _any_of(every), "before hello")
        conn = _Conn(owner.where)
        owner.sent[type(msg).__name__] += 1
        conn.send(encode_frame(msg.to_wire()))
        conn.expect_close(after=f"{msg!r} before any Hello")
        conn.close()
    elif first == "garbage":
        payloads = data.draw(st.lists(raw_payloads, min_size=1, max_size=3), label="garbage")
        conn = _Conn(owner.where)
        owner.sent["garbage"] += 1
        conn.send(b"".join(payloads))
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_WR)
        conn.drain_until_closed()
        conn.close()
    else:
        _Conn(owner.where).close()


def _vanish(owner: _Owner, conn: _Conn, data: st.DataObject) -> None:
    """Close a connection the way a peer might: politely, abruptly, or in the middle of a frame."""
    how = data.draw(st.sampled_from(["close", "bye", "half frame", "shutdown"]), label="vanish")
    if how == "bye":
        conn.send(conn.frames(encode_frame(Bye("done").to_wire())))
    elif how == "half frame":
        conn.send(encode_frame(Ping(1).to_wire())[:5])
    elif how == "shutdown":
        with contextlib.suppress(OSError):
            conn.sock.shutdown(socket.SHUT_RDWR)
    owner.drop(conn)


def _fuzz_owner(owner: _Owner, seed: int, max_examples: int) -> None:
    owner.refresh()
    _one_of_each(owner)
    tried = {"examples": 0}

    @hypothesis_seed(seed)
    # No shrinking: the owner's state carries from one example to the next, so a shrunk replay would not
    # meet the same owner; the failing program is printed whole (at most 8 steps) with the seed.
    @settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        phases=(Phase.explicit, Phase.generate),
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def program(data: st.DataObject) -> None:
        tried["examples"] += 1
        owner.trail.clear()
        try:
            _run_program(owner, data)
        finally:
            for conn in owner.conns:
                conn.close()
            owner.conns.clear()

    program()
    missing = {cls.__name__ for cls in MESSAGE_TYPES.values()} - set(owner.sent)
    assert not missing, f"never sent: {missing}"
    print(f"owner pid {owner.peer.pid}: {tried['examples']} programs")
    print(f"sent: {dict(sorted(owner.sent.items()))}")
    print(f"answers: {dict(sorted(owner.answers.items()))}")


def _one_of_each(owner: _Owner) -> None:
    """Every message type once, deterministically, before the random programs: the requests with real ids
    (granted), then each message a client must not send, on a connection that holds a lease."""
    cache = next(c for c in owner.live.values() if c.kind == "pool")
    blocks = next(c for c in owner.live.values() if c.kind == "pool_blocks")
    assert blocks.model_id is not None
    addr, _ = owner.tensors_of[cache.cache_id][1]
    conn = owner.connect()
    owner.exchange(
        conn,
        [
            Announce(1, "cb.sock"),
            Ping(2),
            TableRequest(3, 1),
            PinRequest(
                4,
                KEY_REQ,
                cache.req_ids[0],
                0,
                0,
                0,
                NUM_TENSORS,
                True,
                _SLOT_NBYTES,
                0,
                True,
                False,
                RULES_V1,
            ),
            PinRequest(
                5, KEY_BLOCKS, 0, blocks.model_id, 0, 0, NUM_TENSORS, True, 0, 0, False, False, RULES_V1
            ),
            PinRequest(
                6, KEY_CACHE_ID, cache.cache_id, 0, 1, 0, NUM_TENSORS, True, 0, 0, False, False, RULES_V2
            ),
            WriteRequest(7, [addr + 5], [16]),
            # Refused on the Unix socket (a peer on this host maps segments itself), answered over TCP.
            AddressRequest(10, [owner.segments[0]]),
        ],
    )
    assert len(conn.held) == 4, "a request with real ids was refused"
    granted = sorted(conn.held)
    owner.exchange(conn, [Release(granted[0], False), Release(granted[1], True), Ping(9)])
    owner.sync()
    assert len(conn.held) == 2
    seg = owner.segments[0]
    entry = (1, False, [], seg, 64, [0], 8, 8, 0, 1)
    not_for_a_server: list[Message] = [
        Hello(PROTOCOL_VERSION, 66, P, 2, _MY_PID, 66),
        Welcome(PROTOCOL_VERSION, 66, 2, _MY_PID, 66),
        Location(1, granted[2], owner.peer.pid, seg, 64, [0], 64, 1, 0),  # as a v1 key pull's grant
        Location(1, granted[2], owner.peer.pid, seg, 64, [0], 8, 8, 0),  # as a v1 blocks pull's
        WriteGrant(1, granted[2], [seg], [64], [0], [0]),
        Location(1, granted[2], owner.peer.pid, "", 0, [0], 8, 8, 0),  # registered memory
        Table(1, owner.peer.pid, seg, [entry], 0, 1),
        Ack(1),
        Error(1, -1, "no"),
        Pong(1),
        Challenge(PROTOCOL_VERSION, b"n" * 32),
        Addresses(1, [4096]),
        Bye("bye"),
    ]
    for msg in not_for_a_server:
        holder = owner.connect()
        owner.exchange(
            holder,
            [PinRequest(1, KEY_CACHE_ID, cache.cache_id, 0, 0, 0, 1, False, 8, 0, False, False, RULES_V1)],
        )
        assert holder.held
        owner.sync()
        owner.exchange(holder, [msg])  # the owner hangs up, and the lease goes with the connection
        owner.sync()
    owner.exchange(conn, [Bye("done")])
    owner.settle_leases(0)
    if owner.v2:
        # The owner unregisters memory a peer holds a lease on: it waits, gives up (keys gone, the cache
        # still registered), and the peer's Release then ends the lease normally.
        registered = owner.live[
            min(c for c, cache in owner.live.items() if cache.kind == "registered_blocks")
        ]
        assert registered.model_id is not None
        holder = owner.connect()
        pin = PinRequest(
            1, KEY_BLOCKS, 0, registered.model_id, 0, 0, NUM_TENSORS, True, 0, 0, False, False, RULES_V2
        )
        owner.exchange(holder, [pin])
        assert len(holder.held) == 1, "no lease on the registered cache"
        owner.owner_op("unregister", 0)
        assert owner.sent["owner unregister timed out"] == 1 and registered.model_id is None
        owner.exchange(holder, [Release(holder.held.copy().pop(), True), Ping(2)])
        owner.sync()
        owner.drop(holder)
        owner.settle_leases(0)


# ---------------------------------------------------------------------------- the tests


@contextlib.contextmanager
def _v2_decoder() -> Iterator[LLMDataDist]:
    """This process as a v2 Decoder that pulls through the owner's server (no one-sided access)."""
    datadist = LLMDataDist(LLMRole.DECODER, 2)
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 5000
    options = dict(config.generate_options())
    options.update(
        {
            "llm.EnableCacheManager": "1",
            "llm.EnableRemoteCacheAccessible": "0",
            "llm.MemPoolConfig": json.dumps({"memory_size": 16 << 20, "page_shift": 16}),
        }
    )
    datadist.init(options)
    try:
        yield datadist
    finally:
        datadist.finalize()


def test_every_message_type_against_a_v2_owner_with_registered_memory(seed: int, _runtime_dir: Path) -> None:
    """Found that a v1 blocks pin (protocol 7's BlocksRequest) naming registered memory was answered Error
    yet left a lease (see test_a_refused_v1_blocks_pin_on_registered_memory_pins_nothing)."""
    port = PORT + 2
    with PromptPeer(P, port, seed, extra=_v2_extra()) as peer, _v2_decoder() as dd:
        print(f"owner pid {peer.pid}")
        assert dd.link_clusters([peer.cluster_info()], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        owner = _Owner(peer, dd, _runtime_dir / f"{PROMPT_IP}_{port}.sock", v2=True)
        try:
            for op in ["register", "register", "alloc", "alloc", "alloc_blocks"]:
                owner.owner_op(op, 0)
            _fuzz_owner(owner, seed, max_examples=250)
        finally:
            owner.close()
        assert peer.stats()["leases"] == 0


def test_every_message_type_against_a_v1_owner(seed: int, _runtime_dir: Path) -> None:
    port = PORT + 3
    with PromptPeer(P, port, seed) as peer, decoder() as dd:
        print(f"owner pid {peer.pid}")
        assert dd.link_clusters([peer.cluster_info()], 5000)[0] == LLMStatusCode.LLM_SUCCESS
        owner = _Owner(peer, dd, _runtime_dir / f"{PROMPT_IP}_{port}.sock", v2=False)
        try:
            for op in ["alloc", "alloc", "alloc_blocks"]:
                owner.owner_op(op, 0)
            _fuzz_owner(owner, seed, max_examples=150)
        finally:
            owner.close()
        assert peer.stats()["leases"] == 0


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_every_message_type_over_tcp_from_a_peer_that_knows_the_secret(
    v2: bool, seed: int, _runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The programs above, sent over TCP as by a peer on another host: Hellos that prove the secret or
    not, and once proven, every message. TCP only on loopback; the owner's transfer engine serves there."""
    problem = engine_available()
    if problem is not None:
        pytest.skip(problem)
    monkeypatch.setenv("LLM_DATADIST_SECRET", SECRET)
    port = PORT + 6 + int(v2)
    tcp = ("127.0.0.1", TCP_PORT + int(v2))
    with PromptPeer(P, port, seed, extra=_v2_extra() if v2 else None) as peer:
        print(f"owner pid {peer.pid}")
        peer.call("listen_tcp", tcp)
        with _v2_decoder() if v2 else decoder() as dd:
            assert dd.link_clusters([peer.cluster_info()], 5000)[0] == LLMStatusCode.LLM_SUCCESS
            owner = _Owner(peer, dd, _runtime_dir / f"{PROMPT_IP}_{port}.sock", v2=v2, tcp=tcp)
            try:
                ops = (
                    ["register", "register", "alloc", "alloc", "alloc_blocks"]
                    if v2
                    else ["alloc", "alloc_blocks"]
                )
                for op in ops:
                    owner.owner_op(op, 0)
                _fuzz_owner(owner, seed, max_examples=250 if v2 else 150)
            finally:
                owner.close()
        assert peer.stats()["leases"] == 0


def test_raw_bytes_before_any_handshake_never_disturb_the_server(seed: int, _runtime_dir: Path) -> None:
    with PromptPeer(P, PORT, seed) as peer, decoder() as dd:
        print(f"owner pid {peer.pid}")
        assert dd.link_clusters([peer.cluster_info()])[0] == LLMStatusCode.LLM_SUCCESS
        cache_id = peer.alloc(2, [1, 512], [(P, 1)])
        path = os.fspath(_runtime_dir / f"{PROMPT_IP}_{PORT}.sock")

        @hypothesis_seed(seed)
        @settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(st.lists(raw_payloads, min_size=1, max_size=3))
        def raw(payloads: list[bytes]) -> None:
            conn = _Conn(path)
            try:
                for payload in payloads:
                    conn.send(payload)
                with contextlib.suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_WR)
                conn.drain_until_closed()
            finally:
                conn.close()

        raw()
        dd.check_link_status(P)
        assert peer.stats()["leases"] == 0
        dst = dd.kv_cache_manager.allocate_cache(CacheDesc(2, [1, 512], DataType.DT_FLOAT16))
        dd.kv_cache_manager.pull_cache(CacheKeyByIdAndIndex(P, cache_id, 0), dst)
        for t, view in enumerate(tensor_views(dst)):
            np.testing.assert_array_equal(view.view(np.uint8).reshape(-1), peer.expected(cache_id, t, 1024))


def test_the_connection_past_the_limit_is_refused_and_the_rest_stay_served(
    seed: int, _runtime_dir: Path
) -> None:
    port = PORT + 1
    with PromptPeer(P, port, seed) as peer, decoder() as dd:
        print(f"owner pid {peer.pid}")
        path = os.fspath(_runtime_dir / f"{PROMPT_IP}_{port}.sock")
        flood: list[_Conn] = []
        try:
            # MAX_CONNECTIONS connections, each handshaken: the owner has accepted and serves every one.
            for i in range(MAX_CONNECTIONS):
                conn = _Conn(path)
                flood.append(conn)
                conn.send(encode_frame(Hello(PROTOCOL_VERSION, 1000 + i, P, 2, _MY_PID, i).to_wire()))
            for conn in flood:
                assert isinstance(conn.receive(), Welcome)
            # The next one is accepted by the kernel and closed by the owner at once, unanswered.
            extra = _Conn(path)
            try:
                extra.send(encode_frame(Hello(PROTOCOL_VERSION, 999, P, 2, _MY_PID, 999).to_wire()))
                extra.expect_close(after=f"connection number {MAX_CONNECTIONS + 1}")
            finally:
                extra.close()
            # Every one of the first MAX_CONNECTIONS is still served, and the owner still answers its
            # own control pipe.
            for i, conn in enumerate(flood):
                conn.send(encode_frame(Ping(i).to_wire()))
            for i, conn in enumerate(flood):
                assert conn.receive() == Pong(i)
            assert peer.stats()["leases"] == 0
        finally:
            for conn in flood:
                conn.close()
        # Once the flood is gone (the owner sees each close on its own time), a legitimate link works.
        deadline = time.monotonic() + 10
        while dd.link_clusters([peer.cluster_info()], timeout=2000)[0] != LLMStatusCode.LLM_SUCCESS:
            assert time.monotonic() < deadline, "the server never recovered from the flood"
            time.sleep(0.05)
        dd.check_link_status(P)
        cache_id = peer.alloc(1, [1, 100], [])
        dst = dd.kv_cache_manager.allocate_cache(CacheDesc(1, [1, 100], DataType.DT_FLOAT16))
        dd.kv_cache_manager.pull_cache(CacheKeyByIdAndIndex(P, cache_id, 0), dst)
        np.testing.assert_array_equal(
            tensor_views(dst)[0].view(np.uint8).reshape(-1), peer.expected(cache_id, 0, 200)
        )


# ---------------------------------------------------------------------------- what the programs above found


def test_a_refused_v1_blocks_pin_on_registered_memory_pins_nothing(seed: int, _runtime_dir: Path) -> None:
    """A v1 blocks pin (a PinRequest with KEY_BLOCKS under RULES_V1) naming registered memory (only
    cache-manager transfers reach it) is refused with Error and pins nothing: a lease left by a refused
    request would make the owner's unregister_cache time out. Found by the v2 program above."""
    port = PORT + 4
    with PromptPeer(P, port, seed, extra=_v2_extra()) as peer:
        print(f"owner pid {peer.pid}")
        cache_id = peer.call("v2_register_blocks", (NUM_TENSORS, BLOCKS_SHAPE, 5, True))
        conn = _Conn(os.fspath(_runtime_dir / f"{PROMPT_IP}_{port}.sock"))
        try:
            conn.send(encode_frame(Hello(PROTOCOL_VERSION, 66, P, 2, _MY_PID, 66).to_wire()))
            assert isinstance(conn.receive(), Welcome)
            conn.send(
                encode_frame(
                    PinRequest(
                        1, KEY_BLOCKS, 0, 5, 0, 0, NUM_TENSORS, True, 0, 0, False, False, RULES_V1
                    ).to_wire()
                )
            )
            reply = conn.receive()
            assert isinstance(reply, Error) and reply.status_code == LLMStatusCode.LLM_PARAM_INVALID, reply
            assert peer.call("stats")["leases"] == 0, "an Error reply left a lease pinned"
            assert peer.call("v2_unregister", cache_id) is None
        finally:
            conn.close()


def test_a_v1_key_pull_on_registered_memory_is_refused_not_a_crash(_runtime_dir: Path) -> None:
    """A v1 pull of a key (a PinRequest under RULES_V1) naming registered (non-blocks) memory, by cache
    id or by a key, is answered Error (not dropped as an internal error) and pins nothing. The owner here
    is this process: PromptPeer cannot register non-blocks memory."""
    port = PORT + 5
    datadist = LLMDataDist(LLMRole.PROMPT, P)
    datadist.init(prompt_options(port, extra=_v2_extra()))
    try:
        memory = np.zeros(64, dtype=np.float16)
        desc = CacheDesc(1, [1, 64], DataType.DT_FLOAT16)
        cache = datadist.cache_manager.register_cache(desc, [memory.ctypes.data], [], True)
        conn = _Conn(os.fspath(_runtime_dir / f"{PROMPT_IP}_{port}.sock"))
        try:
            conn.send(encode_frame(Hello(PROTOCOL_VERSION, 66, P, 2, _MY_PID, 66).to_wire()))
            assert isinstance(conn.receive(), Welcome)
            conn.send(
                encode_frame(
                    PinRequest(
                        1, 3, cache.cache_id, 0, 0, 0, 1, True, 128, 0, False, False, RULES_V1
                    ).to_wire()
                )
            )
            reply = conn.receive()
            assert isinstance(reply, Error), f"the owner answered {reply!r} (None: it dropped the connection)"
            assert datadist._require_core().leases.stats()["leases"] == 0, (
                "an Error reply left a lease pinned"
            )
        finally:
            conn.close()
        datadist.cache_manager.unregister_cache(cache.cache_id)
    finally:
        datadist.finalize()

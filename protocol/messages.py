"""Message schemas: frozen dataclasses that travel as msgpack arrays `[TYPE, field1, field2, ...]`.

Owns the meaning of every message; what each field may hold is `fields.py`, declared next to the field
(`Annotated[int, U32]`) and run in `__post_init__`, so an invalid message cannot even be constructed, and
`from_wire` is just "right shape, then construct". Every failure is `MalformedFrame`. Adding a message type is
adding one decorated class: TYPE values and field order are the wire format and never change.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Annotated, ClassVar, TypeVar

from .errors import MalformedFrame
from .fields import (
    ADDRESS_NAMES,
    ADDRESSES,
    BOOL,
    ENGINE,
    I64,
    MAX_SEGMENT_NAME_CHARS,
    MAX_TENSORS,
    MAX_TEXT_CHARS,
    NONCE,
    NOTIFY_TEXT,
    OFFSETS,
    OPT_NONCE,
    OPT_PROOF,
    OPT_SEGMENT,
    ROLE,
    SEGMENT,
    SEGMENTS,
    SOCKET_NAME,
    TABLE_ENTRIES,
    TEXT,
    U32,
    U32_POSITIVE,
    U64,
    U64_POSITIVE,
    FieldCheck,
    int_in,
    is_int,
    short_repr,
)

# Names code outside protocol/ imports from here since before fields.py existed (not in __all__: the
# package face does not export them).
from .fields import MAX_ADDRESS_NAMES as MAX_ADDRESS_NAMES
from .fields import MAX_TABLE_ENTRIES as MAX_TABLE_ENTRIES

__all__ = [
    "I64",
    "KEY_BLOCKS",
    "KEY_CACHE_ID",
    "KEY_PREFIX",
    "KEY_REQ",
    "MAX_SEGMENT_NAME_CHARS",
    "MAX_TENSORS",
    "MAX_TEXT_CHARS",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "RULES_V1",
    "RULES_V2",
    "U32",
    "U64",
    "Ack",
    "AddressRequest",
    "Addresses",
    "Announce",
    "Bye",
    "Challenge",
    "Error",
    "FieldCheck",
    "Hello",
    "Location",
    "Message",
    "Notify",
    "PinRequest",
    "Ping",
    "Pong",
    "Release",
    "Table",
    "TableRequest",
    "Welcome",
    "WriteGrant",
    "WriteRequest",
    "decode_message",
    "encode_message",
]

# 6: Notify; 7: PullDone (type 5) gone, Release ends every lease; 8: one request and one grant for every
# pin: type 3 is PinRequest (PullRequest's fields in their order, then for_write and rules) and Location
# (17) its grant; PullGrant (4), BlocksRequest and BlocksGrant (12, 13) and ResolveRequest (16) gone.
PROTOCOL_VERSION = 8

# PinRequest.key_kind: what key_id names at the owner.
KEY_REQ = 1  # key_id is a req_id
KEY_PREFIX = 2  # key_id is a prefix_id
KEY_CACHE_ID = 3  # key_id is the owner's cache_id, batch_index the slot
KEY_BLOCKS = 4  # model_id names a blocks cache (key_id unused)

# PinRequest.rules: whose rules name the cache (the API generation that asks).
RULES_V1 = 1
RULES_V2 = 2

_KEY_KIND = int_in(frozenset({KEY_REQ, KEY_PREFIX, KEY_CACHE_ID, KEY_BLOCKS}), "key_kind in {1, 2, 3, 4}")
_RULES = int_in(frozenset({RULES_V1, RULES_V2}), "rules in {1, 2}")

# A message class and its instances in `from_wire` and `_register` (typing.Self is 3.11+).
_M = TypeVar("_M", bound="Message")


@dataclass(frozen=True, slots=True)
class Message:
    """Base of every message. Subclasses are `@_register`-ed frozen, slotted dataclasses whose fields are all
    `Annotated[<type>, <FieldCheck>]`; the base supplies validation and the wire form from that. The base is
    a (field-less) dataclass too, so `dataclasses.replace`/`fields` type-check on a plain `Message`."""

    TYPE: ClassVar[int]
    _CHECKS: ClassVar[tuple[tuple[str, FieldCheck], ...]]
    # (name, low, high, is_bool, check) per field; low/high are None when the field has no inline range.
    _PLAN: ClassVar[tuple[tuple[str, int | None, int | None, bool, FieldCheck], ...]]

    def __post_init__(self) -> None:
        cls = type(self)
        if cls not in _REGISTERED:
            raise TypeError(f"{cls.__name__} is not a registered message class")
        for name, low, high, is_bool, check in cls._PLAN:
            value = getattr(self, name)
            # Inline shortcuts for exact ints in range and bools; anything else (an int subclass, a value
            # out of range, another type) goes to the field's full check, which decides and explains.
            if low is not None and type(value) is int and low <= value <= high:  # type: ignore[operator]
                continue
            if is_bool and type(value) is bool:
                continue
            normalized = check(f"{cls.__name__}.{name}", value)
            if normalized is not value:
                object.__setattr__(self, name, normalized)
        self._check_fields_together()

    def _check_fields_together(self) -> None:
        """Cross-field rules; overridden where a message has any."""

    def to_wire(self) -> list[object]:
        """[TYPE, field1, field2, ...] in declaration order; tuples go out as lists, as they come back."""
        wire: list[object] = [self.TYPE]
        for name, _ in self._CHECKS:
            value = getattr(self, name)
            wire.append(list(value) if isinstance(value, tuple) else value)
        return wire

    @classmethod
    def from_wire(cls: type[_M], wire: list[object]) -> _M:
        """Build and validate a message from its wire array; MalformedFrame on any wrong shape or field."""
        if not isinstance(wire, list):
            raise MalformedFrame(f"{cls.__name__}: expected a msgpack array, got {type(wire).__name__}")
        if len(wire) != 1 + len(cls._CHECKS):
            raise MalformedFrame(f"{cls.__name__}: expected {1 + len(cls._CHECKS)} elements, got {len(wire)}")
        if not is_int(wire[0]) or wire[0] != cls.TYPE:
            raise MalformedFrame(f"{cls.__name__}: expected type {cls.TYPE}, got {short_repr(wire[0])}")
        return cls(*wire[1:])


MESSAGE_TYPES: dict[int, type[Message]] = {}
"""TYPE -> message class, filled by @_register; decode_message dispatches on it."""
_REGISTERED: set[type[Message]] = set()


def _register(cls: type[_M]) -> type[_M]:
    hints = typing.get_type_hints(cls, include_extras=True)
    checks: list[tuple[str, FieldCheck]] = []
    for field in dataclasses.fields(cls):
        found = [m for m in getattr(hints[field.name], "__metadata__", ()) if isinstance(m, FieldCheck)]
        assert len(found) == 1, f"{cls.__name__}.{field.name} needs exactly one FieldCheck"
        checks.append((field.name, found[0]))
    assert cls.TYPE not in MESSAGE_TYPES, f"message TYPE {cls.TYPE} used twice"
    cls._CHECKS = tuple(checks)
    cls._PLAN = tuple(
        (
            name,
            check.int_range[0] if check.int_range else None,
            check.int_range[1] if check.int_range else None,
            check.is_bool,
            check,
        )
        for name, check in checks
    )
    MESSAGE_TYPES[cls.TYPE] = cls
    _REGISTERED.add(cls)
    return cls


@_register
@dataclass(frozen=True, slots=True)
class Hello(Message):
    """Client -> server, first message. remote_cluster_id is the cluster id the client expects the server
    to have. A different version is still delivered: checking it is the receiver's policy. `incarnation`
    is a random number drawn once per initialised instance: a process restarted at the same address (even
    with the same pid) is a new incarnation, and nothing learnt from the old one applies to it."""

    TYPE: ClassVar[int] = 1
    version: Annotated[int, U32]
    cluster_id: Annotated[int, U64]
    remote_cluster_id: Annotated[int, U64]
    role: Annotated[int, ROLE]
    pid: Annotated[int, U32]
    incarnation: Annotated[int, U64]
    # Over TCP: the client's nonce and its proof that it knows the shared secret (see `Challenge`), and
    # the address of its transfer engine; all empty on a Unix socket.
    nonce: Annotated[bytes, OPT_NONCE] = b""
    proof: Annotated[bytes, OPT_PROOF] = b""
    engine: Annotated[str, ENGINE] = ""


@_register
@dataclass(frozen=True, slots=True)
class Challenge(Message):
    """Server -> client, first message on a TCP connection (before Hello): a fresh random nonce. The
    client's Hello answers with its own nonce and a proof over both; the server's Welcome proves the server
    knows the secret too. `version` lets a client name a version mismatch before it proves anything."""

    TYPE: ClassVar[int] = 21
    version: Annotated[int, U32]
    nonce: Annotated[bytes, NONCE]


@_register
@dataclass(frozen=True, slots=True)
class Welcome(Message):
    """Server -> client: handshake accepted; `incarnation` as in Hello, of the serving instance.

    `index` names the server's published index (a shared-memory file, "" if none), `index_row` the row
    of it this connection pins through and `index_ticket` the value that names this connection in that row
    (see `llm_datadist._shm.index`).
    """

    TYPE: ClassVar[int] = 2
    version: Annotated[int, U32]
    cluster_id: Annotated[int, U64]
    role: Annotated[int, ROLE]
    pid: Annotated[int, U32]
    incarnation: Annotated[int, U64]
    index: Annotated[str, OPT_SEGMENT] = ""
    index_row: Annotated[int, U32] = 0
    index_ticket: Annotated[int, U64] = 0
    # Over TCP: the server's proof (see `Challenge`) and its transfer engine's address; empty otherwise.
    proof: Annotated[bytes, OPT_PROOF] = b""
    engine: Annotated[str, ENGINE] = ""


@_register
@dataclass(frozen=True, slots=True)
class PinRequest(Message):
    """Client -> server: find the cache a key names, pin it under a lease and say where its tensors are
    (answered with `Location`), to read from it (a pull) or write into it (`for_write`: a push, which
    consumes nothing and only reaches a cache its user still holds). key_kind KEY_BLOCKS names a blocks
    cache by model_id (key_id unused); KEY_CACHE_ID a cache by id, batch_index its slot. whole=True: the
    cache must have exactly tensor_count tensors. consume: a pull that ends well consumes the req key's
    pulled tensors (see Release).

    rules RULES_V1 (`pull_cache`, `pull_blocks`): keys on pool memory only, a blocks cache only by its
    blocks key, refused with LLM_LINK_BUSY while a layer-wise push into the client's cluster runs, and a
    key pull names `nbytes` of each tensor's slot from `src_offset` (checked against the slot by the
    owner, and against the Location by the client). RULES_V2: the cache manager's (registered memory too;
    nbytes and src_offset are 0).
    """

    TYPE: ClassVar[int] = 3
    seq: Annotated[int, U32]
    key_kind: Annotated[int, _KEY_KIND]
    key_id: Annotated[int, U64]
    model_id: Annotated[int, U64]
    batch_index: Annotated[int, U32]
    tensor_start: Annotated[int, U32]
    tensor_count: Annotated[int, U32_POSITIVE]
    whole: Annotated[bool, BOOL]
    nbytes: Annotated[int, U64]
    src_offset: Annotated[int, U64]
    consume: Annotated[bool, BOOL]
    for_write: Annotated[bool, BOOL]
    rules: Annotated[int, _RULES]

    def _check_fields_together(self) -> None:
        v1_key_pull = self.rules == RULES_V1 and self.key_kind != KEY_BLOCKS
        if v1_key_pull != (self.nbytes > 0):
            raise MalformedFrame(
                "PinRequest: nbytes must be > 0 for a v1 pull of a key, and 0 for anything else"
            )
        if self.rules == RULES_V1 and self.for_write:
            raise MalformedFrame("PinRequest: v1 pushes go by address (WriteRequest)")
        if not v1_key_pull and self.src_offset:
            raise MalformedFrame("PinRequest: src_offset is for v1 pulls of a key")


@_register
@dataclass(frozen=True, slots=True)
class Ack(Message):
    TYPE: ClassVar[int] = 6
    seq: Annotated[int, U32]


@_register
@dataclass(frozen=True, slots=True)
class Error(Message):
    """Server -> client: a request failed with an LLMStatusCode value; seq 0 when not a reply to a request.
    During the handshake it refuses the Hello and closes the connection."""

    TYPE: ClassVar[int] = 7
    seq: Annotated[int, U32]
    status_code: Annotated[int, I64]
    message: Annotated[str, TEXT]


@_register
@dataclass(frozen=True, slots=True)
class Bye(Message):
    """Either side: orderly close; nothing follows it from the sender."""

    TYPE: ClassVar[int] = 8
    reason: Annotated[str, TEXT]


@_register
@dataclass(frozen=True, slots=True)
class Ping(Message):
    """Client -> server liveness probe (check_link_status)."""

    TYPE: ClassVar[int] = 9
    seq: Annotated[int, U32]


@_register
@dataclass(frozen=True, slots=True)
class Pong(Message):
    TYPE: ClassVar[int] = 10
    seq: Annotated[int, U32]


@_register
@dataclass(frozen=True, slots=True)
class Announce(Message):
    """Client -> server, right after the handshake: the file name (in the shared runtime directory) of the
    client's own callback socket, where the server may connect back to push into the client's memory; ""
    when it has none. Answered with Ack, so the server knows it before link setup returns."""

    TYPE: ClassVar[int] = 11
    seq: Annotated[int, U32]
    callback: Annotated[str, SOCKET_NAME]
    # Over TCP: the port where the client serves TCP on the address it connected from (0: none), the way
    # back for pushes into its memory; `callback` is then "".
    tcp_port: Annotated[int, U32] = 0


@_register
@dataclass(frozen=True, slots=True)
class WriteRequest(Message):
    """Client -> server: pin the server's memory at these addresses (in the server's address space) for a
    one-copy push. Range i is [addrs[i], addrs[i] + nbytes[i]); each must lie inside one tensor of one of
    the server's live caches, or the whole request is refused."""

    TYPE: ClassVar[int] = 14
    seq: Annotated[int, U32]
    addrs: Annotated[tuple[int, ...], OFFSETS]
    nbytes: Annotated[tuple[int, ...], OFFSETS]

    def _check_fields_together(self) -> None:
        if len(self.addrs) != len(self.nbytes):
            raise MalformedFrame(f"WriteRequest: {len(self.addrs)} addrs but {len(self.nbytes)} nbytes")


@_register
@dataclass(frozen=True, slots=True)
class WriteGrant(Message):
    """Server -> client: the ranges of the WriteRequest with the same seq are pinned under lease_id; range i
    is at range_offsets[i] in segments[range_segments[i]] (of segment_nbytes[range_segments[i]] bytes)."""

    TYPE: ClassVar[int] = 15
    seq: Annotated[int, U32]
    lease_id: Annotated[int, U64]
    segments: Annotated[tuple[str, ...], SEGMENTS]
    segment_nbytes: Annotated[tuple[int, ...], OFFSETS]
    range_segments: Annotated[tuple[int, ...], OFFSETS]
    range_offsets: Annotated[tuple[int, ...], OFFSETS]

    def _check_fields_together(self) -> None:
        if len(self.segments) != len(self.segment_nbytes):
            raise MalformedFrame(
                f"WriteGrant: {len(self.segments)} segments but {len(self.segment_nbytes)} segment_nbytes"
            )
        if len(self.range_segments) != len(self.range_offsets):
            raise MalformedFrame(
                f"WriteGrant: {len(self.range_segments)} range_segments but "
                f"{len(self.range_offsets)} range_offsets"
            )
        if max(self.range_segments) >= len(self.segments):
            raise MalformedFrame(
                f"WriteGrant: a range_segments entry names none of the {len(self.segments)} segments"
            )


@_register
@dataclass(frozen=True, slots=True)
class Location(Message):
    """Server -> client, the answer to a PinRequest: where the cache's tensors are, pinned under lease_id.
    Tensor i starts at tensor_bases[i] and holds num_units units (batch slots or blocks) of unit_nbytes;
    slot is the unit the key is bound to. With a segment, tensor_bases are offsets in it (and must fit
    it); with segment "", they are addresses in process `pid` (memory the owner registered), reached by
    cross-memory attach."""

    TYPE: ClassVar[int] = 17
    seq: Annotated[int, U32]
    lease_id: Annotated[int, U64]
    pid: Annotated[int, U32]
    segment: Annotated[str, OPT_SEGMENT]
    segment_nbytes: Annotated[int, U64]
    tensor_bases: Annotated[tuple[int, ...], OFFSETS]
    unit_nbytes: Annotated[int, U64_POSITIVE]
    num_units: Annotated[int, U64_POSITIVE]
    slot: Annotated[int, U32]

    def _check_fields_together(self) -> None:
        if self.slot >= self.num_units:
            raise MalformedFrame(f"Location: slot {self.slot} >= num_units {self.num_units}")
        if self.segment and max(self.tensor_bases) + self.unit_nbytes * self.num_units > self.segment_nbytes:
            raise MalformedFrame(
                "Location: a tensor_bases entry + num_units x unit_nbytes exceeds segment_nbytes"
            )


@_register
@dataclass(frozen=True, slots=True)
class TableRequest(Message):
    """Client -> server: send the table of remote-accessible caches (one-sided reads), the page of
    entries whose cache id is at least `start_cache_id` (1 for the first page)."""

    TYPE: ClassVar[int] = 18
    seq: Annotated[int, U32]
    start_cache_id: Annotated[int, U64]


@_register
@dataclass(frozen=True, slots=True)
class Table(Message):
    """Server -> client: the remote-accessible caches of process `pid`. Each entry is
    [cache_id, is_blocks, [model_id, ...], segment or "", segment_nbytes, [tensor_base, ...], unit_nbytes,
    num_units, generation_slot, generation], with the same meaning as in Location. Word `generation_slot`
    of the `generations` segment holds the entry's generation while the cache lives, and changes before
    its memory is reused: a one-sided reader checks it around each copy.

    A table is sent in pages ordered by cache id (ids are never reused, so pages never overlap):
    `next_cache_id` is where the next page starts, 0 when this page is the last. `version` is word 0 of
    the generations segment, read before the page was taken: while the word still holds it, what the
    table's model ids name has not changed."""

    TYPE: ClassVar[int] = 19
    seq: Annotated[int, U32]
    pid: Annotated[int, U32]
    generations: Annotated[str, SEGMENT]
    entries: Annotated[tuple[tuple[object, ...], ...], TABLE_ENTRIES]
    next_cache_id: Annotated[int, U64]
    version: Annotated[int, U64]


@_register
@dataclass(frozen=True, slots=True)
class Release(Message):
    """Client -> server, one way (no reply): the transfer under lease_id is over; ok=False gives back what
    the lease consumed. It costs the client no round trip; the server handles it in order with the
    connection's other messages."""

    TYPE: ClassVar[int] = 20
    lease_id: Annotated[int, U64]
    ok: Annotated[bool, BOOL]


@_register
@dataclass(frozen=True, slots=True)
class AddressRequest(Message):
    """Client -> server, over TCP only: where the server has its segments `names` mapped, so that the
    client's transfer engine can address bytes a grant named by segment and offset. Answered with
    Addresses, or Error for a name that is not one of the server's live segments."""

    TYPE: ClassVar[int] = 22
    seq: Annotated[int, U32]
    names: Annotated[tuple[str, ...], ADDRESS_NAMES]


@_register
@dataclass(frozen=True, slots=True)
class Addresses(Message):
    """Server -> client: the virtual address of each requested segment in the server, in request order."""

    TYPE: ClassVar[int] = 23
    seq: Annotated[int, U32]
    addrs: Annotated[tuple[int, ...], ADDRESSES]


@_register
@dataclass(frozen=True, slots=True)
class Notify(Message):
    """Client -> server (a HIXL engine's `send_notify`): a named message for the server's application, kept
    until it asks for what arrived (`get_notifies`). Answered with Ack once kept, or Error when the server
    keeps no notifies (a plain `llm_datadist` instance) or no more from this connection."""

    TYPE: ClassVar[int] = 24
    seq: Annotated[int, U32]
    name: Annotated[str, NOTIFY_TEXT]
    message: Annotated[str, NOTIFY_TEXT]


def decode_message(obj: object) -> Message:
    """Turn a decoded frame payload into a validated message; MalformedFrame when it is not one."""
    if not isinstance(obj, list) or not obj:
        raise MalformedFrame(f"a message is a non-empty msgpack array, got {type(obj).__name__}")
    type_code = obj[0]
    cls = MESSAGE_TYPES.get(type_code) if is_int(type_code) else None
    if cls is None:
        raise MalformedFrame(f"unknown message type {short_repr(type_code)}")
    return cls.from_wire(obj)


def encode_message(msg: Message) -> object:
    """The object to pass to encode_frame: msg.to_wire()."""
    return msg.to_wire()

"""A process's statistics in shared memory: counters its threads add to without a lock, gauges, and a
header that says whose they are, readable by any process of the same user without waking the writer.

Layout (native byte order, every word 8-byte aligned):

    0    magic "LLMDDST1"
    8    u32 layout version, u32 rows, u32 slots per row, u32 gauges
    24   u32 pid, u32 role, u64 cluster id, u64 created (ns since the epoch)
    48   u32 state (1 open, 2 closed), u32 bytes of the schema
    56   reserved, to HEADER_NBYTES
    HEADER_NBYTES            the schema: JSON, {"slots": [names], "gauges": [names]}
    gauges_offset            gauges x u64
    rows_offset              rows x slots x u64

Rules: each row has one writer at a time (which is the writer's rule: `llm_datadist._stats` gives each
thread its own), so an add needs no lock and is never lost; a reader sums the rows. Words are written whole
(aligned 8-byte stores): a reader sees each word old or new, never torn, and the sum of rows read one after
the other may mix moments a few microseconds apart. The segment is named as every segment of ours
(`names`), so a dead writer's segment is reaped like any other; a child forked from the writer writes
into private memory, never into its parent's figures.
"""

from __future__ import annotations

import json
import os
import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ShmError
from .names import SegmentOwner, owner_alive, parse_segment_name
from .segment import Segment

__all__ = ["MAGIC", "BadStats", "StatsReading", "StatsSegment", "list_stats", "read_stats"]

MAGIC = b"LLMDDST1"
LAYOUT_VERSION = 1
HEADER_NBYTES = 64
_HEADER = struct.Struct("=8sIIII IIQQ II")  # through the schema's length
STATE_OPEN, STATE_CLOSED = 1, 2
_STATE_OFFSET = 48
_STATE = struct.Struct("=I")
# Rows a writer may give its threads.
DEFAULT_ROWS = 64
_MAX_SCHEMA_NBYTES = 64 << 10
# What a reader accepts of a header (another process wrote it: a bad one must not cost us memory): rows,
# slots and gauges each at most this many, the rows at most _MAX_ROWS_NBYTES in all, names at most
# _MAX_NAME_CHARS. (Ours: 64 rows of about 300 slots, 160 KB.)
_MAX_COUNT = 4096
_MAX_ROWS_NBYTES = 16 << 20
_MAX_NAME_CHARS = 128
SHM_DIR = "/dev/shm"


def _align(nbytes: int) -> int:
    return (nbytes + 63) & ~63


@dataclass(frozen=True)
class StatsReading:
    """One look at a stats segment: whose it is and its figures (each slot summed over the rows)."""

    name: str
    pid: int
    role: int
    cluster_id: int
    created_ns: int
    open: bool
    slots: dict[str, int]
    gauges: dict[str, int]


class StatsSegment:
    """The writer's side: create one per instance, add to a row's slots (`words`, `row_word`), set gauges,
    `close` at the end (it unlinks the segment). Which thread writes which row is the caller's rule; this
    class only lays the rows out."""

    def __init__(self, segment: Segment, slots: Sequence[str], gauges: Sequence[str], rows: int) -> None:
        self._segment = segment
        self._words = segment.array.data.cast("Q")
        # Where word 0 is, for a caller that adds in C (`_copykernel.count_transfer`); valid while this
        # object lives (its view keeps the mapping mapped, even past `close`).
        self.address = segment.address
        self._private: np.ndarray[Any, Any] | None = None
        schema_nbytes = _schema_nbytes(slots, gauges)
        self._gauges_word = _align(HEADER_NBYTES + schema_nbytes) // 8
        self._rows_word = self._gauges_word + _align(8 * len(gauges)) // 8
        self._row_words = _align(8 * len(slots)) // 8
        self.rows = rows
        self._pid = os.getpid()
        _live.add(self)

    @classmethod
    def create(
        cls,
        slots: Sequence[str],
        gauges: Sequence[str] = (),
        *,
        role: int = 0,
        cluster_id: int = 0,
        created_ns: int = 0,
        rows: int = DEFAULT_ROWS,
    ) -> StatsSegment:
        """A new stats segment of this process with these slot and gauge names, every figure zero."""
        if not slots or rows < 1:
            raise ShmError("a stats segment needs at least one slot and one row")
        schema = json.dumps({"slots": list(slots), "gauges": list(gauges)}).encode()
        if len(schema) > _MAX_SCHEMA_NBYTES:
            raise ShmError(f"a stats schema of {len(schema)} bytes is over {_MAX_SCHEMA_NBYTES}")
        gauges_offset = _align(HEADER_NBYTES + len(schema))
        rows_offset = gauges_offset + _align(8 * len(gauges))
        nbytes = rows_offset + rows * _align(8 * len(slots))
        segment = Segment.create(nbytes)
        header = _HEADER.pack(
            MAGIC,
            LAYOUT_VERSION,
            rows,
            len(slots),
            len(gauges),
            os.getpid(),
            role,
            cluster_id,
            created_ns,
            STATE_OPEN,
            len(schema),
        )
        array = segment.array
        array[HEADER_NBYTES : HEADER_NBYTES + len(schema)] = memoryview(schema)
        array[: len(header)] = memoryview(header)  # the magic last: a reader never sees half a header
        return cls(segment, slots, gauges, rows)

    @property
    def name(self) -> str:
        return self._segment.name

    @property
    def words(self) -> memoryview:
        """The segment as 8-byte words: row r's slot s is `words[row_word(r) + s]`."""
        return self._words

    def row_word(self, row: int) -> int:
        """The index of row `row`'s first word (0 <= row < rows)."""
        if not 0 <= row < self.rows:
            raise ShmError(f"row {row} outside the segment's {self.rows}")
        return self._rows_word + row * self._row_words

    def set_gauge(self, gauge: int, value: int) -> None:
        self._words[self._gauges_word + gauge] = value

    def close(self) -> None:
        """Say closed, and unlink: `list_stats` no longer finds it. Idempotent. An add still running on
        another thread lands in memory that stays mapped until this object goes."""
        if self._segment.closed or os.getpid() != self._pid:
            return  # a forked child's copy: the segment is its parent's
        _STATE.pack_into(self._segment.array.data, _STATE_OFFSET, STATE_CLOSED)
        self._segment.close()

    def _forked(self) -> None:
        """In a child forked from the writer: what the child adds goes to private memory, never into the
        parent's figures (the mapping is shared)."""
        self._private = np.zeros(len(self._words), dtype=np.uint64)
        self._words = self._private.data.cast("B").cast("Q")
        self.address = int(self._private.ctypes.data)


_live: weakref.WeakSet[StatsSegment] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for stats in list(_live):
        stats._forked()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _schema_nbytes(slots: Sequence[str], gauges: Sequence[str]) -> int:
    return len(json.dumps({"slots": list(slots), "gauges": list(gauges)}).encode())


class BadStats(ShmError):
    """A segment that says it is a stats segment and is not a sound one: its reason."""


def read_stats(name: str) -> StatsReading | None:
    """The figures of the stats segment `name`, or None when it is not one (or is gone): read from the
    file, without mapping it and without waking its writer. BadStats when it claims to be one (our magic)
    and is not sound: every size is bounded by the file and by a sane maximum, every type checked."""
    path = os.path.join(SHM_DIR, name.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        header = os.pread(fd, _HEADER.size, 0)
        if len(header) < _HEADER.size or header[:8] != MAGIC:
            return None
        return _read(name, fd, header)
    except OSError:
        return None  # gone meanwhile
    finally:
        os.close(fd)


def _bad(condition: bool, why: str) -> None:
    if condition:
        raise BadStats(why)


def _names(schema: dict[str, Any], key: str, count: int) -> list[str]:
    names = schema.get(key)
    _bad(not isinstance(names, list) or len(names) != count, f"the schema's {key!r} is not a list of {count}")
    assert isinstance(names, list)
    for item in names:
        _bad(
            not isinstance(item, str) or not 0 < len(item) <= _MAX_NAME_CHARS,
            f"a name in {key!r} is {item!r:.40}",
        )
    _bad(len(set(names)) != len(names), f"the schema's {key!r} repeats a name")
    return names


def _read(name: str, fd: int, header: bytes) -> StatsReading | None:
    _, version, rows, slot_count, gauge_count, pid, role, cluster_id, created, state, schema_nbytes = (
        _HEADER.unpack(header)
    )
    if version != LAYOUT_VERSION:
        return None  # another layout (another version of the library): not ours to read, nor to judge
    _bad(not 0 < schema_nbytes <= _MAX_SCHEMA_NBYTES, f"a schema of {schema_nbytes} bytes")
    _bad(
        max(rows, slot_count, gauge_count) > _MAX_COUNT,
        f"{rows} rows, {slot_count} slots, {gauge_count} gauges (at most {_MAX_COUNT} each)",
    )
    gauges_offset = _align(HEADER_NBYTES + schema_nbytes)
    rows_offset = gauges_offset + _align(8 * gauge_count)
    row_nbytes = _align(8 * slot_count)
    _bad(
        rows * row_nbytes > _MAX_ROWS_NBYTES,
        f"{rows} rows of {row_nbytes} bytes (at most {_MAX_ROWS_NBYTES})",
    )
    file_nbytes = os.fstat(fd).st_size
    _bad(rows_offset + rows * row_nbytes > file_nbytes, "its header describes more than the file holds")
    raw = os.pread(fd, schema_nbytes, HEADER_NBYTES)
    _bad(len(raw) != schema_nbytes, "its schema is cut short")
    try:
        schema = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than the parser goes
        raise BadStats(f"its schema is not JSON we read ({type(exc).__name__})") from None
    _bad(not isinstance(schema, dict), "its schema is not an object")
    slots, gauges = _names(schema, "slots", slot_count), _names(schema, "gauges", gauge_count)
    gauge_raw = os.pread(fd, 8 * gauge_count, gauges_offset)
    body = os.pread(fd, rows * row_nbytes, rows_offset)
    _bad(len(gauge_raw) != 8 * gauge_count or len(body) != rows * row_nbytes, "the file was cut short")
    gauge_words = struct.unpack(f"={gauge_count}Q", gauge_raw)
    table = np.frombuffer(body, dtype=np.uint64).reshape(rows, row_nbytes // 8)[:, :slot_count]
    totals = [int(total) for total in table.sum(axis=0, dtype=np.uint64)]
    return StatsReading(
        name=name if name.startswith("/") else "/" + name,
        pid=pid,
        role=role,
        cluster_id=cluster_id,
        created_ns=created,
        open=state == STATE_OPEN,
        slots=dict(zip(slots, totals, strict=True)),
        gauges=dict(zip(gauges, gauge_words, strict=True)),
    )


# Unsound segments already said (by name): each is said once per process.
_said_bad: set[str] = set()


def list_stats(*, uid: int | None = None, say: Callable[[str], None] | None = None) -> list[StatsReading]:
    """Every open stats segment of user `uid` (default: ours) whose writer is alive, by pid. One that is
    not sound is left out, and `say` is told which and why, once per process; the others are all
    shown."""
    if uid is None:
        uid = os.getuid()
    readings = []
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except OSError:
        return []
    for entry in entries:
        owner: SegmentOwner | None = parse_segment_name(entry)
        if owner is None or owner.uid != uid:
            continue
        try:
            if os.stat(os.path.join(SHM_DIR, entry), follow_symlinks=False).st_uid != uid:
                continue
        except OSError:
            continue
        try:
            reading = read_stats(entry)
        except BadStats as exc:
            if say is not None and entry not in _said_bad:
                _said_bad.add(entry)
                say(f"stats segment /{entry} left out: {exc}")
            continue
        if reading is not None and reading.open and reading.pid == owner.pid and owner_alive(owner):
            readings.append(reading)
    readings.sort(key=lambda r: (r.pid, r.created_ns, r.name))
    return readings

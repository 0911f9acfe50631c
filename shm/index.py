"""The published index: an owner's keys, caches and pins in one shared-memory file, so that a puller on the
same host resolves, pins, copies and consumes without waking the owner.

Rules: every read or write of the index happens under its lock, an OFD byte-range lock (F_OFD_SETLK) on
the whole file, which the kernel drops when the holder's last descriptor closes (a killed holder never
leaves it locked). The owner (`shm.index_owner.OwnerIndex`) creates, sizes, writes and unlinks the file; a
puller (`Index.attach`) maps it writable only to pin, consume and unpin through its own row. Everything a
puller takes from the index is bounds-checked as hostile input (`IndexCorrupt`). A lock that cannot be had
in time raises `IndexLockTimeout`. Not thread-safe within one process: callers serialise users of one
`Index` (one open file description).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterator

import numpy as np

from .errors import ShmError
from .index_layout import (
    _ADDR_WORDS_PER_NAME,
    _BUSY_ALL,
    _BUSY_COUNT_OFFSET,
    _BUSY_OFFSET,
    _CACHE_NAME_OFFSET,
    _CACHE_NBYTES,
    _GENERATIONS_OFFSET,
    _HEADER,
    _MAGIC,
    _NAME_KEY,
    _NAME_MASK_OFFSET,
    _NAME_NBYTES,
    _NAME_PULLED_OFFSET,
    _ROW,
    _ROW_HEAD,
    _ROW_INCARNATION_OFFSET,
    _ROW_MASK_OFFSET,
    _ROW_NBYTES,
    _ROW_RANGE,
    _ROW_RANGE_OFFSET,
    _ROWS_OFFSET,
    _SEGMENT_NAME_NBYTES,
    _U32,
    _U64,
    BUSY_CAPACITY,
    KIND_BLOCKS,
    KIND_REQ,
    LAYOUT_VERSION,
    NAME_CONSUMED,
    NAME_LIVE,
    CacheEntry,
    NameEntry,
    RowEntry,
    _hash,
    _layout_nbytes,
    _mask_bytes,
    _range_mask,
    _read_mask,
)
from .reaper import SHM_DIR

__all__ = [
    "Index",
    "IndexCorrupt",
    "IndexLockTimeout",
    "IndexTruncated",
    "count_lock_wait",
    "lock_waits",
]

_LOCK = struct.Struct("hh4xqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD)
_WRLCK = _LOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)  # the whole file
_UNLCK = _LOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, 0, 0, 0)
_LOCK_RETRY_MIN_S = 20e-6
_LOCK_RETRY_MAX_S = 1e-3


# Locks of an index this process found held and waited for (`lock_waits`): counted without a lock, so two
# threads that start waiting at the same instant may count once.
_lock_waits = [0]


def lock_waits() -> int:
    """How often this process found an index's lock held and waited for it (its own and its peers')."""
    return _lock_waits[0]


def count_lock_wait() -> None:
    """A wait for an index's lock that `Index.lock` did not see (a caller that polls the lock itself)."""
    _lock_waits[0] += 1


class IndexCorrupt(ShmError):
    """The index holds something no owner of ours writes: a hostile or broken peer."""


class IndexTruncated(IndexCorrupt):
    """The index's file is shorter than its layout: another process shrank it under its mappings."""


class IndexLockTimeout(ShmError):
    """The index lock could not be had in time (its holder is stopped, or very slow)."""


class Index:
    """One mapping of an index file and one open file description to lock it with.

    `attach` (a puller) opens and maps it, and checks its header against the expected owner; the owner's
    side (`shm.index_owner.OwnerIndex.create`) makes the file.
    """

    def __init__(self, name: str, fd: int, mapping: mmap.mmap, caps: tuple[int, int, int, int]) -> None:
        self.name = name
        self._fd = fd
        self._mm: mmap.mmap | None = mapping
        self.rows, self.caches, self.names, self.buckets = caps
        self._caches_offset = _ROWS_OFFSET + self.rows * _ROW_NBYTES
        self._names_offset = self._caches_offset + self.caches * _CACHE_NBYTES
        self._buckets_offset = self._names_offset + self.names * _NAME_NBYTES
        self._addrs_offset = self._buckets_offset + self.buckets * 4
        self.addr_words = self.names * _ADDR_WORDS_PER_NAME
        self.nbytes = _layout_nbytes(*caps)
        self._depth = 0
        self._segment_names: dict[bytes, str] = {}  # raw name field -> decoded (a pull decodes none)

    # ------------------------------------------------------------------------------------ lifetime

    @classmethod
    def attach(cls, name: str, *, pid: int, incarnation: int) -> Index:
        """Map the index `name` of owner (`pid`, `incarnation`); IndexCorrupt if it is not that owner's."""
        if not name.startswith("/") or "/" in name[1:] or name in ("/", "/.", "/.."):
            raise IndexCorrupt(f"not an index name: {name!r}")
        try:
            fd = os.open(os.path.join(SHM_DIR, name[1:]), os.O_RDWR | os.O_NOFOLLOW)
        except FileNotFoundError as exc:
            raise ShmError(f"no index named {name!r}") from exc
        except OSError as exc:
            raise ShmError(f"cannot open index {name!r}: {exc}") from exc
        try:
            nbytes = os.fstat(fd).st_size
            if nbytes < _ROWS_OFFSET:
                raise IndexCorrupt(f"index {name!r} holds {nbytes} bytes")
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        try:
            raw = os.pread(fd, _HEADER.size, 0)
            if len(raw) != _HEADER.size:
                raise IndexTruncated(f"index {name!r} was shrunk to {len(raw)} bytes")
            magic, layout, _, owner_pid, owner_inc, rows, caches, names, buckets, _, _ = _HEADER.unpack(raw)
            if magic != _MAGIC or layout != LAYOUT_VERSION:
                raise IndexCorrupt(f"index {name!r}: layout {layout}, not {LAYOUT_VERSION}")
            if (owner_pid, owner_inc) != (pid, incarnation):
                raise IndexCorrupt(f"index {name!r} belongs to pid {owner_pid}, not to the linked owner")
            if not (0 < rows <= 1 << 16 and 0 < caches <= 1 << 20 and 0 < names <= 1 << 22):
                raise IndexCorrupt(f"index {name!r}: capacities out of range")
            if buckets != 2 * names or _layout_nbytes(rows, caches, names, buckets) > nbytes:
                raise IndexCorrupt(f"index {name!r}: capacities do not fit its {nbytes} bytes")
        except BaseException:
            mapping.close()
            os.close(fd)
            raise
        return cls(name, fd, mapping, (rows, caches, names, buckets))

    def close(self) -> None:
        """Unmap and close (the owner's close also marks the index closed and unlinks it)."""
        if self._mm is None:
            return
        # A view still alive somewhere keeps the mapping until its last reference goes.
        with contextlib.suppress(BufferError):
            self._mm.close()
        self._mm = None
        os.close(self._fd)
        self._fd = -1

    @property
    def closed(self) -> bool:
        return self._mm is None

    @property
    def handle(self) -> tuple[int, mmap.mmap]:
        """The file descriptor the lock is taken on and the mapping (for the C kernel, which locks itself)."""
        return self._fd, self._map

    @property
    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise ShmError(f"index {self.name} is closed")
        return self._mm

    # ------------------------------------------------------------------------------------ the lock

    @contextlib.contextmanager
    def locked(self, timeout_s: float) -> Iterator[None]:
        """Hold the index lock (re-entrant within this object); IndexLockTimeout after `timeout_s`."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self.lock(timeout_s)
        try:
            yield
        finally:
            self.unlock()

    @property
    def lock_depth(self) -> int:
        """How deep this object holds the lock now (0: not held)."""
        return self._depth

    def lock(self, timeout_s: float) -> None:
        """Take the lock (not re-entrant: `locked` is); IndexLockTimeout after `timeout_s`."""
        try:
            fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _WRLCK)
            self._depth = 1
            return
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        self._acquire(timeout_s)
        self._depth = 1

    def unlock(self) -> None:
        self._depth = 0
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, _UNLCK)

    def _acquire(self, timeout_s: float) -> None:
        _lock_waits[0] += 1
        request = _WRLCK
        # Held by someone else: holders keep it for microseconds, so poll with a short growing sleep
        # rather than block in F_OFD_SETLKW, which no timeout can interrupt.
        deadline = time.monotonic() + timeout_s
        pause = _LOCK_RETRY_MIN_S
        while True:
            time.sleep(pause)
            try:
                fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, request)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                raise IndexLockTimeout(f"the lock of index {self.name} was held for over {timeout_s:.3f} s")
            pause = min(pause * 2, _LOCK_RETRY_MAX_S)

    def _check_locked(self) -> None:
        if self._mm is None:
            raise ShmError(f"index {self.name} is closed")
        assert self._depth, "index accessed without its lock"

    # ------------------------------------------------------------------------------------ reading, writing
    # Python reads and writes the file with pread and pwrite, never through the mapping: a file another
    # process shrank reads short (IndexTruncated, which fails that transfer) where a load from a page past
    # the file's end would kill the process with SIGBUS. The mapping is the C kernel's (`handle`), which
    # reads it under its SIGBUS guard.

    def _read(self, offset: int, nbytes: int) -> bytes:
        if self._mm is None:
            raise ShmError(f"index {self.name} is closed")
        data = os.pread(self._fd, nbytes, offset)
        if len(data) != nbytes:
            raise IndexTruncated(f"index {self.name} ends before byte {offset + nbytes}: its file was shrunk")
        return data

    def _write(self, offset: int, data: bytes) -> None:
        if self._mm is None:
            raise ShmError(f"index {self.name} is closed")
        os.pwrite(self._fd, data, offset)

    # ------------------------------------------------------------------------------------ header

    def header(self) -> tuple[int, int]:
        """(state, flags)."""
        self._check_locked()
        raw = self._read(0, 64)
        return _U32.unpack_from(raw, 12)[0], _U32.unpack_from(raw, 56)[0]

    @property
    def epoch(self) -> int:
        return int(_U64.unpack(self._read(48, 8))[0])

    def bump_epoch(self) -> None:
        self._check_locked()
        self._write(48, _U64.pack((self.epoch + 1) & ((1 << 64) - 1)))

    # ------------------------------------------------------------------------------------ busy clusters

    def busy(self, cluster_id: int) -> bool:
        self._check_locked()
        if not _U32.unpack(self._read(_BUSY_COUNT_OFFSET, 4))[0]:
            return False  # the common case: the owner pushes into nobody
        words = _BUSY_ALL.unpack(self._read(_BUSY_OFFSET, _BUSY_ALL.size))
        return any(words[i] == cluster_id and words[i + 1] for i in range(0, 2 * BUSY_CAPACITY, 2))

    # ------------------------------------------------------------------------------------ caches

    def cache_flags(self, slot: int) -> int:
        self._check_locked()
        return int(_U32.unpack(self._read(self.cache_offset(slot) + 16, 4))[0])

    def cache(self, slot: int) -> CacheEntry:
        """The live cache in `slot`, checked; IndexCorrupt if the slot is free or its fields are absurd."""
        self._check_locked()
        return self._cache_entry(slot, self._read(self.cache_offset(slot), _CACHE_NBYTES))

    def _cache_entry(self, slot: int, raw: bytes) -> CacheEntry:
        name = raw[_CACHE_NAME_OFFSET : _CACHE_NAME_OFFSET + _SEGMENT_NAME_NBYTES]
        segment = self._segment_names.get(name)
        if segment is None:
            segment = name.split(b"\0", 1)[0].decode("ascii", "replace")
            if len(self._segment_names) >= 4096:
                self._segment_names.clear()
            self._segment_names[name] = segment
        entry = CacheEntry.decode(slot, raw, segment, self.addr_words)
        if entry is None:
            raise IndexCorrupt(f"cache entry {slot} of index {self.name} is not a valid cache")
        if entry.registered:
            count, tensor_nbytes = entry.num_tensors, entry.tensor_nbytes
            addrs = struct.unpack(f"<{count}Q", self._read(self._addrs_offset + 8 * entry.offset, 8 * count))
            if any(addr + tensor_nbytes > 1 << 64 for addr in addrs):
                raise IndexCorrupt(f"cache entry {slot} of index {self.name} passes the address space")
            entry = entry._replace(addrs=addrs)
        return entry

    @property
    def generations(self) -> str:
        """The owner's generation segment's name ("" if none)."""
        raw = self._read(_GENERATIONS_OFFSET, _SEGMENT_NAME_NBYTES)
        return raw.split(b"\0", 1)[0].decode("ascii", "replace")

    def live_caches(self) -> list[CacheEntry]:
        """Every live cache entry, checked (one read of the region, one numpy pass finds them)."""
        self._check_locked()
        region = self._read(self._caches_offset, self.caches * _CACHE_NBYTES)
        words = np.frombuffer(region, dtype="<u8")
        slots = np.flatnonzero(words[:: _CACHE_NBYTES // 8]).tolist()
        nbytes = _CACHE_NBYTES
        return [self._cache_entry(slot, region[slot * nbytes : (slot + 1) * nbytes]) for slot in slots]

    def blocks_names(self) -> list[NameEntry]:
        """Every live KIND_BLOCKS name (one read of the region, one numpy pass finds them)."""
        self._check_locked()
        region = self._read(self._names_offset, self.names * _NAME_NBYTES)
        words = np.frombuffer(region, dtype="<u4")
        stride = _NAME_NBYTES // 4
        found = np.flatnonzero((words[::stride] == NAME_LIVE) & (words[1::stride] == KIND_BLOCKS)).tolist()
        return [
            NameEntry.decode(index, region[index * _NAME_NBYTES : (index + 1) * _NAME_NBYTES])
            for index in found
        ]

    def cache_entry_bytes(self, slot: int) -> bytes:
        """Cache entry `slot` as stored (a repeat pin compares it byte for byte)."""
        return self._read(self.cache_offset(slot), _CACHE_NBYTES)

    def cache_offset(self, slot: int) -> int:
        if not 0 <= slot < self.caches:
            raise IndexCorrupt(f"cache slot {slot} outside an index of {self.caches}")
        return self._caches_offset + slot * _CACHE_NBYTES

    # ------------------------------------------------------------------------------------ names

    def lookup(self, kind: int, key_id: int, model_id: int) -> NameEntry | None:
        """The live name (kind, key_id, model_id), or None."""
        self._check_locked()
        bucket = _hash(kind, key_id, model_id) % self.buckets
        for _ in range(self.buckets):
            (stored,) = _U32.unpack(self._read(self._buckets_offset + 4 * bucket, 4))
            if not stored:
                return None
            raw = self._read(self.name_offset(stored - 1), _NAME_NBYTES)
            if _NAME_KEY.unpack_from(raw) == (NAME_LIVE, kind, key_id, model_id):
                return NameEntry.decode(stored - 1, raw)
            bucket = (bucket + 1) % self.buckets
        raise IndexCorrupt(f"index {self.name}: a hash chain with no end")

    def name_entry(self, index: int) -> NameEntry:
        self._check_locked()
        return NameEntry.decode(index, self._read(self.name_offset(index), _NAME_NBYTES))

    def set_name_state(self, index: int, state: int, mask: int, pulled: int | None = None) -> None:
        """Write a name's state and unclaimed mask (and its pulled mask, unless None)."""
        self._check_locked()
        offset = self.name_offset(index)
        self._write(offset, _U32.pack(state))
        self._write(offset + _NAME_MASK_OFFSET, _mask_bytes(mask))
        if pulled is not None:
            self._write(offset + _NAME_PULLED_OFFSET, _mask_bytes(pulled))

    def name_offset(self, index: int) -> int:
        if not 0 <= index < self.names:
            raise IndexCorrupt(f"name {index} outside an index of {self.names}")
        return self._names_offset + index * _NAME_NBYTES

    def consume(self, index: int, tensors: int) -> int:
        """Reserve the unclaimed tensors of bitmask `tensors` in name `index`; the bits reserved. A name
        with nothing left unclaimed becomes NAME_CONSUMED (lookups no longer find it) and the epoch moves."""
        entry = self.name_entry(index)
        taken = entry.mask & tensors
        if taken:
            left = entry.mask & ~taken
            self.set_name_state(index, NAME_LIVE if left else NAME_CONSUMED, left)
            if not left:
                self.bump_epoch()
        return taken

    def credit(self, index: int, tensors: int, cache_slot: int, generation: int) -> None:
        """A pull of the tensors of bitmask `tensors` ended well: they are pulled, whoever reserved them,
        if name `index` still names that cache. Once nothing is left unclaimed the name is consumed."""
        entry = self._same_key(index, cache_slot, generation)
        if entry is None or not tensors & ~entry.pulled:
            return
        left = entry.mask & ~tensors
        self.set_name_state(index, NAME_LIVE if left else NAME_CONSUMED, left, entry.pulled | tensors)
        if not left:
            self.bump_epoch()

    def restore(self, index: int, tensors: int, cache_slot: int, generation: int) -> None:
        """Give back the tensors a failed pull reserved, but for those another pull pulled meanwhile, if
        name `index` still names that cache."""
        entry = self._same_key(index, cache_slot, generation)
        if entry is None:
            return
        back = tensors & ~entry.pulled
        if back & ~entry.mask:
            self.set_name_state(index, NAME_LIVE, entry.mask | back)
            self.bump_epoch()

    def _same_key(self, index: int, cache_slot: int, generation: int) -> NameEntry | None:
        entry = self.name_entry(index)
        if (
            entry.state in (NAME_LIVE, NAME_CONSUMED)
            and entry.kind == KIND_REQ
            and (entry.cache_slot, entry.generation) == (cache_slot, generation)
        ):
            return entry
        return None

    # ------------------------------------------------------------------------------------ rows

    def row_state(self, row: int) -> tuple[int, int]:
        """(holder, state) of a row."""
        self._check_locked()
        holder, state = _ROW_HEAD.unpack(self._read(self.row_offset(row), _ROW_HEAD.size))
        return holder, state

    def row_incarnation(self, row: int) -> int:
        """The incarnation of the puller a row was handed to."""
        self._check_locked()
        return int(_U64.unpack(self._read(self.row_offset(row) + _ROW_INCARNATION_OFFSET, 8))[0])

    def row(self, row: int) -> RowEntry:
        self._check_locked()
        raw = self._read(self.row_offset(row), _ROW_NBYTES)
        incarnation, state, cache_slot, generation, name = _ROW.unpack_from(raw)
        return RowEntry(
            incarnation,
            state,
            cache_slot,
            generation,
            name - 1,
            _read_mask(raw, _ROW_MASK_OFFSET),
            _range_mask(*_ROW_RANGE.unpack_from(raw, _ROW_RANGE_OFFSET)),
        )

    def set_row(
        self, row: int, holder: int, cache_slot: int, generation: int, name: int, taken: int, pulled: range
    ) -> None:
        """A puller pins (cache_slot, generation) through its row, noting the name it pulls from, what it
        reserved of it and the tensors it pulls."""
        self._check_locked()
        offset = self.row_offset(row)
        self._write(offset, _ROW.pack(holder, 1, cache_slot, generation, name + 1))
        self._write(offset + _ROW_RANGE_OFFSET, _ROW_RANGE.pack(pulled.start, len(pulled)))
        self._write(offset + _ROW_MASK_OFFSET, _mask_bytes(taken))

    def clear_row(self, row: int, holder: int) -> None:
        """End the row's pin (its other fields mean nothing while its state is 0)."""
        self._check_locked()
        self._write(self.row_offset(row), _ROW.pack(holder, 0, 0, 0, 0))

    def regions(self) -> tuple[int, int, int, int, int, int]:
        """(caches offset, caches, names offset, names, buckets offset, buckets): where a lookup reads
        (`llm_datadist._puller.fresh`, the C kernel's `index_pull_key`)."""
        return (
            self._caches_offset,
            self.caches,
            self._names_offset,
            self.names,
            self._buckets_offset,
            self.buckets,
        )

    def row_offset(self, row: int) -> int:
        if not 0 <= row < self.rows:
            raise IndexCorrupt(f"row {row} outside an index of {self.rows}")
        return _ROWS_OFFSET + row * _ROW_NBYTES

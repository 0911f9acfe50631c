"""The owner's side of the published index (`shm.index` has the layout): it creates the file, writes it,
and never trusts what pullers can write there.

Rules: the owner keeps a private copy of everything it writes (the shadow, an anonymous mapping of the same
layout), and takes the index's structure (which bucket holds which name, what a name's key is) from that
copy, never from the shared file: a stray write into the file can mislead pullers until it is repaired, but
never the owner. Of the shared file the owner reads only the fields pullers legitimately write (a name's
state and unpulled mask, a row's pin, the epoch), each clamped to the values a puller may write. `audit`
compares the file with the shadow and checks those fields; `repair` puts back what the owner wrote and
clamps the rest, under the lock, leaving what pullers consumed and pinned as they left it (both by the
rules below, which `shm.index_audit` applies).

Which bytes are whose (offsets within each region; everything not listed is the owner's):

    header      [48, 56)   the epoch: pullers move it
    row         [8, 32)    state, cache slot, generation, name + 1: the row's holder writes them
                [40, 48)   the tensors the holder's pin pulls (first, count)
                [64, 128)  what the holder's pin reserved (a 512-bit mask)
    name        [0, 4)     state: a puller marks a name with nothing left unclaimed NAME_CONSUMED
                [64, 128)  the unclaimed mask: pullers reserve bits and give back what nobody pulled
                [128, 192) the pulled mask: pullers whose pull ended well set bits

Created by `OwnerIndex.create` (mode 0600, under a segment name, so the reaper removes it after a crash),
unlinked by `close` (or by a finalizer when the creating process exits without closing).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import struct
import weakref
from collections.abc import Iterable

import numpy as np

from .errors import ShmError
from .index import Index, IndexTruncated
from .index_audit import Regions, find_damage, puller_name_state, put_back
from .index_layout import (
    _BUSY,
    _BUSY_ALL,
    _BUSY_COUNT_OFFSET,
    _BUSY_OFFSET,
    _CACHE,
    _CACHE_NAME_OFFSET,
    _GENERATIONS_OFFSET,
    _HEADER,
    _MAGIC,
    _NAME,
    _NAME_MASK_OFFSET,
    _NAME_NBYTES,
    _ROW,
    _ROW_INCARNATION_OFFSET,
    _ROW_MASK_OFFSET,
    _ROW_NBYTES,
    _ROW_RANGE,
    _ROW_RANGE_OFFSET,
    _SEGMENT_NAME_NBYTES,
    _U32,
    BUSY_CAPACITY,
    KIND_REQ,
    LAYOUT_VERSION,
    NAME_CONSUMED,
    NAME_LIVE,
    STATE_CLOSED,
    STATE_OPEN,
    CacheEntry,
    NameEntry,
    RowEntry,
    _hash,
    _layout_nbytes,
    _mask_bytes,
    _range_mask,
    _read_mask,
)
from .names import make_segment_name
from .reaper import SHM_DIR
from .space import exhausted

__all__ = ["OwnerIndex"]


def _unlink_if_creator(name: str, creator_pid: int) -> None:
    # A weakref finalizer (GC or interpreter exit) of an owner that never closed; a forked child that exits
    # normally must not unlink its parent's index.
    if os.getpid() == creator_pid:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name[1:]))


class OwnerIndex(Index):
    """The owner's mapping of its index, its private shadow of what it wrote, and the writes themselves."""

    def __init__(
        self, name: str, fd: int, mapping: mmap.mmap, caps: tuple[int, int, int, int], shadow: mmap.mmap
    ) -> None:
        super().__init__(name, fd, mapping, caps)
        self._shadow: mmap.mmap | None = shadow
        self.repairs = 0  # how many times `repair` found something to put back
        self.regrowths = 0  # how many times another process had shrunk the file (grown back and repaired)
        self._shrunk = False  # a read found the file short: repaired at the next lock
        self._names_high = 0  # names [0, high) may be in use
        self._regions = Regions(
            self.rows, self.names, self._caches_offset, self._names_offset, self._buckets_offset, self.nbytes
        )
        # An owner that never closes (its process exits without finalizing) still unlinks the file.
        self._finalizer = weakref.finalize(self, _unlink_if_creator, name, os.getpid())

    @classmethod
    def create(
        cls,
        pid: int,
        incarnation: int,
        *,
        rows: int = 512,
        caches: int = 16384,
        names: int = 16384,
        generations: str = "",
    ) -> OwnerIndex:
        buckets = 2 * names
        nbytes = _layout_nbytes(rows, caches, names, buckets)
        raw = generations.encode()
        if len(raw) >= _SEGMENT_NAME_NBYTES:
            raise ShmError(f"generation segment name {generations!r} is too long for the index")
        for _ in range(8):
            name = make_segment_name()
            try:
                fd = os.open(os.path.join(SHM_DIR, name[1:]), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                break
            except FileExistsError:
                continue
        else:
            raise ShmError("could not create a uniquely named index")
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, nbytes)
            try:
                # Every page backed now: a write into a page tmpfs cannot back would be SIGBUS later.
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                raise exhausted(nbytes, "an owner's published index", error=exc.errno) from exc
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            # Private and anonymous: pages read before they are written are the zero page, not memory.
            shadow = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except BaseException:
            os.close(fd)
            os.unlink(os.path.join(SHM_DIR, name[1:]))
            raise
        header = _HEADER.pack(
            _MAGIC, LAYOUT_VERSION, STATE_OPEN, pid, incarnation, rows, caches, names, buckets, 0, 0
        )
        for target_offset, data in ((0, header), (_GENERATIONS_OFFSET, raw)):
            os.pwrite(fd, data, target_offset)
            shadow[target_offset : target_offset + len(data)] = data
        return cls(name, fd, mapping, (rows, caches, names, buckets), shadow)

    def forget_in_child(self) -> None:
        """In a process forked from the owner: unmap and close this process's copy only. The file, its
        state and its lock are the owner's (an OFD lock lives as long as any copy of the descriptor, so a
        child that kept it would keep a lock its owner took)."""
        self._finalizer.detach()
        super().close()

    def close(self) -> None:
        """Mark the index closed (pullers that still map it see that), unlink and unmap it."""
        if self._mm is None:
            return
        # Without the lock: a closing owner may be one whose lock a stopped process holds, and a single
        # aligned word is read whole.
        os.pwrite(self._fd, _U32.pack(STATE_CLOSED), 12)
        self._finalizer.detach()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self.name[1:]))
        shadow, self._shadow = self._shadow, None
        if shadow is not None:
            with contextlib.suppress(BufferError):
                shadow.close()
        super().close()

    # ------------------------------------------------------------------------------------ writing

    @property
    def _own(self) -> mmap.mmap:
        shadow = self._shadow
        if shadow is None:
            raise ShmError(f"index {self.name} is closed")
        return shadow

    def _pack(self, fmt: struct.Struct, offset: int, *values: object) -> None:
        """Write owner fields: the shared file and the shadow alike."""
        self._put(offset, fmt.pack(*values))

    def _put(self, offset: int, data: bytes) -> None:
        self._check_locked()
        self._write(offset, data)
        self._own[offset : offset + len(data)] = data

    def set_flags(self, flags: int) -> None:
        self._pack(_U32, 56, flags)

    def set_busy(self, cluster_id: int, delta: int) -> None:
        """Count a push into `cluster_id` in (+1) or out (-1)."""
        self._check_locked()
        own = self._own
        free = -1
        for i in range(BUSY_CAPACITY):
            cid, count = _BUSY.unpack_from(own, _BUSY_OFFSET + 16 * i)
            if count and cid == cluster_id:
                self._pack(_BUSY, _BUSY_OFFSET + 16 * i, cid, max(count + delta, 0))
                self._count_busy()
                return
            if not count and free < 0:
                free = i
        if delta <= 0:
            return
        if free < 0:
            raise ShmError(f"pushing into more than {BUSY_CAPACITY} clusters at once")
        self._pack(_BUSY, _BUSY_OFFSET + 16 * free, cluster_id, delta)
        self._count_busy()

    def _count_busy(self) -> None:
        words = _BUSY_ALL.unpack_from(self._own, _BUSY_OFFSET)
        self._pack(_U32, _BUSY_COUNT_OFFSET, sum(1 for count in words[1::2] if count))

    def put_cache(self, entry: CacheEntry) -> None:
        offset = self.cache_offset(entry.slot)
        raw = entry.segment.encode()
        if len(raw) >= _SEGMENT_NAME_NBYTES:
            raise ShmError(f"segment name {entry.segment!r} is too long for the index")
        self._pack(
            _CACHE,
            offset,
            entry.generation,
            entry.cache_id,
            entry.flags,
            entry.batch_size,
            entry.offset,
            entry.pitch_nbytes,
            entry.tensor_nbytes,
            entry.num_tensors,
            entry.segment_nbytes,
        )
        self._put(offset + _CACHE_NAME_OFFSET, raw.ljust(_SEGMENT_NAME_NBYTES, b"\0"))

    def set_cache_flags(self, slot: int, flags: int) -> None:
        self._pack(_U32, self.cache_offset(slot) + 16, flags)

    def cache_flags(self, slot: int) -> int:
        self._check_locked()
        return int(_U32.unpack_from(self._own, self.cache_offset(slot) + 16)[0])

    def clear_cache(self, slot: int) -> None:
        self._put(self.cache_offset(slot), bytes(128))

    def put_addresses(self, first_word: int, addrs: tuple[int, ...]) -> None:
        """A registered cache's tensor addresses, at words [first_word, + len(addrs))."""
        if not 0 <= first_word <= self.addr_words - len(addrs):
            raise ShmError(
                f"address words [{first_word}, +{len(addrs)}) outside the index's {self.addr_words}"
            )
        self._pack(struct.Struct(f"<{len(addrs)}Q"), self._addrs_offset + 8 * first_word, *addrs)

    # ------------------------------------------------------------------------------------ names

    def insert_name(
        self,
        index: int,
        kind: int,
        key_id: int,
        model_id: int,
        cache_slot: int,
        batch_slot: int,
        generation: int,
        *,
        target: int = -1,
        num_tensors: int = 0,
    ) -> None:
        """Write name entry `index` (free) and hash it in."""
        offset = self.name_offset(index)
        count = num_tensors if kind == KIND_REQ else 0
        self._pack(
            _NAME,
            offset,
            NAME_LIVE,
            kind,
            key_id,
            model_id,
            cache_slot,
            batch_slot,
            generation,
            target + 1,
            count,
        )
        self._write(offset + _NAME_MASK_OFFSET, _mask_bytes((1 << count) - 1))  # pullers' from now on
        self._names_high = max(self._names_high, index + 1)
        own = self._own
        bucket = _hash(kind, key_id, model_id) % self.buckets
        for _ in range(self.buckets):
            at = self._buckets_offset + 4 * bucket
            if not _U32.unpack_from(own, at)[0]:
                self._pack(_U32, at, index + 1)
                return
            bucket = (bucket + 1) % self.buckets
        raise ShmError("the index's hash is full")

    def retarget_name(self, index: int, cache_slot: int, generation: int) -> None:
        """Point a blocks name at another cache."""
        offset = self.name_offset(index)
        self._pack(_U32, offset + 24, cache_slot)
        self._pack(struct.Struct("<Q"), offset + 32, generation)

    def remove_name(self, index: int) -> None:
        """Unhash name `index` (linear probing, backward-shift deletion) and free its entry."""
        kind, key_id, model_id = self._key_of(index)
        own = self._own
        bucket = _hash(kind, key_id, model_id) % self.buckets
        for _ in range(self.buckets):
            stored = _U32.unpack_from(own, self._buckets_offset + 4 * bucket)[0]
            if not stored:
                break
            if stored == index + 1:
                self._delete_bucket(bucket)
                break
            bucket = (bucket + 1) % self.buckets
        self._put(self.name_offset(index), bytes(_NAME_NBYTES))

    def _key_of(self, index: int) -> tuple[int, int, int]:
        _, kind, key_id, model_id, *_ = _NAME.unpack_from(self._own, self.name_offset(index))
        return kind, key_id, model_id

    def _delete_bucket(self, hole: int) -> None:
        own = self._own
        size = self.buckets
        probe = hole
        for _ in range(size):
            probe = (probe + 1) % size
            stored = _U32.unpack_from(own, self._buckets_offset + 4 * probe)[0]
            if not stored:
                break
            home = _hash(*self._key_of(stored - 1)) % size
            # Move the entry into the hole unless its home lies cyclically in (hole, probe].
            if (probe - home) % size >= (probe - hole) % size:
                self._pack(_U32, self._buckets_offset + 4 * hole, stored)
                hole = probe
        self._pack(_U32, self._buckets_offset + 4 * hole, 0)

    def name_entry(self, index: int) -> NameEntry:
        """Name `index` as the owner wrote it, with the state and masks pullers left (clamped: a state no
        puller writes reads as live, mask bits past the key's tensors are not there, a pulled tensor is
        not unclaimed)."""
        self._check_locked()
        offset = self.name_offset(index)
        owned_state, kind, key_id, model_id, cache_slot, batch_slot, gen, target, count = _NAME.unpack_from(
            self._own, offset
        )
        if not owned_state:
            return NameEntry(index, 0, kind, key_id, model_id, cache_slot, batch_slot, gen, target - 1, 0)
        state, mask, pulled = puller_name_state(self._read(offset, _NAME_NBYTES), 0, count)
        return NameEntry(
            index, state, kind, key_id, model_id, cache_slot, batch_slot, gen, target - 1, mask, pulled
        )

    def restore(self, index: int, tensors: int, cache_slot: int, generation: int) -> None:
        super().restore(index, tensors & self._tensors_of(index), cache_slot, generation)

    def credit(self, index: int, tensors: int, cache_slot: int, generation: int) -> None:
        super().credit(index, tensors & self._tensors_of(index), cache_slot, generation)

    def _tensors_of(self, index: int) -> int:
        """The bitmask of every tensor of name `index`'s key (as the owner wrote it)."""
        return (1 << int(_NAME.unpack_from(self._own, self.name_offset(index))[8])) - 1

    def consumed_names(self) -> list[int]:
        """The indices of live names pullers marked NAME_CONSUMED (one read of the names in use, one numpy
        pass over them)."""
        self._check_locked()
        high = self._names_high
        if not high:
            return []
        shared = np.frombuffer(self._read(self._names_offset, high * _NAME_NBYTES), dtype="<u4")
        own = np.frombuffer(self._own, dtype="<u4", count=high * _NAME_NBYTES // 4, offset=self._names_offset)
        stride = _NAME_NBYTES // 4
        found: list[int] = np.flatnonzero(
            (shared[::stride] == NAME_CONSUMED) & (own[::stride] == NAME_LIVE)
        ).tolist()
        del own  # no export of the shadow may outlive this call (close needs none)
        return found

    # ------------------------------------------------------------------------------------ rows

    def assign_row(self, row: int, holder: int, incarnation: int) -> None:
        """Hand row `row` to the connection that got ticket `holder` in its handshake, from a puller of
        that incarnation; (0, 0) takes it back: nobody's, and every field cleared."""
        offset = self.row_offset(row)
        self._put(offset, bytes(_ROW_NBYTES))
        self._pack(_ROW, offset, holder, 0, 0, 0, 0)
        self._pack(struct.Struct("<Q"), offset + _ROW_INCARNATION_OFFSET, incarnation)

    def row(self, row: int) -> RowEntry:
        """The row as its holder left it, clamped: a row the owner handed to nobody pins nothing, nor does a
        state no holder writes, and a name outside the index is none."""
        self._check_locked()
        offset = self.row_offset(row)
        holder = struct.unpack_from("<Q", self._own, offset)[0]
        raw = self._read(offset, _ROW_NBYTES)
        _, state, cache_slot, generation, name = _ROW.unpack_from(raw)
        if not holder or state != 1:
            return RowEntry(holder, 0, 0, 0, -1, 0, 0)
        if not 0 <= name - 1 < self.names:
            return RowEntry(holder, 1, cache_slot, generation, -1, 0, 0)
        taken = _read_mask(raw, _ROW_MASK_OFFSET)
        pulled = _range_mask(*_ROW_RANGE.unpack_from(raw, _ROW_RANGE_OFFSET))
        return RowEntry(holder, 1, cache_slot, generation, name - 1, taken, pulled)

    def pinned(self, rows: Iterable[int]) -> dict[int, tuple[int, int]]:
        """row -> (cache slot, generation) for each of `rows` that pins a cache."""
        found: dict[int, tuple[int, int]] = {}
        for row in rows:
            entry = self.row(row)
            if entry.state:
                found[row] = (entry.cache_slot, entry.generation)
        return found

    # ------------------------------------------------------------------------------------ audit

    def audit(self) -> list[str]:
        """The regions where the shared file holds what no owner wrote and no puller may write ([]: none),
        "size" when it was shrunk; taken without the lock (`shm.index_audit.find_damage`)."""
        raw = os.pread(self._fd, self.nbytes, 0)
        if len(raw) != self.nbytes:
            return ["size"]
        return find_damage(raw, self._own, self._regions)

    def repair(self) -> bool:
        """Put back every byte the owner wrote and clamp what pullers wrote to what they may write, under
        the lock (the caller holds it); what pullers consumed and pinned stays. A shrunk file is grown back
        first: what pullers had written in the part that was cut (pins, reservations) is gone, and their
        transfers through it fail when they unpin. False if nothing was wrong."""
        self._check_locked()
        if not self.audit():
            return False
        self._regrow()
        shared = bytearray(self._read(0, self.nbytes))
        put_back(shared, self._own, self._regions)
        os.pwrite(self._fd, shared, 0)
        self.bump_epoch()
        self.repairs += 1
        return True

    def lock(self, timeout_s: float) -> None:
        """Take the lock; a file another process shrank (or a read that found it short) is grown back and
        repaired at once, before the owner reads or writes anything else of it."""
        super().lock(timeout_s)
        if self._shrunk or os.fstat(self._fd).st_size < self.nbytes:
            self._shrunk = False
            self.repair()
            self.regrowths += 1

    def _read(self, offset: int, nbytes: int) -> bytes:
        """A read that found the file shrunk grows it back (the owner's calls never fail for it) and reads
        zeros there; the repair comes with the next lock."""
        try:
            return super()._read(offset, nbytes)
        except IndexTruncated:
            self._regrow()
            self._shrunk = True
            return super()._read(offset, nbytes)

    def _regrow(self) -> None:
        if os.fstat(self._fd).st_size >= self.nbytes:
            return
        os.ftruncate(self._fd, self.nbytes)
        with contextlib.suppress(OSError):  # backed later, page by page, if /dev/shm is short now
            os.posix_fallocate(self._fd, 0, self.nbytes)

"""Pinning again what a pin found: the puller's fast path for a pull it repeats (see `shm.index`).

Rules: a `RepinPlan` is made from a pin that consumed nothing, just after it, and names the row, the name
entry and the cache entry that pin used. `repin` takes the index lock without waiting, checks under it that
each of them still says what it said then (the index open, no push into the puller's cluster when asked,
the row ours and idle, the name live with the same key, cache, batch slot and generation, the cache entry
byte for byte as that pin read it, flags aside), pins through the row as `_pin_locked` would and unlocks:
one short hold, no lookup, no decoding. Anything else is `STALE` (or `BUSY` when the lock is held) and the
caller pins the full way, which raises whatever the change calls for. `unpin` ends such a pin the same
way. The C kernel (shm/_copykernel.c) does each in one call, and `index_pull` both with the copy between
(a small copy under the lock itself, with the same checks); the functions here are the pure-Python twins.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
from collections.abc import Callable
from typing import NamedTuple

from .index import (
    _BUSY_COUNT_OFFSET,
    _CACHE_NBYTES,
    _MASK_NBYTES,
    _ROW,
    _ROW_MASK_OFFSET,
    _U32,
    _UNLCK,
    _WRLCK,
    CACHE_PENDING,
    NAME_LIVE,
    STATE_OPEN,
    CacheEntry,
    Index,
    NameEntry,
)

__all__ = [
    "BUSY",
    "DONE",
    "STALE",
    "Kernel",
    "RepinPlan",
    "kernel",
    "repin",
    "repin_python",
    "unpin",
    "unpin_python",
]

DONE = 0  # pinned (repin) or unpinned (unpin)
BUSY = 1  # the lock is held by someone else: nothing was done
STALE = 2  # repin: something changed, nothing was done; unpin: the row is no longer ours or pins nothing

# row offset, ticket, name offset, key id, model id, cache offset, generation, kind, cache slot, batch slot,
# whether a push into the puller's cluster stops the pin; then the cache entry as the first pin read it,
# its flags zeroed (they change while the cache lives; every other field is fixed for its generation). The
# C kernel reads the same 200 bytes.
_PLAN = struct.Struct("<QQQQQQQIIII128s")
_NAME_HEAD = struct.Struct("<IIQQIIQ")  # state, kind, key id, model id, cache slot, batch slot, generation
_ROW_HEAD = struct.Struct("<QI")  # holder, state
_U64 = struct.Struct("<Q")
_STATE_OFFSET = 12  # header: the index's state
_EPOCH_OFFSET = 48  # header: the epoch
_CACHE_FLAGS_OFFSET = 16  # of a cache entry: its u32 flags
_FLAGS = slice(_CACHE_FLAGS_OFFSET, _CACHE_FLAGS_OFFSET + 4)
_NO_MASK = bytes(_MASK_NBYTES)


class RepinPlan(NamedTuple):
    """What `repin` checks and writes, packed once (`plan`), and what `unpin` needs."""

    plan: bytes
    row_offset: int
    ticket: int
    cache_offset: int

    @classmethod
    def make(
        cls, index: Index, row: int, ticket: int, name: NameEntry, cache: CacheEntry, *, check_busy: bool
    ) -> RepinPlan:
        """The plan of a pin of `cache` through `row` that `name` found and consumed nothing of."""
        row_offset = index.row_offset(row)
        cache_offset = index.cache_offset(cache.slot)
        entry = bytearray(index.cache_entry_bytes(cache.slot))
        entry[_FLAGS] = bytes(4)
        plan = _PLAN.pack(
            row_offset,
            ticket,
            index.name_offset(name.number),
            name.key_id,
            name.model_id,
            cache_offset,
            cache.generation,
            name.kind,
            cache.slot,
            name.batch_slot,
            int(check_busy),
            bytes(entry),
        )
        return cls(plan, row_offset, ticket, cache_offset)


class Kernel(NamedTuple):
    """The C kernel's twins of `repin` and `unpin`, and `index_pull`: repin, copy the caller's runs and
    unpin, all in one call without the GIL; `index_pull_key` and `index_unpin_key`: a pull of a key looked
    up afresh (`llm_datadist._fresh`). See shm/_copykernel.c."""

    index_repin: Callable[[mmap.mmap, int, bytes], int]
    index_unpin: Callable[[mmap.mmap, int, int, int, int], int]
    index_pull: Callable[..., tuple[int, bool, int]]
    index_pull_key: Callable[[mmap.mmap, int, bytes, bytes, bytes, bytearray | None], int]
    index_unpin_key: Callable[[mmap.mmap, int, bytes], int]


def _load_kernel() -> Kernel | None:
    """The C kernel, or None (not built, a big-endian build, or LLM_DATADIST_NO_EXTENSION set)."""
    if os.environ.get("LLM_DATADIST_NO_EXTENSION", "") not in ("", "0"):
        return None
    try:
        from ._copykernel import index_pull, index_pull_key, index_repin, index_unpin, index_unpin_key
    except ImportError:
        return None
    return Kernel(index_repin, index_unpin, index_pull, index_pull_key, index_unpin_key)


# Module-level so that tests can swap it (None: the Python twins).
kernel = _load_kernel()


def repin(index: Index, plan: RepinPlan) -> int:
    """Pin again what `plan` names: DONE, BUSY or STALE."""
    fd, mm = index.handle
    if kernel is not None:
        return kernel.index_repin(mm, fd, plan.plan)
    return repin_python(fd, mm, plan)


def unpin(index: Index, plan: RepinPlan) -> int:
    """End a pin `repin` took: DONE, BUSY or STALE (the owner took the row back)."""
    fd, mm = index.handle
    if kernel is not None:
        return kernel.index_unpin(mm, fd, plan.row_offset, plan.ticket, plan.cache_offset)
    return unpin_python(fd, mm, plan)


def repin_python(fd: int, mm: mmap.mmap, plan: RepinPlan) -> int:
    """`repin`'s pure-Python twin. It reads and writes the file with pread and pwrite, never through the
    mapping `mm` (the C kernel's): a file shrunk under it is STALE, never SIGBUS."""
    if not _try_lock(fd):
        return BUSY
    try:
        (
            row_offset,
            ticket,
            name_offset,
            key_id,
            model_id,
            cache_offset,
            generation,
            kind,
            cache_slot,
            batch_slot,
            check_busy,
            entry,
        ) = _PLAN.unpack(plan.plan)
        header = _read(fd, 0, 64)
        row = _read(fd, row_offset, _ROW_HEAD.size)
        name = _read(fd, name_offset, _NAME_HEAD.size)
        cache = _read(fd, cache_offset, _CACHE_NBYTES)
        if header is None or row is None or name is None or cache is None:
            return STALE  # the file was shrunk: the full way fails the transfer
        if _U32.unpack_from(header, _STATE_OFFSET)[0] != STATE_OPEN:
            return STALE
        if check_busy and _U32.unpack_from(header, _BUSY_COUNT_OFFSET)[0]:
            return STALE
        if _ROW_HEAD.unpack(row) != (ticket, 0):
            return STALE
        if _NAME_HEAD.unpack(name) != (NAME_LIVE, kind, key_id, model_id, cache_slot, batch_slot, generation):
            return STALE
        if _U64.unpack_from(cache)[0] != generation:
            return STALE
        if cache[:16] != entry[:16] or cache[20:] != entry[20:]:
            return STALE  # a stray write into the entry: the full way refuses it
        os.pwrite(fd, _ROW.pack(ticket, 1, cache_slot, generation, 0), row_offset)
        os.pwrite(fd, _NO_MASK, row_offset + _ROW_MASK_OFFSET)
        return DONE
    finally:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _UNLCK)


def unpin_python(fd: int, mm: mmap.mmap, plan: RepinPlan) -> int:
    """`unpin`'s pure-Python twin (pread and pwrite, as `repin_python`)."""
    if not _try_lock(fd):
        return BUSY
    try:
        row_offset, ticket = plan.row_offset, plan.ticket
        row = _read(fd, row_offset, _ROW_HEAD.size)
        flags = _read(fd, plan.cache_offset + _CACHE_FLAGS_OFFSET, 4)
        epoch = _read(fd, _EPOCH_OFFSET, 8)
        if row is None or flags is None or epoch is None:
            return STALE
        holder, state = _ROW_HEAD.unpack(row)
        if holder != ticket or not state:
            return STALE
        if _U32.unpack(flags)[0] & CACHE_PENDING:
            # The owner frees what only this pin kept at its next look.
            os.pwrite(fd, _U64.pack((_U64.unpack(epoch)[0] + 1) & ((1 << 64) - 1)), _EPOCH_OFFSET)
        os.pwrite(fd, _ROW.pack(ticket, 0, 0, 0, 0), row_offset)
        return DONE
    finally:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _UNLCK)


def _read(fd: int, offset: int, nbytes: int) -> bytes | None:
    """`nbytes` at `offset`, or None when the file ends before them (another process shrank it)."""
    data = os.pread(fd, nbytes, offset)
    return data if len(data) == nbytes else None


def _try_lock(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _WRLCK)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True

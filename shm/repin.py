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
        entry = bytearray(index.handle[1][cache_offset : cache_offset + _CACHE_NBYTES])
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
    unpin, all in one call without the GIL (see shm/_copykernel.c)."""

    index_repin: Callable[[mmap.mmap, int, bytes], int]
    index_unpin: Callable[[mmap.mmap, int, int, int, int], int]
    index_pull: Callable[..., tuple[int, bool, int]]


def _load_kernel() -> Kernel | None:
    """The C kernel, or None (not built, a big-endian build, or LLM_DATADIST_NO_EXTENSION set)."""
    if os.environ.get("LLM_DATADIST_NO_EXTENSION", "") not in ("", "0"):
        return None
    try:
        from ._copykernel import index_pull, index_repin, index_unpin
    except ImportError:
        return None
    return Kernel(index_repin, index_unpin, index_pull)


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
    """`repin`'s pure-Python twin."""
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
        if _U32.unpack_from(mm, _STATE_OFFSET)[0] != STATE_OPEN:
            return STALE
        if check_busy and _U32.unpack_from(mm, _BUSY_COUNT_OFFSET)[0]:
            return STALE
        if _ROW_HEAD.unpack_from(mm, row_offset) != (ticket, 0):
            return STALE
        expected = (NAME_LIVE, kind, key_id, model_id, cache_slot, batch_slot, generation)
        if _NAME_HEAD.unpack_from(mm, name_offset) != expected:
            return STALE
        if _U64.unpack_from(mm, cache_offset)[0] != generation:
            return STALE
        if mm[cache_offset : cache_offset + 16] != entry[:16] or (
            mm[cache_offset + 20 : cache_offset + _CACHE_NBYTES] != entry[20:]
        ):
            return STALE  # a stray write into the entry: the full way refuses it
        _ROW.pack_into(mm, row_offset, ticket, 1, cache_slot, generation, 0)
        mm[row_offset + _ROW_MASK_OFFSET : row_offset + _ROW_MASK_OFFSET + _MASK_NBYTES] = _NO_MASK
        return DONE
    finally:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _UNLCK)


def unpin_python(fd: int, mm: mmap.mmap, plan: RepinPlan) -> int:
    """`unpin`'s pure-Python twin."""
    if not _try_lock(fd):
        return BUSY
    try:
        row_offset, ticket = plan.row_offset, plan.ticket
        holder, state = _ROW_HEAD.unpack_from(mm, row_offset)
        if holder != ticket or not state:
            return STALE
        if _U32.unpack_from(mm, plan.cache_offset + _CACHE_FLAGS_OFFSET)[0] & CACHE_PENDING:
            # The owner frees what only this pin kept at its next look.
            (epoch,) = _U64.unpack_from(mm, _EPOCH_OFFSET)
            _U64.pack_into(mm, _EPOCH_OFFSET, (epoch + 1) & ((1 << 64) - 1))
        _ROW.pack_into(mm, row_offset, ticket, 0, 0, 0, 0)
        return DONE
    finally:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _UNLCK)


def _try_lock(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _WRLCK)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True

"""Audit and repair of an owner's published index: the shared file checked against the owner's shadow.

Rules: the shadow (what the owner wrote) decides every byte the owner owns; of the fields pullers write (the
table "which bytes are whose" in `shm.index_owner`) only values a puller may write pass. `find_damage`
changes nothing and needs no lock; `put_back` corrects a copy of the shared file that its caller, holding
the lock, writes back.
"""

from __future__ import annotations

import mmap
import struct
from typing import Any, NamedTuple

import numpy as np

from .index_layout import (
    _NAME,
    _NAME_MASK_OFFSET,
    _NAME_NBYTES,
    _NAME_PULLED_OFFSET,
    _ROW,
    _ROW_NBYTES,
    _ROWS_OFFSET,
    _U32,
    NAME_CONSUMED,
    NAME_LIVE,
    _read_mask,
    _write_mask,
)

__all__ = ["Regions", "find_damage", "puller_name_state", "put_back"]

_EPOCH = slice(48, 56)  # the header's epoch: pullers move it
# The shared file as read: the owner reads it with pread, never through a mapping.
_Buffer = bytes | bytearray | mmap.mmap


class Regions(NamedTuple):
    """Where an index's regions start (byte offsets in the file), and how many rows and names it has."""

    rows: int
    names: int
    caches_offset: int
    names_offset: int
    buckets_offset: int
    nbytes: int


def puller_name_state(shared: _Buffer, offset: int, count: int) -> tuple[int, int, int]:
    """(state, unclaimed mask, pulled mask) that pullers left in the name at `offset`, clamped to what
    pullers write: mask bits past the key's `count` tensors are not there, a pulled tensor is not
    unclaimed, a key pulled whole is consumed, and any other state than live or consumed reads as live. A
    live req key with nothing unclaimed is never written (pullers mark it consumed): its masks were lost
    (a file shrunk under them, zeros read back), and what was not pulled is unclaimed again."""
    state = _U32.unpack_from(shared, offset)[0]
    tensors = (1 << count) - 1
    pulled = _read_mask(shared, offset + _NAME_PULLED_OFFSET) & tensors
    mask = _read_mask(shared, offset + _NAME_MASK_OFFSET) & tensors & ~pulled
    if tensors and pulled == tensors:
        return NAME_CONSUMED, 0, pulled
    if state != NAME_CONSUMED and not mask:
        return NAME_LIVE, tensors & ~pulled, pulled
    return (state if state in (NAME_LIVE, NAME_CONSUMED) else NAME_LIVE), mask, pulled


def find_damage(shared: _Buffer, own: mmap.mmap, regions: Regions) -> list[str]:
    """The regions where the shared file holds what no owner wrote and no puller may write ([]: none).
    A few numpy compares over 64-bit words (a couple of milliseconds for the default capacities), taken
    without the lock: pullers write only their own fields, which it leaves out or only range-checks."""
    damaged = []
    shared_words = np.frombuffer(shared, dtype="<u8", count=regions.nbytes // 8)
    own_words = np.frombuffer(own, dtype="<u8", count=regions.nbytes // 8)
    try:
        epoch = _EPOCH.start // 8
        header_end = _ROWS_OFFSET // 8
        if not (
            np.array_equal(shared_words[:epoch], own_words[:epoch])
            and np.array_equal(shared_words[epoch + 1 : header_end], own_words[epoch + 1 : header_end])
        ):
            damaged.append("header")
        if not _rows_sane(
            _words(shared_words, _ROWS_OFFSET, regions.rows, _ROW_NBYTES),
            _words(own_words, _ROWS_OFFSET, regions.rows, _ROW_NBYTES),
        ):
            damaged.append("rows")
        caches = slice(regions.caches_offset // 8, regions.names_offset // 8)
        if not np.array_equal(shared_words[caches], own_words[caches]):
            damaged.append("caches")
        if not _names_sane(
            _words(shared_words, regions.names_offset, regions.names, _NAME_NBYTES),
            _words(own_words, regions.names_offset, regions.names, _NAME_NBYTES),
        ):
            damaged.append("names")
        tail = regions.buckets_offset // 8
        if not np.array_equal(shared_words[tail:], own_words[tail:]):
            damaged.append("buckets and addresses")
    finally:
        # No export of a mapping may outlive this call (closing the index needs none).
        del shared_words, own_words
    return damaged


def _words(view: np.ndarray[Any, Any], offset: int, count: int, nbytes: int) -> np.ndarray[Any, Any]:
    """A region as one row of 64-bit words per entry."""
    return view[offset // 8 : (offset + count * nbytes) // 8].reshape(count, nbytes // 8)


def _rows_sane(rows: np.ndarray[Any, Any], own: np.ndarray[Any, Any]) -> bool:
    """Words 0 (holder), 4 (incarnation) and 6-7 (padding) are the owner's; a row handed to nobody is all
    zero; a holder's state (the low half of word 1) is 0 or 1."""
    if not (
        np.array_equal(rows[:, 0], own[:, 0])
        and np.array_equal(rows[:, 4], own[:, 4])
        and np.array_equal(rows[:, 6:8], own[:, 6:8])
    ):
        return False
    free = own[:, 0] == 0
    return not rows[free].any() and bool(np.all((rows[:, 1] & 0xFFFFFFFF) <= 1))


def _names_sane(names: np.ndarray[Any, Any], own: np.ndarray[Any, Any]) -> bool:
    """The owner's part of each name is as written (the high half of word 0, words 1-7); a free name is
    all zero; a live one is live or consumed, and its masks (words 8-15 unclaimed, 16-23 pulled) have no
    bit past its key's tensor count (the high half of word 5) and none in common."""
    if not (
        np.array_equal(names[:, 1:8], own[:, 1:8]) and np.array_equal(names[:, 0] >> 32, own[:, 0] >> 32)
    ):
        return False
    live = (own[:, 0] & 0xFFFFFFFF) != 0
    states = names[:, 0] & 0xFFFFFFFF
    if np.any(states[~live]) or not np.all((states[live] == NAME_LIVE) | (states[live] == NAME_CONSUMED)):
        return False
    masks = names[:, 8:]
    with_bits = np.bitwise_or.reduce(masks, axis=1) != 0
    if np.any(with_bits & ~live):
        return False
    which = np.flatnonzero(with_bits)
    if not len(which):
        return True
    unclaimed, pulled = masks[which, :8], masks[which, 8:16]
    counts = (own[which, 5] >> 32).astype(np.int64)
    # Word j holds bits [64 j, 64 j + 64): the first count - 64 j of them (clamped to [0, 64]) may be set.
    allowed = np.clip(counts[:, None] - 64 * np.arange(8)[None, :], 0, 64)
    low = np.where(allowed >= 64, ~np.uint64(0), (np.uint64(1) << allowed.astype(np.uint64)) - np.uint64(1))
    return not (np.any(unclaimed & ~low) or np.any(pulled & ~low) or np.any(unclaimed & pulled))


def put_back(shared: bytearray, own: mmap.mmap, regions: Regions) -> None:
    """Put back every byte the owner wrote and clamp what pullers wrote to what they may write; what pullers
    consumed and pinned stays. The caller holds the lock, and moves the epoch afterwards."""
    shared[: _EPOCH.start] = own[: _EPOCH.start]
    shared[_EPOCH.stop : _ROWS_OFFSET] = own[_EPOCH.stop : _ROWS_OFFSET]
    for row in range(regions.rows):
        offset = _ROWS_OFFSET + row * _ROW_NBYTES
        state = _ROW.unpack_from(shared, offset)[1]
        if not struct.unpack_from("<Q", own, offset)[0] or state > 1:
            shared[offset : offset + _ROW_NBYTES] = own[offset : offset + _ROW_NBYTES]  # idle: nothing pinned
        else:
            shared[offset : offset + 8] = own[offset : offset + 8]
            shared[offset + 32 : offset + 40] = own[offset + 32 : offset + 40]
            shared[offset + 48 : offset + 64] = own[offset + 48 : offset + 64]
    shared[regions.caches_offset : regions.names_offset] = own[regions.caches_offset : regions.names_offset]
    for index in range(regions.names):
        offset = regions.names_offset + index * _NAME_NBYTES
        shared[offset + 4 : offset + 64] = own[offset + 4 : offset + 64]
        owned_state, *_, count = _NAME.unpack_from(own, offset)
        if not owned_state:
            shared[offset : offset + _NAME_NBYTES] = bytes(_NAME_NBYTES)
        else:
            state, mask, pulled = puller_name_state(shared, offset, count)
            _U32.pack_into(shared, offset, state)
            _write_mask(shared, offset + _NAME_MASK_OFFSET, mask)
            _write_mask(shared, offset + _NAME_PULLED_OFFSET, pulled)
    shared[regions.buckets_offset : regions.nbytes] = own[regions.buckets_offset : regions.nbytes]

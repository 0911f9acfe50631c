"""First-fit allocation of aligned, prefaulted blocks out of shared-memory segments this process owns.

The pool creates, closes and unlinks its segments; a `Block` is only a (segment, offset, nbytes) handle. Not
thread-safe: the caller holds a lock around every call. Every byte handed out has its pages populated for
writing, so no later copy into a block takes a page fault.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .errors import OutOfPoolMemory, SharedMemoryExhausted, ShmError
from .segment import PAGE_NBYTES, Segment
from .space import check_space, exhausted, format_nbytes

__all__ = ["Block", "Pool"]


def _align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


@dataclass(frozen=True)
class Block:
    """`nbytes` bytes at `offset` in `segment`, as returned by `Pool.allocate` (valid until freed)."""

    segment: Segment
    offset: int
    nbytes: int

    @property
    def address(self) -> int:
        """Virtual address of the first byte in this process."""
        return self.segment.address + self.offset

    def array(self) -> npt.NDArray[np.uint8]:
        """A 1-D uint8 view of exactly the block's bytes."""
        return self.segment.view(self.offset, self.nbytes)


@dataclass(eq=False)
class _Arena:
    """Bookkeeping for one segment: sorted, disjoint, non-adjacent free ranges and the live reservations."""

    segment: Segment
    free_offsets: list[int] = field(default_factory=list)
    free_nbytes: list[int] = field(default_factory=list)
    # offset -> (block, reserved nbytes); the reservation is the block's nbytes rounded up to the alignment.
    reserved: dict[int, tuple[Block, int]] = field(default_factory=dict)
    used_nbytes: int = 0
    # Pages below this offset were populated once and stay backed (freeing a block keeps its pages): a
    # block there costs /dev/shm nothing new. First fit fills segments from the start, so the prefix is all.
    backed_end_offset: int = 0

    @classmethod
    def over(cls, segment: Segment) -> _Arena:
        return cls(segment, [0], [segment.nbytes])

    def take(self, reserve_nbytes: int, alignment: int) -> int | None:
        """Reserve the first free range that fits (address aligned); its offset, or None."""
        base_address = self.segment.address
        for index, (start_offset, nbytes) in enumerate(zip(self.free_offsets, self.free_nbytes, strict=True)):
            offset = _align_up(base_address + start_offset, alignment) - base_address
            end_offset = start_offset + nbytes
            if offset + reserve_nbytes > end_offset:
                continue
            # Split [start, end) into the alignment gap (stays free), the reservation, the tail (stays free).
            del self.free_offsets[index], self.free_nbytes[index]
            if offset + reserve_nbytes < end_offset:
                self.free_offsets.insert(index, offset + reserve_nbytes)
                self.free_nbytes.insert(index, end_offset - offset - reserve_nbytes)
            if offset > start_offset:
                self.free_offsets.insert(index, start_offset)
                self.free_nbytes.insert(index, offset - start_offset)
            self.used_nbytes += reserve_nbytes
            return offset
        return None

    def give_back(self, offset: int, nbytes: int) -> None:
        """Return [offset, offset + nbytes) to the free list, merging with free neighbours on either side."""
        index = bisect.bisect_left(self.free_offsets, offset)
        end_offset = offset + nbytes
        if index < len(self.free_offsets) and self.free_offsets[index] == end_offset:
            end_offset += self.free_nbytes[index]
            del self.free_offsets[index], self.free_nbytes[index]
        if index > 0 and self.free_offsets[index - 1] + self.free_nbytes[index - 1] == offset:
            index -= 1
            offset = self.free_offsets[index]
            del self.free_offsets[index], self.free_nbytes[index]
        self.free_offsets.insert(index, offset)
        self.free_nbytes.insert(index, end_offset - offset)
        self.used_nbytes -= nbytes

    @property
    def empty(self) -> bool:
        return not self.reserved


class Pool:
    """A first-fit allocator over one or more segments that it creates, owns, closes and unlinks.

    Layout of each segment (offsets from its page-aligned base address; a, b multiples of `alignment` in
    address terms, r(X) = X.nbytes rounded up to `alignment`)::

        offset                      bytes
        0                           free range (free ranges are sorted and coalesced on `free`)
        a                           block A: A.nbytes bytes, (base + a) % alignment == 0
        a + A.nbytes                padding, reserved with A up to a + r(A)
        a + r(A)                    free range
        b                           block B: B.nbytes bytes, aligned likewise
        b + B.nbytes                padding up to b + r(B)
        ...
        segment.nbytes              end (a page multiple)

    Block addresses (not just offsets) are multiples of `alignment`; each reservation is the block's nbytes
    rounded up to `alignment`, so with the default alignment (one page) no two blocks share a page. Free
    ranges are kept sorted and coalesced with their neighbours on `free`. Segments are created with
    prefault=False; `allocate` prefaults only the reserved range, so untouched capacity costs no memory.

    Sizing: with `capacity_nbytes`, exactly one segment of that size (rounded up to a page), created at the
    first `allocate`, never grown: `OutOfPoolMemory` when nothing fits. Without it, the pool grows by a new
    segment of max(chunk_nbytes, the request rounded up to a page) when nothing fits, and closes and unlinks
    a segment that becomes entirely free, except the most recently created one (so an allocate/free cycle at
    the edge does not create and destroy a segment each time).

    Lifetime: the pool creates each segment (`Segment.create`, this process owns it), maps it here, and is the
    only one to close and unlink it: at `close`, or when it falls empty in a growing pool. Peers map it by
    name (`MappingCache`) and never unlink it. Blocks are views into a segment and must not be used after
    their `free` or the pool's `close`. Not thread-safe.
    """

    def __init__(
        self, *, capacity_nbytes: int | None = None, chunk_nbytes: int = 64 << 20, alignment: int = 4096
    ) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if capacity_nbytes is not None and capacity_nbytes <= 0:
            raise ValueError(f"capacity_nbytes must be positive, got {capacity_nbytes}")
        if chunk_nbytes <= 0:
            raise ValueError(f"chunk_nbytes must be positive, got {chunk_nbytes}")
        self._capacity_nbytes = None if capacity_nbytes is None else _align_up(capacity_nbytes, PAGE_NBYTES)
        self._chunk_nbytes = chunk_nbytes
        self._alignment = alignment
        self._arenas: list[_Arena] = []  # in creation order; the last one is never dropped when empty
        self._closed = False
        # Called with each segment just before the pool closes it (whoever exposed its memory elsewhere,
        # such as to a transfer engine, withdraws it there first). It must not raise.
        self.on_release: Callable[[Segment], None] | None = None

    @property
    def segments(self) -> list[Segment]:
        """The segments currently held, oldest first (a copy of the list)."""
        return [arena.segment for arena in self._arenas]

    @property
    def used_nbytes(self) -> int:
        """Bytes reserved by live blocks, each counted rounded up to the alignment."""
        return sum(arena.used_nbytes for arena in self._arenas)

    @property
    def capacity_nbytes(self) -> int | None:
        """The fixed capacity (rounded up to a page), or None for a growing pool."""
        return self._capacity_nbytes

    @property
    def alignment(self) -> int:
        return self._alignment

    def allocate(self, nbytes: int) -> Block:
        """A block of `nbytes` (> 0) at an aligned address, its pages prefaulted for writing.

        Raises ValueError for nbytes <= 0, `OutOfPoolMemory` when a fixed pool has no free range that fits,
        `SharedMemoryExhausted` (an `OutOfPoolMemory`) when /dev/shm cannot back the pages: checked before
        populating any (what it has free against what the block adds), and again if populating fails, in
        which case the pages it did populate are given back before the error is raised.
        """
        if self._closed:
            raise ShmError("pool is closed")
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        reserve_nbytes = _align_up(nbytes, self._alignment)
        for arena in self._arenas:
            offset = arena.take(reserve_nbytes, self._alignment)
            if offset is not None:
                return self._hand_out(arena, offset, nbytes, reserve_nbytes)
        if self._capacity_nbytes is not None and self._arenas:
            raise OutOfPoolMemory(
                f"no free range of {reserve_nbytes} bytes in a pool of {self._capacity_nbytes} bytes "
                f"({self.used_nbytes} in use)"
            )
        if self._capacity_nbytes is None:
            # A new segment only for this block: refuse before making it (its pages are all new).
            check_space(reserve_nbytes, f"a pool block of {format_nbytes(nbytes)}")
        arena = self._add_arena(reserve_nbytes)
        offset = arena.take(reserve_nbytes, self._alignment)
        if offset is None:
            assert self._capacity_nbytes is not None  # a grown segment is sized to fit the request
            raise OutOfPoolMemory(
                f"{nbytes} bytes exceed the pool's capacity of {self._capacity_nbytes} bytes"
            )
        return self._hand_out(arena, offset, nbytes, reserve_nbytes)

    def free(self, block: Block) -> None:
        """Return a block to the pool. `ShmError` for a block this pool did not hand out or already took back.

        After `close` this does nothing: close already released every block.
        """
        if self._closed:
            return
        arena = self._arena_of(block.segment)
        entry = arena.reserved.get(block.offset) if arena is not None else None
        if arena is None or entry is None or entry[0] != block:
            raise ShmError(
                f"block at offset {block.offset} of {block.segment.name} is not allocated from this pool"
            )
        del arena.reserved[block.offset]
        arena.give_back(block.offset, entry[1])
        if self._capacity_nbytes is None and arena.empty and arena is not self._arenas[-1]:
            self._arenas.remove(arena)
            self._release(arena.segment)

    def close(self) -> None:
        """Close and unlink every segment. Idempotent; blocks still held become invalid."""
        self._closed = True
        arenas, self._arenas = self._arenas, []
        for arena in arenas:
            self._release(arena.segment)

    def __repr__(self) -> str:
        return (
            f"<Pool segments={len(self._arenas)} used_nbytes={self.used_nbytes} "
            f"capacity_nbytes={self._capacity_nbytes} alignment={self._alignment}>"
        )

    def _hand_out(self, arena: _Arena, offset: int, nbytes: int, reserve_nbytes: int) -> Block:
        end_offset = offset + reserve_nbytes
        new_offset = max(offset, arena.backed_end_offset)  # from here on, the pages are not backed yet
        what = f"a pool block of {format_nbytes(nbytes)}"
        try:
            check_space(end_offset - new_offset, what)
            arena.segment.prefault(offset, reserve_nbytes)
        except SharedMemoryExhausted as exc:
            arena.give_back(offset, reserve_nbytes)
            if exc.error is None:
                raise  # refused by the check: nothing was populated
            # Populating failed part way: what it did populate would stay in /dev/shm, unused, until the
            # segment goes. Give those pages back, then say what is free once they are.
            if end_offset > new_offset:
                arena.segment.release(new_offset, end_offset - new_offset)
            raise exhausted(end_offset - new_offset, what, error=exc.error) from exc
        except BaseException:
            arena.give_back(offset, reserve_nbytes)
            raise
        arena.backed_end_offset = max(arena.backed_end_offset, end_offset)
        block = Block(arena.segment, offset, nbytes)
        arena.reserved[offset] = (block, reserve_nbytes)
        return block

    def _add_arena(self, reserve_nbytes: int) -> _Arena:
        if self._capacity_nbytes is not None:
            segment_nbytes = self._capacity_nbytes
        else:
            # Alignments above a page may need up to (alignment - page) bytes of padding before the block.
            pad_nbytes = max(0, self._alignment - PAGE_NBYTES)
            segment_nbytes = max(self._chunk_nbytes, _align_up(reserve_nbytes + pad_nbytes, PAGE_NBYTES))
        arena = _Arena.over(Segment.create(segment_nbytes, prefault=False))
        # An empty segment kept as "most recent" did not fit this request; it loses that status, so drop it.
        for stale in [old for old in self._arenas if old.empty]:
            self._arenas.remove(stale)
            self._release(stale.segment)
        self._arenas.append(arena)
        return arena

    def _release(self, segment: Segment) -> None:
        if self.on_release is not None:
            self.on_release(segment)
        segment.close()

    def _arena_of(self, segment: Segment) -> _Arena | None:
        for arena in self._arenas:
            if arena.segment is segment:
                return arena
        return None

"""Generation words: how a one-sided reader learns that a cache it read was freed or reused meanwhile.

Layout of the owner's generation segment (created by `GenerationTable`, mapped read-only by readers)::

    offset 0           8               16                    8*capacity
    | version: u64     | slot 1: u64   | ...                 |

Word 0 is the table's version: it starts at 1 and the owner increments it whenever what its keys name
changes in a way a reader's copy of the table cannot notice by itself (a blocks key bound to another
cache); a reader that fetched the table at version v refetches once the word is no longer v. Slot i >= 1
holds the generation of the live cache assigned to it, or 0 while free. The owner writes a cache's
word when it is created and zeroes it *before* its memory goes back to the pool, so a reader that sees the
cache's generation after its copy read a cache that lived throughout. Ordering: on the owner's side the
zeroing store precedes, in program order, the lock release through which the memory is handed out again
(a release orders earlier stores on every CPU); on the reader's side the copy's loads must complete before
the word is read, which x86-64 guarantees and weakly ordered CPUs (aarch64) need a barrier for: the reader
places one (see `llm_datadist._core`). Not thread-safe: the owner's cache table serialises calls. The
owner creates, closes and unlinks the segment.
"""

from __future__ import annotations

import struct

import numpy as np

from .errors import ShmError
from .segment import Segment

__all__ = ["DEFAULT_CAPACITY", "GenerationTable", "read_generation"]

_WORD = struct.Struct("=Q")  # one generation word, native byte order as numpy's uint64 writes it

DEFAULT_CAPACITY = 65536  # live caches per process; 512 KiB of words


class GenerationTable:
    """The owner's side: hands out (slot, generation) pairs and retires them."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity <= 1:
            raise ValueError(f"capacity must be at least 2 (the version word and a slot), got {capacity}")
        self.segment = Segment.create(capacity * 8)
        self._words = self.segment.array.view(np.uint64)
        self._words[0] = 1
        self._free = list(range(capacity - 1, 0, -1))
        self._next_generation = 1

    @property
    def version(self) -> int:
        return int(self._words[0])

    def bump_version(self) -> None:
        """A reader's copy of the table may now name the wrong cache: make it refetch."""
        self._words[0] += 1

    @property
    def name(self) -> str:
        return self.segment.name

    def acquire(self) -> tuple[int, int]:
        """A free slot and a generation never used before in this process, published in the slot."""
        if not self._free:
            raise ShmError("no free generation slot: too many live caches")
        slot = self._free.pop()
        generation = self._next_generation
        self._next_generation += 1
        self._words[slot] = generation
        return slot, generation

    def retire(self, slot: int) -> None:
        """Zero the slot (before the cache's memory is reused) and make it available again."""
        self._words[slot] = 0
        self._free.append(slot)

    def close(self) -> None:
        self._words = np.empty(0, dtype=np.uint64)
        self.segment.close()


def read_generation(generations: Segment, slot: int) -> int:
    """The generation word `slot` of a mapped generation segment (bounds-checked)."""
    if not 0 <= slot < generations.nbytes // 8:
        raise ShmError(f"generation slot {slot} outside a table of {generations.nbytes // 8}")
    (word,) = _WORD.unpack_from(generations.array.data, slot * 8)
    return int(word)

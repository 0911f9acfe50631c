"""Internal errors of `shm/`, each named by the condition it reports.

`llm_datadist` translates them to `LLMException` at one place; nothing here knows about status codes.
"""

from __future__ import annotations


class ShmError(Exception):
    """Base class: a shared-memory operation could not be done as asked."""


class SegmentNotFound(ShmError):
    """No shared-memory object has that name (never created, or already unlinked)."""


class SegmentTooSmall(ShmError):
    """A segment is smaller than the caller needs (or empty: its creator has not sized it yet)."""


class OutOfPoolMemory(ShmError):
    """A pool has no free range large enough for the request."""


class SharedMemoryExhausted(OutOfPoolMemory):
    """The kernel could not back the pages (the tmpfs behind /dev/shm is full, or memory ran out).

    A subclass of `OutOfPoolMemory` so a caller that handles a full pool handles a full host the same way.
    """


class InvalidRange(ShmError):
    """An (offset, nbytes) range or copy run falls outside the memory it addresses, or is negative."""


class ProcessGone(ShmError):
    """The process asked about does not exist (it exited, or was never there)."""

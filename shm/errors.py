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
    """The tmpfs behind /dev/shm cannot back the pages asked for (it is full, or memory ran out), found by a
    check before populating them or by the population failing. `space.exhausted` builds it: the message
    names the directory and its mount, the bytes needed and free, and how to make it larger.

    A subclass of `OutOfPoolMemory` so a caller that handles a full pool handles a full host the same way.
    """

    def __init__(
        self,
        message: str,
        *,
        needed_nbytes: int = 0,
        free_nbytes: int = 0,
        size_nbytes: int = 0,
        directory: str = "/dev/shm",
        error: int | None = None,
    ) -> None:
        super().__init__(message)
        self.error = error  # the errno of the population that failed; None: refused before populating
        self.needed_nbytes = needed_nbytes
        self.free_nbytes = free_nbytes
        self.size_nbytes = size_nbytes
        self.directory = directory


class InvalidRange(ShmError):
    """An (offset, nbytes) range or copy run falls outside the memory it addresses, or is negative."""


class ProcessGone(ShmError):
    """The process asked about does not exist (it exited, or was never there)."""

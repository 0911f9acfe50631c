"""Mappings of other processes' segments, made once and reused: mapped once per peer, not once per pull.

The cache attaches (never creates or unlinks) and closes what it attached. Not thread-safe: the caller locks.
"""

from __future__ import annotations

from shm.errors import SegmentTooSmall
from shm.segment import Segment

__all__ = ["MappingCache"]


class MappingCache:
    """Attached `Segment`s keyed by (name, writable); each is attached on first `get` and closed on `drop`."""

    def __init__(self) -> None:
        self._segments: dict[tuple[str, bool], Segment] = {}

    def get(self, name: str, *, min_nbytes: int = 0, writable: bool = False) -> Segment:
        """The mapping of segment `name`, attaching it the first time.

        Raises `SegmentNotFound` if it must be attached and is gone, `SegmentTooSmall` if it (or the cached
        mapping) holds fewer than `min_nbytes` bytes.
        """
        if not name.startswith("/"):
            name = "/" + name
        key = (name, writable)
        segment = self._segments.get(key)
        if segment is None:
            segment = Segment.attach(name, writable=writable, min_nbytes=min_nbytes)
            self._segments[key] = segment
        elif segment.nbytes < min_nbytes:
            raise SegmentTooSmall(
                f"segment {name!r} holds {segment.nbytes} bytes, need at least {min_nbytes}"
            )
        return segment

    def drop(self, name: str) -> None:
        """Close the mappings of `name` (read-only and writable), if any."""
        if not name.startswith("/"):
            name = "/" + name
        for writable in (False, True):
            segment = self._segments.pop((name, writable), None)
            if segment is not None:
                segment.close()

    def clear(self) -> None:
        """Close every mapping."""
        segments, self._segments = self._segments, {}
        for segment in segments.values():
            segment.close()

    def __len__(self) -> int:
        return len(self._segments)

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        if not name.startswith("/"):
            name = "/" + name
        return (name, False) in self._segments or (name, True) in self._segments

"""Mappings of other processes' segments, made once and reused: mapped once per peer, not once per pull.

The cache attaches (never creates or unlinks) and closes what it attached. A mapping is dropped once its
owner unlinked the segment (`drop_unlinked`), so freed memory is not kept alive here. Not thread-safe:
the caller locks.
"""

from __future__ import annotations

import os

from .errors import SegmentTooSmall
from .reaper import SHM_DIR
from .segment import Segment

__all__ = ["MappingCache", "segment_exists"]


def segment_exists(name: str) -> bool:
    """Whether the segment `name` (with or without its leading '/') still has a name in /dev/shm."""
    return os.path.exists(SHM_DIR + "/" + name.lstrip("/"))


class MappingCache:
    """Attached `Segment`s keyed by (name, writable); each is attached on first `get` and closed on `drop`.

    Closing a mapping that a copy still uses is safe: the unmap waits until the last view of it goes. At
    most `max_mappings` are held: past that, those whose segments were unlinked go first, else the oldest.
    """

    def __init__(self, max_mappings: int = 4096) -> None:
        self._segments: dict[tuple[str, bool], Segment] = {}
        self._max_mappings = max_mappings

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
            if len(self._segments) > self._max_mappings:
                for old in self._evict(keep=key):
                    old.close()
        if segment.nbytes < min_nbytes:
            raise SegmentTooSmall(
                f"segment {name!r} holds {segment.nbytes} bytes, need at least {min_nbytes}"
            )
        return segment

    def _evict(self, *, keep: tuple[str, bool]) -> list[Segment]:
        others = [key for key in self._segments if key != keep]
        gone = [key for key in others if not segment_exists(key[0])] or others[:1]
        return [self._segments.pop(key) for key in gone]

    def drop(self, name: str) -> None:
        """Close the mappings of `name` (read-only and writable), if any."""
        if not name.startswith("/"):
            name = "/" + name
        segments = [self._segments.pop((name, writable), None) for writable in (False, True)]
        for segment in segments:
            if segment is not None:
                segment.close()

    def drop_unlinked(self) -> list[str]:
        """Close the mappings of segments their owner unlinked (retired); returns their names."""
        names = {name for name, _ in self._segments}
        gone = sorted(name for name in names if not segment_exists(name))
        for name in gone:
            self.drop(name)
        return gone

    def names(self) -> list[str]:
        return sorted({name for name, _ in self._segments})

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

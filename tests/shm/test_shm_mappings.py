"""The mapping cache maps a peer's segment once and hands back the same mapping until dropped."""

from __future__ import annotations

import pytest

from llm_datadist._shm.errors import SegmentNotFound, SegmentTooSmall
from llm_datadist._shm.mappings import MappingCache
from llm_datadist._shm.segment import Segment


def test_maps_once_and_reuses() -> None:
    cache = MappingCache()
    with Segment.create(3333) as owner:
        try:
            first = cache.get(owner.name, min_nbytes=100)
            assert cache.get(owner.name) is first
            assert cache.get(owner.name[1:], min_nbytes=3333) is first  # name with or without "/"
            assert not first.writable and not first.owned
            assert len(cache) == 1 and owner.name in cache
            writable = cache.get(owner.name, writable=True)
            assert writable is not first and writable.writable
            assert len(cache) == 2
            writable.array[0] = 3
            assert first.array[0] == 3 == owner.array[0]
            with pytest.raises(SegmentTooSmall):
                cache.get(owner.name, min_nbytes=3334)
            assert cache.get(owner.name) is first  # a refused request does not evict the mapping
            cache.drop(owner.name)
            assert len(cache) == 0 and first.closed and writable.closed
            assert owner.name not in cache
            cache.drop(owner.name)  # nothing left: a no-op
            again = cache.get(owner.name)
            assert again is not first
        finally:
            cache.clear()
    assert len(cache) == 0 and again.closed


def test_first_attach_errors_are_not_cached() -> None:
    cache = MappingCache()
    with Segment.create(100) as owner:
        with pytest.raises(SegmentTooSmall):
            cache.get(owner.name, min_nbytes=101)
        assert len(cache) == 0
        name = owner.name
    with pytest.raises(SegmentNotFound):
        cache.get(name)
    assert len(cache) == 0


def test_cached_mapping_survives_unlink_and_clear_closes_all() -> None:
    cache = MappingCache()
    owners = [Segment.create(nbytes) for nbytes in (1, 4097, 3333)]
    try:
        mapped = [cache.get(owner.name) for owner in owners]
        owners[0].array[0] = 1
        owners[0].close()
        assert mapped[0].array[0] == 1  # unlinked by its owner, still mapped here
        assert cache.get(owners[0].name) is mapped[0]
        cache.clear()
        assert all(segment.closed for segment in mapped) and len(cache) == 0
    finally:
        for owner in owners:
            owner.close()

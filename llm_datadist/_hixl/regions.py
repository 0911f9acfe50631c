"""Where a transfer's raw addresses lie: memory this engine registered (`Regions`, by handle and address)
and memory a peer registered (`RemoteRegions`, from the peer's one-sided table).

Rules: a registration is a registered cache of one tensor of `len` bytes at `addr`, remote accessible; the
table keeps them disjoint, so a range is found by bisection and is inside a region only if wholly in it.
Handles come from one counter per process and are never reused.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from dataclasses import dataclass

from .._puller.source import RemoteCache, RemoteTable

_HANDLES = itertools.count(0x1000)


@dataclass(frozen=True)
class Region:
    """Memory this engine registered: `nbytes` at `addr`, recorded as cache `cache_id`."""

    handle: int
    cache_id: int
    addr: int
    nbytes: int
    mem_type: int


def new_handle() -> int:
    return next(_HANDLES)


class Regions:
    """The memory one engine registered."""

    def __init__(self) -> None:
        # Held across a registration or deregistration, so that two of one range make one region.
        self.registering = threading.Lock()
        self._lock = threading.Lock()  # guards the maps below (transfers look up while others register)
        self._by_handle: dict[int, Region] = {}
        self._starts: list[int] = []
        self._by_start: dict[int, Region] = {}

    def exact(self, addr: int, nbytes: int) -> Region | None:
        """The region registered at exactly [addr, addr + nbytes), if any."""
        with self._lock:
            region = self._by_start.get(addr)
        return region if region is not None and region.nbytes == nbytes else None

    def add(self, region: Region) -> None:
        with self._lock:
            self._by_handle[region.handle] = region
            self._by_start[region.addr] = region
            bisect.insort(self._starts, region.addr)

    def remove(self, handle: int) -> Region | None:
        with self._lock:
            region = self._by_handle.pop(handle, None)
            if region is not None:
                del self._by_start[region.addr]
                self._starts.remove(region.addr)
            return region

    def get(self, handle: int) -> Region | None:
        with self._lock:
            return self._by_handle.get(handle)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_handle)

    def containing(self, addr: int, nbytes: int) -> Region | None:
        """The region [addr, addr + nbytes) lies in wholly, if any."""
        with self._lock:
            i = bisect.bisect_right(self._starts, addr) - 1
            if i < 0:
                return None
            region = self._by_start[self._starts[i]]
        return region if addr + nbytes <= region.addr + region.nbytes else None


@dataclass(frozen=True)
class RemoteRegion:
    """Tensor `tensor` of a peer's registered cache: `nbytes` at `addr` in the peer's process."""

    cache: RemoteCache
    tensor: int
    addr: int
    nbytes: int


class RemoteRegions:
    """The registered memory a peer's one-sided table lists, by address (pool caches have no address a
    peer may name, and are left out)."""

    def __init__(self, table: RemoteTable) -> None:
        self.table = table
        regions = sorted(
            (
                RemoteRegion(cache, t, base, cache.unit_nbytes * cache.num_units)
                for cache in table.caches.values()
                if not cache.segment
                for t, base in enumerate(cache.tensor_bases)
            ),
            key=lambda r: r.addr,
        )
        self._starts = [r.addr for r in regions]
        self._regions = regions

    def containing(self, addr: int, nbytes: int) -> RemoteRegion | None:
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0:
            return None
        region = self._regions[i]
        return region if addr + nbytes <= region.addr + region.nbytes else None

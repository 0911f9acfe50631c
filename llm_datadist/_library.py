"""Memory the library hands out for the user to register (`ext.shared_arrays`): numpy arrays over a POSIX
shared-memory segment of this process. A peer on this host maps the segment and copies from it with
memcpy, where memory private to its owner can only be read through process_vm_readv.

Rules: one segment per call, named as every segment of ours (the reaper removes it after a crash), every
array page-aligned in it. The name goes once the last array over the segment is gone and no registration
holds it (`SharedSpan.keep`), as private memory is freed. A registration asks `span`: tensors that all lie
in one segment this process created are published by its name and their offsets, anything else by
address. A forked child inherits the parent's segments as shared memory (a write shows on both sides) and
publishes them by address: their names are the parent's.
"""

from __future__ import annotations

import bisect
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ._shm.segment import PAGE_NBYTES, Segment, _unlink_if_creator


@dataclass(frozen=True)
class SharedSpan:
    """Tensors in one segment of this process: its name and size, each tensor's offset in it, and what
    keeps it mapped and named (held by the registration)."""

    name: str
    nbytes: int
    offsets: tuple[int, ...]
    keep: Any


@dataclass(frozen=True)
class _Allocation:
    address: int
    nbytes: int
    name: str
    pid: int
    mapping: weakref.ref[Any]  # the mmap: alive while any array over it is


_lock = threading.RLock()  # re-entered when a look under it drops the last reference (`_release`)
_starts: list[int] = []  # sorted addresses of the live allocations
_allocations: dict[int, _Allocation] = {}


def allocate(count: int, nbytes: int) -> list[npt.NDArray[np.uint8]]:
    """`count` zeroed uint8 arrays of `nbytes` each, page-aligned in one new segment, every page backed
    now (a full /dev/shm fails here, `SharedMemoryExhausted`, never as a SIGBUS later). The caller checked
    `count` and `nbytes` (`ext.shared_arrays`)."""
    pitch = -(-nbytes // PAGE_NBYTES) * PAGE_NBYTES
    segment = Segment.create(pitch * count, prefault=True)
    name, address, total = segment.name, segment.address, segment.nbytes
    root = segment.hand_over()
    view = root.base
    assert isinstance(view, memoryview)  # numpy's view of the mmap
    mapping = view.obj
    entry = _Allocation(address, total, name, os.getpid(), weakref.ref(mapping))
    with _lock:
        # An address is reused only once its mapping is gone, whose `_release` may still be to come: the
        # new entry takes its place, and that release leaves it alone (it names another segment).
        if address not in _allocations:
            bisect.insort(_starts, address)
        _allocations[address] = entry
    weakref.finalize(mapping, _release, address, name, entry.pid)
    return [root[i * pitch : i * pitch + nbytes] for i in range(count)]


def _release(address: int, name: str, creator_pid: int) -> None:
    """The last array and registration over a segment went: its name goes (in the process that made it)."""
    with _lock:
        entry = _allocations.get(address)
        if entry is not None and entry.name == name:
            del _allocations[address]
            del _starts[bisect.bisect_left(_starts, address)]
    _unlink_if_creator(name, creator_pid)


def _find(address: int) -> _Allocation | None:
    """The live allocation holding `address` (the lock held)."""
    i = bisect.bisect_right(_starts, address) - 1
    if i < 0:
        return None
    entry = _allocations[_starts[i]]
    return entry if address < entry.address + entry.nbytes else None


def span(addrs: list[int] | tuple[int, ...], tensor_nbytes: int) -> SharedSpan | None:
    """Where tensors of `tensor_nbytes` at `addrs` are, when every one lies whole in one segment this
    process made here (not a parent's, after a fork); None otherwise (they are published by address)."""
    if not addrs:
        return None
    with _lock:
        entry = _find(addrs[0])
        if entry is None or entry.pid != os.getpid():
            return None
        end = entry.address + entry.nbytes
        if any(not entry.address <= addr <= end - tensor_nbytes for addr in addrs):
            return None
        mapping = entry.mapping()
    if mapping is None:  # gone between the look and now: nothing holds that memory any more
        return None
    return SharedSpan(entry.name, entry.nbytes, tuple(addr - entry.address for addr in addrs), mapping)


def segment_address(name: str) -> tuple[int, int] | None:
    """(address, nbytes) of the live segment `name` this process made here, with or without its slash."""
    name = "/" + name.lstrip("/")
    with _lock:
        for entry in list(_allocations.values()):
            if entry.name == name and entry.pid == os.getpid() and entry.mapping() is not None:
                return entry.address, entry.nbytes
    return None

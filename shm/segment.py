"""One POSIX shared-memory object mapped into this process: creation, attachment, page population, teardown.

Rules: create exclusively under a random owner-tagged name (`names.make_segment_name`), mode 0600 whatever the
umask; close the fd right after mapping; only the creating process unlinks, once. Nothing here is thread-safe:
the caller serialises `close`/`unlink` against users of the mapping.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import weakref
from types import TracebackType

import numpy as np
import numpy.typing as npt
import posix_ipc

from .errors import InvalidRange, SegmentNotFound, SegmentTooSmall, SharedMemoryExhausted, ShmError
from .names import make_segment_name
from .space import check_space, exhausted

PAGE_NBYTES = mmap.PAGESIZE

# Linux >= 5.14 madvise advice values; the mmap module does not name them, but mmap.madvise passes ints on.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23

# Random names collide with probability 2**-64 per try; a few tries make failure impossible in practice.
_CREATE_TRIES = 8

# Measured here (Linux 6.18, 2 cores), np.copyto of 256 MiB from a faulted private buffer into a new segment:
#   (a) created with prefault=False, first copy:                       0.6-1.4 GB/s (a write fault per page)
#   (b) after prefault() = madvise(MADV_POPULATE_WRITE), first copy:   8.3-10.0 GB/s (= a second copy)
#       the prefault itself took 0.10-0.14 s; repeated on present pages it costs 3-16 ms per 256 MiB.
#   MAP_POPULATE at create time is NOT enough for a fresh object: 4.4-4.5 GB/s, and so is MADV_POPULATE_READ
#   (populating for read leaves a second, write, fault per page). Touching one byte per page: 9.0 GB/s.
# Attaching an object whose pages exist: populating the page tables gives 9.1-9.2 GB/s on the first read
# (6.3-6.6 without; MAP_POPULATE and MADV_POPULATE_READ alike, 11 ms per 256 MiB) and 10.1 GB/s on the first
# write of a writable mapping (2.4 without). So `attach` runs prefault() (MADV_POPULATE_WRITE, or _READ for
# a read-only mapping, which must use ACCESS_READ) over the object's data extents only: on tmpfs a populate,
# read or write, allocates every hole it covers, so populating a pool's sparse segment whole (or mapping it
# with MAP_POPULATE) filled /dev/shm with capacity nobody used (a 64 MiB chunk holding a 4 MiB cache took
# 64 MiB as soon as a peer mapped it).
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _unlink_if_creator(name: str, creator_pid: int) -> None:
    # Runs from a weakref finalizer (GC or interpreter exit) when the owner forgot to close. The pid check
    # keeps a forked child that exits normally from unlinking its parent's segments.
    if os.getpid() != creator_pid:
        return
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_shared_memory(name)


class Segment:
    """A POSIX shared-memory object mapped MAP_SHARED into this process.

    Layout: one flat byte range, nothing of ours inside it::

        address (page-aligned, chosen by mmap)
        |<-------------------------------- nbytes -------------------------------->|
        | caller's bytes, offsets 0 .. nbytes-1 (the object's size; last page padded |
        |  by the kernel with zeros, not addressable through `array`)                |

    Lifetime: `create` (in the owning process) does shm_open(O_CREAT|O_EXCL), fchmod 0600, ftruncate, mmap,
    and closes the fd; `attach` (in any process of the same uid) does shm_open, fstat, mmap (read-only unless
    writable), and closes the fd. `close` unmaps; in the owner it also unlinks. Only the owner unlinks, once;
    other mappings stay valid after the unlink until they close. The owner's name is also unlinked if the
    object is garbage-collected or the interpreter exits without `close` (never from a forked child).
    """

    def __init__(self, name: str, mapping: mmap.mmap, nbytes: int, *, owned: bool, writable: bool) -> None:
        # Use `create` or `attach`; this only wraps a mapping they made.
        self._name = name
        self._mmap: mmap.mmap | None = mapping
        self._nbytes = nbytes
        self._owned = owned
        self._writable = writable
        self._unlinked = False
        # numpy holds one buffer export on the mmap; it is also how we learn the real base address.
        array: npt.NDArray[np.uint8] = np.frombuffer(mapping, dtype=np.uint8, count=nbytes)
        self._array: npt.NDArray[np.uint8] | None = array
        self._address = int(array.__array_interface__["data"][0])
        self._finalizer = weakref.finalize(self, _unlink_if_creator, name, os.getpid()) if owned else None

    # ----------------------------------------------------------------- construction

    @classmethod
    def create(cls, nbytes: int, *, prefault: bool = True) -> Segment:
        """Create, size and map a new segment owned by this process; with `prefault`, populate every page now.

        Raises ValueError for nbytes <= 0, `SharedMemoryExhausted` if the pages cannot be backed: with
        `prefault`, checked before anything is created (what /dev/shm has free), and again if populating
        fails (the segment is gone by then, so the figures in the message are those after it). Without
        `prefault` nothing is backed yet (tmpfs objects are sparse) and nothing is checked.
        """
        if nbytes <= 0:
            raise ValueError(f"segment size must be positive, got {nbytes}")
        if prefault:
            check_space(nbytes, "a new shared-memory segment")
        shm = None
        for _ in range(_CREATE_TRIES):
            name = make_segment_name()
            try:
                # size=0: posix_ipc leaves it unsized; we ftruncate ourselves so a failure can unlink it.
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
                break
            except posix_ipc.ExistentialError:
                continue
        if shm is None:
            raise ShmError(f"could not create a uniquely named segment in {_CREATE_TRIES} tries")
        try:
            try:
                # shm_open applied the umask to 0600, which can only remove bits; set it exactly.
                os.fchmod(shm.fd, 0o600)
                os.ftruncate(shm.fd, nbytes)
                mapping = mmap.mmap(shm.fd, nbytes, flags=mmap.MAP_SHARED, prot=_PROT_RW)
            finally:
                shm.close_fd()
        except BaseException:
            _unlink_if_creator(name, os.getpid())
            raise
        segment = cls(name, mapping, nbytes, owned=True, writable=True)
        if prefault:
            try:
                segment.prefault()
            except SharedMemoryExhausted as exc:
                segment.close()  # unlinked: the pages it did populate are free again
                raise exhausted(nbytes, "a new shared-memory segment", error=exc.error) from exc
            except BaseException:
                segment.close()
                raise
        return segment

    @classmethod
    def attach(cls, name: str, *, writable: bool = False, min_nbytes: int = 0) -> Segment:
        """Map an existing segment (read-only unless `writable`), its page tables populated; not owned here.

        Only the pages the object holds now are populated (its data extents, found with SEEK_DATA and
        SEEK_HOLE): on tmpfs even a read fault allocates a page, so populating a pool's sparse segment whole
        would fill /dev/shm with its unused capacity. Pages the creator backs later fault in on first use.

        Raises `SegmentNotFound` if no object has that name, `SegmentTooSmall` if it is empty or smaller than
        `min_nbytes`, `ShmError` if this process may not open it.
        """
        if not name.startswith("/"):
            name = "/" + name
        try:
            shm = posix_ipc.SharedMemory(name, 0, read_only=not writable)
        except posix_ipc.ExistentialError as exc:
            raise SegmentNotFound(f"no shared-memory segment named {name!r}") from exc
        except posix_ipc.PermissionsError as exc:
            raise ShmError(f"not allowed to open segment {name!r}") from exc
        try:
            nbytes = os.fstat(shm.fd).st_size
            if nbytes == 0 or nbytes < min_nbytes:
                need_nbytes = max(min_nbytes, 1)
                raise SegmentTooSmall(f"segment {name!r} holds {nbytes} bytes, need at least {need_nbytes}")
            if writable:
                # No MAP_POPULATE: it would populate the holes too (see above); prefault() below populates.
                mapping = mmap.mmap(shm.fd, nbytes, flags=mmap.MAP_SHARED, prot=_PROT_RW)
            else:
                # ACCESS_READ (not prot=PROT_READ) makes the buffer, hence numpy's array, refuse writes
                # rather than segfault; mmap then rejects extra flags, so prefault() below populates.
                mapping = mmap.mmap(shm.fd, nbytes, access=mmap.ACCESS_READ)
            extents = _data_extents(shm.fd, nbytes)
        finally:
            shm.close_fd()
        segment = cls(name, mapping, nbytes, owned=False, writable=writable)
        try:
            for offset, extent_nbytes in extents:
                segment.prefault(offset, extent_nbytes)
        except BaseException:
            segment.close()
            raise
        return segment

    # ----------------------------------------------------------------- properties

    @property
    def name(self) -> str:
        """The POSIX name, with its leading "/"."""
        return self._name

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def owned(self) -> bool:
        """True in the process that created the segment (the one that unlinks it)."""
        return self._owned

    @property
    def writable(self) -> bool:
        return self._writable

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def address(self) -> int:
        """Base virtual address of the mapping in this process, valid until `close`."""
        self._check_open()
        return self._address

    @property
    def array(self) -> npt.NDArray[np.uint8]:
        """A 1-D uint8 array over the whole mapping (read-only flag set when not writable)."""
        return self._check_open()

    def view(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        """The uint8 slice [offset, offset + nbytes); `InvalidRange` if it leaves the segment."""
        array = self._check_range(offset, nbytes)
        return array[offset : offset + nbytes]

    # ----------------------------------------------------------------- pages

    def prefault(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Make every page of [offset, offset + nbytes) present in this process's page tables, writable when
        the mapping is, so later copies take no faults. Cheap when the pages are already present.

        Uses MADV_POPULATE_WRITE (READ for a read-only mapping) on the enclosing page-aligned range; it never
        changes bytes. On kernels without it (< 5.14, EINVAL) it falls back to touching the pages, see
        `_touch_pages`. Raises `SharedMemoryExhausted` when the kernel cannot back the pages.
        """
        if nbytes is None:
            nbytes = self._nbytes - offset
        array = self._check_range(offset, nbytes)
        if nbytes == 0:
            return
        assert self._mmap is not None
        start_offset = offset - offset % PAGE_NBYTES
        advice = MADV_POPULATE_WRITE if self._writable else MADV_POPULATE_READ
        try:
            self._mmap.madvise(advice, start_offset, offset + nbytes - start_offset)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                _touch_pages(array, offset, nbytes, write=self._writable)
                return
            # ENOMEM (no memory) or EFAULT (tmpfs full: the fault would have been SIGBUS). The pages it did
            # populate stay in the object: `release` gives back those of a range nobody uses.
            raise exhausted(nbytes, f"segment {self._name}", error=exc.errno) from exc

    def release(self, offset: int, nbytes: int) -> None:
        """Give the pages wholly inside [offset, offset + nbytes) back to the system (MADV_REMOVE: the file
        system frees them; they read as zeros afterwards). For the owner's writable mapping only, over bytes
        that nobody uses: a pool's free range, or a reservation whose prefault failed. Partial pages at
        either end stay: they may hold a neighbour's bytes."""
        self._check_range(offset, nbytes)
        if not self._writable:
            raise ShmError(f"segment {self._name} is mapped read-only here; it cannot release pages")
        first_offset = -(-offset // PAGE_NBYTES) * PAGE_NBYTES
        end_offset = (offset + nbytes) // PAGE_NBYTES * PAGE_NBYTES
        if end_offset <= first_offset:
            return
        assert self._mmap is not None
        self._mmap.madvise(mmap.MADV_REMOVE, first_offset, end_offset - first_offset)

    # ----------------------------------------------------------------- teardown

    def hand_over(self) -> npt.NDArray[np.uint8]:
        """The whole mapping as one array, which alone keeps it mapped from now on: this object forgets it
        (closed, as if `close` had run) and no longer unlinks its name, not even when it is collected; the
        caller unlinks (`library`)."""
        array = self._check_open()
        self._mmap, self._array = None, None
        if self._finalizer is not None:
            self._finalizer.detach()
        self._unlinked = True
        return array

    def close(self) -> None:
        """Unmap (and unlink, in the owner). Idempotent. If the caller still holds views of the mapping, the
        unmap is left to the garbage collector, which runs it when the last view goes."""
        if self._mmap is None:
            return
        mapping, self._mmap = self._mmap, None
        self._array = None
        # Exported views keep the mmap object alive (BufferError); dropping our reference is all we may do.
        with contextlib.suppress(BufferError):
            mapping.close()
        if self._owned:
            self.unlink()

    def unlink(self) -> None:
        """Remove the name (owner only; idempotent; tolerates a name already gone). Mappings stay valid."""
        if not self._owned:
            raise ShmError(f"segment {self._name} is not owned by this process; only its creator unlinks it")
        if self._unlinked:
            return
        self._unlinked = True
        if self._finalizer is not None:
            self._finalizer.detach()
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(self._name)

    def __enter__(self) -> Segment:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"address=0x{self._address:x}"
        role = "owned" if self._owned else "attached"
        mode = "rw" if self._writable else "ro"
        return f"<Segment {self._name} nbytes={self._nbytes} {role} {mode} {state}>"

    def _check_open(self) -> npt.NDArray[np.uint8]:
        if self._array is None:
            raise ShmError(f"segment {self._name} is closed")
        return self._array

    def _check_range(self, offset: int, nbytes: int) -> npt.NDArray[np.uint8]:
        array = self._check_open()
        if offset < 0 or nbytes < 0 or offset + nbytes > self._nbytes:
            raise InvalidRange(f"[{offset}, {offset}+{nbytes}) outside {self._name} ({self._nbytes} bytes)")
        return array


def _data_extents(fd: int, nbytes: int) -> list[tuple[int, int]]:
    """(offset, nbytes) of each range of the object `fd` that holds pages, in order (lseek SEEK_DATA and
    SEEK_HOLE, which tmpfs answers from its page cache); the whole object where the file system cannot say."""
    extents: list[tuple[int, int]] = []
    offset = 0
    try:
        while offset < nbytes:
            data_offset = os.lseek(fd, offset, os.SEEK_DATA)
            hole_offset = min(os.lseek(fd, data_offset, os.SEEK_HOLE), nbytes)
            extents.append((data_offset, hole_offset - data_offset))
            offset = hole_offset
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: no data after `offset`
            return [(0, nbytes)]
    return extents


def _touch_pages(array: npt.NDArray[np.uint8], offset: int, nbytes: int, *, write: bool) -> None:
    """Fallback prefault: read (or rewrite) one byte per page of [offset, offset + nbytes).

    A rewrite of a byte races with another process writing that same byte, so it only touches pages that lie
    wholly inside the range (the caller owns those bytes); the partial pages at either end are left to fault
    once on first use. Reads are harmless, so a read-only mapping has every page touched.
    """
    if write:
        first_offset = -(-offset // PAGE_NBYTES) * PAGE_NBYTES
        end_offset = (offset + nbytes) // PAGE_NBYTES * PAGE_NBYTES
        if end_offset <= first_offset:
            return
        pages = array[first_offset:end_offset:PAGE_NBYTES]
        pages[...] = pages.copy()
    else:
        first_offset = offset - offset % PAGE_NBYTES
        int(array[first_offset : offset + nbytes : PAGE_NBYTES].sum())

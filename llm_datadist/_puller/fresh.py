"""A pull of a key as real clients make it (a new key object each request, pulled once, consumed) through
the C kernel, with no Python per tensor: look the key up in the peer's index, check it as the full way's
pin would, copy and consume (`index_pull_key` in shm/_copykernel.c, the GIL released). A pull of at most
`MAX_NBYTES` is all one hold of the index lock, with nothing written to our row: nothing the owner does can
come between the lookup and the copy. A larger one is pinned through our row as the full way pins (the key
reserved, the cache and the key named), copied with the lock free and unpinned, crediting what it pulled,
in the same call (the copy shared with the kernel's helper thread); a copy for more than two copy threads
is made by them between that call's pin and a second call's unpin (`index_unpin_key`).

Rules: what it does not handle (no kernel, a lease pull, registered memory, a segment not mapped here yet,
a key partly reserved by another pull, anything refused or odd) comes back STALE with nothing done, and the
caller takes the full way, which raises what it calls for and maps what it needs. With a fault point armed
(`_faults`) every pull is pinned by the kernel and copied and unpinned here, through the full way's points
("pinned", "copied", "released"), so that fault tests reach this path too. Once pinned, it is the full
way's pin: a copy that fails gives back what it reserved, and an unpin that cannot be done at once is the
full way's (`dataplane.unpin`: it waits, or fails the transfer and says why). A pull of the full way out
of a segment makes that segment the one the next fresh pulls from that peer read (`remember`). No memo: the
destination's addresses are packed once per cache (`CacheRecord.packed_addrs`), and the kernel polls the
link's socket for a hang-up before it reads the index (a dead owner's index is never read).
"""

from __future__ import annotations

import mmap
import struct
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_datadist._shm import indexkernel
from llm_datadist._shm.errors import ShmError
from llm_datadist._shm.index import _LOCK_RETRY_MAX_S, _LOCK_RETRY_MIN_S, Index, count_lock_wait
from llm_datadist._shm.segment import Segment

from .. import _faults
from .._keys import KEY_CACHE_ID, KEY_PREFIX, KEY_REQ
from .._owner.records import CacheRecord
from .copy import Copier
from .dataplane import unpin
from .peer import Peer
from .source import SourceRef

DONE, BUSY, STALE, FAULTED, PINNED, COPIED, PIN_FAULTED, GONE = 0, 1, 2, 3, 4, 5, 6, 7
MAX_NBYTES = 64 << 10  # the kernel's HOLD_MAX_NBYTES: copies this small are made under the index lock
_CHECK_BUSY, _WHOLE = 1, 2
# row offset, ticket, caches, names and buckets offsets, key id, model id, source offset, bytes per tensor,
# destination offset; then the three capacities, kind, consume, flags, first tensor, tensor count, batch
# index (a pull by cache id), a spare word.
_PLAN = struct.Struct("<10Q10I")
# A peer's segment mapped here: its name as the index's cache entries hold it, its address here, its size.
_SEGMENT = struct.Struct("<64sQQ")
_MAX_SEGMENTS = 16  # segments of one peer remembered (a pool grows by a few)


@dataclass(frozen=True, slots=True)
class FreshSource:
    """What fresh pulls from one peer read (`Peer.fresh`): its index as mapped here, our row there, and
    the peer's segments full pulls read (mapped here), with their table for the kernel."""

    index: weakref.ref[Index]  # weak, as the segments below: a peer's mapping of a dead owner's index goes
    handle: tuple[int, mmap.mmap]  # the index's (fd, mapping), while it is the peer's open index
    socket_fd: int  # the link's socket, polled by the kernel for a hang-up (the link outlives the source)
    row_offset: int
    ticket: int
    regions: tuple[int, int, int, int, int, int]
    # Weak: a pull must never keep a mapping alive that the peer's mapping cache let go (a peer's retired
    # or unlinked segment would stay mapped here, and its memory with it).
    segments: tuple[weakref.ref[Segment], ...]
    table: bytes  # `segment_table` of them: their addresses are valid while their arrays are held

    def arrays(self) -> list[np.ndarray[Any, Any]] | None:
        """Every segment's array (holding them keeps the mappings mapped), or None if one was let go."""
        arrays = []
        for ref in self.segments:
            segment = ref()
            if segment is None:
                return None
            try:
                arrays.append(segment.array)
            except ShmError:  # closed by housekeeping
                return None
        return arrays

    def with_segments(self, segments: list[Segment]) -> FreshSource:
        """The same source over `segments` (those still open)."""
        live, entries = [], []
        for segment in segments[-_MAX_SEGMENTS:]:
            name = segment.name.encode("ascii")
            if len(name) > 64:  # not a name an index's cache entry can hold
                continue
            try:
                entries.append((name, segment.address, segment.nbytes))
            except ShmError:
                continue
            live.append(weakref.ref(segment))
        return FreshSource(
            self.index,
            self.handle,
            self.socket_fd,
            self.row_offset,
            self.ticket,
            self.regions,
            tuple(live),
            segment_table(entries),
        )

    def live_segments(self) -> list[Segment]:
        return [segment for ref in self.segments if (segment := ref()) is not None and not segment.closed]


def segment_table(segments: list[tuple[bytes, int, int]]) -> bytes:
    """The kernel's table of a peer's segments mapped here: (name, address here, size) each."""
    return b"".join(_SEGMENT.pack(*entry) for entry in segments)


def pack_plan(
    row_offset: int,
    ticket: int,
    regions: tuple[int, int, int, int, int, int],
    ref: SourceRef,
    dst_offset: int,
    check_busy: bool,
    socket_fd: int = -1,
) -> bytes:
    """The kernel's plan: our row (its offset in the index, our ticket), the index's `regions`
    (`Index.regions`), the request, and the link's socket to poll for a hang-up first (-1: none)."""
    caches_offset, caches, names_offset, names, buckets_offset, buckets = regions
    return _PLAN.pack(
        row_offset,
        ticket,
        caches_offset,
        names_offset,
        buckets_offset,
        ref.key_id,
        ref.model_id,
        ref.src_offset,
        ref.nbytes,
        dst_offset,
        caches,
        names,
        buckets,
        ref.key_kind,
        int(ref.consume and not ref.for_write),
        (_CHECK_BUSY if check_busy else 0) | (_WHOLE if ref.whole else 0),
        ref.tensor_start,
        ref.tensor_count,
        ref.batch_index,
        socket_fd + 1,
    )


class FreshPulls:
    """The fresh pulls of one instance."""

    def __init__(self, copier: Copier) -> None:
        self._copier = copier
        self.done = 0  # pulls made here

    @staticmethod
    def remember(peer: Peer, segment: Segment) -> None:
        """A full pull from `peer` read `segment`: fresh pulls read it too from now on."""
        index = peer.index
        if index is None:
            return
        source = peer.fresh
        if source is None or source.index() is not index:
            source = FreshSource(
                weakref.ref(index),
                index.handle,
                peer.link.socket_fd,
                index.row_offset(peer.index_row),
                peer.index_ticket,
                index.regions(),
                (),
                b"",
            )
        elif any(ref() is segment for ref in source.segments):
            return
        peer.fresh = source.with_segments([*source.live_segments(), segment])

    def pull(
        self,
        peer: Peer,
        ref: SourceRef,
        dst: CacheRecord,
        dst_tensor_start: int,
        dst_offset: int,
        deadline: float,
        check_busy: bool,
    ) -> int:
        """Pull `ref` into `dst` from its tensor `dst_tensor_start` on, at `dst_offset` in each slot: DONE,
        or STALE (nothing done: take the full way). The caller holds the link exclusively. A lock that
        stays busy until `deadline` is STALE too (the full way waits and says why)."""
        kernel = indexkernel.kernel
        if kernel is None or ref.key_kind not in (KEY_REQ, KEY_PREFIX, KEY_CACHE_ID):
            return STALE
        source = peer.fresh
        count, nbytes = ref.tensor_count, ref.nbytes
        if source is None or source.index() is not peer.index or dst.block is None or not count * nbytes:
            return STALE
        # Held until the copy is done: the mappings stay mapped, even if housekeeping closes a segment
        # meanwhile (its mapping goes when the last view does).
        src_arrays = source.arrays()
        if src_arrays is None:  # housekeeping let one go: the others stay
            peer.fresh = source = source.with_segments(source.live_segments())
            src_arrays = source.arrays()
        try:
            dst_array = dst.block.segment.array
        except ShmError:
            return STALE
        if not src_arrays:
            return STALE
        # The link was found usable as the caller took it; the kernel polls its socket for a hang-up first.
        plan = pack_plan(
            source.row_offset, source.ticket, source.regions, ref, dst_offset, check_busy, source.socket_fd
        )
        addrs = _addresses(dst, dst_tensor_start, count)
        index = peer.index
        assert index is not None  # it is the remembered one (above)
        fd, mapping = source.handle
        total = count * nbytes
        sources, one_call = None, 0
        if total > MAX_NBYTES or _faults.hook is not None:
            # A pin, and its copy in the same call unless more copy threads take it (or a fault point is
            # armed: the copy is made here, between the points).
            sources = bytearray(8 * count)
            one_call = 0 if _faults.hook is not None else self._copier.one_call(total)
        outcome = kernel.index_pull_key(mapping, fd, plan, addrs, source.table, sources, one_call)
        if outcome == DONE:  # the common case: looked up, copied and unpinned in that one call
            self.done += 1
            return DONE
        pause = _LOCK_RETRY_MIN_S
        if outcome == BUSY:
            count_lock_wait()
        while outcome == BUSY and time.monotonic() < deadline:
            # Held for microseconds (the owner, another puller): wait as the full way's lock would.
            time.sleep(pause)
            pause = min(pause * 2, _LOCK_RETRY_MAX_S)
            outcome = kernel.index_pull_key(mapping, fd, plan, addrs, source.table, sources, one_call)
        if outcome == PINNED:
            assert sources is not None
            self._copy_pinned(peer, index, (fd, mapping), plan, sources, addrs, dst_offset, nbytes)
            outcome = DONE
        elif outcome == COPIED:  # the unpin found the lock busy or the row changed: the full way's unpin
            unpin(peer, index, ok=True)
            outcome = DONE
        elif outcome == GONE:
            peer.link.check_peer_alive()  # breaks the link and raises PeerGone
        elif outcome == PIN_FAULTED:
            unpin(peer, index, ok=False)  # what it reserved goes back: the key can be pulled again
            outcome = FAULTED
        del src_arrays, dst_array
        if outcome == FAULTED:
            raise ShmError("a fresh pull met a page that vanished under a mapping: nothing was consumed")
        if outcome != DONE:
            return STALE
        self.done += 1
        return DONE

    def _copy_pinned(
        self,
        peer: Peer,
        index: Index,
        handle: tuple[int, mmap.mmap],
        plan: bytes,
        sources: bytearray,
        addrs: bytes,
        dst_offset: int,
        nbytes: int,
    ) -> None:
        """Copy what the kernel pinned (each tensor's source address in `sources`), then unpin; the fault
        points of the full way's pin on the way (`acquire._Holding`)."""
        kernel = indexkernel.kernel
        assert kernel is not None
        src = np.frombuffer(sources, dtype=np.uint64)
        dst = np.frombuffer(addrs, dtype=np.uint64) + np.uint64(dst_offset)
        try:
            _faults.at("pinned")
            if not self._copier.copy_addresses(src, dst, nbytes):
                raise ShmError("a fresh pull pinned a key with no copy kernel")
            _faults.at("copied")
        except BaseException:
            unpin(peer, index, ok=False)  # what it reserved goes back: the key can be pulled again
            raise
        try:
            unpinned = kernel.index_unpin_key(handle[1], handle[0], plan)
        except OSError:
            unpinned = BUSY
        if unpinned != DONE:
            unpin(peer, index, ok=True)  # waits for a busy lock, or fails the transfer and says why
        _faults.at("released")


def _addresses(dst: CacheRecord, start: int, count: int) -> bytes:
    """The addresses of `dst`'s tensors [start, start + count), packed (the record keeps them all)."""
    packed = dst.packed_addrs
    if not packed:
        packed = dst.packed_addrs = struct.pack(f"<{dst.num_tensors}Q", *dst.tensor_addrs())
    if start == 0 and count == dst.num_tensors:
        return packed
    return packed[8 * start : 8 * (start + count)]

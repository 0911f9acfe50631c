"""How bytes move between this process and one peer, chosen once, when the link is made: `HostMover` for a
peer on this host (its segments mapped here and copied by the copy kernel, its registered memory by
cross-memory attach), `EngineMover` for a peer on another host (Mooncake Transfer Engine).

Rules: a mover only moves bytes between memory that is already pinned on both sides (the caller holds the
source or destination through `acquire` and its own cache through the table); it never asks the peer to
pin anything. Every range it is given is checked against what it lands in before any byte moves: a
peer's description of its memory is never trusted (a segment must be the peer's own and hold the range).
A device-memory mover fits beside these two: it implements `Mover` and is chosen when the link is made.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import psutil

from llm_datadist._protocol.messages import WriteGrant
from llm_datadist._shm.copyplan import BlockPlan, Run, StridedCopy, block_runs, plan_tensor_copy
from llm_datadist._shm.errors import ShmError
from llm_datadist._shm.names import parse_segment_name
from llm_datadist._shm.segment import Segment

from .._errors import PeerGone, StatusError
from .._native import address_view, vm_columns
from .._owner.records import CacheRecord
from .._stats import CMA, MOONCAKE, SHM
from ..status import LLMStatusCode
from .copy import Copier
from .fresh import FreshPulls
from .peer import Peer
from .source import Location
from .vm import FEW_RUNS, PreparedRuns, VmBadAddress, VmError, VmNotPermitted, VmProcessGone, VmRun

if TYPE_CHECKING:
    from .crosshost import CrossHost


@dataclass(frozen=True)
class UnitRun:
    """`nbytes` between byte `remote_offset` of a remote tensor and byte `local_offset` of the matching
    local tensor; the same runs apply to every tensor of a transfer."""

    remote_offset: int
    local_offset: int
    nbytes: int


class RangeUnmapped(StatusError):
    """A cross-memory copy met an address range that is not mapped (on either side)."""


@dataclass(frozen=True)
class PushSpan:
    """Bytes to push into [dst_addr, dst_addr + nbytes) of the peer: runs from our segment, their
    destination offsets relative to dst_addr."""

    dst_addr: int
    nbytes: int
    runs: tuple[Run, ...]


class Mover(Protocol):
    """Moves bytes between pinned memory of ours and of the peer at the other end of a link (`Peer`)."""

    def transport(self, segment: str) -> int:
        """How this mover moves bytes of the peer's `segment` ("": its registered memory), as the stats
        count it (`_stats.TRANSPORTS`)."""
        ...

    def words(self, peer: Peer, name: str, nbytes: int) -> Segment | None:
        """The peer's generation segment `name` (at least `nbytes`) as mapped here, for reads that need no
        pin (`oneside`: the words say whether the owner still holds what was read); None when nothing of
        the peer is visible here, and reads must pin."""
        ...

    def read_tensors(
        self,
        peer: Peer,
        loc: Location,
        dst: CacheRecord,
        dst_offsets: list[int],
        nbytes: int,
        deadline: float,
        marks: list[float] | None = None,
    ) -> None:
        """`nbytes` from each `loc.tensor_bases[i]` to `dst`'s segment at `dst_offsets[i]` (a v1 pull).
        `marks`: the time planning ended is appended to it (the bench's breakdown of a pull)."""
        ...

    def read_blocks(
        self, peer: Peer, loc: Location, plan: BlockPlan, dst: CacheRecord, deadline: float
    ) -> None:
        """A paged copy from `loc`'s segment into `dst`'s (v1 `pull_blocks`)."""
        ...

    def copy_units(
        self,
        peer: Peer,
        loc: Location,
        local: CacheRecord,
        local_tensor_start: int,
        runs: list[UnitRun],
        *,
        write: bool,
        deadline: float,
        prepared: PreparedRuns | None = None,
    ) -> PreparedRuns | None:
        """`runs` of each of `loc`'s tensors from or (`write`) to our tensors from `local_tensor_start`
        (v2). Returns what a repeat of the very same copy may pass back as `prepared` (or None)."""
        ...

    def write_ranges(
        self,
        peer: Peer,
        grant: WriteGrant,
        src: CacheRecord,
        spans: list[PushSpan],
        deadline: float,
        first: int = 0,
    ) -> None:
        """Push `spans` of `src`'s segment into the ranges the peer granted (`transfer_cache_async`): span
        i into the grant's range `first + i`."""
        ...


def _local_addrs(local: CacheRecord, start: int, count: int, runs: list[UnitRun]) -> list[int]:
    for run in runs:
        if run.local_offset + run.nbytes > local.tensor_nbytes:
            raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, "the transfer does not fit the local tensors")
    addrs = local.addrs if local.block is None else local.tensor_addrs()  # registered: its own addresses
    return list(addrs[start : start + count])


def _granted(grant: WriteGrant, first: int, count: int) -> list[tuple[int, int]]:
    """(segment index, offset) of the grant's ranges `first` to `first + count`."""
    stop = first + count
    if stop > len(grant.range_offsets):
        raise StatusError(LLMStatusCode.LLM_FAILED, "the peer granted fewer ranges than the push has")
    return list(zip(grant.range_segments[first:stop], grant.range_offsets[first:stop], strict=True))


def _outside_segment() -> StatusError:
    return StatusError(LLMStatusCode.LLM_FAILED, "peer granted memory outside its segment")


# ====================================================================== a peer on this host


def peer_segment(peer: Peer, name: str, nbytes: int, *, writable: bool) -> Segment:
    """Map a segment a peer on this host named. Never trust a peer's description of memory: the segment
    must be the peer's own (its pid and our uid in the name) and hold what the grant says. A segment that
    cannot be mapped because its owner died is a link failure, not a shared-memory one."""
    if name not in peer.owned_segments:
        owner = parse_segment_name(name)
        if owner is None or owner.pid != peer.info.pid or owner.uid != os.getuid():
            raise StatusError(LLMStatusCode.LLM_FAILED, f"peer granted a segment it does not own: {name}")
        peer.owned_segments.add(name)  # a name carries its owner: once checked, it stays the peer's
    try:
        return peer.mappings.get(name, min_nbytes=nbytes, writable=writable)
    except ShmError as exc:
        # An owner unlinks a segment with something granted in it only when it finalizes or dies, and it
        # closes its connections first: the link tells which.
        peer.check_peer_alive()
        if process_alive(peer.info.pid):
            raise
        raise peer_ended(peer, exc) from exc


def process_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def peer_ended(peer: Peer, cause: Exception) -> PeerGone:
    """Break `link` because its peer's process ended; the error to raise (from `cause`)."""
    peer.fail(f"process {peer.info.pid} is gone")
    return PeerGone(f"cluster {peer.info.cluster_id} (pid {peer.info.pid}) is gone: {cause}")


class HostMover:
    """A peer on this host: its pool segments mapped here, its registered memory by cross-memory attach."""

    def __init__(self, copier: Copier) -> None:
        self._copier = copier

    def transport(self, segment: str) -> int:
        return SHM if segment else CMA

    def words(self, peer: Peer, name: str, nbytes: int) -> Segment | None:
        return peer_segment(peer, name, nbytes, writable=False)

    def read_tensors(
        self,
        peer: Peer,
        loc: Location,
        dst: CacheRecord,
        dst_offsets: list[int],
        nbytes: int,
        deadline: float,
        marks: list[float] | None = None,
    ) -> None:
        src = peer_segment(peer, loc.segment, loc.segment_nbytes, writable=False)
        # Tensors are a constant pitch apart on each side: one strided copy, else a list of runs.
        strided = StridedCopy.from_offsets(loc.tensor_bases, dst_offsets, nbytes)
        if strided is not None:
            if marks is not None:
                marks.append(time.perf_counter())
            self._copier.run_strided(strided, src.array, dst.pool_block.segment.array)
        else:
            runs = plan_tensor_copy(loc.tensor_bases, dst_offsets, nbytes)
            if marks is not None:
                marks.append(time.perf_counter())
            self._copier.run(runs, src.array, dst.pool_block.segment.array)
        FreshPulls.remember(peer, src)  # the kernel's pulls from this peer read that segment next

    def read_blocks(
        self, peer: Peer, loc: Location, plan: BlockPlan, dst: CacheRecord, deadline: float
    ) -> None:
        src = peer_segment(peer, loc.segment, loc.segment_nbytes, writable=False)
        self._copier.run_blocks(plan, src.array, dst.pool_block.segment.array)

    def copy_units(
        self,
        peer: Peer,
        loc: Location,
        local: CacheRecord,
        local_tensor_start: int,
        runs: list[UnitRun],
        *,
        write: bool,
        deadline: float,
        prepared: PreparedRuns | None = None,
    ) -> PreparedRuns | None:
        bases = loc.tensor_bases
        if not loc.segment:
            return self._attach_copy(peer, loc, local, local_tensor_start, runs, write, prepared)
        local_addrs = _local_addrs(local, local_tensor_start, len(bases), runs)
        mapped = peer_segment(peer, loc.segment, loc.segment_nbytes, writable=write)
        if local.block is not None:
            local_array = local.block.segment.array
            local_bases = [local.tensor_offset(local_tensor_start + i) for i in range(len(bases))]
        else:
            low = min(local_addrs)
            local_array = address_view(low, max(local_addrs) + local.tensor_nbytes - low)
            local_bases = [addr - low for addr in local_addrs]
        # Every run of every tensor, tensor by tensor, as columns: (bases x runs) with no Python per run.
        columns = np.array(
            [(run.remote_offset, run.local_offset, run.nbytes) for run in runs], dtype=np.int64
        ).reshape(-1, 3)
        remote = (np.asarray(bases, dtype=np.int64)[:, None] + columns[:, 0]).ravel()
        here = (np.asarray(local_bases, dtype=np.int64)[:, None] + columns[:, 1]).ravel()
        lengths = np.tile(columns[:, 2], len(bases))
        if write:
            self._copier.run_columns(local_array, mapped.array, here, remote, lengths)
        else:
            self._copier.run_columns(mapped.array, local_array, remote, here, lengths)
        return None

    def _attach_copy(
        self,
        peer: Peer,
        loc: Location,
        local: CacheRecord,
        local_tensor_start: int,
        runs: list[UnitRun],
        write: bool,
        prepared: PreparedRuns | None,
    ) -> PreparedRuns | None:
        """The peer's registered memory: one kernel copy between the two address spaces."""
        pid, bases = loc.pid, loc.tensor_bases
        if pid != peer.info.pid:
            raise StatusError(LLMStatusCode.LLM_FAILED, f"peer {peer.info.pid} named memory of process {pid}")
        try:
            if prepared is not None:
                prepared()
                return prepared
            local_addrs = _local_addrs(local, local_tensor_start, len(bases), runs)
            if len(runs) * len(bases) <= FEW_RUNS:  # `vm`'s ctypes fast path
                vm_runs = [
                    VmRun(addr + run.local_offset, base + run.remote_offset, run.nbytes)
                    for addr, base in zip(local_addrs, bases, strict=True)
                    for run in runs
                ]
                prepared = PreparedRuns(pid, vm_runs, write=write)
                prepared()
                return prepared
            # Many runs (a block table): numpy columns, split over the copy threads by bytes.
            columns = vm_columns(
                local_addrs,
                [run.local_offset for run in runs],
                bases,
                [run.remote_offset for run in runs],
                [run.nbytes for run in runs],
            )
            self._copier.run_vm(pid, *columns, write=write)
            return None
        except VmNotPermitted as exc:
            raise StatusError(
                LLMStatusCode.LLM_FAILED, f"cross-memory attach to pid {pid} refused: {exc}"
            ) from exc
        except VmError as exc:
            # The peer died (or is exiting, its memory already unmapped): a link failure, noticed here
            # before the socket said so.
            if isinstance(exc, VmProcessGone) or not process_alive(pid):
                raise peer_ended(peer, exc) from exc
            error = RangeUnmapped if isinstance(exc, VmBadAddress) else StatusError
            raise error(
                LLMStatusCode.LLM_PARAM_INVALID, f"cross-memory copy with pid {pid} failed: {exc}"
            ) from exc

    def write_ranges(
        self,
        peer: Peer,
        grant: WriteGrant,
        src: CacheRecord,
        spans: list[PushSpan],
        deadline: float,
        first: int = 0,
    ) -> None:
        granted = _granted(grant, first, len(spans))
        targets = [
            peer_segment(peer, name, nbytes, writable=True)
            for name, nbytes in zip(grant.segments, grant.segment_nbytes, strict=True)
        ]
        by_target: dict[int, list[Run]] = {}
        for span, (index, offset) in zip(spans, granted, strict=True):
            if offset + span.nbytes > targets[index].nbytes:
                raise _outside_segment()
            by_target.setdefault(index, []).extend(
                Run(run.src_offset, offset + run.dst_offset, run.nbytes) for run in span.runs
            )
        for index, runs in by_target.items():
            self._copier.run(runs, src.pool_block.segment.array, targets[index].array)


# ====================================================================== a peer on another host


class EngineMover:
    """A peer on another host: every copy is one batch of address runs through the transfer engines."""

    def __init__(self, cross: CrossHost) -> None:
        self._cross = cross

    def transport(self, segment: str) -> int:
        return MOONCAKE

    def words(self, peer: Peer, name: str, nbytes: int) -> Segment | None:
        return None

    def read_tensors(
        self,
        peer: Peer,
        loc: Location,
        dst: CacheRecord,
        dst_offsets: list[int],
        nbytes: int,
        deadline: float,
        marks: list[float] | None = None,
    ) -> None:
        runs = plan_tensor_copy(loc.tensor_bases, dst_offsets, nbytes)
        if marks is not None:
            marks.append(time.perf_counter())
        (src_base,) = self._cross.segment_bases(peer, [loc.segment], deadline)
        dst_base = dst.pool_block.segment.address
        self._cross.copy(
            peer,
            dst,
            [dst_base + run.dst_offset for run in runs],
            [src_base + run.src_offset for run in runs],
            [run.nbytes for run in runs],
            write=False,
            deadline=deadline,
        )

    def read_blocks(
        self, peer: Peer, loc: Location, plan: BlockPlan, dst: CacheRecord, deadline: float
    ) -> None:
        # The grant's blocks must lie in its segment and ours in our segment, as the local copy checks.
        try:
            plan.check(loc.segment_nbytes, dst.pool_block.segment.nbytes)
        except ShmError as exc:
            raise StatusError(LLMStatusCode.LLM_FAILED, f"peer granted blocks out of range: {exc}") from exc
        (src_base,) = self._cross.segment_bases(peer, [loc.segment], deadline)
        dst_base = dst.pool_block.segment.address
        src_starts, dst_starts, lengths = block_runs(plan)
        count = len(plan.src_tensor_offsets)
        # Every tensor's runs at once: (tensor, run) grids of addresses, flattened in tensor order.
        remote = src_base + np.add.outer(np.array(plan.src_tensor_offsets, dtype=np.int64), src_starts)
        local = dst_base + np.add.outer(np.array(plan.dst_tensor_offsets, dtype=np.int64), dst_starts)
        self._cross.copy(
            peer,
            dst,
            local.ravel().tolist(),
            remote.ravel().tolist(),
            np.tile(lengths, count).tolist(),
            write=False,
            deadline=deadline,
        )

    def copy_units(
        self,
        peer: Peer,
        loc: Location,
        local: CacheRecord,
        local_tensor_start: int,
        runs: list[UnitRun],
        *,
        write: bool,
        deadline: float,
        prepared: PreparedRuns | None = None,
    ) -> PreparedRuns | None:
        # Segment offsets (or registered addresses) become addresses there, for its engine.
        bases = loc.tensor_bases
        local_addrs = _local_addrs(local, local_tensor_start, len(bases), runs)
        (segment_base,) = self._cross.segment_bases(peer, [loc.segment], deadline) if loc.segment else (0,)
        self._cross.copy(
            peer,
            local,
            [addr + run.local_offset for addr in local_addrs for run in runs],
            [segment_base + base + run.remote_offset for base in bases for run in runs],
            [run.nbytes for _ in bases for run in runs],
            write=write,
            deadline=deadline,
        )
        return None

    def write_ranges(
        self,
        peer: Peer,
        grant: WriteGrant,
        src: CacheRecord,
        spans: list[PushSpan],
        deadline: float,
        first: int = 0,
    ) -> None:
        granted = _granted(grant, first, len(spans))
        bases = self._cross.segment_bases(peer, list(grant.segments), deadline)
        src_base = src.pool_block.segment.address
        local: list[int] = []
        remote: list[int] = []
        lengths: list[int] = []
        for span, (index, offset) in zip(spans, granted, strict=True):
            if offset + span.nbytes > grant.segment_nbytes[index]:
                raise _outside_segment()
            for run in span.runs:
                local.append(src_base + run.src_offset)
                remote.append(bases[index] + offset + run.dst_offset)
                lengths.append(run.nbytes)
        self._cross.copy(peer, src, local, remote, lengths, write=True, deadline=deadline)

"""Transfers that pin: v1 `pull_cache`, `pull_blocks` and `transfer_cache_async` pushes, and the v2
transfers the peer resolves or pins by cache id. Each is one shape:

    with link.exclusive(deadline), acquirer.acquire(link, ref, deadline) as location:
        mover_of(link).<read or write>(link, location, ...)

Rules: a transfer holds its link exclusively, its local cache pinned (the caller's `table.pinned`) and the
peer's memory pinned (`_acquire`) for the whole copy; checks of what the peer granted against our side come
before any byte moves. Deadlines are the instance's `sync_kv_timeout`. Nothing here asks where the peer
is: its link's mover knows.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from llm_datadist._protocol.messages import WriteGrant
from llm_datadist._shm import repin as _repin
from llm_datadist._shm.copyplan import BlockPlan
from llm_datadist._shm.errors import ShmError
from llm_datadist._shm.index import _LOCK_RETRY_MAX_S, _LOCK_RETRY_MIN_S, Index, count_lock_wait
from llm_datadist._shm.repin import RepinPlan

from . import _faults
from ._acquire import Acquirer, WriteLease
from ._copy import Copier, PreparedCopy
from ._dataplane import repin, unpin, unpin_again
from ._errors import StatusError
from ._fresh import DONE as FRESH_DONE
from ._fresh import FreshPulls
from ._keys import KEY_BLOCKS, KEY_CACHE_ID
from ._links import Links, mover_of
from ._movers import PushSpan, UnitRun
from ._owner.records import CacheRecord
from ._source import V2, Location, RemoteCache, SourceRef
from ._stats import GEN_V1, MOONCAKE, PULL, PUSH, SHM, Stats, transport
from ._wire.client import ClientLink
from .status import LLMStatusCode
from .utils.log import log

# Repeatable pulls kept per instance; past this many the memo starts over.
_MAX_REPEATS = 1024


@dataclass(frozen=True, slots=True)
class PullSpec:
    """A validated v1 pull: `ref` at `remote_cluster_id` into our tensors from `dst_tensor_start`, each at
    `dst_base_offset` into its slot (the batch slot and offset the caller chose)."""

    remote_cluster_id: int
    ref: SourceRef
    dst_tensor_start: int
    dst_base_offset: int


@dataclass(slots=True, eq=False)
class Repeat:
    """A pull to run again without a lookup or a plan: the pin its first run took, to take again through
    the same link's row of the same mapping of the owner's index, and the copy, ready to run into `dst`."""

    spec: PullSpec
    link: ClientLink
    index: Index
    plan: RepinPlan
    copy: PreparedCopy
    dst: CacheRecord

    def run(self, marks: list[float]) -> int:
        """Pin, copy, unpin, if nothing the first run found changed: `shm.repin.DONE`. BUSY (the index lock
        was held: the caller may try again) or STALE (anything else: the caller takes the full way, which
        raises whatever a change calls for): nothing was done. The caller holds the link exclusively; the
        owner's socket is asked first, as for every pin."""
        link, index = self.link, self.index
        link.check_usable()
        link.check_peer_alive()
        if link.index is not index or _faults.hook is not None:
            return _repin.STALE
        arrays = self.copy.arrays()  # held until the copy ends: the mappings stay mapped
        if arrays is None:
            return _repin.STALE
        kernel, runs = _repin.kernel, self.copy.kernel_runs()
        if kernel is not None and runs is not None:
            # Pin, copy, unpin in one call of the C kernel.
            try:
                fd, mm = index.handle
                pinned, faulted, unpinned = kernel.index_pull(mm, fd, self.plan.plan, *runs)
            except (ShmError, OSError):  # the index closed, or its lock failed: nothing was pinned
                return _repin.STALE
            if pinned != _repin.DONE:
                return pinned
            if unpinned != _repin.DONE:  # busy, or the owner took the row back: the full way
                unpin(link, index, ok=not faulted)
            if faulted:
                raise ShmError("copying rows within this process failed: a page of a mapping vanished")
            ended = time.perf_counter()  # one call: its time is the copy's
            marks.extend((marks[0], marks[0], ended, ended))
            return _repin.DONE
        pinned = repin(link, index, self.plan)
        if pinned != _repin.DONE:
            return pinned
        marks.append(time.perf_counter())
        marks.append(marks[-1])
        try:
            self.copy.run(arrays)
        except BaseException:
            unpin(link, index, ok=False)
            raise
        marks.append(time.perf_counter())
        unpin_again(link, index, self.plan)
        marks.append(time.perf_counter())
        return _repin.DONE


@dataclass(frozen=True)
class BlocksSpec:
    """A validated block pull: remote blocks `src_blocks[k]` into local blocks `dst_blocks[k]`."""

    remote_cluster_id: int
    model_id: int
    src_tensor_start: int
    tensor_count: int
    whole: bool
    dst_tensor_start: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]


class Transfers:
    """The pinning transfers of one initialised instance."""

    def __init__(
        self,
        links: Links,
        acquirer: Acquirer,
        timeout_s: float,
        copier: Copier,
        stats: Stats | None = None,
    ) -> None:
        self._links = links
        self._acquirer = acquirer
        self._timeout_s = timeout_s
        self._stats = stats if stats is not None else Stats.off()
        # The times the last pull passed its phases (`last_pull_breakdown`).
        self._last_marks: list[float] = []
        # Pulls that may repeat, by the identity of what was asked (the face keeps its checked specs: a
        # repeat passes the same object; an entry holds its spec, so an id is never reused meanwhile).
        # At most _MAX_REPEATS: a connector repeats a few.
        self._repeats: dict[int, Repeat] = {}
        self.repeated = 0  # pulls that ran as a Repeat
        self.fresh = FreshPulls(copier)

    def pull(self, spec: PullSpec, dst: CacheRecord) -> None:
        """Pin the source in the owner's published index (or, for what it could not publish, ask it), copy
        from its segment into `dst`, unpin (consuming the key if asked). A pull that repeats one whose pin
        consumed nothing, into the same cache over the same link, takes that pin again and runs the same
        copy (`Repeat`) while nothing it found changed."""
        deadline = time.monotonic() + self._timeout_s
        link = self._links.get(spec.remote_cluster_id)
        marks = [time.perf_counter()]
        ref = spec.ref
        with link.exclusive(deadline):
            fresh = self.fresh.pull(
                link, ref, dst, spec.dst_tensor_start, spec.dst_base_offset, deadline, check_busy=True
            )
        if fresh == FRESH_DONE:
            ended = time.perf_counter()  # one call: its time is the copy's
            marks.extend((marks[0], marks[0], ended, ended))
            self._last_marks = marks
            self._stats.transfer(
                GEN_V1, PULL, SHM, ref.nbytes * ref.tensor_count, ref.tensor_count, ended - marks[0]
            )
            return
        repeat = self._repeats.get(id(spec))
        if repeat is not None and repeat.spec is spec and repeat.link is link and repeat.dst is dst:
            with link.exclusive(deadline):
                outcome = repeat.run(marks)
                pause = _LOCK_RETRY_MIN_S
                if outcome == _repin.BUSY:
                    count_lock_wait()
                while outcome == _repin.BUSY and time.monotonic() < deadline:
                    # The lock is held for microseconds (the owner, another puller): wait as a full pin
                    # would (the pauses of `Index.lock`, until the deadline), so that whether a pull
                    # repeats depends on what changed, not on timing.
                    time.sleep(pause)
                    pause = min(pause * 2, _LOCK_RETRY_MAX_S)
                    outcome = repeat.run(marks)
            if outcome == _repin.DONE:
                self.repeated += 1
                self._last_marks = marks
                ref = spec.ref
                self._stats.transfer(
                    GEN_V1, PULL, SHM, ref.nbytes * ref.tensor_count, ref.tensor_count, marks[-1] - marks[0]
                )
                return
            del marks[1:]
        held = self._acquirer.acquire(link, ref, deadline, again=True)
        with link.exclusive(deadline), held as location:
            marks.append(time.perf_counter())
            dst_offsets = [
                dst.tensor_offset(spec.dst_tensor_start + i) + spec.dst_base_offset
                for i in range(ref.tensor_count)
            ]
            again = held.again
            mover = mover_of(link)
            copy = mover.read_tensors(
                link, location, dst, dst_offsets, ref.nbytes, deadline, marks, repeat=again is not None
            )
            marks.append(time.perf_counter())
            if mover.sees_peer_memory and location.segment:
                # Fresh pulls over this link read that segment next (it is mapped now).
                with contextlib.suppress(ShmError):  # closed meanwhile: the next pull maps it again
                    segment = link.mappings.get(location.segment, min_nbytes=location.segment_nbytes)
                    self.fresh.remember(link, segment)
        marks.append(time.perf_counter())
        self._stats.transfer(
            GEN_V1,
            PULL,
            transport(mover, location),
            ref.nbytes * ref.tensor_count,
            ref.tensor_count,
            marks[-1] - marks[0],
        )
        if copy is not None and again is not None:
            if len(self._repeats) >= _MAX_REPEATS:
                self._repeats.clear()
            self._repeats[id(spec)] = Repeat(spec, link, again[0], again[1], copy, dst)
        self._last_marks = marks

    @property
    def last_pull_breakdown(self) -> dict[str, float]:
        """Where the last pull's time went, in seconds (the bench reads it): resolve and pin, planning,
        copy, unpin; empty before the first pull."""
        marks = self._last_marks
        if len(marks) != 5:
            return {}
        start, pinned_at, planned, copied, done = marks
        return {
            "resolve": pinned_at - start,
            "plan": planned - pinned_at,
            "copy": copied - planned,
            "release": done - copied,
        }

    def pull_blocks(self, spec: BlocksSpec, dst: CacheRecord) -> None:
        """Pin the owner's paged cache, copy block src_blocks[k] to dst_blocks[k] of every tensor, unpin."""
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        link = self._links.get(spec.remote_cluster_id)
        ref = SourceRef(KEY_BLOCKS, 0, spec.model_id, 0, spec.src_tensor_start, spec.tensor_count, spec.whole)
        with link.exclusive(deadline), self._acquirer.acquire(link, ref, deadline) as location:
            block_nbytes, num_blocks = location.unit_nbytes, location.num_units
            if block_nbytes != dst.slot_nbytes:
                raise StatusError(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"remote blocks are {block_nbytes} bytes, local blocks {dst.slot_nbytes}",
                )
            if max(spec.src_blocks) >= num_blocks:
                raise StatusError(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"prompt block {max(spec.src_blocks)} >= the remote block count {num_blocks}",
                )
            dst_offsets = [dst.tensor_offset(spec.dst_tensor_start + i) for i in range(spec.tensor_count)]
            plan = BlockPlan.make(
                location.tensor_bases,
                dst_offsets,
                spec.src_blocks,
                spec.dst_blocks,
                block_nbytes,
                dst.slot_nbytes,
                dst.slot_nbytes,
            )
            mover = mover_of(link)
            mover.read_blocks(link, location, plan, dst, deadline)
        runs = len(spec.src_blocks) * spec.tensor_count
        self._stats.transfer(
            GEN_V1, PULL, transport(mover, location), runs * block_nbytes, runs, time.perf_counter() - started
        )

    def leased_push(
        self, remote_cluster_id: int, src: CacheRecord, spans: list[PushSpan], generation: int
    ) -> LeasedPush:
        """The pushes of `spans` from `src` into a peer that linked to us (over its callback socket), under
        one lease of every span's destination (`LeasedPush`); counted as pushes of API `generation`."""
        return LeasedPush(
            self._links,
            self._acquirer,
            self._timeout_s,
            remote_cluster_id,
            src,
            spans,
            self._stats,
            generation,
        )

    def transfer_pinned(
        self,
        remote_cluster_id: int,
        remote: RemoteCache,
        remote_tensor_start: int,
        local: CacheRecord,
        local_tensor_start: int,
        tensor_count: int,
        runs: list[UnitRun],
        *,
        write: bool = False,
        deadline: float | None = None,
        count_as: tuple[int, int] | None = None,
    ) -> None:
        """Read (or `write`) `runs` between our tensors and a peer's cache found in its table, pinned by its
        cache id for the duration (in the peer's index, or by asking the peer): memory its owner frees or
        unregisters is never written, and LLM_KV_CACHE_NOT_EXIST comes once it freed the cache. `deadline`:
        the caller's (a HIXL transfer's own timeout), else `sync_kv_timeout` from now. `count_as`: the
        (API generation, operation) the stats count it as, if the caller does not count it itself."""
        ref = SourceRef(
            KEY_CACHE_ID,
            remote.cache_id,
            0,
            0,
            remote_tensor_start,
            tensor_count,
            False,
            for_write=write,
            rules=V2,
        )

        def plan(location: Location) -> list[UnitRun]:
            if (location.unit_nbytes, location.num_units) != (remote.unit_nbytes, remote.num_units):
                raise StatusError(LLMStatusCode.LLM_FAILED, "peer resolved a cache of another shape")
            return runs

        self.transfer_resolved(
            remote_cluster_id, ref, local, local_tensor_start, plan, deadline=deadline, count_as=count_as
        )

    def transfer_resolved(
        self,
        remote_cluster_id: int,
        ref: SourceRef,
        local: CacheRecord,
        local_tensor_start: int,
        plan: Callable[[Location], list[UnitRun]],
        *,
        deadline: float | None = None,
        count_as: tuple[int, int] | None = None,
    ) -> None:
        """Pin the cache `ref` names at the peer (in its index when it holds the cache, else by asking it),
        copy the runs `plan` gives for where it is (a push when `ref.for_write`), release. `count_as`: the
        (API generation, operation) the stats count it as, if the caller does not count it itself."""
        started = time.perf_counter()
        if deadline is None:
            deadline = time.monotonic() + self._timeout_s
        link = self._links.link_to(remote_cluster_id, deadline)
        with link.exclusive(deadline), self._acquirer.acquire(link, ref, deadline) as location:
            mover = mover_of(link)
            runs = plan(location)
            mover.copy_units(
                link, location, local, local_tensor_start, runs, write=ref.for_write, deadline=deadline
            )
        if count_as is not None:
            count = len(location.tensor_bases)
            nbytes = count * sum(run.nbytes for run in runs)
            seconds = time.perf_counter() - started
            self._stats.transfer(*count_as, transport(mover, location), nbytes, count * len(runs), seconds)


class LeasedPush:
    """One `transfer_cache_async` config's pushes into a peer's memory. The destination of every span is
    leased at the first push (one WriteRequest: one round trip for the whole transfer, however many
    layers) and stays leased until `end` or `pause`, so that each later push is its copy alone, and memory
    the peer's user frees meanwhile is not reused before the transfer ends. After `pause` (the job waited
    too long for the user between layers) the next push leases again, and fails if the memory went. The
    lease lives on the link it was first taken on: a push that finds another link (the peer was linked
    again) fails, as the peer's memory may be another process's now. Every push holds the link
    exclusively for its copy only."""

    __slots__ = (
        "_acquirer",
        "_cluster_id",
        "_generation",
        "_grant",
        "_lease",
        "_link",
        "_links",
        "_spans",
        "_src",
        "_stats",
        "_timeout_s",
    )

    def __init__(
        self,
        links: Links,
        acquirer: Acquirer,
        timeout_s: float,
        remote_cluster_id: int,
        src: CacheRecord,
        spans: list[PushSpan],
        stats: Stats,
        generation: int,
    ) -> None:
        self._links = links
        self._stats = stats
        self._generation = generation
        self._acquirer = acquirer
        self._timeout_s = timeout_s
        self._cluster_id = remote_cluster_id
        self._src = src
        self._spans = spans
        self._lease: WriteLease | None = None
        self._grant: WriteGrant | None = None
        self._link: ClientLink | None = None

    def push(self, first: int, count: int) -> None:
        """Copy spans `first` to `first + count` into the leased ranges (leasing every span first)."""
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        link = self._links.link_to(self._cluster_id, deadline)
        with link.exclusive(deadline):
            grant = self._grant
            if self._link is not None and link is not self._link:
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"the link to cluster {self._cluster_id} was made again during the transfer",
                )
            if self._lease is None:
                spans = self._spans
                lease = self._acquirer.write_lease(
                    link, tuple(s.dst_addr for s in spans), tuple(s.nbytes for s in spans), deadline
                )
                grant = lease.__enter__()
                self._lease, self._grant, self._link = lease, grant, link
            else:
                # Nothing was asked of the peer for this push: its socket says whether it is still there to
                # receive it (a dead peer's memory stays mapped here, and the copy would succeed).
                link.check_peer_alive()
            assert grant is not None
            spans = self._spans[first : first + count]
            mover = mover_of(link)
            mover.write_ranges(link, grant, self._src, spans, deadline, first)
            link.check_peer_alive()  # and whether it was there to receive it
        runs = sum(len(span.runs) for span in spans)
        nbytes = sum(run.nbytes for span in spans for run in span.runs)
        self._stats.transfer(
            self._generation,
            PUSH,
            SHM if mover.sees_peer_memory else MOONCAKE,
            nbytes,
            runs,
            time.perf_counter() - started,
        )

    def pause(self) -> None:
        """Release the lease for now (what was pushed landed); the next push leases again."""
        self.end(ok=True)

    def end(self, ok: bool) -> None:
        """Release the lease (`ok`: every push of it landed; else the peer is told the transfer failed).
        Never raises: a link that cannot carry the release has ended, and the lease with it."""
        lease, self._lease, link = self._lease, None, self._link
        if lease is None or link is None:
            return
        deadline = time.monotonic() + self._timeout_s
        try:
            with link.exclusive(deadline):
                lease.release(ok=ok, deadline=deadline)
        except StatusError as exc:
            log.warning("transfer_cache_async: releasing the pushes to cluster %d: %s", self._cluster_id, exc)

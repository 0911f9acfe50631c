"""Transfers that pin: v1 `pull_cache`, `pull_blocks` and `transfer_cache_async` pushes, and the v2
transfers the peer resolves or pins by cache id. Each is one shape:

    with peer.exclusive(deadline), acquirer.acquire(peer, ref, deadline) as location:
        peer.mover.<read or write>(peer, location, ...)

Rules: a transfer holds its link exclusively, its local cache pinned (the caller's `table.pinned`) and the
peer's memory pinned (`acquire`) for the whole copy; checks of what the peer granted against our side come
before any byte moves. Deadlines are the instance's `sync_kv_timeout`. Nothing here asks where the peer
is: its mover (`Peer.mover`) knows.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from llm_datadist._protocol.messages import WriteGrant
from llm_datadist._shm.copyplan import BlockPlan

from .._errors import StatusError
from .._keys import KEY_BLOCKS, KEY_CACHE_ID
from .._owner.records import CacheRecord
from .._stats import GEN_V1, PULL, PUSH, SHM, Stats
from ..status import LLMStatusCode
from ..utils.log import log
from .acquire import Acquirer, WriteLease
from .copy import Copier
from .fresh import DONE as FRESH_DONE
from .fresh import FreshPulls
from .links import Links
from .movers import PushSpan, UnitRun
from .peer import Peer
from .source import V2, Location, RemoteCache, SourceRef


class PullSpec(NamedTuple):
    """A validated v1 pull: `ref` at `remote_cluster_id` into our tensors from `dst_tensor_start`, each at
    `dst_base_offset` into its slot (the batch slot and offset the caller chose)."""

    remote_cluster_id: int
    ref: SourceRef
    dst_tensor_start: int
    dst_base_offset: int


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
        self.fresh = FreshPulls(copier)

    def pull(self, spec: PullSpec, dst: CacheRecord) -> None:
        """Pin the source in the owner's published index (or, for what it could not publish, ask it), copy
        from its segment into `dst`, unpin (consuming the key if asked): in the C kernel when it can
        (`FreshPulls`), else the full way, which maps what the kernel's way then reads."""
        deadline = time.monotonic() + self._timeout_s
        peer = self._links.get(spec.remote_cluster_id)
        started = time.perf_counter()
        ref = spec.ref
        link = peer.link
        link.hold(deadline)
        try:
            fresh = self.fresh.pull(
                peer, ref, dst, spec.dst_tensor_start, spec.dst_base_offset, deadline, check_busy=True
            )
        finally:
            link.let_go()
        if fresh == FRESH_DONE:
            ended = time.perf_counter()  # one call: its time is the copy's
            self._last_marks = [started, started, started, ended, ended]
            self._stats.transfer(
                GEN_V1, PULL, SHM, ref.nbytes * ref.tensor_count, ref.tensor_count, ended - started
            )
            return
        marks = [started]
        with peer.exclusive(deadline), self._acquirer.acquire(peer, ref, deadline) as location:
            marks.append(time.perf_counter())
            dst_offsets = [
                dst.tensor_offset(spec.dst_tensor_start + i) + spec.dst_base_offset
                for i in range(ref.tensor_count)
            ]
            mover = peer.mover
            mover.read_tensors(peer, location, dst, dst_offsets, ref.nbytes, deadline, marks)
            marks.append(time.perf_counter())
        marks.append(time.perf_counter())
        self._stats.transfer(
            GEN_V1,
            PULL,
            mover.transport(location.segment),
            ref.nbytes * ref.tensor_count,
            ref.tensor_count,
            marks[-1] - marks[0],
        )
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
        peer = self._links.get(spec.remote_cluster_id)
        ref = SourceRef(KEY_BLOCKS, 0, spec.model_id, 0, spec.src_tensor_start, spec.tensor_count, spec.whole)
        with peer.exclusive(deadline), self._acquirer.acquire(peer, ref, deadline) as location:
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
            mover = peer.mover
            mover.read_blocks(peer, location, plan, dst, deadline)
        runs = len(spec.src_blocks) * spec.tensor_count
        self._stats.transfer(
            GEN_V1,
            PULL,
            mover.transport(location.segment),
            runs * block_nbytes,
            runs,
            time.perf_counter() - started,
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
        peer = self._links.link_to(remote_cluster_id, deadline)
        with peer.exclusive(deadline), self._acquirer.acquire(peer, ref, deadline) as location:
            mover = peer.mover
            runs = plan(location)
            mover.copy_units(
                peer, location, local, local_tensor_start, runs, write=ref.for_write, deadline=deadline
            )
        if count_as is not None:
            count = len(location.tensor_bases)
            nbytes = count * sum(run.nbytes for run in runs)
            seconds = time.perf_counter() - started
            self._stats.transfer(
                *count_as, mover.transport(location.segment), nbytes, count * len(runs), seconds
            )


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
        "_links",
        "_peer",
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
        self._peer: Peer | None = None

    def push(self, first: int, count: int) -> None:
        """Copy spans `first` to `first + count` into the leased ranges (leasing every span first)."""
        started = time.perf_counter()
        deadline = time.monotonic() + self._timeout_s
        peer = self._links.link_to(self._cluster_id, deadline)
        with peer.exclusive(deadline):
            grant = self._grant
            if self._peer is not None and peer is not self._peer:
                raise StatusError(
                    LLMStatusCode.LLM_LINK_FAILED,
                    f"the peer to cluster {self._cluster_id} was made again during the transfer",
                )
            if self._lease is None:
                spans = self._spans
                lease = self._acquirer.write_lease(
                    peer, tuple(s.dst_addr for s in spans), tuple(s.nbytes for s in spans), deadline
                )
                grant = lease.__enter__()
                self._lease, self._grant, self._peer = lease, grant, peer
            else:
                # Nothing was asked of the peer for this push: its socket says whether it is still there to
                # receive it (a dead peer's memory stays mapped here, and the copy would succeed).
                peer.check_peer_alive()
            assert grant is not None
            spans = self._spans[first : first + count]
            mover = peer.mover
            mover.write_ranges(peer, grant, self._src, spans, deadline, first)
            peer.check_peer_alive()  # and whether it was there to receive it
        runs = sum(len(span.runs) for span in spans)
        nbytes = sum(run.nbytes for span in spans for run in span.runs)
        self._stats.transfer(
            self._generation,
            PUSH,
            mover.transport(grant.segments[0] if grant.segments else ""),
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
        lease, self._lease, peer = self._lease, None, self._peer
        if lease is None or peer is None:
            return
        deadline = time.monotonic() + self._timeout_s
        try:
            with peer.exclusive(deadline):
                lease.release(ok=ok, deadline=deadline)
        except StatusError as exc:
            log.warning("transfer_cache_async: releasing the pushes to cluster %d: %s", self._cluster_id, exc)

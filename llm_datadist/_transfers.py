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

import time
from collections.abc import Callable
from dataclasses import dataclass

from llm_datadist._shm.copyplan import BlockPlan

from ._acquire import Acquirer
from ._errors import StatusError
from ._keys import KEY_BLOCKS, KEY_CACHE_ID
from ._links import Links, mover_of
from ._movers import PushSpan, UnitRun
from ._owner.records import CacheRecord
from ._source import V2, Location, RemoteCache, SourceRef
from .status import LLMStatusCode


@dataclass(frozen=True, slots=True)
class PullSpec:
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

    def __init__(self, links: Links, acquirer: Acquirer, timeout_s: float) -> None:
        self._links = links
        self._acquirer = acquirer
        self._timeout_s = timeout_s
        # Where the last pull's time went (bench reads it): resolve and pin, planning, copy, unpin.
        self.last_pull_breakdown: dict[str, float] = {}

    def pull(self, spec: PullSpec, dst: CacheRecord) -> None:
        """Pin the source in the owner's published index (or, for what it could not publish, ask it), copy
        from its segment into `dst`, unpin (consuming the key if asked)."""
        deadline = time.monotonic() + self._timeout_s
        link = self._links.get(spec.remote_cluster_id)
        ref = spec.ref
        marks = [time.perf_counter()]
        with link.exclusive(deadline), self._acquirer.acquire(link, ref, deadline) as location:
            marks.append(time.perf_counter())
            dst_offsets = [
                dst.tensor_offset(spec.dst_tensor_start + i) + spec.dst_base_offset
                for i in range(ref.tensor_count)
            ]
            mover_of(link).read_tensors(link, location, dst, dst_offsets, ref.nbytes, deadline, marks)
            marks.append(time.perf_counter())
        marks.append(time.perf_counter())
        if len(marks) == 5:
            start, pinned_at, planned, copied, done = marks
            self.last_pull_breakdown = {
                "resolve": pinned_at - start,
                "plan": planned - pinned_at,
                "copy": copied - planned,
                "release": done - copied,
            }

    def pull_blocks(self, spec: BlocksSpec, dst: CacheRecord) -> None:
        """Pin the owner's paged cache, copy block src_blocks[k] to dst_blocks[k] of every tensor, unpin."""
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
            mover_of(link).read_blocks(link, location, plan, dst, deadline)

    def push(self, remote_cluster_id: int, src: CacheRecord, spans: list[PushSpan]) -> None:
        """Pin the peer's memory at the spans' addresses, copy into it from `src`'s segment, release.

        Goes over the link back to a peer that linked to us (its callback socket).
        """
        deadline = time.monotonic() + self._timeout_s
        link = self._links.link_to(remote_cluster_id, deadline)
        addrs = tuple(span.dst_addr for span in spans)
        nbytes = tuple(span.nbytes for span in spans)
        with link.exclusive(deadline), self._acquirer.write_lease(link, addrs, nbytes, deadline) as grant:
            mover_of(link).write_ranges(link, grant, src, spans, deadline)

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
    ) -> None:
        """Read (or `write`) `runs` between our tensors and a peer's cache found in its table, pinned by its
        cache id for the duration (in the peer's index, or by asking the peer): memory its owner frees or
        unregisters is never written, and LLM_KV_CACHE_NOT_EXIST comes once it freed the cache. `deadline`:
        the caller's (a HIXL transfer's own timeout), else `sync_kv_timeout` from now."""
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

        self.transfer_resolved(remote_cluster_id, ref, local, local_tensor_start, plan, deadline=deadline)

    def transfer_resolved(
        self,
        remote_cluster_id: int,
        ref: SourceRef,
        local: CacheRecord,
        local_tensor_start: int,
        plan: Callable[[Location], list[UnitRun]],
        *,
        deadline: float | None = None,
    ) -> None:
        """Pin the cache `ref` names at the peer (in its index when it holds the cache, else by asking it),
        copy the runs `plan` gives for where it is (a push when `ref.for_write`), release."""
        if deadline is None:
            deadline = time.monotonic() + self._timeout_s
        link = self._links.link_to(remote_cluster_id, deadline)
        with link.exclusive(deadline), self._acquirer.acquire(link, ref, deadline) as location:
            mover_of(link).copy_units(
                link,
                location,
                local,
                local_tensor_start,
                plan(location),
                write=ref.for_write,
                deadline=deadline,
            )

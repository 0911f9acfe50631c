"""One HIXL transfer: raw addresses become runs for `llm_datadist`'s movers (`_puller.oneside`,
`_puller.transfers`).

Rules: every local range wholly in memory this engine registered, every remote one in memory the peer
registered as its table says now (read again once on a miss or stale entry), else PARAM_INVALID and nothing
moves. One-sided reads on this host are checked by generation; writes, and all across hosts, pin the peer's
region for their duration. The whole transfer keeps to the caller's deadline."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from .. import _stats
from .._core import Core
from .._errors import StatusError
from .._puller.movers import UnitRun
from .._puller.source import RemoteTable
from ..status import LLMStatusCode
from .codes import WRITE
from .regions import Region, Regions, RemoteRegion, RemoteRegions


@dataclass(frozen=True, slots=True)
class OpDesc:
    """One descriptor: `nbytes` between `local_addr` here and `remote_addr` at the peer."""

    local_addr: int
    remote_addr: int
    nbytes: int


# (local cache id, the peer's cache id, the peer's tensor) -> what to copy between them.
_Groups = dict[tuple[int, int, int], tuple[RemoteRegion, list[UnitRun]]]


def _invalid(detail: str) -> StatusError:
    return StatusError(LLMStatusCode.LLM_PARAM_INVALID, detail)


class Mover:
    """The transfers of one engine over its `Core`'s links."""

    def __init__(self, core: Core, regions: Regions) -> None:
        self._core = core
        self._regions = regions
        # The peer's regions by cluster, kept while its link keeps the same table.
        self._remote: dict[int, RemoteRegions] = {}

    def local_runs(self, descs: Sequence[OpDesc]) -> list[tuple[Region, OpDesc]]:
        """(local region, descriptor) for each descriptor that moves bytes; PARAM_INVALID for a local
        range outside this engine's registered memory."""
        found = []
        for desc in descs:
            if not desc.nbytes:
                continue
            region = self._regions.containing(desc.local_addr, desc.nbytes)
            if region is None:
                raise _invalid(
                    f"local range [{desc.local_addr:#x}, +{desc.nbytes}) is not inside memory this engine "
                    "registered"
                )
            found.append((region, desc))
        return found

    def run(self, cluster_id: int, op: int, descs: Sequence[OpDesc], deadline: float) -> None:
        """Move `descs` (READ: from the peer, WRITE: to it) by `deadline`; StatusError on failure. Counted
        in the instance's stats as the `hixl` generation's reads and writes (docs/metrics.md)."""
        started = time.perf_counter()
        operation = _stats.WRITE if op == WRITE else _stats.READ
        try:
            moved = self._run(cluster_id, op, descs, deadline)
        except StatusError as exc:
            self._core.stats.failed(_stats.GEN_HIXL, operation, exc.code)
            raise
        if moved:
            nbytes, runs = moved
            peer = self._core.links.get(cluster_id)
            how = peer.mover.transport("")  # hixl names registered memory by address
            self._core.stats.transfer(
                _stats.GEN_HIXL, operation, how, nbytes, runs, time.perf_counter() - started
            )

    def _run(self, cluster_id: int, op: int, descs: Sequence[OpDesc], deadline: float) -> tuple[int, int]:
        """`run` but the counting: (bytes, descriptors) moved."""
        local = self.local_runs(descs)
        if not local:
            return 0, 0
        for attempt in (0, 1):
            refresh = attempt > 0
            groups = self._plan(cluster_id, local, refresh, deadline)
            if groups is None:
                continue  # a range the table did not list: look at the peer's table as it is now
            try:
                for (local_id, _, _), (region, runs) in groups.items():
                    self._move(cluster_id, op, local_id, region, runs, deadline)
                return sum(desc.nbytes for _, desc in local), len(local)
            except StatusError as exc:
                # The peer deregistered a region since its table was read: read the table again, once.
                if exc.code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST or refresh:
                    raise
        raise _invalid("a remote range is not inside memory the peer registered")

    def _plan(
        self, cluster_id: int, local: list[tuple[Region, OpDesc]], refresh: bool, deadline: float
    ) -> _Groups | None:
        """The runs of each (local region, remote region) pair, or None when a remote range is not in the
        table (the caller reads it again once; on the fresh table that is PARAM_INVALID)."""
        table = self._core.oneside.remote_table(cluster_id, refresh=refresh, deadline=deadline)
        remote = self._regions_of(cluster_id, table)
        groups: _Groups = {}
        for local_region, desc in local:
            region = remote.containing(desc.remote_addr, desc.nbytes)
            if region is None:
                if refresh:
                    raise _invalid(
                        f"remote range [{desc.remote_addr:#x}, +{desc.nbytes}) is not inside memory the "
                        "peer registered"
                    )
                return None
            key = (local_region.cache_id, region.cache.cache_id, region.tensor)
            runs = groups.setdefault(key, (region, []))[1]
            runs.append(
                UnitRun(desc.remote_addr - region.addr, desc.local_addr - local_region.addr, desc.nbytes)
            )
        return groups

    def _regions_of(self, cluster_id: int, table: RemoteTable) -> RemoteRegions:
        remote = self._remote.get(cluster_id)
        if remote is None or remote.table is not table:
            remote = RemoteRegions(table)
            self._remote[cluster_id] = remote
        return remote

    def _move(
        self,
        cluster_id: int,
        op: int,
        local_id: int,
        region: RemoteRegion,
        runs: list[UnitRun],
        deadline: float,
    ) -> None:
        core = self._core
        with core.pins.pinned(local_id) as local:
            if op == WRITE:
                core.transfers.transfer_pinned(
                    cluster_id, region.cache, region.tensor, local, 0, 1, runs, write=True, deadline=deadline
                )
                return
            peer = core.links.get(cluster_id)
            if not core.oneside.remote_is_current(cluster_id, region.cache):
                raise StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "the peer deregistered that memory")
            core.oneside.read(
                cluster_id, region.cache, region.tensor, local, 0, 1, runs, peer=peer, deadline=deadline
            )

    def forget(self, cluster_id: int) -> None:
        """The link to `cluster_id` went: its peer's regions go with it."""
        self._remote.pop(cluster_id, None)


def deadline_in(timeout_ms: int) -> float:
    return time.monotonic() + timeout_ms / 1000.0

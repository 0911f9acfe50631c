"""v2 one-sided reads: a peer's table of remote-accessible caches, read once per link, and reads from
them with no message to the peer.

Rules: everything learnt from a peer belongs to its link (a restarted peer is a new link with no table).
The table comes from the peer's index (no message) or, when the peer could not publish every cache there,
page by page from the peer. A read without a pin is trusted only if the cache's generation word, checked
after the copy, still says the owner holds it: a change means freed or reused memory and the read fails
with LLM_KV_CACHE_NOT_EXIST. Only a mover that maps the peer's generation words (`Mover.words`) can read
so; through any other the read pins the cache by id for its duration (`Transfers.transfer_pinned`).
Writes never go unpinned (a write cannot be taken back once it landed in reused memory).
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, cast

from llm_datadist._protocol.messages import Table, TableRequest
from llm_datadist._shm.errors import ShmError
from llm_datadist._shm.index_layout import CACHE_REMOTE, CACHE_WITHDRAWN, FLAG_CACHES_UNPUBLISHED, STATE_OPEN
from llm_datadist._shm.segment import Segment

from .._errors import PeerGone, StatusError
from .._native import kernel_function
from .._owner.pins import LocalPins
from .._owner.records import CacheRecord
from .._stats import GEN_V2, READ, Stats
from ..status import LLMException, LLMStatusCode
from .acquire import Acquirer
from .copy import load_words
from .dataplane import index_not_open, peer_index, raise_index_error
from .links import Links
from .movers import RangeUnmapped, UnitRun, peer_segment
from .peer import Peer
from .source import Location, RemoteCache, RemoteTable
from .transfers import Transfers
from .vm import PreparedRuns

# A peer's one-sided table comes in pages; more pages than this is a peer describing more than it can own.
_MAX_TABLE_PAGES = 1024

# The C kernel's checked read of registered memory (`OneSided._read_again`), None without it; its results.
_vm_read_checked = kernel_function("vm_read_checked")
_VM_DONE, _VM_GONE, _VM_STALE, _VM_CHANGED, _VM_SHORT = range(5)

# (remote slot, remote unit bytes, remote unit count) -> the byte runs to copy in every tensor.
RunsFor = Callable[[int, int, int], list[UnitRun]]


class Moved(NamedTuple):
    """What a read moved, as the stats count it: how (`_stats.TRANSPORTS`), bytes and byte runs in all."""

    transport: int
    nbytes: int
    runs: int


@dataclass(frozen=True, slots=True)
class _Found:
    """What a read found on the remote side and derived from it: the link and the peer's table it looked
    in, the entry, the runs, and what the read prepared (the copy, the mapped generation segment)."""

    peer: Peer
    table: RemoteTable
    remote: RemoteCache
    runs: list[UnitRun]
    prepared: PreparedRuns | None
    words: Segment | None  # None for a peer on another host (nothing of it is mapped here)
    moved: Moved  # what the read moves, for the stats
    location: Location  # the entry's tensors the read names


@dataclass(slots=True, eq=False)
class PreparedRead:
    """A one-sided read whose arguments were checked: everything derived from them and the local record
    alone, kept by its caller for as long as it may repeat the read (a face's memo), run by `OneSided.run`,
    which checks the remote side afresh each time. Only `found` changes: what the last run found, reused
    while the link, the peer's table and the entry's generation say a lookup would find it again."""

    record: CacheRecord
    cluster_id: int
    cache_id: int | None  # the remote cache by id, or by blocks model id
    model_id: int | None
    slot: int
    src_start: int
    dst_start: int
    count: int
    whole: bool
    runs_for: RunsFor
    continuous_source: bool  # pull_cache: the remote cache must not be a blocks cache
    found: _Found | None = None


class OneSided:
    """The one-sided reads of one initialised instance."""

    def __init__(
        self,
        links: Links,
        acquirer: Acquirer,
        transfers: Transfers,
        pins: LocalPins,
        timeout_s: float,
        stats: Stats | None = None,
    ) -> None:
        self._stats = stats if stats is not None else Stats.off()
        self._links = links
        self._pins = pins
        self._acquirer = acquirer
        self._transfers = transfers
        self._timeout_s = timeout_s

    def run(self, read: PreparedRead, runs_for: RunsFor | None = None) -> None:
        """Pin the local cache, check the peer, find the remote cache in the peer's table (refetched when
        stale), read, and count the read. When the link and the peer's table are those of the last run, and
        that run's entry is still current (by model id: in a table whose version is current), the lookup
        would find that entry again: the read reuses what was derived. `runs_for`: this call's runs (a
        pull of other blocks), instead of the read's own."""
        started = time.perf_counter()
        moved = self._run(read, runs_for)
        self._stats.transfer(GEN_V2, READ, *moved, time.perf_counter() - started)

    def _run(self, read: PreparedRead, runs_for: RunsFor | None) -> Moved:
        """`run` but the counting: what the read moved."""
        with self._pins.pinned(read.record.cache_id) as pinned:
            if not pinned.remote_accessible:
                # The real one-sided path needs the local side registered for remote access too.
                raise _invalid("with remote cache access, the local cache must be remote_accessible too")
            found = read.found if pinned is read.record else None
            runs_for = runs_for or read.runs_for
            if (
                found is not None
                and self._runs_again(read, found, runs_for)
                and self._read_again(read, found)
            ):
                return found.moved
            peer = self.check_peer(read.cluster_id)
            if (
                found is not None
                and found.peer is peer
                and found.table is peer.table
                and self.remote_cache_current(
                    peer, found.remote, found.table if read.model_id is not None else None, words=found.words
                )
            ):
                table, remote, words, location = found.table, found.remote, found.words, found.location
            else:
                table, remote = self.find(read.cluster_id, read.cache_id, read.model_id)
                if read.continuous_source and remote.is_blocks:
                    raise _invalid("the source of pull_cache must not be a blocks cache")
                check_remote_tensors(remote, read.src_start, read.count, read.whole)
                found, words = None, None
                location = remote.location(read.src_start, read.count)
            runs = runs_for(read.slot, remote.unit_nbytes, remote.num_units)
            # What the last run prepared serves only the very same runs again.
            prepared = found.prepared if found is not None and runs == found.runs else None
            prepared, words = self.read(
                read.cluster_id,
                remote,
                read.src_start,
                pinned,
                read.dst_start,
                read.count,
                runs,
                peer=peer,
                prepared=prepared,
                words=words,
                location=location,
            )
            nbytes = read.count * sum(run.nbytes for run in runs)
            moved = Moved(peer.mover.transport(remote.segment), nbytes, read.count * len(runs))
            if pinned is read.record:
                read.found = _Found(peer, table, remote, runs, prepared, words, moved, location)
            return moved

    @staticmethod
    def _runs_again(read: PreparedRead, found: _Found, runs_for: RunsFor) -> bool:
        """Whether `runs_for` gives the last run's runs on the entry it found (a pull of the same blocks): a
        refusal there is the full way's to make, on the entry a lookup finds now."""
        if found.prepared is None:
            return False
        try:
            runs = runs_for(read.slot, found.remote.unit_nbytes, found.remote.num_units)
        except (StatusError, LLMException):
            return False
        return runs == found.runs

    def _read_again(self, read: PreparedRead, found: _Found) -> bool:
        """The last run's read of registered memory once more, in one call of the C kernel
        (`vm_read_checked`): the link's socket polled for a hang-up, the entry's generation word (and for a
        model id its table's version) checked, the copy, then the socket and the word again, as `run`'s
        full way does them. True when done; LLM_LINK_FAILED for a peer that ended, LLM_KV_CACHE_NOT_EXIST
        for a cache freed or reused during the copy; False when the full way must look (no kernel, another
        link or table, a stale entry: nothing copied; a copy the kernel did not complete: redone there)."""
        kernel = _vm_read_checked
        if kernel is None or found.words is None or found.prepared is None:
            return False
        iovecs = found.prepared.read_iovecs
        if iovecs is None:
            return False
        deadline = time.monotonic() + self._timeout_s
        peer, table, remote = self._links.link_to(read.cluster_id, deadline), found.table, found.remote
        if peer is not found.peer or table is not peer.table:
            return False
        version = 0
        if read.model_id is not None:
            if not table.version or table.generations != remote.generations:
                return False
            version = table.version
        local, remote_iovecs, wanted = iovecs
        with peer.exclusive(deadline):
            words = found.words
            if words.closed:
                return False
            outcome = kernel(
                peer.link.socket_fd,
                peer.info.pid,
                local,
                remote_iovecs,
                wanted,
                words.array,
                remote.gen_slot,
                remote.generation,
                version,
            )
        if outcome == _VM_DONE:
            return True
        if outcome == _VM_GONE:
            peer.check_peer_alive()  # breaks the link and raises
            raise PeerGone(f"link to cluster {read.cluster_id}: the peer hung up")
        if outcome == _VM_CHANGED:
            raise StatusError(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                f"remote cache {remote.cache_id} was freed or reused during the transfer",
            )
        return False

    def remote(self, cluster_id: int, cache_id: int | None, model_id: int | None) -> RemoteCache:
        """A cache from the peer's table, by id or by blocks model id, refetching the table once on a miss.
        Nothing learnt from a peer is trusted once it ended: a dead peer is a link failure before any
        check against its table."""
        self.check_peer(cluster_id)
        return self.find(cluster_id, cache_id, model_id)[1]

    def find(
        self, cluster_id: int, cache_id: int | None, model_id: int | None
    ) -> tuple[RemoteTable, RemoteCache]:
        """`remote` once the peer was checked, with the table the cache was found in. A model id is looked
        up only in a table whose version is current (the owner may have bound it to another cache since), a
        cache id in any (ids are never reused). LLM_KV_CACHE_NOT_EXIST when the peer holds no such cache."""
        for refresh in (False, True):
            table = self.remote_table(cluster_id, refresh=refresh)
            if model_id is not None and not refresh and not self.remote_table_current(cluster_id, table):
                continue
            wanted = table.blocks.get(model_id) if model_id is not None else cache_id
            # An entry whose cache the owner has freed since the table was fetched is stale: refetch.
            if (
                wanted is not None
                and wanted in table.caches
                and self.remote_is_current(cluster_id, table.caches[wanted])
            ):
                return table, table.caches[wanted]
        name = f"model_id {model_id}" if model_id is not None else f"cache id {cache_id}"
        raise StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no remote-accessible cache with {name}")

    def remote_table(
        self, remote_cluster_id: int, *, refresh: bool = False, deadline: float | None = None
    ) -> RemoteTable:
        """The peer's table of remote-accessible caches, read from its index (or, when the peer could not
        publish every cache there, fetched page by page) on first use and kept on the link: a new link, to
        a restarted peer, starts with no table. `deadline`: the caller's, else `sync_kv_timeout` from now."""
        if deadline is None:
            deadline = time.monotonic() + self._timeout_s
        peer = self._links.link_to(remote_cluster_id, deadline)
        table = None if refresh else peer.table
        if isinstance(table, RemoteTable):
            return table
        with peer.exclusive(deadline):
            table = self._index_table(peer, deadline) or _fetched_table(peer, deadline)
            peer.table = table
        return table

    def _index_table(self, peer: Peer, deadline: float) -> RemoteTable | None:
        """The peer's one-sided table as its index holds it, with no message; None when the peer has no
        index or could not publish every cache in it."""
        peer.check_usable()
        peer.check_peer_alive()
        timeout_code = self._acquirer.timeout_code
        index = peer_index(peer, self._acquirer.incarnation, deadline, timeout_code)
        if index is None:
            return None
        try:
            generations = index.generations
            if not generations:
                return None
            # The version word before the entries: a change in between makes the reader refetch once more.
            words = peer_segment(peer, generations, 8, writable=False)
            version = _generation_word(words, 0)
            order_loads()
            index.lock(max(deadline - time.monotonic(), 0.0))
            try:
                state, flags = index.header()
                if state != STATE_OPEN:
                    raise index_not_open(peer, state)
                if flags & FLAG_CACHES_UNPUBLISHED:
                    return None
                entries = index.live_caches()
                names = index.blocks_names()
            finally:
                index.unlock()
        except ShmError as exc:
            raise_index_error(peer, exc, timeout_code)
        pid = peer.info.pid
        caches: dict[int, RemoteCache] = {}
        by_slot: dict[tuple[int, int], int] = {}
        for entry in entries:
            if entry.flags & CACHE_WITHDRAWN or not entry.flags & CACHE_REMOTE:
                continue
            caches[entry.cache_id] = RemoteCache(
                entry.cache_id,
                entry.is_blocks,
                pid,
                entry.segment,
                entry.segment_nbytes,
                entry.tensor_bases(0, entry.num_tensors),
                entry.slot_nbytes,
                entry.batch_size,
                generations,
                entry.slot,
                entry.generation,
            )
            by_slot[(entry.slot, entry.generation)] = entry.cache_id
        blocks: dict[int, int] = {}
        for name in names:
            cache_id = by_slot.get((name.cache_slot, name.generation))
            if cache_id is not None:
                blocks[name.model_id] = cache_id
        return RemoteTable(caches, blocks, generations, version)

    def remote_table_current(self, remote_cluster_id: int, table: RemoteTable) -> bool:
        """Whether what `table`'s model ids name is still what the peer's keys name (its version word)."""
        deadline = time.monotonic() + self._timeout_s
        peer = self._links.link_to(remote_cluster_id, deadline)
        if not table.version or not table.generations:
            return False
        words = peer.mover.words(peer, table.generations, 8)
        if words is None:
            return False
        order_loads()
        return _generation_word(words, 0) == table.version

    def check_peer(self, remote_cluster_id: int) -> Peer:
        """LLM_LINK_FAILED at once if the link to `remote_cluster_id` is broken or its peer has ended: a
        one-sided transfer checks this before it trusts anything it learnt from that peer. Returns the
        link (`link_to`)."""
        deadline = time.monotonic() + self._timeout_s
        peer = self._links.link_to(remote_cluster_id, deadline)
        peer.link.check_usable()
        peer.link.check_peer_alive()
        return peer

    def read(
        self,
        remote_cluster_id: int,
        remote: RemoteCache,
        remote_tensor_start: int,
        local: CacheRecord,
        local_tensor_start: int,
        tensor_count: int,
        runs: list[UnitRun],
        *,
        peer: Peer | None = None,
        prepared: PreparedRuns | None = None,
        words: Segment | None = None,
        deadline: float | None = None,
        location: Location | None = None,
    ) -> tuple[PreparedRuns | None, Segment | None]:
        """Read from a peer's cache (from its table) into ours with no round trip to the peer.

        The cache's generation word is checked after the copy: if the owner freed or reused the cache
        meanwhile, the bytes cannot be trusted and the read fails with LLM_KV_CACHE_NOT_EXIST instead of
        returning stale data. No check is needed before: callers take `remote` from a table entry they just
        found current, and a change since then fails the check after.

        `link`: the link `link_to` just gave (spares looking it up again). Returns what a caller that
        repeats this very read (same link, entry, local record and runs) may pass back to skip building it
        again: the prepared copy and the entry's generation segment as mapped (`remote_cache_current`'s
        `words`). `deadline`: the caller's (a HIXL transfer's own timeout), else `sync_kv_timeout` from now.
        """
        if deadline is None:
            deadline = time.monotonic() + self._timeout_s
        if peer is None:
            peer = self._links.link_to(remote_cluster_id, deadline)
        mover = peer.mover
        if words is None:  # (one closed since is mapped again by the check after the copy)
            words = mover.words(peer, remote.generations, (remote.gen_slot + 1) * 8)
        if words is None:
            # Nothing of the peer is mapped here to check a generation in: it pins the cache for the read
            # instead (one round trip, then the mover's read).
            self._transfers.transfer_pinned(
                remote_cluster_id,
                remote,
                remote_tensor_start,
                local,
                local_tensor_start,
                tensor_count,
                runs,
                deadline=deadline,
            )
            return None, None
        if location is None:
            location = remote.location(remote_tensor_start, tensor_count)
        with peer.link.exclusive(deadline):
            try:
                prepared = mover.copy_units(
                    peer,
                    location,
                    local,
                    local_tensor_start,
                    runs,
                    write=False,
                    deadline=deadline,
                    prepared=prepared,
                )
            except RangeUnmapped as exc:
                # The owner unregistered and freed that memory during the read (nothing pins it): the
                # generation check tells that from a bad local range.
                if not self.remote_cache_current(peer, remote, words=words):
                    raise StatusError(
                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                        f"remote cache {remote.cache_id} was unregistered during the transfer",
                    ) from exc
                raise
            peer.check_peer_alive()
            if not self.remote_cache_current(peer, remote, words=words):
                raise StatusError(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
                    f"remote cache {remote.cache_id} was freed or reused during the transfer",
                )
        return prepared, words

    def remote_cache_current(
        self,
        peer: Peer,
        remote: RemoteCache,
        table: RemoteTable | None = None,
        *,
        words: Segment | None = None,
    ) -> bool:
        """Whether the owner still holds the cache this table entry describes (its generation word). A
        generation segment that is gone because its owner ended is a link failure (see `peer_segment`).

        With `table` (the entry's), also whether what its model ids name is still current, as
        `remote_table_current` says, in the same look at the segment: False for a table whose version
        word is unknown or lives in another segment than the entry's. `words`: the entry's generation
        segment as an earlier call on this link mapped it, used while it is open (the link's mapping cache
        closes what it drops)."""
        if table is not None and (
            not table.version or not table.generations or table.generations != remote.generations
        ):
            return False
        if words is None or words.closed:
            words = peer.mover.words(peer, remote.generations, (remote.gen_slot + 1) * 8)
        if words is None:
            return False  # nothing of it is mapped here: the caller looks the cache up again
        order_loads()
        if table is None:
            return _generation_words(words, (remote.gen_slot,)) == [remote.generation]
        return _generation_words(words, (0, remote.gen_slot)) == [table.version, remote.generation]

    def remote_is_current(self, remote_cluster_id: int, remote: RemoteCache) -> bool:
        deadline = time.monotonic() + self._timeout_s
        peer = self._links.link_to(remote_cluster_id, deadline)
        words = peer.mover.words(peer, remote.generations, (remote.gen_slot + 1) * 8)
        if words is None:
            return True  # the transfer pins it by id at the peer, which says if it is gone
        return self.remote_cache_current(peer, remote, words=words)


def _generation_word(words: Segment, slot: int) -> int:
    """Word `slot` of a peer's mapped generation segment (`_generation_words`)."""
    return _generation_words(words, (slot,))[0]


def _generation_words(words: Segment, slots: tuple[int, ...]) -> list[int]:
    """Words `slots` of a peer's mapped generation segment, in order, read as copies read a peer's memory:
    a segment another process shrank fails the transfer (LLM_FAILED) instead of the process (SIGBUS)."""
    count, address = words.nbytes // 8, words.address
    for slot in slots:
        if not 0 <= slot < count:
            raise StatusError(LLMStatusCode.LLM_FAILED, f"generation slot {slot} outside the peer's segment")
    try:
        return load_words(tuple(address + 8 * slot for slot in slots))
    except ShmError as exc:
        raise StatusError(
            LLMStatusCode.LLM_FAILED, f"the peer's generation segment was shrunk: {exc}"
        ) from exc


def check_remote_tensors(remote: RemoteCache, src_start: int, count: int, whole: bool) -> None:
    """The tensors a transfer selects exist in the remote cache (and are all of them when `whole`)."""
    tensors = len(remote.tensor_bases)
    if whole and count != tensors:
        raise _invalid(f"the remote cache has {tensors} tensors, the local selection {count}")
    if src_start + count > tensors:
        raise _invalid(f"remote tensors [{src_start}, +{count}) exceed its {tensors}")


def _invalid(detail: str) -> StatusError:
    return StatusError(LLMStatusCode.LLM_PARAM_INVALID, detail)


def _fetched_table(peer: Peer, deadline: float) -> RemoteTable:
    """The peer's one-sided table, asked for page by page (the caller holds the link)."""
    caches: dict[int, RemoteCache] = {}
    blocks: dict[int, int] = {}
    start_cache_id = 1
    versions: set[int] = set()
    generations = ""
    for _ in range(_MAX_TABLE_PAGES):
        seq = peer.next_seq()
        reply = peer.request(TableRequest(seq, start_cache_id), seq, deadline)
        if not isinstance(reply, Table):
            raise PeerGone(f"expected Table, got {type(reply).__name__}")
        if reply.pid != peer.info.pid:
            raise StatusError(
                LLMStatusCode.LLM_FAILED, f"peer {peer.info.pid} sent the table of pid {reply.pid}"
            )
        _add_table_page(reply, caches, blocks)
        versions.add(reply.version)
        generations = reply.generations
        if reply.next_cache_id == 0:
            break
        if reply.next_cache_id <= start_cache_id:
            raise StatusError(LLMStatusCode.LLM_FAILED, "peer's table pages go backwards")
        start_cache_id = reply.next_cache_id
    else:
        raise StatusError(LLMStatusCode.LLM_FAILED, f"peer's table has over {_MAX_TABLE_PAGES} pages")
    # Pages taken at different versions: keep the table for this call, refetch at the next.
    version = versions.pop() if len(versions) == 1 else 0
    return RemoteTable(caches, blocks, generations, version)


def _add_table_page(reply: Table, caches: dict[int, RemoteCache], blocks: dict[int, int]) -> None:
    for entry in reply.entries:
        # The protocol validated every entry's shape and ranges; this only restores the types.
        cache_id, is_blocks, model_ids, segment, segment_nbytes, bases, unit, units, slot, gen = cast(
            tuple[int, bool, tuple[int, ...], str, int, tuple[int, ...], int, int, int, int], entry
        )
        caches[cache_id] = RemoteCache(
            cache_id,
            is_blocks,
            reply.pid,
            segment,
            segment_nbytes,
            bases,
            unit,
            units,
            reply.generations,
            slot,
            gen,
        )
        for model_id in model_ids:
            blocks[model_id] = cache_id


# x86-64 never reorders a load with an earlier load, so the copy's loads are done before the generation
# word is read. Weakly ordered CPUs (aarch64) may read the word first: there a lock's release followed by
# an acquire sits between them (a store-release is never reordered with a later load-acquire, and neither
# with the loads on its side), which is the barrier CPython can place without compiled code.
_STRONGLY_ORDERED = platform.machine().lower() in {"x86_64", "amd64", "i386", "i686"}
_FENCE = threading.Lock()


def _new_fence() -> None:
    global _FENCE
    _FENCE = threading.Lock()  # one a thread of the parent held at the fork stays held in the child


os.register_at_fork(after_in_child=_new_fence)


def order_loads() -> None:
    if _STRONGLY_ORDERED:
        return
    with _FENCE:
        pass
    with _FENCE:
        pass

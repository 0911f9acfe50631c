"""The per-process cache table: caches carved from the shared-memory pool, the keys bound to their batch
slots, and the leases that pin a cache while a peer copies out of it.

Rules: every method takes the table's lock, so the server thread and user threads may call it at once.
A cache's memory returns to the pool only when nothing references it any more: not the user (external
reference, dropped by `deallocate`), not a key, not a lease (a peer mid-copy) and not a local pin (a pull
writing into it). Cache ids count from 1 and are never reused. Leases belong to a connection token, so a
dead peer's leases can be dropped in one call without consuming its keys. A lease names the records it
pins, not their ids: whatever the owner did to a cache meanwhile (unregistered it, freed it), ending the
lease is always well-defined. A connection holds at most `MAX_LEASES_PER_OWNER` leases at once.

The table publishes its pool caches, their keys and its pins in a shared-memory index (`shm.index`), so
that pullers on this host pin, copy and consume without a message: each connection gets a row of the index
to pin through. The index is the truth for what pullers did (consumed keys, pins); the table catches up
(`_sync`) at the start of every operation that depends on it, and its server thread does so twice a second.
A cache whose last reference goes while a row pins it is freed when that row lets go.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from llm_datadist._shm.errors import OutOfPoolMemory, ShmError
from llm_datadist._shm.generations import GenerationTable
from llm_datadist._shm.index import (
    CACHE_BLOCKS,
    CACHE_PENDING,
    CACHE_REGISTERED,
    CACHE_REMOTE,
    CACHE_WITHDRAWN,
    KIND_BLOCKS,
    KIND_CACHE,
    KIND_SLOT,
    MAX_MASK_TENSORS,
    NAME_CONSUMED,
    NAME_LIVE,
    CacheEntry,
    IndexLockTimeout,
)
from llm_datadist._shm.index_owner import OwnerIndex
from llm_datadist._shm.pool import Block, Pool
from llm_datadist._shm.segment import Segment

from ._errors import IndexBusy, StatusError
from ._rows import Holder, Rows
from .status import LLMStatusCode
from .utils.log import log

KEY_REQ = 1
KEY_PREFIX = 2
KEY_CACHE_ID = 3
KEY_BLOCKS = 4

# (kind, req_id or prefix_id, model_id)
KeyId = tuple[int, int, int]

# Each tensor starts on its own page: copies stay aligned and a tensor never shares a page with another.
TENSOR_ALIGN_NBYTES = 4096
# A well-behaved link holds one lease at a time (one transfer at a time per link); this bounds a peer that
# asks for leases and never releases them.
MAX_LEASES_PER_OWNER = 1024
# The owner's calls wait this long for the index lock by default (a puller holds it for microseconds; only a
# stopped process holds it longer); an instance waits its `sync_kv_timeout`.
INDEX_LOCK_TIMEOUT_S = 5.0
# The server thread never waits that long: what it cannot do at once it retries at its next housekeeping
# (a request waits in its connection's queue meanwhile; see `_transport.Server`).
SERVER_LOCK_TIMEOUT_S = 0.005
# Housekeeping runs about twice a second; every this many times it also looks for stray writes into the
# index (a few milliseconds for the default capacities).
AUDIT_EVERY = 4
# Index header flags: some key or cache is not in the index (more tensors than a mask holds, a full index):
# a puller that does not find a name asks the owner instead; with caches missing, the one-sided table
# comes from the owner too.
FLAG_UNPUBLISHED = 1
FLAG_CACHES_UNPUBLISHED = 2


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(eq=False)
class CacheRecord:
    """One cache: `num_tensors` tensors of `tensor_nbytes` each.

    A pool cache has its tensors `pitch_nbytes` apart in one pool block (offsets relative to the block)::

        0                 pitch            2*pitch                 num_tensors*pitch
        | tensor 0 | pad  | tensor 1 | pad  | ... | tensor n-1 | pad |

    so tensor t, slot b starts at block.offset + t*pitch + b*slot_nbytes within the segment. A registered
    cache (v2 `register_cache`) has no block: its tensors are at the user's `addrs`, memory this process
    owns but the library did not allocate; peers reach it by cross-memory attach, never through a segment.
    """

    cache_id: int
    num_tensors: int
    tensor_nbytes: int
    batch_size: int
    pitch_nbytes: int
    block: Block | None
    is_blocks: bool = False
    addrs: tuple[int, ...] = ()
    placement: int = 1
    remote_accessible: bool = True
    # The cache's word in the generation table (see shm.generations): one-sided readers check it.
    gen_slot: int = -1
    generation: int = 0
    external: bool = True
    keys: set[KeyId] = field(default_factory=set)
    leases: int = 0
    pins: int = 0
    # In the index: the cache entry (at gen_slot) and its KIND_CACHE name; `pending` once nothing but a
    # puller's row keeps it (its free waits for that row).
    published: bool = False
    cache_name: int = -1
    pending: bool = False
    addr_words: int = -1  # registered: its first word in the index's address region

    @property
    def slot_nbytes(self) -> int:
        return self.tensor_nbytes // self.batch_size

    @property
    def registered(self) -> bool:
        return self.block is None

    @property
    def pool_block(self) -> Block:
        """The block of a pool cache (an invariant: callers only ask pool caches)."""
        assert self.block is not None, f"cache {self.cache_id} is registered memory, not a pool block"
        return self.block

    def tensor_offset(self, tensor_index: int) -> int:
        """Offset of tensor `tensor_index` within the segment (pool caches only)."""
        return self.pool_block.offset + tensor_index * self.pitch_nbytes

    def tensor_addrs(self) -> list[int]:
        if self.block is None:
            return list(self.addrs)
        base = self.block.address
        return [base + t * self.pitch_nbytes for t in range(self.num_tensors)]

    @property
    def referenced(self) -> bool:
        return self.external or bool(self.keys) or self.leases > 0 or self.pins > 0


@dataclass(eq=False)
class KeyRecord:
    key: KeyId
    cache_id: int
    slot: int
    # v1 tracks, per key, the tensors not pulled yet: a layer-by-layer pull consumes the key only once
    # every tensor was pulled (reference §9.4, §16). For a key in the index (`name` >= 0) the index's
    # mask is the truth and this set is unused.
    unpulled: set[int]
    name: int = -1
    slot_name: int = -1  # req keys: the KIND_SLOT name that finds this key from (cache id, slot)


@dataclass(frozen=True)
class Lease:
    """Pins `cache_ids` until released; a pull lease may consume its key's tensors when it ends well."""

    lease_id: int
    records: tuple[CacheRecord, ...]
    consume_key: KeyId | None
    tensor_start: int
    tensor_count: int
    owner: object
    # What taking the lease consumed of the key (given back if the transfer fails): the tensors, and the
    # slot the key was bound to when that emptied it and unbound it.
    consumed: frozenset[int] = frozenset()
    unbound_slot: int | None = None


@dataclass(frozen=True)
class Grant:
    lease_id: int
    segment_name: str
    segment_nbytes: int
    tensor_offsets: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class LocationData:
    """Where tensors [tensor_start, +count) of a cache are: `segment` "" means addresses in this process."""

    lease_id: int
    segment_name: str
    segment_nbytes: int
    tensor_bases: tuple[int, ...]
    unit_nbytes: int
    num_units: int
    slot: int


def _location(
    record: CacheRecord, lease_id: int, tensor_start: int, tensor_count: int, slot: int
) -> LocationData:
    tensors = range(tensor_start, tensor_start + tensor_count)
    if record.block is None:
        return LocationData(
            lease_id,
            "",
            0,
            tuple(record.addrs[t] for t in tensors),
            record.slot_nbytes,
            record.batch_size,
            slot,
        )
    segment = record.block.segment
    return LocationData(
        lease_id,
        segment.name,
        segment.nbytes,
        tuple(record.tensor_offset(t) for t in tensors),
        record.slot_nbytes,
        record.batch_size,
        slot,
    )


@dataclass(frozen=True)
class BlocksGrant:
    lease_id: int
    segment_name: str
    segment_nbytes: int
    tensor_offsets: tuple[int, ...]
    block_nbytes: int
    num_blocks: int


@dataclass(frozen=True)
class WriteGrant:
    lease_id: int
    segments: tuple[str, ...]
    segment_nbytes: tuple[int, ...]
    range_segments: tuple[int, ...]
    range_offsets: tuple[int, ...]


class CacheTable:
    """Caches, keys and leases of one process, backed by one `shm.pool.Pool`."""

    def __init__(
        self,
        pools: dict[int, Pool],
        *,
        oom_code: LLMStatusCode,
        incarnation: int = 0,
        lock_timeout_s: float = INDEX_LOCK_TIMEOUT_S,
    ) -> None:
        # Pools by placement (Placement.DEVICE = 1, HOST = 0); a placement without a pool cannot allocate.
        self._pools = pools
        # Called (under the table's lock) with a registered cache once it is forgotten, before `unregister`
        # returns and the user may reuse its memory: whoever exposed that memory elsewhere withdraws it.
        self.on_unregistered: Callable[[CacheRecord], None] | None = None
        self._generations = GenerationTable()
        self._oom_code = oom_code
        # Re-entrant: a KvCache finaliser run by the garbage collector may deallocate from inside a call.
        self._lock = threading.RLock()
        self._next_cache_id = 1
        self._next_lease_id = 1
        self._caches: dict[int, CacheRecord] = {}
        self._keys: dict[KeyId, KeyRecord] = {}
        self._slot_req_key: dict[tuple[int, int], KeyId] = {}
        # BlocksCacheKey index: model_id -> cache_id; registering a newer blocks cache with the same model_id
        # points the index at it (reference §6.4). Blocks keys are never consumed and hold no reference.
        self._blocks_keys: dict[int, int] = {}
        self._leases: dict[int, Lease] = {}
        self._leases_by_owner: dict[int, int] = {}  # id(owner) -> leases held
        # Signalled whenever a lease ends (unregister waits for the leases on memory its caller will reuse).
        self._lease_ended = threading.Condition(self._lock)
        self.index = OwnerIndex.create(os.getpid(), incarnation, generations=self._generations.name)
        self._addr_free: list[tuple[int, int]] = [(0, self.index.addr_words)]  # (first word, count)
        self._free_names = list(range(self.index.names - 1, -1, -1))
        self._key_by_name: dict[int, KeyId] = {}
        self._blocks_names: dict[int, int] = {}  # model_id -> KIND_BLOCKS name
        self._rows = Rows(self.index)
        self._pending: dict[int, CacheRecord] = {}  # cache_id -> a record whose free waits for a row
        self._epoch_seen = 0
        self._flags = 0
        # What could not be done when it was asked because the index lock was held elsewhere, done at the
        # next housekeeping (`sync`) instead, never dropped: connections that ended (with the leases they
        # released in messages not yet read), frees of caches whose last local pin ended, pushes that
        # ended, deallocations from finalizers, and names by id to publish again.
        self._ended: list[tuple[object, frozenset[int]]] = []
        self._to_free: dict[int, CacheRecord] = {}
        self._busy_deltas: list[tuple[int, int]] = []
        self._to_deallocate: list[int] = []
        self._to_republish: dict[int, CacheRecord] = {}
        self._to_release: list[tuple[int, bool, object]] = []
        self._syncs = 0
        self._lock_timeout_s = lock_timeout_s  # the owner's own calls wait this long for the index lock

    # ----------------------------------------------------------------- the index (lock held)

    @contextlib.contextmanager
    def _indexed(self, timeout_s: float | None = None) -> Iterator[OwnerIndex]:
        """Hold the index lock (re-entrant: an operation takes it once, first, so that what it does is
        done whole or not at all); IndexBusy when it cannot be had within `timeout_s` (default: the owner's
        own calls' wait)."""
        if timeout_s is None:
            timeout_s = self._lock_timeout_s
        index = self.index
        if index.lock_depth:
            with index.locked(timeout_s):
                yield index
            return
        try:
            index.lock(timeout_s)
        except IndexLockTimeout as exc:
            raise IndexBusy(LLMStatusCode.LLM_TIMEOUT, str(exc)) from exc
        try:
            # What waited for the lock comes first, in order, before anything asked after it.
            if self._ended or self._to_release or self._busy_deltas or self._to_deallocate:
                self._apply_queued()
            yield index
        finally:
            index.unlock()

    def _unpublished(self, flags: int = FLAG_UNPUBLISHED) -> None:
        if self._flags & flags != flags:
            self._flags |= flags
            self.index.set_flags(self._flags)

    def _new_name(
        self, kind: int, key_id: int, model_id: int, record: CacheRecord, slot: int, target: int = -1
    ) -> int:
        if not self._free_names:
            self._unpublished()
            return -1
        name = self._free_names.pop()
        self.index.insert_name(
            name,
            kind,
            key_id,
            model_id,
            record.gen_slot,
            slot,
            record.generation,
            target=target,
            num_tensors=record.num_tensors,
        )
        return name

    def _drop_name(self, name: int) -> None:
        if name < 0:
            return
        self.index.remove_name(name)
        self._free_names.append(name)

    def _publish_cache(self, record: CacheRecord) -> None:
        if record.gen_slot >= self.index.caches:
            self._unpublished(FLAG_UNPUBLISHED | FLAG_CACHES_UNPUBLISHED)
            return
        if record.block is None:
            first_word = self._take_words(record.num_tensors)
            if first_word < 0:
                self._unpublished(FLAG_UNPUBLISHED | FLAG_CACHES_UNPUBLISHED)
                return
            record.addr_words = first_word
            where, segment_name, segment_nbytes = first_word, "", 0
        else:
            where, segment_name, segment_nbytes = (
                record.block.offset,
                record.block.segment.name,
                record.block.segment.nbytes,
            )
        index = self.index
        if record.block is None:
            index.put_addresses(record.addr_words, record.addrs)
        index.put_cache(
            CacheEntry(
                record.gen_slot,
                record.generation,
                record.cache_id,
                _flags_of(record),
                record.batch_size,
                where,
                record.pitch_nbytes,
                record.tensor_nbytes,
                record.num_tensors,
                segment_name,
                segment_nbytes,
            )
        )
        record.cache_name = self._new_name(KIND_CACHE, record.cache_id, 0, record, 0)
        record.published = True

    def _take_words(self, count: int) -> int:
        """First fit in the index's address words: the first of `count` free words, or -1."""
        for i, (first, free) in enumerate(self._addr_free):
            if free >= count:
                if free == count:
                    del self._addr_free[i]
                else:
                    self._addr_free[i] = (first + count, free - count)
                return first
        return -1

    def _give_words(self, first: int, count: int) -> None:
        spans = sorted([*self._addr_free, (first, count)])
        merged: list[tuple[int, int]] = []
        for start, length in spans:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((start, length))
        self._addr_free = merged

    def _withdraw(self, record: CacheRecord) -> None:
        """The cache left the table for good (freed, unregistered): its entry and words go."""
        if not record.published:
            return
        self._drop_name(record.cache_name)
        record.cache_name = -1
        index = self.index
        index.clear_cache(record.gen_slot)
        if record.addr_words >= 0:
            self._give_words(record.addr_words, record.num_tensors)
            record.addr_words = -1
        record.published = False

    def _publish_key(self, key_record: KeyRecord, record: CacheRecord) -> None:
        if not record.published or record.num_tensors > MAX_MASK_TENSORS:
            self._unpublished()
            return
        kind, key_id, model_id = key_record.key
        name = self._new_name(kind, key_id, model_id, record, key_record.slot)
        if name < 0:
            return
        key_record.name = name
        self._key_by_name[name] = key_record.key
        if kind == KEY_REQ:
            if key_record.unpulled != set(range(record.num_tensors)):
                index = self.index
                index.set_name_state(name, NAME_LIVE, _mask(key_record.unpulled))
            key_record.slot_name = self._new_name(
                KIND_SLOT, record.cache_id, key_record.slot, record, key_record.slot, target=name
            )

    def _unpublish_key(self, key_record: KeyRecord) -> None:
        self._key_by_name.pop(key_record.name, None)
        self._drop_name(key_record.name)
        self._drop_name(key_record.slot_name)
        key_record.name = key_record.slot_name = -1

    def _sync(self) -> None:
        """Catch up with what pullers did in the index (lock held): unbind the keys they consumed (once no
        row still refers to them) and free the caches whose rows let go."""
        index = self.index
        epoch = index.epoch
        if epoch == self._epoch_seen:
            return
        self._epoch_seen = epoch
        consumed = index.consumed_names()
        if consumed:
            referenced = {index.row(row)[4] for row in index.pinned(self._rows.all())}
            for name in consumed:
                key = self._key_by_name.get(name)
                if key is not None and name not in referenced:
                    self._unbind(key)
        for record in list(self._pending.values()):
            self._maybe_free(record)

    def sync(self) -> None:
        """The server thread's housekeeping: what waited for the index lock (connections that ended, frees,
        pushes that ended, deallocations, names to publish again), orphaned rows whose holder let go, what
        pullers did in the index, and every few times a look for stray writes into it (repaired at once).
        Skipped, to the next time, while the lock is held elsewhere."""
        with self._lock:
            try:
                with self._indexed(SERVER_LOCK_TIMEOUT_S):
                    self._catch_up()
            except IndexBusy:
                return

    def _catch_up(self) -> None:
        self._apply_queued()
        for record in list(self._to_republish.values()):
            self._republish_by_id(record)
        for record in list(self._to_free.values()):
            del self._to_free[record.cache_id]
            self._maybe_free(record)
        if self._rows.sweep():
            self._epoch_seen = -1  # what those pins consumed or kept is looked at now
        self._sync()
        self._syncs += 1
        if self._syncs % AUDIT_EVERY == 0 and self.index.repair():
            log.warning(
                "the index %s held bytes nobody of ours wrote there: republished from this process's own "
                "record (%d repairs so far)",
                self.index.name,
                self.index.repairs,
            )
            self._epoch_seen = -1
            self._sync()

    def _apply_queued(self) -> None:
        """What was asked while the lock was busy, in the order it was asked (lock held)."""
        ended, self._ended = self._ended, []
        for owner, released in ended:
            self._connection_ended(owner, released)
        deltas, self._busy_deltas = self._busy_deltas, []
        for cluster_id, delta in deltas:
            self.index.set_busy(cluster_id, delta)
        releases, self._to_release = self._to_release, []
        for lease_id, ok, owner in releases:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.owner is owner:
                self._end_lease(lease, restore=not ok)
        deallocations, self._to_deallocate = self._to_deallocate, []
        for cache_id in deallocations:
            self._deallocate(cache_id)

    def _pin_count(self) -> int:
        """How many rows pin a cache now (two pullers pinning one cache are two pins)."""
        return len(self.index.pinned(self._rows.all()))

    # ----------------------------------------------------------------- rows and connections (server thread)

    def assign_row(self, owner: object, incarnation: int, holder: Holder) -> tuple[int, int]:
        """A row of the index for a new connection of a puller of `incarnation` (process `holder`) to pin
        through, and the ticket that names the connection in it; (-1, 0) if none is free or the lock is
        busy (the connection then asks for what it pulls). The ticket is drawn per connection: a puller's
        earlier connection that got the same row never touches it again."""
        with self._lock:
            if not self._rows.available():
                return -1, 0
            ticket = secrets.randbits(64) or 1
            try:
                with self._indexed(SERVER_LOCK_TIMEOUT_S):
                    return self._rows.assign(owner, ticket, incarnation, holder), ticket
            except IndexBusy:
                return -1, 0

    def connection_ended(self, owner: object, released: frozenset[int] = frozenset()) -> None:
        """A connection ended: its leases end (`released`: those its peer released well in messages never
        read; the others give back what they consumed), and its row is freed or, while its live holder
        still pins through it, orphaned. Done at the next housekeeping if the lock is busy now."""
        with self._lock:
            try:
                with self._indexed(SERVER_LOCK_TIMEOUT_S):
                    self._connection_ended(owner, released)
            except IndexBusy:
                self._ended.append((owner, released))

    def _connection_ended(self, owner: object, released: frozenset[int]) -> None:
        for lease in [lease for lease in self._leases.values() if lease.owner is owner]:
            self._end_lease(lease, restore=lease.lease_id not in released)
        if self._rows.end(owner):
            self._epoch_seen = -1
        self._sync()

    def start_push(self, clusters: set[int], connections: Callable[[int], list[object]]) -> int | None:
        """Mark pushes into `clusters` in the index unless one of them is pulling from us: the busy cluster
        then (nothing marked), else None. Pullers check the mark under the same lock."""
        with self._lock, self._indexed() as index:
            pinning = index.pinned(self._rows.all())
            for cluster_id in sorted(clusters):
                for conn in connections(cluster_id):
                    if id(conn) in self._leases_by_owner or self._rows.of(conn) in pinning:
                        return cluster_id
            for cluster_id in clusters:
                index.set_busy(cluster_id, 1)
            return None

    def end_push(self, clusters: set[int]) -> None:
        """Unmark pushes into `clusters` (at the next housekeeping if the lock is busy: never lost)."""
        with self._lock:
            try:
                with self._indexed(SERVER_LOCK_TIMEOUT_S) as index:
                    for cluster_id in clusters:
                        index.set_busy(cluster_id, -1)
            except IndexBusy:
                self._busy_deltas.extend((cluster_id, -1) for cluster_id in clusters)

    # ----------------------------------------------------------------- local operations (owner side)

    def allocate(
        self,
        *,
        num_tensors: int,
        tensor_nbytes: int,
        batch_size: int,
        keys: list[KeyId | None],
        is_blocks: bool = False,
        placement: int = 1,
        remote_accessible: bool = True,
        unique_keys: bool = False,
        blocks_model_id: int | None = None,
    ) -> CacheRecord:
        """Carve a cache from the placement's pool and bind `keys[i]` (None: padding) to batch slot i, and
        `blocks_model_id` (a BlocksCacheKey) to the whole cache, in one step: all of it or nothing.

        `unique_keys` (v2): the same key twice in one call is refused; otherwise the last slot wins (v1).
        """
        bindings = self._bindings(num_tensors, tensor_nbytes, batch_size, keys, unique_keys)
        pitch = _align_up(tensor_nbytes, TENSOR_ALIGN_NBYTES)
        with self._lock, self._indexed():
            self._sync()
            self._check_unbound(bindings)
            pool = self._pools.get(placement)
            if pool is None:
                raise StatusError(
                    LLMStatusCode.LLM_FEATURE_NOT_ENABLED,
                    "no memory pool for this placement: config memory pool firstly",
                )
            try:
                block = pool.allocate(pitch * num_tensors)
            except OutOfPoolMemory as exc:
                raise StatusError(self._oom_code, str(exc)) from exc
            try:
                gen_slot, generation = self._acquire_generation()
            except BaseException:
                pool.free(block)
                raise
            record = CacheRecord(
                cache_id=self._next_cache_id,
                num_tensors=num_tensors,
                tensor_nbytes=tensor_nbytes,
                batch_size=batch_size,
                pitch_nbytes=pitch,
                block=block,
                is_blocks=is_blocks,
                placement=placement,
                remote_accessible=remote_accessible,
                gen_slot=gen_slot,
                generation=generation,
            )
            return self._add(record, bindings, blocks_model_id)

    def register(
        self,
        *,
        num_tensors: int,
        tensor_nbytes: int,
        batch_size: int,
        addrs: list[int],
        keys: list[KeyId | None],
        is_blocks: bool,
        placement: int,
        remote_accessible: bool,
        blocks_model_id: int | None = None,
    ) -> CacheRecord:
        """Record a cache over memory the user owns at `addrs` (one address per tensor), with its keys, in
        one step. Its keys are never consumed by pulls; overlapping another registered cache is refused."""
        bindings = self._bindings(num_tensors, tensor_nbytes, batch_size, keys, True)
        if len(addrs) != num_tensors:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID, f"{len(addrs)} addresses for {num_tensors} tensors"
            )
        with self._lock, self._indexed():
            self._sync()
            self._check_unbound(bindings)
            spans = sorted((addr, addr + tensor_nbytes) for addr in addrs)
            for record in self._caches.values():
                if record.registered:
                    spans.extend((addr, addr + record.tensor_nbytes) for addr in record.addrs)
            spans.sort()
            for (_, end), (start, _) in itertools.pairwise(spans):
                if start < end:
                    raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, "registered addresses overlap")
            gen_slot, generation = self._acquire_generation()
            record = CacheRecord(
                cache_id=self._next_cache_id,
                num_tensors=num_tensors,
                tensor_nbytes=tensor_nbytes,
                batch_size=batch_size,
                pitch_nbytes=tensor_nbytes,
                block=None,
                is_blocks=is_blocks,
                addrs=tuple(addrs),
                placement=placement,
                remote_accessible=remote_accessible,
                gen_slot=gen_slot,
                generation=generation,
            )
            return self._add(record, bindings, blocks_model_id)

    def _acquire_generation(self) -> tuple[int, int]:
        try:
            return self._generations.acquire()
        except ShmError as exc:
            raise StatusError(self._oom_code, str(exc)) from exc

    def unregister(self, cache_id: int, *, timeout_s: float) -> bool:
        """Forget a registered cache and its keys; False if `cache_id` is not a registered cache.

        The caller may reuse the memory as soon as this returns, so a peer's transfer that pins the cache
        (a lease, or a pin in the index, whether or not its connection still exists) must end first: this
        waits for it up to `timeout_s`, then raises StatusError(LLM_TIMEOUT) and leaves the cache
        registered. New pins cannot start meanwhile: the keys go first (and stay gone).
        """
        deadline = time.monotonic() + timeout_s
        with self._lock:
            record = self._caches.get(cache_id)
            if record is None or not record.registered:
                return False
            with self._indexed():
                self._sync()
                for key in list(record.keys):
                    self._unbind(key)
                self._drop_blocks_keys(cache_id)
                # Refuse new leases and pins by id while waiting (resolve checks `external`; the index's
                # name by id goes), then wait out the old ones.
                record.external = False
                self._to_republish.pop(cache_id, None)
                if record.published:
                    self._drop_name(record.cache_name)
                    record.cache_name = -1
                    self.index.set_cache_flags(record.gen_slot, _flags_of(record))
            while True:
                remaining = deadline - time.monotonic()
                try:
                    # A lease's end is signalled; a pin's end is not (the puller writes only the index):
                    # look again every few milliseconds.
                    with self._indexed(min(max(remaining, 0.0), SERVER_LOCK_TIMEOUT_S)):
                        if record.leases <= 0 and not self._pinned_in_index(record):
                            self._forget_registered(record)
                            return True
                except IndexBusy:
                    pass  # not known to be free: wait on
                if remaining <= 0:
                    self._give_back_registered(record)
                    raise StatusError(
                        LLMStatusCode.LLM_TIMEOUT,
                        f"cache {cache_id} is still pinned by a peer's transfer; its keys were removed",
                    )
                self._lease_ended.wait(min(remaining, 0.005))

    def _forget_registered(self, record: CacheRecord) -> None:
        if self._caches.get(record.cache_id) is record:
            self._withdraw(record)
            del self._caches[record.cache_id]
            self._generations.retire(record.gen_slot)
        if self.on_unregistered is not None:
            self.on_unregistered(record)  # before the user may reuse the memory

    def _give_back_registered(self, record: CacheRecord) -> None:
        """An unregister that timed out: the cache is the user's again, reachable by id (at the next
        housekeeping if the lock is busy now)."""
        record.external = True
        try:
            with self._indexed(SERVER_LOCK_TIMEOUT_S):
                self._republish_by_id(record)
        except IndexBusy:
            self._to_republish[record.cache_id] = record

    def _republish_by_id(self, record: CacheRecord) -> None:
        self._to_republish.pop(record.cache_id, None)
        if record.published and record.external and record.cache_name < 0:
            record.cache_name = self._new_name(KIND_CACHE, record.cache_id, 0, record, 0)
            self.index.set_cache_flags(record.gen_slot, _flags_of(record))

    def _pinned_in_index(self, record: CacheRecord) -> bool:
        if not record.published:
            return False
        return (record.gen_slot, record.generation) in set(self.index.pinned(self._rows.all()).values())

    @staticmethod
    def _bindings(
        num_tensors: int, tensor_nbytes: int, batch_size: int, keys: list[KeyId | None], unique: bool
    ) -> dict[KeyId, int]:
        if num_tensors <= 0 or tensor_nbytes <= 0 or batch_size <= 0:
            raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, "cache must have tensors of non-zero size")
        if len(keys) > batch_size:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID, f"{len(keys)} cache keys for a batch of {batch_size}"
            )
        bindings: dict[KeyId, int] = {}
        for slot, key in enumerate(keys):
            if key is None:
                continue
            if unique and key in bindings:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"cache key {_key_text(key)} given twice")
            # v1: the same key twice in one call, the last slot wins.
            bindings[key] = slot
        return bindings

    def _check_unbound(self, bindings: dict[KeyId, int]) -> None:
        for key in bindings:
            if key in self._keys:
                raise StatusError(
                    LLMStatusCode.LLM_PARAM_INVALID, f"cache key {_key_text(key)} is already bound"
                )

    def _add(
        self, record: CacheRecord, bindings: dict[KeyId, int], blocks_model_id: int | None
    ) -> CacheRecord:
        self._next_cache_id += 1
        self._caches[record.cache_id] = record
        self._publish_cache(record)
        for key, slot in bindings.items():
            key_record = KeyRecord(key, record.cache_id, slot, set(range(record.num_tensors)))
            self._keys[key] = key_record
            record.keys.add(key)
            if key[0] == KEY_REQ:
                self._slot_req_key[(record.cache_id, slot)] = key
            self._publish_key(key_record, record)
        if blocks_model_id is not None:
            self._bind_blocks_key(blocks_model_id, record.cache_id)
        return record

    def bind_blocks_key(self, model_id: int, cache_id: int) -> None:
        with self._lock, self._indexed():
            self._bind_blocks_key(model_id, cache_id)

    def _bind_blocks_key(self, model_id: int, cache_id: int) -> None:
        if model_id in self._blocks_keys:
            # Peers' copies of the table name the old cache under this model id: make them refetch.
            self._generations.bump_version()
        self._blocks_keys[model_id] = cache_id
        record = self._caches.get(cache_id)
        name = self._blocks_names.get(model_id, -1)
        if record is None or not record.published:
            self._drop_name(name)
            self._blocks_names.pop(model_id, None)
            self._unpublished()
        elif name >= 0:
            self.index.retarget_name(name, record.gen_slot, record.generation)
        else:
            name = self._new_name(KIND_BLOCKS, 0, model_id, record, 0)
            if name >= 0:
                self._blocks_names[model_id] = name

    def _drop_blocks_keys(self, cache_id: int) -> None:
        for model_id in [m for m, c in self._blocks_keys.items() if c == cache_id]:
            del self._blocks_keys[model_id]
            self._drop_name(self._blocks_names.pop(model_id, -1))

    @property
    def table_version(self) -> int:
        """The version word of the generation segment (see shm.generations)."""
        with self._lock:
            return self._generations.version

    def deallocate(self, cache_id: int) -> None:
        """Drop the user's reference; the memory goes back once no key, lease or pin remains. All or
        nothing: IndexBusy (LLM_TIMEOUT) leaves the cache as it was, to be deallocated again."""
        with self._lock, self._indexed():
            self._deallocate(cache_id)

    def deallocate_later(self, cache_id: int) -> None:
        """`deallocate` from a finalizer, which may neither wait nor fail, and may run inside any call of
        this thread (the garbage collector runs it where it likes): done first thing in the next operation
        that takes the index lock, or at the next housekeeping."""
        self._to_deallocate.append(cache_id)  # a list's append is atomic: no lock needed

    def _deallocate(self, cache_id: int) -> None:
        record = self._caches.get(cache_id)
        if record is None or not record.external:
            return
        record.external = False
        self._drop_blocks_keys(cache_id)
        if record.published:
            self.index.set_cache_flags(record.gen_slot, _flags_of(record))
        self._maybe_free(record)

    def remove_key(self, key: KeyId) -> None:
        with self._lock, self._indexed():
            self._sync()
            self._unbind(key)

    def get(self, cache_id: int) -> CacheRecord | None:
        with self._lock:
            return self._caches.get(cache_id)

    def key_on_registered(self, key: KeyId) -> bool:
        """True if `key` is bound to a registered cache (whose keys nothing removes)."""
        with self._lock, self._indexed():
            self._sync()
            key_record = self._keys.get(key)
            return key_record is not None and self._caches[key_record.cache_id].registered

    def has_key(self, key: KeyId) -> bool:
        with self._lock, self._indexed():
            self._sync()
            return key in self._keys

    def pin(self, cache_id: int) -> CacheRecord:
        """Keep a local cache alive while a pull writes into it."""
        with self._lock:
            record = self._caches.get(cache_id)
            if record is None or not record.external:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"cache {cache_id} was deallocated")
            record.pins += 1
            return record

    def unpin(self, record: CacheRecord) -> None:
        """End a local pin; a cache only it kept is freed now, or at the next housekeeping if the index
        lock is busy (a transfer's end never waits for it)."""
        with self._lock:
            record.pins -= 1
            if record.referenced or self._caches.get(record.cache_id) is not record:
                self._lease_ended.notify_all()
                return
            try:
                with self._indexed(SERVER_LOCK_TIMEOUT_S):
                    self._maybe_free(record)
            except IndexBusy:
                self._to_free[record.cache_id] = record
            self._lease_ended.notify_all()

    def hold(self, record: CacheRecord) -> Callable[[], None]:
        """Pin `record` (which the caller holds pinned already) until the returned release is called: a
        transfer engine may use its memory after the call that started it gave up."""
        with self._lock:
            record.pins += 1
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.unpin(record)

        return release

    def local_pins(self) -> int:
        """How many local pins (transfers of this process into or out of its caches) are running."""
        with self._lock:
            return sum(record.pins for record in self._caches.values())

    def wait_for_local_pins(self, timeout_s: float) -> bool:
        """Wait until no local pin is held (every transfer of this process ended); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while any(record.pins for record in self._caches.values()):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._lease_ended.wait(min(remaining, 0.05))
            return True

    def pools(self) -> list[Pool]:
        return list(self._pools.values())

    def segment_address(self, name: str) -> tuple[int, int] | None:
        """(address, nbytes) of our live pool segment `name` (with or without its leading slash)."""
        name = name.lstrip("/")
        with self._lock:
            for pool in self._pools.values():
                for segment in pool.segments:
                    if segment.name.lstrip("/") == name and not segment.closed:
                        return segment.address, segment.nbytes
        return None

    def pinned(self, cache_id: int) -> _Pinned:
        """`pin` for the duration of a with-block (pinned when the with-block enters)."""
        return _Pinned(self, cache_id)

    # ----------------------------------------------------------------- remote operations (server thread)

    def resolve(
        self,
        *,
        key_kind: int,
        key_id: int,
        model_id: int,
        batch_index: int,
        tensor_start: int,
        tensor_count: int,
        whole: bool,
        nbytes: int,
        src_offset: int,
        consume: bool,
        owner: object,
    ) -> Grant:
        """Find the slot a pull names, check the ranges against it and pin it with a lease."""
        with self._lock, self._indexed(SERVER_LOCK_TIMEOUT_S):
            self._sync()
            record, slot, consume_key = self._find(key_kind, key_id, model_id, batch_index)
            if key_kind == KEY_CACHE_ID and record.is_blocks:
                # v1 pulls a continuous slot by cache id; a paged cache is pulled by its blocks key.
                raise blocks_by_id(key_id)
            check_tensors(record.num_tensors, tensor_start, tensor_count, whole)
            check_source_bytes(record.slot_nbytes, src_offset, nbytes)
            # Everything that can refuse comes before the lease: a refused request pins nothing.
            segment = _segment_of(record)
            base = slot * record.slot_nbytes + src_offset
            offsets = tuple(
                record.tensor_offset(t) + base for t in range(tensor_start, tensor_start + tensor_count)
            )
            lease = self._lease(
                (record,), consume_key if consume else None, tensor_start, tensor_count, owner
            )
            return Grant(
                lease_id=lease.lease_id,
                segment_name=segment.name,
                segment_nbytes=segment.nbytes,
                tensor_offsets=offsets,
                nbytes=nbytes,
            )

    def resolve_blocks(
        self, *, model_id: int, tensor_start: int, tensor_count: int, whole: bool, owner: object
    ) -> BlocksGrant:
        """Pin the blocks cache a BlocksCacheKey's model_id names (blocks keys are never consumed)."""
        with self._lock, self._indexed(SERVER_LOCK_TIMEOUT_S):
            self._sync()
            record, _, _ = self._find(KEY_BLOCKS, 0, model_id, 0)
            check_tensors(record.num_tensors, tensor_start, tensor_count, whole)
            segment = _segment_of(record)  # before the lease: a refused request pins nothing
            offsets = tuple(record.tensor_offset(t) for t in range(tensor_start, tensor_start + tensor_count))
            lease = self._lease((record,), None, tensor_start, tensor_count, owner)
            return BlocksGrant(
                lease_id=lease.lease_id,
                segment_name=segment.name,
                segment_nbytes=segment.nbytes,
                tensor_offsets=offsets,
                block_nbytes=record.slot_nbytes,
                num_blocks=record.batch_size,
            )

    def resolve_write(self, *, addrs: tuple[int, ...], nbytes: tuple[int, ...], owner: object) -> WriteGrant:
        """Pin the caches that hold these address ranges of this process for a peer's push.

        Each range must lie inside one tensor of a live cache (one the user still holds); otherwise the
        whole request is refused and nothing is pinned.
        """
        with self._lock, self._indexed(SERVER_LOCK_TIMEOUT_S):
            live = [record for record in self._caches.values() if record.external]
            segments: dict[str, int] = {}
            segment_nbytes: list[int] = []
            range_segments: list[int] = []
            range_offsets: list[int] = []
            records: dict[int, CacheRecord] = {}
            for addr, length in zip(addrs, nbytes, strict=True):
                record = _record_holding(live, addr, length)
                if record is None:
                    raise StatusError(
                        LLMStatusCode.LLM_PARAM_INVALID,
                        f"[{addr:#x}, +{length}) is not inside one tensor of a live cache of this process",
                    )
                segment = _segment_of(record)
                index = segments.setdefault(segment.name, len(segments))
                if index == len(segment_nbytes):
                    segment_nbytes.append(segment.nbytes)
                range_segments.append(index)
                range_offsets.append(addr - segment.address)
                records[record.cache_id] = record
            lease = self._lease(tuple(records.values()), None, 0, 0, owner)
            return WriteGrant(
                lease_id=lease.lease_id,
                segments=tuple(segments),
                segment_nbytes=tuple(segment_nbytes),
                range_segments=tuple(range_segments),
                range_offsets=tuple(range_offsets),
            )

    def resolve_location(
        self,
        *,
        key_kind: int,
        key_id: int,
        model_id: int,
        batch_index: int,
        tensor_start: int,
        tensor_count: int,
        whole: bool,
        consume: bool,
        owner: object,
        for_write: bool = False,
    ) -> LocationData:
        """Cache-manager mode: pin the cache a key names and say where its tensors are (segment offsets
        for pool caches, addresses for registered memory). Keys on registered memory are never consumed.
        A write (a peer's push) only reaches a cache its user still holds."""
        with self._lock, self._indexed(SERVER_LOCK_TIMEOUT_S):
            self._sync()
            record, slot, consume_key = self._find(key_kind, key_id, model_id, batch_index)
            if for_write and not record.external:
                raise StatusError(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {record.cache_id} was deallocated"
                )
            check_tensors(record.num_tensors, tensor_start, tensor_count, whole)
            if record.registered:
                consume_key = None
            lease = self._lease(
                (record,), consume_key if consume else None, tensor_start, tensor_count, owner
            )
            return _location(record, lease.lease_id, tensor_start, tensor_count, slot)

    @property
    def generations_name(self) -> str:
        return self._generations.name

    def table(self, start_cache_id: int = 0) -> list[tuple[CacheRecord, LocationData, tuple[int, ...]]]:
        """Remote-accessible live caches with ids from `start_cache_id` on, in id order: each with its whole
        location and the blocks model ids naming it."""
        with self._lock, self._indexed(SERVER_LOCK_TIMEOUT_S):
            self._sync()
            entries = []
            for cache_id in sorted(c for c in self._caches if c >= start_cache_id):
                record = self._caches[cache_id]
                if not record.external or not record.remote_accessible:
                    continue
                model_ids = tuple(m for m, c in self._blocks_keys.items() if c == record.cache_id)
                entries.append((record, _location(record, 0, 0, record.num_tensors, 0), model_ids))
            return entries

    def release(self, lease_id: int, *, ok: bool, owner: object) -> None:
        """End a lease. The key's tensors were consumed when the lease was taken (so a second pull of a
        key in flight already sees it gone); a failed transfer gives them back. IndexBusy (nothing done)
        when the lock is busy: the server retries."""
        with self._lock, self._indexed(SERVER_LOCK_TIMEOUT_S):
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner is not owner:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"unknown lease {lease_id}")
            self._end_lease(lease, restore=not ok)

    def release_soon(self, lease_id: int, *, ok: bool, owner: object) -> None:
        """`release` that never fails for a busy lock: done at the next housekeeping then."""
        with self._lock:
            try:
                with self._indexed(SERVER_LOCK_TIMEOUT_S):
                    lease = self._leases.get(lease_id)
                    if lease is not None and lease.owner is owner:
                        self._end_lease(lease, restore=not ok)
            except IndexBusy:
                self._to_release.append((lease_id, ok, owner))

    def wait_for_lease_end(self, timeout_s: float) -> None:
        """Block until some lease ends or `timeout_s` passed (callers re-check what they wait for)."""
        with self._lock:
            self._lease_ended.wait(timeout_s)

    def holds_leases(self, owner: object) -> bool:
        """Whether a connection holds a lease (what it pins through its row is the index's to say)."""
        with self._lock:
            return id(owner) in self._leases_by_owner

    def drop_owner(self, owner: object) -> int:
        """End every lease a connection holds, giving back what they consumed (a connection that ends
        goes through `connection_ended`, which does this and its row too)."""
        with self._lock, self._indexed():
            dropped = [lease for lease in self._leases.values() if lease.owner is owner]
            for lease in dropped:
                self._end_lease(lease, restore=True)
            return len(dropped)

    # ----------------------------------------------------------------- introspection and teardown

    def stats(self) -> dict[str, int]:
        with self._lock, self._indexed():
            self._sync()
            return {
                "caches": len(self._caches),
                "keys": len(self._keys),
                "leases": len(self._leases),
                "pins": self._pin_count(),
                "pool_used_nbytes": sum(pool.used_nbytes for pool in self._pools.values()),
            }

    def wait_for_pins(self, timeout_s: float) -> bool:
        """Wait until no row of the index pins a cache (orphans included); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    with self._indexed(min(max(remaining, 0.0), SERVER_LOCK_TIMEOUT_S)):
                        self._rows.sweep()
                        if not self._pin_count():
                            return True
                except IndexBusy:
                    pass
                if remaining <= 0:
                    return False
                self._lease_ended.wait(min(remaining, 0.005))

    def close(self) -> None:
        """Forget everything and give the pool's segments back (unlinked). Rows that still pin are taken
        back first, so that their holders' unpins fail (`wait_for_pins` gives them their chance)."""
        with self._lock:
            try:
                with self._indexed(SERVER_LOCK_TIMEOUT_S):
                    revoked = self._rows.revoke_all()
                if revoked:
                    log.warning("closing with %d pins of peers still held: their transfers fail", revoked)
            except IndexBusy:
                log.warning("closing while the index lock is held elsewhere: its rows stay as they are")
            self._caches.clear()
            self._keys.clear()
            self._slot_req_key.clear()
            self._blocks_keys.clear()
            self._leases.clear()
            self._leases_by_owner.clear()
            self._lease_ended.notify_all()
            self._pending.clear()
            self._to_free.clear()
            for pool in self._pools.values():
                pool.close()
            self._generations.close()
            self.index.close()

    # ----------------------------------------------------------------- helpers (lock held)

    def _find(
        self, key_kind: int, key_id: int, model_id: int, batch_index: int
    ) -> tuple[CacheRecord, int, KeyId | None]:
        """The cache a key names, the slot it is bound to, and the req key a successful pull of that slot
        consumes (none for prefix and blocks keys: those are never consumed)."""
        if key_kind == KEY_BLOCKS:
            cache_id = self._blocks_keys.get(model_id)
            record = self._caches.get(cache_id) if cache_id is not None else None
            if record is None:
                raise not_found(KEY_BLOCKS, 0, model_id)
            return record, 0, None
        if key_kind == KEY_CACHE_ID:
            record = self._caches.get(key_id)
            if record is None or record.pending or (record.registered and not record.external):
                raise not_found(KEY_CACHE_ID, key_id, 0)
            check_batch_index(record.batch_size, batch_index)
            return record, batch_index, self._slot_req_key.get((record.cache_id, batch_index))
        key = (key_kind, key_id, model_id)
        key_record = self._keys.get(key)
        if key_record is not None and key_record.name >= 0:
            # A puller consumed it in the index and still pins it: gone, though not unbound here yet.
            index = self.index
            if index.name_entry(key_record.name).state == NAME_CONSUMED:
                key_record = None
        if key_record is None:
            raise not_found(key_kind, key_id, model_id)
        return self._caches[key_record.cache_id], key_record.slot, key if key_kind == KEY_REQ else None

    def _lease(
        self,
        records: tuple[CacheRecord, ...],
        consume_key: KeyId | None,
        tensor_start: int,
        tensor_count: int,
        owner: object,
    ) -> Lease:
        held = self._leases_by_owner.get(id(owner), 0)
        if held >= MAX_LEASES_PER_OWNER:
            raise StatusError(
                LLMStatusCode.LLM_FAILED,
                f"this link already holds {held} leases (the limit): release them before asking for more",
            )
        consumed: frozenset[int] = frozenset()
        unbound_slot: int | None = None
        if consume_key is not None:
            key_record = self._keys.get(consume_key)
            if key_record is not None and key_record.cache_id == records[0].cache_id:
                wanted = set(range(tensor_start, tensor_start + tensor_count))
                if key_record.name >= 0:
                    index = self.index
                    before = index.name_entry(key_record.name).mask
                    taken = index.consume(key_record.name, _mask(wanted))
                    consumed = frozenset(_tensors(taken))
                    # Emptied by this lease; one a puller's pin emptied is unbound when that pin ends.
                    emptied = bool(taken) and not before & ~taken
                else:
                    consumed = frozenset(key_record.unpulled & wanted)
                    key_record.unpulled -= consumed
                    emptied = not key_record.unpulled
                if emptied:
                    unbound_slot = key_record.slot
        lease = Lease(
            lease_id=self._next_lease_id,
            records=records,
            consume_key=consume_key,
            tensor_start=tensor_start,
            tensor_count=tensor_count,
            owner=owner,
            consumed=consumed,
            unbound_slot=unbound_slot,
        )
        self._next_lease_id += 1
        self._leases[lease.lease_id] = lease
        self._leases_by_owner[id(owner)] = held + 1
        for record in records:
            record.leases += 1
        # Unbind only now: the lease keeps the cache alive even if the key was its last reference.
        if unbound_slot is not None and consume_key is not None:
            self._unbind(consume_key)
        return lease

    def _restore(self, lease: Lease) -> None:
        """Give back what a failed or abandoned transfer consumed: its tensors, and the key itself if the
        transfer had unbound it and nobody bound it again meanwhile."""
        key = lease.consume_key
        if key is None or not lease.consumed:
            return
        record = lease.records[0]
        if self._caches.get(record.cache_id) is not record:
            return
        key_record = self._keys.get(key)
        if key_record is None and lease.unbound_slot is not None:
            if key[0] == KEY_REQ and (record.cache_id, lease.unbound_slot) in self._slot_req_key:
                return  # the slot was bound to another key since
            key_record = KeyRecord(key, record.cache_id, lease.unbound_slot, set(lease.consumed))
            self._keys[key] = key_record
            record.keys.add(key)
            if key[0] == KEY_REQ:
                self._slot_req_key[(record.cache_id, lease.unbound_slot)] = key
            self._publish_key(key_record, record)
            return
        if key_record is not None and key_record.cache_id == record.cache_id:
            if key_record.name >= 0:
                index = self.index
                index.restore(key_record.name, _mask(lease.consumed), record.gen_slot, record.generation)
            else:
                key_record.unpulled |= lease.consumed

    def _end_lease(self, lease: Lease, *, restore: bool) -> None:
        del self._leases[lease.lease_id]
        held = self._leases_by_owner[id(lease.owner)] - 1
        if held:
            self._leases_by_owner[id(lease.owner)] = held
        else:
            del self._leases_by_owner[id(lease.owner)]
        if restore:
            self._restore(lease)
        for record in lease.records:
            record.leases -= 1
            # A record the owner dropped meanwhile (unregistered) is no longer in the table: nothing to free.
            self._maybe_free(record)
        self._lease_ended.notify_all()

    def _unbind(self, key: KeyId) -> None:
        key_record = self._keys.pop(key, None)
        if key_record is None:
            return
        if key[0] == KEY_REQ:
            self._slot_req_key.pop((key_record.cache_id, key_record.slot), None)
        self._unpublish_key(key_record)
        record = self._caches[key_record.cache_id]
        record.keys.discard(key)
        self._maybe_free(record)

    def _maybe_free(self, record: CacheRecord) -> None:
        if record.referenced or self._caches.get(record.cache_id) is not record:
            return
        if record.published:
            # No new pin may start (its last name goes first); one already taken keeps the memory.
            self._drop_name(record.cache_name)
            record.cache_name = -1
            index = self.index
            if (record.gen_slot, record.generation) in set(index.pinned(self._rows.all()).values()):
                if not record.pending:
                    record.pending = True
                    index.set_cache_flags(record.gen_slot, _flags_of(record))
                    self._pending[record.cache_id] = record
                return
            self._pending.pop(record.cache_id, None)
            self._withdraw(record)
        del self._caches[record.cache_id]
        # Retire the generation before the memory can be handed out again: readers check it after copying.
        self._generations.retire(record.gen_slot)
        if record.block is not None:
            self._pools[record.placement].free(record.block)


def _flags_of(record: CacheRecord) -> int:
    """The index's flags for a cache (see shm.index)."""
    return (
        (CACHE_BLOCKS if record.is_blocks else 0)
        | (CACHE_PENDING if record.pending else 0)
        | (0 if record.external else CACHE_WITHDRAWN)
        | (CACHE_REGISTERED if record.registered else 0)
        | (CACHE_REMOTE if record.remote_accessible else 0)
    )


def _mask(tensors: set[int] | frozenset[int]) -> int:
    mask = 0
    for tensor in tensors:
        mask |= 1 << tensor
    return mask


def _tensors(mask: int) -> list[int]:
    return [t for t in range(mask.bit_length()) if mask >> t & 1]


def _key_text(key: KeyId) -> str:
    kind, key_id, model_id = key
    name = {KEY_REQ: "req_id", KEY_PREFIX: "prefix_id"}.get(kind, "id")
    return f"({name}={key_id}, model_id={model_id})"


def _segment_of(record: CacheRecord) -> Segment:
    if record.block is None:
        raise registered_for_v1(record.cache_id)
    return record.block.segment


# The checks a pull's source gets, shared by the owner (a request over the socket) and the puller (a pin in
# the owner's index, `_dataplane`): the same refusals with the same codes and words, whoever makes them.


def check_tensors(num_tensors: int, tensor_start: int, tensor_count: int, whole: bool) -> None:
    if whole and tensor_count != num_tensors:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"source cache has {num_tensors} tensors, destination selects {tensor_count}",
        )
    if tensor_start + tensor_count > num_tensors:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"source tensors [{tensor_start}, {tensor_start + tensor_count}) exceed "
            f"the cache's {num_tensors}",
        )


def check_source_bytes(slot_nbytes: int, src_offset: int, nbytes: int) -> None:
    if src_offset + nbytes > slot_nbytes:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"src_cache_offset {src_offset} + size {nbytes} > source slot {slot_nbytes}",
        )


def check_batch_index(batch_size: int, batch_index: int) -> None:
    if batch_index >= batch_size:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"batch index {batch_index} out of range for batch size {batch_size}",
        )


def not_found(key_kind: int, key_id: int, model_id: int) -> StatusError:
    if key_kind == KEY_BLOCKS:
        return StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no blocks cache with model_id {model_id}")
    if key_kind == KEY_CACHE_ID:
        return StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache id {key_id} does not exist")
    key = (key_kind, key_id, model_id)
    return StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache key {_key_text(key)} does not exist")


def blocks_by_id(cache_id: int) -> StatusError:
    return StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache id {cache_id} is a blocks cache")


def registered_for_v1(cache_id: int) -> StatusError:
    return StatusError(
        LLMStatusCode.LLM_PARAM_INVALID,
        f"cache {cache_id} is registered memory: only cache-manager mode transfers reach it",
    )


def _record_holding(records: list[CacheRecord], addr: int, nbytes: int) -> CacheRecord | None:
    """The cache one of whose tensors contains [addr, addr + nbytes), if any."""
    for record in records:
        if record.block is None:
            for base in record.addrs:
                if base <= addr < base + record.tensor_nbytes:
                    return record if nbytes > 0 and addr + nbytes <= base + record.tensor_nbytes else None
            continue
        offset = addr - record.block.address
        if offset < 0 or offset >= record.pitch_nbytes * record.num_tensors:
            continue
        within = offset % record.pitch_nbytes
        return record if nbytes > 0 and within + nbytes <= record.tensor_nbytes else None
    return None


class _Pinned:
    """`CacheTable.pinned`: a class, not @contextmanager, since every transfer enters one."""

    __slots__ = ("_cache_id", "_record", "_table")

    def __init__(self, table: CacheTable, cache_id: int) -> None:
        self._table = table
        self._cache_id = cache_id
        self._record: CacheRecord | None = None

    def __enter__(self) -> CacheRecord:
        self._record = self._table.pin(self._cache_id)
        return self._record

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        record, self._record = self._record, None
        if record is not None:
            self._table.unpin(record)

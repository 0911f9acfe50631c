"""The owner's table as pullers on this host see it: the published index (`shm.index`), kept by one
`IndexMirror`.

Rules: the table tells the mirror what changed (a cache or key added, withdrawn, flagged) and the mirror
writes it into the index; what pullers did in the index (keys they consumed, pins they let go of) comes
back only through `drain`, as events the table applies, never by a call from the mirror into the table.
Every method runs with the index lock held (`locked`, re-entrant); the table's lock is the caller's too.
What could not be done because the lock was held elsewhere is deferred (`defer`), never dropped: it runs,
in order, first thing when the lock is next had. The mirror also looks for stray writes into the index
every few housekeepings and repairs them from the owner's own record (`shm.index_owner`).

Names are the index's hash entries (a key, a cache by id, a slot, a blocks key); a name that cannot be had
(the index is full, a cache has more tensors than a mask holds) is flagged unpublished, so that a puller
that does not find one asks the owner instead.
"""

from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Iterator

from llm_datadist._shm.index import IndexLockTimeout
from llm_datadist._shm.index_layout import (
    FLAG_CACHES_UNPUBLISHED,
    FLAG_UNPUBLISHED,
    KIND_BLOCKS,
    KIND_CACHE,
    KIND_SLOT,
    MAX_MASK_TENSORS,
    NAME_CONSUMED,
    NAME_LIVE,
    CacheEntry,
)
from llm_datadist._shm.index_owner import OwnerIndex

from .._errors import IndexBusy
from .._keys import KEY_REQ, KeyId
from ..status import LLMStatusCode
from ..utils.log import log
from .records import CacheRecord, KeyRecord, mask_of, tensors_of
from .rows import Rows

# The owner's calls wait this long for the index lock by default (a puller holds it for microseconds; only a
# stopped process holds it longer); an instance waits its `sync_kv_timeout`.
INDEX_LOCK_TIMEOUT_S = 5.0
# The server thread never waits that long: what it cannot do at once it retries at its next housekeeping
# (a request waits in its connection's queue meanwhile; see `_wire.server.Server`).
SERVER_LOCK_TIMEOUT_S = 0.005
# Housekeeping runs about twice a second; every this many times it also looks for stray writes into the
# index (a few milliseconds for the default capacities).
AUDIT_EVERY = 4


class IndexMirror:
    """Writes the owner's caches, keys and rows into the published index and reads back what pullers did."""

    def __init__(self, *, incarnation: int, generations: str, lock_timeout_s: float) -> None:
        self.index = OwnerIndex.create(os.getpid(), incarnation, generations=generations)
        self.rows = Rows(self.index)
        self._addr_free: list[tuple[int, int]] = [(0, self.index.addr_words)]  # (first word, count)
        self._free_names = list(range(self.index.names - 1, -1, -1))
        self._key_by_name: dict[int, KeyId] = {}
        self._blocks_names: dict[int, int] = {}  # model_id -> KIND_BLOCKS name
        self._epoch_seen = 0
        self._flags = 0
        self._syncs = 0
        self._lock_timeout_s = lock_timeout_s
        self._regrowths_seen = 0
        # Work that waited for the lock, run in order when it is next had (appends are atomic: any thread).
        self._deferred: deque[Callable[[], None]] = deque()

    # ----------------------------------------------------------------- the lock

    @contextlib.contextmanager
    def locked(self, timeout_s: float | None = None) -> Iterator[OwnerIndex]:
        """Hold the index lock (re-entrant: an operation takes it once, first, so that what it does is
        done whole or not at all); IndexBusy when it cannot be had within `timeout_s` (default: the owner's
        own calls' wait). What was deferred runs first, before anything asked after it."""
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
        if index.regrowths != self._regrowths_seen:
            self._regrowths_seen = index.regrowths
            log.error(
                "another process shrank the index %s under its mappings: grown back and republished from "
                "this process's own record; pins and reservations pullers had written in the part that "
                "was cut are lost, and their transfers fail",
                index.name,
            )
            self.look_again()
        try:
            while self._deferred:
                self._deferred.popleft()()
            yield index
        finally:
            index.unlock()

    def defer(self, work: Callable[[], None]) -> None:
        """Run `work` (with the table's lock and the index lock held) when the lock is next had."""
        self._deferred.append(work)

    def now_or_later(self, work: Callable[[], None]) -> None:
        """Run `work` now if the lock can be had at once, else when it is next had (the caller holds the
        table's lock)."""
        try:
            with self.locked(SERVER_LOCK_TIMEOUT_S):
                work()
        except IndexBusy:
            self.defer(work)

    # ----------------------------------------------------------------- what pullers did

    def drain(self) -> list[KeyId] | None:
        """What pullers did since the last drain: None if nothing, else the keys they consumed that no row
        refers to any more (the table unbinds them, and looks again at the caches whose free waits)."""
        index = self.index
        epoch = index.epoch
        if epoch == self._epoch_seen:
            return None
        self._epoch_seen = epoch
        consumed = index.consumed_names()
        if not consumed:
            return []
        referenced = {index.row(row)[4] for row in index.pinned(self.rows.all())}
        keys = (self._key_by_name.get(name) for name in consumed if name not in referenced)
        return [key for key in keys if key is not None]

    def look_again(self) -> None:
        """The next `drain` reports what the index holds even if no puller moved the epoch since."""
        self._epoch_seen = -1

    def audit(self) -> bool:
        """Every `AUDIT_EVERY` calls: repair stray writes into the index; True if it held any."""
        self._syncs += 1
        if self._syncs % AUDIT_EVERY or not self.index.repair():
            return False
        log.warning(
            "the index %s held bytes nobody of ours wrote there: republished from this process's own "
            "record (%d repairs so far)",
            self.index.name,
            self.index.repairs,
        )
        self.look_again()
        return True

    def pins(self) -> set[tuple[int, int]]:
        """(cache slot, generation) of every cache a row pins now."""
        return set(self.index.pinned(self.rows.all()).values())

    def pin_count(self) -> int:
        """How many rows pin a cache now (two pullers pinning one cache are two pins)."""
        return len(self.index.pinned(self.rows.all()))

    def pinned(self, record: CacheRecord) -> bool:
        return record.published and (record.gen_slot, record.generation) in self.pins()

    # ----------------------------------------------------------------- a req key's tensors
    # In the index for a published key (pullers there reserve and credit it too), in its record otherwise.

    def claimed(self, key_record: KeyRecord) -> bool:
        """Every tensor of the key is reserved by a transfer in flight or pulled: no new pull finds it (it
        stays bound until those transfers end, then it is consumed or found again)."""
        if key_record.name >= 0:
            return self.index.name_entry(key_record.name).state == NAME_CONSUMED
        return not key_record.unpulled

    def reserve(self, key_record: KeyRecord, wanted: set[int]) -> frozenset[int]:
        """Reserve the unclaimed tensors among `wanted`: what was reserved."""
        if key_record.name >= 0:
            return frozenset(tensors_of(self.index.consume(key_record.name, mask_of(wanted))))
        taken = frozenset(key_record.unpulled & wanted)
        key_record.unpulled -= taken
        return taken

    def credit(self, key_record: KeyRecord, pulled: frozenset[int], record: CacheRecord) -> None:
        """A transfer that pulled `pulled` ended well."""
        if key_record.name >= 0:
            self.index.credit(key_record.name, mask_of(pulled), record.gen_slot, record.generation)
            return
        key_record.pulled |= pulled
        key_record.unpulled -= pulled

    def give_back(self, key_record: KeyRecord, reserved: frozenset[int], record: CacheRecord) -> None:
        """A transfer that reserved `reserved` failed: back, but for what others pulled meanwhile."""
        if key_record.name >= 0:
            self.index.restore(key_record.name, mask_of(reserved), record.gen_slot, record.generation)
            return
        key_record.unpulled |= reserved - key_record.pulled

    # ----------------------------------------------------------------- what the owner publishes

    def unpublished(self, flags: int = FLAG_UNPUBLISHED) -> None:
        if self._flags & flags != flags:
            self._flags |= flags
            self.index.set_flags(self._flags)

    def publish_cache(self, record: CacheRecord) -> None:
        if record.gen_slot >= self.index.caches:
            self.unpublished(FLAG_UNPUBLISHED | FLAG_CACHES_UNPUBLISHED)
            return
        if record.block is None:
            first_word = self._take_words(record.num_tensors)
            if first_word < 0:
                self.unpublished(FLAG_UNPUBLISHED | FLAG_CACHES_UNPUBLISHED)
                return
            record.addr_words = first_word
            shared = record.shared
            if shared is not None:  # the library's memory: the segment's name, the tensors' offsets
                where, segment_name, segment_nbytes = first_word, shared.name, shared.nbytes
                self.index.put_addresses(record.addr_words, shared.offsets)
            else:
                where, segment_name, segment_nbytes = first_word, "", 0
                self.index.put_addresses(record.addr_words, record.addrs)
        else:
            where, segment_name, segment_nbytes = (
                record.block.offset,
                record.block.segment.name,
                record.block.segment.nbytes,
            )
        self.index.put_cache(
            CacheEntry(
                record.gen_slot,
                record.generation,
                record.cache_id,
                record.index_flags,
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

    def withdraw(self, record: CacheRecord) -> None:
        """The cache left the table for good (freed, unregistered): its entry and words go."""
        if not record.published:
            return
        self.hide(record)
        self.index.clear_cache(record.gen_slot)
        if record.addr_words >= 0:
            self._give_words(record.addr_words, record.num_tensors)
            record.addr_words = -1
        record.published = False

    def hide(self, record: CacheRecord) -> None:
        """No new pin by id: the cache's name goes (its entry stays for the pins already taken)."""
        self._drop_name(record.cache_name)
        record.cache_name = -1

    def show(self, record: CacheRecord) -> None:
        """A cache the user holds again (an unregister that timed out): reachable by id again."""
        if record.published and record.external and record.cache_name < 0:
            record.cache_name = self._new_name(KIND_CACHE, record.cache_id, 0, record, 0)
            self.set_flags(record)

    def set_flags(self, record: CacheRecord) -> None:
        if record.published:
            self.index.set_cache_flags(record.gen_slot, record.index_flags)

    def publish_key(self, key_record: KeyRecord, record: CacheRecord) -> None:
        kind, key_id, model_id = key_record.key
        name = -1
        if record.published and record.num_tensors <= MAX_MASK_TENSORS:
            name = self._new_name(kind, key_id, model_id, record, key_record.slot)
        if name < 0:
            self.unpublished()
            if kind == KEY_REQ:
                self._keys_unpublished(record)
            return
        key_record.name = name
        self._key_by_name[name] = key_record.key
        if kind == KEY_REQ:
            if key_record.unpulled != set(range(record.num_tensors)):
                state = NAME_LIVE if key_record.unpulled else NAME_CONSUMED
                self.index.set_name_state(
                    name, state, mask_of(key_record.unpulled), mask_of(key_record.pulled)
                )
            key_record.slot_name = self._new_name(
                KIND_SLOT, record.cache_id, key_record.slot, record, key_record.slot, target=name
            )
            if key_record.slot_name < 0:
                self._keys_unpublished(record)

    def _keys_unpublished(self, record: CacheRecord) -> None:
        """A pull by id of one of `record`'s slots may consume a req key the index does not hold: such
        pulls ask the owner (the flag stays with the cache: asking is never wrong, only slower)."""
        if record.published and not record.keys_unpublished:
            record.keys_unpublished = True
            self.set_flags(record)

    def unpublish_key(self, key_record: KeyRecord) -> None:
        self._key_by_name.pop(key_record.name, None)
        self._drop_name(key_record.name)
        self._drop_name(key_record.slot_name)
        key_record.name = key_record.slot_name = -1

    def publish_blocks_key(self, model_id: int, record: CacheRecord | None) -> None:
        """`model_id`'s blocks key names `record` now (None: a cache the index does not hold)."""
        name = self._blocks_names.get(model_id, -1)
        if record is None or not record.published:
            self.drop_blocks_key(model_id)
            self.unpublished()
        elif name >= 0:
            self.index.retarget_name(name, record.gen_slot, record.generation)
        else:
            name = self._new_name(KIND_BLOCKS, 0, model_id, record, 0)
            if name >= 0:
                self._blocks_names[model_id] = name

    def drop_blocks_key(self, model_id: int) -> None:
        self._drop_name(self._blocks_names.pop(model_id, -1))

    def set_busy(self, cluster_id: int, delta: int) -> None:
        self.index.set_busy(cluster_id, delta)

    def close(self) -> None:
        self._deferred.clear()
        self.index.close()

    # ----------------------------------------------------------------- names and address words

    def _new_name(
        self, kind: int, key_id: int, model_id: int, record: CacheRecord, slot: int, target: int = -1
    ) -> int:
        if not self._free_names:
            self.unpublished()
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

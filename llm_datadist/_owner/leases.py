"""Peers' hold on the owner's caches: the leases granted by message, and the rows of the index that
connections pin through.

Rules: a lease pins the records it names (not their ids) until its connection releases it or ends, so
whatever the owner did to a cache meanwhile (unregistered it, freed it), ending the lease is well-defined.
A pull lease reserves its key's tensors when it is taken (a second pull of a key in flight already sees
it gone); when it ends well the key gains what it pulled, whoever had reserved it, and a failed or
abandoned transfer gives back what it reserved, but for what other pulls pulled meanwhile (reference
§9.4: a key is consumed once pulls that ended well copied all of it). A connection holds at most
`MAX_LEASES_PER_OWNER` leases. Everything that can refuse a request comes before its lease: a refused
request pins nothing. The server thread never waits for the index lock: a request that finds it busy
raises IndexBusy (nothing done) and is retried; a connection's end or a release that cannot wait is
deferred (done when the lock is next had, never dropped).

A pin through a row is the puller's: see `rows` for a row's life, `_puller.dataplane` for the puller's side.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable

from llm_datadist._protocol.messages import RULES_V1, Location, PinRequest, WriteGrant, WriteRequest

from .._errors import IndexBusy, StatusError
from .._keys import (
    KEY_BLOCKS,
    KEY_CACHE_ID,
    KEY_REQ,
    KeyId,
    blocks_by_id,
    check_batch_index,
    check_source_bytes,
    check_tensors,
    not_found,
    registered_for_v1,
)
from ..status import LLMStatusCode
from .mirror import SERVER_LOCK_TIMEOUT_S
from .records import CacheRecord, Lease
from .rows import Holder
from .table import CacheTable

# A well-behaved link holds one lease at a time (one transfer at a time per link); this bounds a peer that
# asks for leases and never releases them.
MAX_LEASES_PER_OWNER = 1024


def find(
    table: CacheTable, key_kind: int, key_id: int, model_id: int, batch_index: int
) -> tuple[CacheRecord, int, KeyId | None]:
    """The cache a key names in `table`, the slot it is bound to, and the req key a successful pull of that
    slot consumes (none for prefix and blocks keys: those are never consumed). Both locks held."""
    if key_kind == KEY_BLOCKS:
        cache_id = table.blocks_keys.get(model_id)
        record = table.caches.get(cache_id) if cache_id is not None else None
        if record is None:
            raise not_found(KEY_BLOCKS, 0, model_id)
        return record, 0, None
    if key_kind == KEY_CACHE_ID:
        record = table.caches.get(key_id)
        if record is None or record.pending or (record.registered and not record.external):
            raise not_found(KEY_CACHE_ID, key_id, 0)
        check_batch_index(record.batch_size, batch_index)
        return record, batch_index, table.slot_req_key(record.cache_id, batch_index)
    key = (key_kind, key_id, model_id)
    key_record = table.keys.get(key)
    if key_record is not None and table.mirror.claimed(key_record):
        key_record = None  # pulled whole, or reserved whole by transfers in flight: gone for now
    if key_record is None:
        raise not_found(key_kind, key_id, model_id)
    return table.caches[key_record.cache_id], key_record.slot, key if key_kind == KEY_REQ else None


class Leases:
    """The leases and rows of the connections of peers that pull from, or push into, one table."""

    def __init__(self, table: CacheTable) -> None:
        self.table = table
        self._mirror = table.mirror
        self._next_lease_id = 1
        self._leases: dict[int, Lease] = {}
        self._held: dict[int, int] = {}  # id(owner) -> leases held

    # ----------------------------------------------------------------- connections

    def assign_row(self, owner: object, incarnation: int, holder: Holder) -> tuple[int, int]:
        """A row of the index for a new connection of a puller of `incarnation` (process `holder`) to pin
        through, and the ticket that names the connection in it; (-1, 0) if none is free or the lock is
        busy (the connection then asks for what it pulls). The ticket is drawn per connection: a puller's
        earlier connection that got the same row never touches it again."""
        with self.table.lock:
            if not self._mirror.rows.available():
                return -1, 0
            ticket = secrets.randbits(64) or 1
            try:
                with self._mirror.locked(SERVER_LOCK_TIMEOUT_S):
                    return self._mirror.rows.assign(owner, ticket, incarnation, holder), ticket
            except IndexBusy:
                return -1, 0

    def connection_ended(self, owner: object, released: frozenset[int] = frozenset()) -> None:
        """A connection ended: its leases end (`released`: those its peer released well in messages never
        read; the others give back what they consumed), and its row is freed or, while its live holder
        still pins through it, orphaned. Done when the lock is next had if it is busy now."""
        with self.table.lock:
            self._mirror.now_or_later(lambda: self._connection_ended(owner, released))

    def _connection_ended(self, owner: object, released: frozenset[int]) -> None:
        for lease in [lease for lease in self._leases.values() if lease.owner is owner]:
            self._end(lease, restore=lease.lease_id not in released)
        if self._mirror.rows.end(owner):
            self._mirror.look_again()
        self.table.catch_up()

    def start_push(self, clusters: set[int], connections: Callable[[int], list[object]]) -> int | None:
        """Mark pushes into `clusters` in the index unless one of them is pulling from us: the busy cluster
        then (nothing marked), else None. Pullers check the mark under the same lock."""
        with self.table.lock, self._mirror.locked() as index:
            pinning = index.pinned(self._mirror.rows.all())
            for cluster_id in sorted(clusters):
                for conn in connections(cluster_id):
                    if id(conn) in self._held or self._mirror.rows.of(conn) in pinning:
                        return cluster_id
            for cluster_id in clusters:
                self._mirror.set_busy(cluster_id, 1)
            return None

    def end_push(self, clusters: set[int]) -> None:
        """Unmark pushes into `clusters` (when the lock is next had if it is busy now: never lost)."""

        def unmark() -> None:
            for cluster_id in clusters:
                self._mirror.set_busy(cluster_id, -1)

        with self.table.lock:
            self._mirror.now_or_later(unmark)

    # ----------------------------------------------------------------- grants (server thread)

    def resolve(self, msg: PinRequest, owner: object) -> Location:
        """Pin the cache a request names with a lease and say where its tensors are (segment offsets, or
        addresses for registered memory), under the request's rules: v1 reaches pool memory only, a
        blocks cache only by its blocks key, and checks the bytes a key pull names against the slot; keys
        on registered memory are never consumed. A write (a peer's push) only reaches a cache its user
        still holds, and consumes nothing."""
        with self.table.lock, self._mirror.locked(SERVER_LOCK_TIMEOUT_S):
            self.table.catch_up()
            record, slot, consume_key = find(
                self.table, msg.key_kind, msg.key_id, msg.model_id, msg.batch_index
            )
            if msg.rules == RULES_V1:
                if msg.key_kind == KEY_CACHE_ID and record.is_blocks:
                    # v1 pulls a continuous slot by cache id; a paged cache is pulled by its blocks key.
                    raise blocks_by_id(msg.key_id)
                if record.registered:
                    raise registered_for_v1(record.cache_id)
            if msg.for_write and not record.external:
                raise StatusError(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {record.cache_id} was deallocated"
                )
            check_tensors(record.num_tensors, msg.tensor_start, msg.tensor_count, msg.whole)
            if msg.nbytes:  # a v1 pull of a key
                check_source_bytes(record.slot_nbytes, msg.src_offset, msg.nbytes)
            consume = consume_key if msg.consume and not msg.for_write and not record.registered else None
            tensors = range(msg.tensor_start, msg.tensor_start + msg.tensor_count)
            lease = self._lease((record,), consume, set(tensors), owner)
            where = record.location(msg.tensor_start, msg.tensor_count)
            return Location(
                msg.seq,
                lease.lease_id,
                os.getpid(),
                where.segment_name,
                where.segment_nbytes,
                where.tensor_bases,
                where.unit_nbytes,
                where.num_units,
                slot,
            )

    def resolve_write(self, msg: WriteRequest, owner: object) -> WriteGrant:
        """Pin the caches that hold these address ranges of this process for a peer's push.

        Each range must lie inside one tensor of a live cache (one the user still holds); otherwise the
        whole request is refused and nothing is pinned.
        """
        with self.table.lock, self._mirror.locked(SERVER_LOCK_TIMEOUT_S):
            live = [record for record in self.table.caches.values() if record.external]
            segments: dict[str, int] = {}
            segment_nbytes: list[int] = []
            range_segments: list[int] = []
            range_offsets: list[int] = []
            records: dict[int, CacheRecord] = {}
            for addr, length in zip(msg.addrs, msg.nbytes, strict=True):
                record = _record_holding(live, addr, length)
                if record is None:
                    raise StatusError(
                        LLMStatusCode.LLM_PARAM_INVALID,
                        f"[{addr:#x}, +{length}) is not inside one tensor of a live cache of this process",
                    )
                segment = record.segment
                index = segments.setdefault(segment.name, len(segments))
                if index == len(segment_nbytes):
                    segment_nbytes.append(segment.nbytes)
                range_segments.append(index)
                range_offsets.append(addr - segment.address)
                records[record.cache_id] = record
            lease = self._lease(tuple(records.values()), None, set(), owner)
            return WriteGrant(
                msg.seq,
                lease.lease_id,
                tuple(segments),
                tuple(segment_nbytes),
                tuple(range_segments),
                tuple(range_offsets),
            )

    # ----------------------------------------------------------------- releases

    def release(self, lease_id: int, *, ok: bool, owner: object) -> None:
        """End a lease; a failed transfer gives back what it consumed. IndexBusy (nothing done) when the
        lock is busy: the server retries."""
        with self.table.lock, self._mirror.locked(SERVER_LOCK_TIMEOUT_S):
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner is not owner:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"unknown lease {lease_id}")
            self._end(lease, restore=not ok)

    def release_soon(self, lease_id: int, *, ok: bool, owner: object) -> None:
        """`release` that never fails for a busy lock: done when the lock is next had then."""

        def release() -> None:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.owner is owner:
                self._end(lease, restore=not ok)

        with self.table.lock:
            self._mirror.now_or_later(release)

    def holds(self, owner: object) -> bool:
        """Whether a connection holds a lease (what it pins through its row is the index's to say)."""
        with self.table.lock:
            return id(owner) in self._held

    def drop_owner(self, owner: object) -> int:
        """End every lease a connection holds, giving back what they consumed (a connection that ends
        goes through `connection_ended`, which does this and its row too)."""
        with self.table.lock, self._mirror.locked():
            dropped = [lease for lease in self._leases.values() if lease.owner is owner]
            for lease in dropped:
                self._end(lease, restore=True)
            return len(dropped)

    def wait_for_end(self, timeout_s: float) -> None:
        """Block until some lease or local pin ends or `timeout_s` passed (callers re-check)."""
        with self.table.lock:
            self.table.changed.wait(timeout_s)

    @property
    def count(self) -> int:
        """Leases held now (peers' transfers in flight), read without a lock."""
        return len(self._leases)

    def stats(self) -> dict[str, int]:
        """Caches, keys, leases, pins (rows that pin a cache) and pool bytes in use."""
        table = self.table
        with table.lock, self._mirror.locked():
            table.catch_up()
            return {
                "caches": len(table.caches),
                "keys": len(table.keys),
                "leases": len(self._leases),
                "pins": self._mirror.pin_count(),
                "pool_used_nbytes": sum(pool.used_nbytes for pool in table.pools()),
            }

    def wait_for_pins(self, timeout_s: float) -> bool:
        """Wait until no row of the index pins a cache (orphans included); False at the timeout."""
        deadline = time.monotonic() + timeout_s
        with self.table.lock:
            while True:
                remaining = deadline - time.monotonic()
                try:
                    with self._mirror.locked(min(max(remaining, 0.0), SERVER_LOCK_TIMEOUT_S)):
                        self._mirror.rows.sweep()
                        if not self._mirror.pin_count():
                            return True
                except IndexBusy:
                    pass
                if remaining <= 0:
                    return False
                self.table.changed.wait(min(remaining, 0.005))

    def close(self) -> None:
        with self.table.lock:
            self._leases.clear()
            self._held.clear()

    # ----------------------------------------------------------------- both locks held

    def _lease(
        self, records: tuple[CacheRecord, ...], consume_key: KeyId | None, tensors: set[int], owner: object
    ) -> Lease:
        held = self._held.get(id(owner), 0)
        if held >= MAX_LEASES_PER_OWNER:
            raise StatusError(
                LLMStatusCode.LLM_FAILED,
                f"this link already holds {held} leases (the limit): release them before asking for more",
            )
        key_record = self.table.keys.get(consume_key) if consume_key is not None else None
        reserved: frozenset[int] = frozenset()
        if key_record is not None and key_record.cache_id == records[0].cache_id:
            # Reserved now (a second pull of the key while this one is in flight finds it claimed); the
            # key stays bound until the lease ends: pulled whole, it is consumed then.
            reserved = self._mirror.reserve(key_record, tensors)
            key_record.leases += 1
        else:
            key_record = None
        lease = Lease(self._next_lease_id, records, key_record, owner, reserved, frozenset(tensors))
        self._next_lease_id += 1
        self._leases[lease.lease_id] = lease
        self._held[id(owner)] = held + 1
        for record in records:
            record.leases += 1
        return lease

    def _settle_key(self, lease: Lease, *, ok: bool) -> None:
        """The lease's key gains what the transfer pulled (it ended well) or gets back what it reserved (it
        failed), if it is still bound to the leased cache; consumed once pulled whole."""
        key_record = lease.key
        if key_record is None:
            return
        key_record.leases -= 1
        record = lease.records[0]
        table = self.table
        if (
            table.keys.get(key_record.key) is not key_record
            or table.caches.get(record.cache_id) is not record
        ):
            return  # removed (or bound anew) meanwhile: nothing of this lease's is left to settle
        if ok:
            self._mirror.credit(key_record, lease.pulled, record)
        elif lease.reserved:
            self._mirror.give_back(key_record, lease.reserved, record)
        table.key_settled(key_record)

    def _end(self, lease: Lease, *, restore: bool) -> None:
        del self._leases[lease.lease_id]
        held = self._held[id(lease.owner)] - 1
        if held:
            self._held[id(lease.owner)] = held
        else:
            del self._held[id(lease.owner)]
        self._settle_key(lease, ok=not restore)
        for record in lease.records:
            record.leases -= 1
            # A record the owner dropped meanwhile (unregistered) is no longer in the table: nothing to free.
            self.table.maybe_free(record)
        self.table.changed.notify()


def _record_holding(records: list[CacheRecord], addr: int, nbytes: int) -> CacheRecord | None:
    """The cache one of whose tensors contains [addr, addr + nbytes), if any."""
    for record in records:
        holds = record.holds(addr, nbytes)
        if holds is not None:
            return record if holds else None
    return None

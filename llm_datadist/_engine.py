"""The per-process cache table: caches carved from the shared-memory pool, the keys bound to their batch
slots, and the leases that pin a cache while a peer copies out of it.

Rules: every method takes the table's lock, so the server thread and user threads may call it at once.
A cache's memory returns to the pool only when nothing references it any more: not the user (external
reference, dropped by `deallocate`), not a key, not a lease (a peer mid-copy) and not a local pin (a pull
writing into it). Cache ids count from 1 and are never reused. Leases belong to a connection token, so a
dead peer's leases can be dropped in one call without consuming its keys. A lease names the records it
pins, not their ids: whatever the owner did to a cache meanwhile (unregistered it, freed it), ending the
lease is always well-defined. A connection holds at most `MAX_LEASES_PER_OWNER` leases at once.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

from llm_datadist._shm.errors import OutOfPoolMemory, ShmError
from llm_datadist._shm.generations import GenerationTable
from llm_datadist._shm.pool import Block, Pool
from llm_datadist._shm.segment import Segment

from ._errors import StatusError
from .status import LLMStatusCode

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
    # every tensor was pulled (reference §9.4, §16).
    unpulled: set[int]


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

    def __init__(self, pools: dict[int, Pool], *, oom_code: LLMStatusCode) -> None:
        # Pools by placement (Placement.DEVICE = 1, HOST = 0); a placement without a pool cannot allocate.
        self._pools = pools
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
    ) -> CacheRecord:
        """Carve a cache from the placement's pool and bind `keys[i]` (None: padding) to batch slot i.

        `unique_keys` (v2): the same key twice in one call is refused; otherwise the last slot wins (v1).
        """
        bindings = self._bindings(num_tensors, tensor_nbytes, batch_size, keys, unique_keys)
        pitch = _align_up(tensor_nbytes, TENSOR_ALIGN_NBYTES)
        with self._lock:
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
            return self._add(record, bindings)

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
    ) -> CacheRecord:
        """Record a cache over memory the user owns at `addrs` (one address per tensor). Its keys are never
        consumed by pulls; overlapping another registered cache is refused."""
        bindings = self._bindings(num_tensors, tensor_nbytes, batch_size, keys, True)
        if len(addrs) != num_tensors:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID, f"{len(addrs)} addresses for {num_tensors} tensors"
            )
        with self._lock:
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
            return self._add(record, bindings)

    def _acquire_generation(self) -> tuple[int, int]:
        try:
            return self._generations.acquire()
        except ShmError as exc:
            raise StatusError(self._oom_code, str(exc)) from exc

    def unregister(self, cache_id: int, *, timeout_s: float) -> bool:
        """Forget a registered cache and its keys; False if `cache_id` is not a registered cache.

        The caller may reuse the memory as soon as this returns, so a peer's transfer that pins the cache
        (a lease) must end first: this waits for it up to `timeout_s`, then raises StatusError(LLM_TIMEOUT)
        and leaves the cache registered. New leases cannot start meanwhile: the keys go first.
        """
        with self._lock:
            record = self._caches.get(cache_id)
            if record is None or not record.registered:
                return False
            for key in list(record.keys):
                self._unbind(key)
            for model_id in [m for m, c in self._blocks_keys.items() if c == cache_id]:
                del self._blocks_keys[model_id]
            # Refuse new leases by id while waiting (resolve checks `external`), then wait out the old ones.
            record.external = False
            deadline = time.monotonic() + timeout_s
            while record.leases > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    record.external = True
                    raise StatusError(
                        LLMStatusCode.LLM_TIMEOUT,
                        f"cache {cache_id} is still pinned by a peer's transfer; its keys were removed",
                    )
                self._lease_ended.wait(remaining)
            if self._caches.get(cache_id) is record:
                del self._caches[cache_id]
                self._generations.retire(record.gen_slot)
            return True

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

    def _add(self, record: CacheRecord, bindings: dict[KeyId, int]) -> CacheRecord:
        self._next_cache_id += 1
        self._caches[record.cache_id] = record
        for key, slot in bindings.items():
            self._keys[key] = KeyRecord(key, record.cache_id, slot, set(range(record.num_tensors)))
            record.keys.add(key)
            if key[0] == KEY_REQ:
                self._slot_req_key[(record.cache_id, slot)] = key
        return record

    def bind_blocks_key(self, model_id: int, cache_id: int) -> None:
        with self._lock:
            if model_id in self._blocks_keys:
                # Peers' copies of the table name the old cache under this model id: make them refetch.
                self._generations.bump_version()
            self._blocks_keys[model_id] = cache_id

    @property
    def table_version(self) -> int:
        """The version word of the generation segment (see shm.generations)."""
        with self._lock:
            return self._generations.version

    def deallocate(self, cache_id: int) -> None:
        """Drop the user's reference; the memory goes back once no key, lease or pin remains."""
        with self._lock:
            record = self._caches.get(cache_id)
            if record is None or not record.external:
                return
            record.external = False
            for model_id in [m for m, c in self._blocks_keys.items() if c == cache_id]:
                del self._blocks_keys[model_id]
            self._maybe_free(record)

    def remove_key(self, key: KeyId) -> None:
        with self._lock:
            self._unbind(key)

    def get(self, cache_id: int) -> CacheRecord | None:
        with self._lock:
            return self._caches.get(cache_id)

    def key_on_registered(self, key: KeyId) -> bool:
        """True if `key` is bound to a registered cache (whose keys nothing removes)."""
        with self._lock:
            key_record = self._keys.get(key)
            return key_record is not None and self._caches[key_record.cache_id].registered

    def has_key(self, key: KeyId) -> bool:
        with self._lock:
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
        with self._lock:
            record.pins -= 1
            self._maybe_free(record)

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
        with self._lock:
            record, slot, consume_key = self._find(key_kind, key_id, model_id, batch_index)
            if key_kind == KEY_CACHE_ID and record.is_blocks:
                # v1 pulls a continuous slot by cache id; a paged cache is pulled by its blocks key.
                raise StatusError(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache id {key_id} is a blocks cache"
                )
            self._check_tensors(record, tensor_start, tensor_count, whole)
            if src_offset + nbytes > record.slot_nbytes:
                raise StatusError(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"src_cache_offset {src_offset} + size {nbytes} > source slot {record.slot_nbytes}",
                )
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
        with self._lock:
            record, _, _ = self._find(KEY_BLOCKS, 0, model_id, 0)
            self._check_tensors(record, tensor_start, tensor_count, whole)
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
        with self._lock:
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
        with self._lock:
            record, slot, consume_key = self._find(key_kind, key_id, model_id, batch_index)
            if for_write and not record.external:
                raise StatusError(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache {record.cache_id} was deallocated"
                )
            self._check_tensors(record, tensor_start, tensor_count, whole)
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
        with self._lock:
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
        key in flight already sees it gone); a failed transfer gives them back."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner is not owner:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"unknown lease {lease_id}")
            self._end_lease(lease, restore=not ok)

    def wait_for_lease_end(self, timeout_s: float) -> None:
        """Block until some lease ends or `timeout_s` passed (callers re-check what they wait for)."""
        with self._lock:
            self._lease_ended.wait(timeout_s)

    def holds_leases(self, owner: object) -> bool:
        with self._lock:
            return id(owner) in self._leases_by_owner

    def drop_owner(self, owner: object) -> int:
        """Release every lease a (dead or departed) connection held, consuming nothing."""
        with self._lock:
            if id(owner) not in self._leases_by_owner:
                return 0
            dropped = [lease for lease in self._leases.values() if lease.owner is owner]
            for lease in dropped:
                self._end_lease(lease, restore=True)
            return len(dropped)

    # ----------------------------------------------------------------- introspection and teardown

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "caches": len(self._caches),
                "keys": len(self._keys),
                "leases": len(self._leases),
                "pool_used_nbytes": sum(pool.used_nbytes for pool in self._pools.values()),
            }

    def close(self) -> None:
        """Forget everything and give the pool's segments back (unlinked)."""
        with self._lock:
            self._caches.clear()
            self._keys.clear()
            self._slot_req_key.clear()
            self._blocks_keys.clear()
            self._leases.clear()
            self._leases_by_owner.clear()
            self._lease_ended.notify_all()
            for pool in self._pools.values():
                pool.close()
            self._generations.close()

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
                raise StatusError(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no blocks cache with model_id {model_id}"
                )
            return record, 0, None
        if key_kind == KEY_CACHE_ID:
            record = self._caches.get(key_id)
            if record is None or (record.registered and not record.external):
                raise StatusError(LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache id {key_id} does not exist")
            if batch_index >= record.batch_size:
                raise StatusError(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"batch index {batch_index} out of range for batch size {record.batch_size}",
                )
            return record, batch_index, self._slot_req_key.get((record.cache_id, batch_index))
        key = (key_kind, key_id, model_id)
        key_record = self._keys.get(key)
        if key_record is None:
            raise StatusError(
                LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache key {_key_text(key)} does not exist"
            )
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
                consumed = frozenset(
                    key_record.unpulled & set(range(tensor_start, tensor_start + tensor_count))
                )
                key_record.unpulled -= consumed
                if not key_record.unpulled:
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
            key_record = KeyRecord(key, record.cache_id, lease.unbound_slot, set())
            self._keys[key] = key_record
            record.keys.add(key)
            if key[0] == KEY_REQ:
                self._slot_req_key[(record.cache_id, lease.unbound_slot)] = key
        if key_record is not None and key_record.cache_id == record.cache_id:
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

    @staticmethod
    def _check_tensors(record: CacheRecord, tensor_start: int, tensor_count: int, whole: bool) -> None:
        if whole and tensor_count != record.num_tensors:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"source cache has {record.num_tensors} tensors, destination selects {tensor_count}",
            )
        if tensor_start + tensor_count > record.num_tensors:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"source tensors [{tensor_start}, {tensor_start + tensor_count}) exceed "
                f"the cache's {record.num_tensors}",
            )

    def _unbind(self, key: KeyId) -> None:
        key_record = self._keys.pop(key, None)
        if key_record is None:
            return
        if key[0] == KEY_REQ:
            self._slot_req_key.pop((key_record.cache_id, key_record.slot), None)
        record = self._caches[key_record.cache_id]
        record.keys.discard(key)
        self._maybe_free(record)

    def _maybe_free(self, record: CacheRecord) -> None:
        if record.referenced or self._caches.get(record.cache_id) is not record:
            return
        del self._caches[record.cache_id]
        # Retire the generation before the memory can be handed out again: readers check it after copying.
        self._generations.retire(record.gen_slot)
        if record.block is not None:
            self._pools[record.placement].free(record.block)


def _key_text(key: KeyId) -> str:
    kind, key_id, model_id = key
    name = {KEY_REQ: "req_id", KEY_PREFIX: "prefix_id"}.get(kind, "id")
    return f"({name}={key_id}, model_id={model_id})"


def _segment_of(record: CacheRecord) -> Segment:
    if record.block is None:
        raise StatusError(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"cache {record.cache_id} is registered memory: only cache-manager mode transfers reach it",
        )
    return record.block.segment


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

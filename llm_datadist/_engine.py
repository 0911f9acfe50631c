"""The per-process cache table: caches carved from the shared-memory pool, the keys bound to their batch
slots, and the leases that pin a cache while a peer copies out of it.

Rules: every method takes the table's lock, so the server thread and user threads may call it at once.
A cache's memory returns to the pool only when nothing references it any more: not the user (external
reference, dropped by `deallocate`), not a key, not a lease (a peer mid-copy) and not a local pin (a pull
writing into it). Cache ids count from 1 and are never reused. Leases belong to a connection token, so a
dead peer's leases can be dropped in one call without consuming its keys.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from shm.errors import OutOfPoolMemory
from shm.pool import Block, Pool

from ._errors import StatusError
from .status import LLMStatusCode

KEY_REQ = 1
KEY_PREFIX = 2
KEY_CACHE_ID = 3

# (kind, req_id or prefix_id, model_id)
KeyId = tuple[int, int, int]

# Each tensor starts on its own page: copies stay aligned and a tensor never shares a page with another.
TENSOR_ALIGN_NBYTES = 4096


def _align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


@dataclass(eq=False)
class CacheRecord:
    """One cache: `num_tensors` tensors of `tensor_nbytes`, each `pitch_nbytes` apart in one pool block.

    Layout inside `block` (offsets relative to the block start)::

        0                 pitch            2*pitch                 num_tensors*pitch
        | tensor 0 | pad  | tensor 1 | pad  | ... | tensor n-1 | pad |

    Tensor t, slot b starts at block.offset + t*pitch + b*slot_nbytes within the segment.
    """

    cache_id: int
    num_tensors: int
    tensor_nbytes: int
    batch_size: int
    pitch_nbytes: int
    block: Block
    is_blocks: bool = False
    external: bool = True
    keys: set[KeyId] = field(default_factory=set)
    leases: int = 0
    pins: int = 0

    @property
    def slot_nbytes(self) -> int:
        return self.tensor_nbytes // self.batch_size

    def tensor_offset(self, tensor_index: int) -> int:
        """Offset of tensor `tensor_index` within the segment."""
        return self.block.offset + tensor_index * self.pitch_nbytes

    def tensor_addrs(self) -> list[int]:
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
    cache_ids: tuple[int, ...]
    consume_key: KeyId | None
    tensor_start: int
    tensor_count: int
    owner: object


@dataclass(frozen=True)
class Grant:
    lease_id: int
    segment_name: str
    segment_nbytes: int
    tensor_offsets: tuple[int, ...]
    nbytes: int


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

    def __init__(self, pool: Pool, *, oom_code: LLMStatusCode) -> None:
        self._pool = pool
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

    # ----------------------------------------------------------------- local operations (owner side)

    def allocate(
        self,
        *,
        num_tensors: int,
        tensor_nbytes: int,
        batch_size: int,
        keys: list[KeyId | None],
        is_blocks: bool = False,
    ) -> CacheRecord:
        """Carve a cache from the pool and bind `keys[i]` (None: padding) to batch slot i."""
        if num_tensors <= 0 or tensor_nbytes <= 0 or batch_size <= 0:
            raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, "cache must have tensors of non-zero size")
        if len(keys) > batch_size:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"{len(keys)} cache keys for a batch of {batch_size}",
            )
        # Duplicates in one call: the last slot wins (the v1 documentation's rule).
        bindings: dict[KeyId, int] = {}
        for slot, key in enumerate(keys):
            if key is not None:
                bindings[key] = slot
        pitch = _align_up(tensor_nbytes, TENSOR_ALIGN_NBYTES)
        with self._lock:
            for key in bindings:
                if key in self._keys:
                    raise StatusError(
                        LLMStatusCode.LLM_PARAM_INVALID, f"cache key {_key_text(key)} is already bound"
                    )
            try:
                block = self._pool.allocate(pitch * num_tensors)
            except OutOfPoolMemory as exc:
                raise StatusError(self._oom_code, str(exc)) from exc
            record = CacheRecord(
                cache_id=self._next_cache_id,
                num_tensors=num_tensors,
                tensor_nbytes=tensor_nbytes,
                batch_size=batch_size,
                pitch_nbytes=pitch,
                block=block,
                is_blocks=is_blocks,
            )
            self._next_cache_id += 1
            self._caches[record.cache_id] = record
            for key, slot in bindings.items():
                self._keys[key] = KeyRecord(key, record.cache_id, slot, set(range(num_tensors)))
                record.keys.add(key)
                if key[0] == KEY_REQ:
                    self._slot_req_key[(record.cache_id, slot)] = key
            return record

    def bind_blocks_key(self, model_id: int, cache_id: int) -> None:
        with self._lock:
            self._blocks_keys[model_id] = cache_id

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

    @contextlib.contextmanager
    def pinned(self, cache_id: int) -> Iterator[CacheRecord]:
        """`pin` for the duration of a with-block."""
        record = self.pin(cache_id)
        try:
            yield record
        finally:
            self.unpin(record)

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
            consume_key: KeyId | None = None
            if key_kind == KEY_CACHE_ID:
                record = self._caches.get(key_id)
                if record is None or record.is_blocks:
                    raise StatusError(
                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache id {key_id} does not exist"
                    )
                if batch_index >= record.batch_size:
                    raise StatusError(
                        LLMStatusCode.LLM_PARAM_INVALID,
                        f"batch index {batch_index} out of range for batch size {record.batch_size}",
                    )
                slot = batch_index
                consume_key = self._slot_req_key.get((record.cache_id, slot))
            else:
                key = (key_kind, key_id, model_id)
                key_record = self._keys.get(key)
                if key_record is None:
                    raise StatusError(
                        LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"cache key {_key_text(key)} does not exist"
                    )
                record = self._caches[key_record.cache_id]
                slot = key_record.slot
                # Prefix keys are never consumed by a pull.
                consume_key = key if key_kind == KEY_REQ else None
            self._check_tensors(record, tensor_start, tensor_count, whole)
            if src_offset + nbytes > record.slot_nbytes:
                raise StatusError(
                    LLMStatusCode.LLM_PARAM_INVALID,
                    f"src_cache_offset {src_offset} + size {nbytes} > source slot {record.slot_nbytes}",
                )
            lease = self._lease(
                (record,), consume_key if consume else None, tensor_start, tensor_count, owner
            )
            base = slot * record.slot_nbytes + src_offset
            offsets = tuple(
                record.tensor_offset(t) + base for t in range(tensor_start, tensor_start + tensor_count)
            )
            return Grant(
                lease_id=lease.lease_id,
                segment_name=record.block.segment.name,
                segment_nbytes=record.block.segment.nbytes,
                tensor_offsets=offsets,
                nbytes=nbytes,
            )

    def resolve_blocks(
        self, *, model_id: int, tensor_start: int, tensor_count: int, whole: bool, owner: object
    ) -> BlocksGrant:
        """Pin the blocks cache a BlocksCacheKey's model_id names (blocks keys are never consumed)."""
        with self._lock:
            cache_id = self._blocks_keys.get(model_id)
            record = self._caches.get(cache_id) if cache_id is not None else None
            if record is None:
                raise StatusError(
                    LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, f"no blocks cache with model_id {model_id}"
                )
            self._check_tensors(record, tensor_start, tensor_count, whole)
            lease = self._lease((record,), None, tensor_start, tensor_count, owner)
            return BlocksGrant(
                lease_id=lease.lease_id,
                segment_name=record.block.segment.name,
                segment_nbytes=record.block.segment.nbytes,
                tensor_offsets=tuple(
                    record.tensor_offset(t) for t in range(tensor_start, tensor_start + tensor_count)
                ),
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
                segment = record.block.segment
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

    def release(self, lease_id: int, *, ok: bool, owner: object) -> None:
        """End a lease; after a successful pull, consume the key's pulled tensors (§9.4)."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.owner is not owner:
                raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"unknown lease {lease_id}")
            del self._leases[lease_id]
            if ok and lease.consume_key is not None:
                key_record = self._keys.get(lease.consume_key)
                if key_record is not None and key_record.cache_id in lease.cache_ids:
                    key_record.unpulled.difference_update(
                        range(lease.tensor_start, lease.tensor_start + lease.tensor_count)
                    )
                    if not key_record.unpulled:
                        self._unbind(lease.consume_key)
            self._unlease(lease)

    def holds_leases(self, owner: object) -> bool:
        with self._lock:
            return any(lease.owner is owner for lease in self._leases.values())

    def drop_owner(self, owner: object) -> int:
        """Release every lease a (dead or departed) connection held, consuming nothing."""
        with self._lock:
            dropped = [lease for lease in self._leases.values() if lease.owner is owner]
            for lease in dropped:
                del self._leases[lease.lease_id]
                self._unlease(lease)
            return len(dropped)

    # ----------------------------------------------------------------- introspection and teardown

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "caches": len(self._caches),
                "keys": len(self._keys),
                "leases": len(self._leases),
                "pool_used_nbytes": self._pool.used_nbytes,
            }

    def close(self) -> None:
        """Forget everything and give the pool's segments back (unlinked)."""
        with self._lock:
            self._caches.clear()
            self._keys.clear()
            self._slot_req_key.clear()
            self._blocks_keys.clear()
            self._leases.clear()
            self._pool.close()

    # ----------------------------------------------------------------- helpers (lock held)

    def _lease(
        self,
        records: tuple[CacheRecord, ...],
        consume_key: KeyId | None,
        tensor_start: int,
        tensor_count: int,
        owner: object,
    ) -> Lease:
        lease = Lease(
            lease_id=self._next_lease_id,
            cache_ids=tuple(record.cache_id for record in records),
            consume_key=consume_key,
            tensor_start=tensor_start,
            tensor_count=tensor_count,
            owner=owner,
        )
        self._next_lease_id += 1
        self._leases[lease.lease_id] = lease
        for record in records:
            record.leases += 1
        return lease

    def _unlease(self, lease: Lease) -> None:
        for cache_id in lease.cache_ids:
            record = self._caches[cache_id]
            record.leases -= 1
            self._maybe_free(record)

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
        self._pool.free(record.block)


def _key_text(key: KeyId) -> str:
    kind, key_id, model_id = key
    name = {KEY_REQ: "req_id", KEY_PREFIX: "prefix_id"}.get(kind, "id")
    return f"({name}={key_id}, model_id={model_id})"


def _record_holding(records: list[CacheRecord], addr: int, nbytes: int) -> CacheRecord | None:
    """The cache one of whose tensors contains [addr, addr + nbytes), if any."""
    for record in records:
        base = record.block.address
        offset = addr - base
        if offset < 0 or offset >= record.pitch_nbytes * record.num_tensors:
            continue
        within = offset % record.pitch_nbytes
        return record if nbytes > 0 and within + nbytes <= record.tensor_nbytes else None
    return None

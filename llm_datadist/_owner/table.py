"""The per-process cache table: caches carved from the shared-memory pools or registered over the user's
memory, and the keys bound to their batch slots.

Rules: every method takes the table's lock (re-entrant), then the index lock once, first (through the
mirror), so the server thread and user threads may call it at once and an operation is done whole or not
at all. A cache's memory returns to the pool only when nothing references it any more: not the user
(external reference, dropped by `deallocate`), not a key, not a lease (a peer mid-copy, `leases.Leases`)
and not a local pin (a pull writing into it); one a puller's row still pins is freed when that row lets
go. Cache ids count from 1 and are never reused. The index is the truth for what pullers did (consumed
keys, pins): the table applies what the mirror drains from it at the start of every operation that
depends on it, and at housekeeping (`sync`, twice a second on the server thread).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator

from llm_datadist._library import SharedSpan
from llm_datadist._shm.errors import OutOfPoolMemory, ShmError
from llm_datadist._shm.generations import GenerationTable
from llm_datadist._shm.pool import Pool

from .._errors import IndexBusy, StatusError
from .._keys import KEY_REQ, KeyId, key_text
from ..status import LLMStatusCode
from ..utils.log import log
from .mirror import INDEX_LOCK_TIMEOUT_S, SERVER_LOCK_TIMEOUT_S, IndexMirror
from .records import TENSOR_ALIGN_NBYTES, CacheRecord, KeyRecord, align_up


class Changes:
    """The ends of references to a table's caches (a lease, a local pin), for those who wait for one: each
    waits under the table's lock (`wait`) and re-checks what it waits for. An end nobody waits for costs a
    counter's look (`notify`): a pull's end is on the serving path. A local pin of a cache its user holds
    ends without the lock (`LocalPins.unpin`) unless someone `watches`: who waits for such an end watches
    from before its first look."""

    def __init__(self, lock: threading.RLock) -> None:
        self._condition = threading.Condition(lock)
        self._waiting = 0  # threads in `wait` (under the lock)
        self.watchers = 0  # threads inside `watching` (changed under the lock, read without it)

    def wait(self, timeout_s: float) -> None:
        """Wait (holding the lock) until a reference ends or `timeout_s` passed."""
        self._waiting += 1
        try:
            self._condition.wait(timeout_s)
        finally:
            self._waiting -= 1

    @contextlib.contextmanager
    def watching(self) -> Iterator[None]:
        """Around a loop that looks for local pins' ends and `wait`s (holding the lock): every pin that ends
        meanwhile takes the lock and notifies, so that none ends between a look and the wait unseen."""
        self.watchers += 1
        try:
            yield
        finally:
            self.watchers -= 1

    def notify(self) -> None:
        """A reference ended (the caller holds the lock): wake who waits, if anyone does."""
        if self._waiting:
            self._condition.notify_all()


class CacheTable:
    """Caches and keys of one process, backed by its pools and published through one `IndexMirror`."""

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
        # Told how many keys were published ("published"), removed by the user ("removed") or consumed by
        # pulls ("consumed"): the instance's stats.
        self.on_keys: Callable[[str, int], None] | None = None
        self.generations = GenerationTable()  # what one-sided readers check (see shm.generations)
        self._oom_code = oom_code
        # Re-entrant: a KvCache finaliser run by the garbage collector may deallocate from inside a call.
        self.lock = threading.RLock()
        # Told whenever a reference ends (a lease, a local pin): who waits for one re-checks.
        self.changed = Changes(self.lock)
        self._next_cache_id = 1
        self.caches: dict[int, CacheRecord] = {}
        self.keys: dict[KeyId, KeyRecord] = {}
        self._slot_req_key: dict[tuple[int, int], KeyId] = {}
        # BlocksCacheKey index: model_id -> cache_id; registering a newer blocks cache with the same model_id
        # points the index at it (reference §6.4). Blocks keys are never consumed and hold no reference.
        self.blocks_keys: dict[int, int] = {}
        self._pending: dict[int, CacheRecord] = {}  # cache_id -> a record whose free waits for a row
        self.mirror = IndexMirror(
            incarnation=incarnation, generations=self.generations.name, lock_timeout_s=lock_timeout_s
        )
        self.index = self.mirror.index

    # ----------------------------------------------------------------- housekeeping

    def sync(self) -> None:
        """The server thread's housekeeping: what waited for the index lock, orphaned rows whose holder let
        go, what pullers did in the index, and every few times a look for stray writes into it (repaired
        at once). Skipped, to the next time, while the lock is held elsewhere."""
        with self.lock:
            try:
                with self.mirror.locked(SERVER_LOCK_TIMEOUT_S):
                    if self.mirror.rows.sweep():
                        self.mirror.look_again()  # what those pins consumed or kept is looked at now
                    self.catch_up()
                    if self.mirror.audit():
                        self.catch_up()
            except IndexBusy:
                return

    def catch_up(self) -> None:
        """Apply what pullers did in the index (both locks held): unbind the keys they consumed (once no
        row still refers to them) and free the caches whose rows let go."""
        consumed = self.mirror.drain()
        if consumed is None:
            return
        # A lease in flight that reserved a key's tensors, or will credit it, keeps it bound until it ends.
        consumed = [key for key in consumed if (bound := self.keys.get(key)) is not None and not bound.leases]
        for key in consumed:
            self.unbind(key)
        if consumed and self.on_keys is not None:
            self.on_keys("consumed", len(consumed))
        for record in list(self._pending.values()):
            self.maybe_free(record)

    def key_settled(self, key_record: KeyRecord) -> None:
        """A transfer that reserved or pulled tensors of `key_record` ended (both locks held): a key that
        is still bound, claimed whole and held by no other transfer was pulled whole, and is consumed."""
        if key_record.leases or self.keys.get(key_record.key) is not key_record:
            return
        if not self.mirror.claimed(key_record):
            return
        if key_record.name >= 0:
            self.mirror.look_again()  # unbound by `catch_up` once no row refers to it either
            self.catch_up()
            return
        self.unbind(key_record.key)
        if self.on_keys is not None:
            self.on_keys("consumed", 1)

    # ----------------------------------------------------------------- allocate, register, bind

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
        bindings = _bindings(num_tensors, tensor_nbytes, batch_size, keys, unique_keys)
        pitch = align_up(tensor_nbytes, TENSOR_ALIGN_NBYTES)
        with self.lock, self.mirror.locked():
            self.catch_up()
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
        shared: SharedSpan | None = None,
    ) -> CacheRecord:
        """Record a cache over memory the user owns at `addrs` (one per tensor; `shared`: where in the
        library's memory) with its keys. Keys never consumed by pulls; overlapping another is refused."""
        bindings = _bindings(num_tensors, tensor_nbytes, batch_size, keys, True)
        if len(addrs) != num_tensors:
            raise StatusError(
                LLMStatusCode.LLM_PARAM_INVALID, f"{len(addrs)} addresses for {num_tensors} tensors"
            )
        with self.lock, self.mirror.locked():
            self.catch_up()
            self._check_unbound(bindings)
            spans = [(addr, addr + tensor_nbytes) for addr in addrs]
            for record in self.caches.values():
                spans.extend((addr, addr + record.tensor_nbytes) for addr in record.addrs)  # registered ones
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
                shared=shared,
            )
            return self._add(record, bindings, blocks_model_id)

    def _acquire_generation(self) -> tuple[int, int]:
        try:
            return self.generations.acquire()
        except ShmError as exc:
            raise StatusError(self._oom_code, str(exc)) from exc

    def _check_unbound(self, bindings: dict[KeyId, int]) -> None:
        for key in bindings:
            if key in self.keys:
                raise StatusError(
                    LLMStatusCode.LLM_PARAM_INVALID, f"cache key {key_text(key)} is already bound"
                )

    def _add(
        self, record: CacheRecord, bindings: dict[KeyId, int], blocks_model_id: int | None
    ) -> CacheRecord:
        self._next_cache_id += 1
        self.caches[record.cache_id] = record
        self.mirror.publish_cache(record)
        for key, slot in bindings.items():
            self.bind(key, record, slot, set(range(record.num_tensors)))
        if blocks_model_id is not None:
            self._bind_blocks_key(blocks_model_id, record.cache_id)
        return record

    def bind(self, key: KeyId, record: CacheRecord, slot: int, unpulled: set[int]) -> None:
        """Bind `key` to `record`'s batch slot `slot`, its tensors `unpulled` not pulled yet (both locks)."""
        key_record = KeyRecord(key, record.cache_id, slot, unpulled)
        self.keys[key] = key_record
        record.keys.add(key)
        if key[0] == KEY_REQ:
            self._slot_req_key[(record.cache_id, slot)] = key
        self.mirror.publish_key(key_record, record)
        if self.on_keys is not None:
            self.on_keys("published", 1)

    def slot_req_key(self, cache_id: int, slot: int) -> KeyId | None:
        """The req key bound to this slot, if any."""
        return self._slot_req_key.get((cache_id, slot))

    def bind_blocks_key(self, model_id: int, cache_id: int) -> None:
        with self.lock, self.mirror.locked():
            self._bind_blocks_key(model_id, cache_id)

    def _bind_blocks_key(self, model_id: int, cache_id: int) -> None:
        if model_id in self.blocks_keys:
            # Peers' copies of the table name the old cache under this model id: make them refetch.
            self.generations.bump_version()
        self.blocks_keys[model_id] = cache_id
        self.mirror.publish_blocks_key(model_id, self.caches.get(cache_id))

    def _drop_blocks_keys(self, cache_id: int) -> None:
        for model_id in [m for m, c in self.blocks_keys.items() if c == cache_id]:
            del self.blocks_keys[model_id]
            self.mirror.drop_blocks_key(model_id)

    # ----------------------------------------------------------------- unregister, deallocate, unbind

    def unregister(self, cache_id: int, *, timeout_s: float) -> bool:
        """Forget a registered cache and its keys; False if `cache_id` is not a registered cache.

        The caller may reuse the memory as soon as this returns, so every transfer that touches the cache
        must end first: a peer's (a lease, or a pin in the index, whether or not its connection still
        exists) and this process's own (a local pin: a pull writing into it, a push or an engine's transfer
        reading it). This waits for them up to `timeout_s`, then raises StatusError(LLM_TIMEOUT) and leaves
        the cache registered. New pins cannot start meanwhile: the keys go first (and stay gone), and local
        pins need `external`.
        """
        deadline = time.monotonic() + timeout_s
        with self.lock:
            record = self.caches.get(cache_id)
            if record is None or not record.registered:
                return False
            with self.mirror.locked():
                self.catch_up()
                for key in list(record.keys):
                    self.unbind(key)
                self._drop_blocks_keys(cache_id)
                # Refuse new leases and pins by id while waiting (resolve checks `external`; the index's
                # name by id goes), then wait out the old ones.
                record.external = False
                self.mirror.hide(record)
                self.mirror.set_flags(record)
            while True:
                remaining = deadline - time.monotonic()
                try:
                    # A lease's or a local pin's end is signalled; an index pin's end is not (the puller
                    # writes only the index): look again every few milliseconds.
                    with self.mirror.locked(min(max(remaining, 0.0), SERVER_LOCK_TIMEOUT_S)):
                        if record.leases <= 0 and record.pins <= 0 and not self.mirror.pinned(record):
                            self._forget_registered(record)
                            return True
                except IndexBusy:
                    pass  # not known to be free: wait on
                if remaining <= 0:
                    # The cache is the user's again, reachable by id (once the lock can be had).
                    record.external = True
                    self.mirror.now_or_later(lambda: self.mirror.show(record))
                    whose = "a transfer of this process" if record.pins > 0 else "a peer's transfer"
                    raise StatusError(
                        LLMStatusCode.LLM_TIMEOUT,
                        f"cache {cache_id} is still in use by {whose}; its keys were removed",
                    )
                self.changed.wait(min(remaining, 0.005))

    def _forget_registered(self, record: CacheRecord) -> None:
        if self.caches.get(record.cache_id) is record:
            self.mirror.withdraw(record)
            del self.caches[record.cache_id]
            self.generations.retire(record.gen_slot)
        if self.on_unregistered is not None:
            self.on_unregistered(record)  # before the user may reuse the memory

    def deallocate(self, cache_id: int) -> None:
        """Drop the user's reference; the memory goes back once no key, lease or pin remains. All or
        nothing: IndexBusy (LLM_TIMEOUT) leaves the cache as it was, to be deallocated again."""
        with self.lock, self.mirror.locked():
            self._deallocate(cache_id)

    def deallocate_later(self, cache_id: int) -> None:
        """`deallocate` from a finalizer, which may neither wait nor fail, and may run inside any call of
        this thread (the garbage collector runs it where it likes): done first thing in the next operation
        that takes the index lock, or at the next housekeeping."""
        self.mirror.defer(lambda: self._deallocate(cache_id))

    def _deallocate(self, cache_id: int) -> None:
        record = self.caches.get(cache_id)
        if record is None or not record.external:
            return
        record.external = False
        self._drop_blocks_keys(cache_id)
        self.mirror.set_flags(record)
        self.maybe_free(record)

    def remove_key(self, key: KeyId) -> None:
        with self.lock, self.mirror.locked():
            self.catch_up()
            if key in self.keys and self.on_keys is not None:
                self.on_keys("removed", 1)
            self.unbind(key)

    def unbind(self, key: KeyId) -> None:
        key_record = self.keys.pop(key, None)
        if key_record is None:
            return
        if key[0] == KEY_REQ:
            self._slot_req_key.pop((key_record.cache_id, key_record.slot), None)
        self.mirror.unpublish_key(key_record)
        record = self.caches[key_record.cache_id]
        record.keys.discard(key)
        self.maybe_free(record)

    def maybe_free(self, record: CacheRecord) -> None:
        """Free a cache nothing references any more (both locks held); one a row still pins is pending
        until that row lets go."""
        if record.referenced or self.caches.get(record.cache_id) is not record:
            return
        if record.published:
            # No new pin may start (its last name goes first); one already taken keeps the memory.
            self.mirror.hide(record)
            if self.mirror.pinned(record):
                if not record.pending:
                    record.pending = True
                    self.mirror.set_flags(record)
                    self._pending[record.cache_id] = record
                return
            self._pending.pop(record.cache_id, None)
            self.mirror.withdraw(record)
        del self.caches[record.cache_id]
        # Retire the generation before the memory can be handed out again: readers check it after copying.
        self.generations.retire(record.gen_slot)
        if record.block is not None:
            self._pools[record.placement].free(record.block)

    # ----------------------------------------------------------------- lookups

    def get(self, cache_id: int) -> CacheRecord | None:
        with self.lock:
            return self.caches.get(cache_id)

    def bound(self, key: KeyId) -> CacheRecord | None:
        """The cache `key` is bound to now (what pullers consumed is caught up with first), or None."""
        with self.lock, self.mirror.locked():
            self.catch_up()
            key_record = self.keys.get(key)
            return self.caches[key_record.cache_id] if key_record is not None else None

    def pools(self) -> list[Pool]:
        return list(self._pools.values())

    def close(self) -> None:
        """Forget everything and give the pool's segments back (unlinked). Rows that still pin are taken
        back first, so that their holders' unpins fail (`wait_for_pins` gives them their chance)."""
        with self.lock:
            try:
                with self.mirror.locked(SERVER_LOCK_TIMEOUT_S):
                    revoked = self.mirror.rows.revoke_all()
                if revoked:
                    log.warning("closing with %d pins of peers still held: their transfers fail", revoked)
            except IndexBusy:
                log.warning("closing while the index lock is held elsewhere: its rows stay as they are")
            self.caches.clear()
            self.keys.clear()
            self._slot_req_key.clear()
            self.blocks_keys.clear()
            self.changed.notify()
            self._pending.clear()
            for pool in self._pools.values():
                pool.close()
            self.generations.close()
            self.mirror.close()


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
            raise StatusError(LLMStatusCode.LLM_PARAM_INVALID, f"cache key {key_text(key)} given twice")
        # v1: the same key twice in one call, the last slot wins.
        bindings[key] = slot
    return bindings

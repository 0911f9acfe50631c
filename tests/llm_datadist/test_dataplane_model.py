"""A model-based test of the published index's protocol: an owner's cache table and two pullers that pin,
check, unpin and disconnect through their own open file descriptions of the owner's index, in any order
hypothesis finds, against a model of what the reference semantics promise. The owner also ends
connections from its side while their pullers still pin (a live holder's pin outlives its connection; a
dead holder's is cleared), and another process stops while it holds the index lock (the owner's calls then
change nothing and fail with LLM_TIMEOUT, what ends meanwhile is done once the lock is back).

Everything here is the shipped code (the cache table, the index, `_puller.dataplane.pin` / `unpin`) in one
process: the pullers' links are stood in for by their rows and tickets, which is all pinning uses of a
link. What the model checks after every step: a pinned cache's bytes are still the ones it was filled
with (its memory was neither freed nor reused), a key is consumed once pulls that ended well copied all
of it (whoever reserved its tensors), a failed or abandoned pull gives back what it reserved but for what
others pulled meanwhile, a key stays bound while a pull that names it is in flight, and the owner's
counters (caches, keys, pins, pool bytes) match.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llm_datadist._errors import StatusError
from llm_datadist._keys import KEY_CACHE_ID, KEY_PREFIX, KEY_REQ
from llm_datadist._owner.leases import Leases
from llm_datadist._owner.rows import Holder
from llm_datadist._owner.table import CacheTable
from llm_datadist._puller.dataplane import pin, unpin
from llm_datadist._puller.fresh import DONE as FRESH_DONE
from llm_datadist._puller.fresh import PINNED as FRESH_PINNED
from llm_datadist._puller.fresh import STALE as FRESH_STALE
from llm_datadist._puller.fresh import pack_plan, segment_table
from llm_datadist._puller.source import V2, SourceRef
from llm_datadist._shm.index import Index
from llm_datadist._shm.indexkernel import kernel as _kernel
from llm_datadist._shm.pool import Pool
from llm_datadist._wire.peer import PeerInfo
from llm_datadist.status import LLMStatusCode

NUM_TENSORS = 2
BATCH = 2
TENSOR_NBYTES = 2 * 96  # two slots of 96 bytes
SLOT_NBYTES = TENSOR_NBYTES // BATCH
KEYS = [(KEY_REQ, 1), (KEY_REQ, 2), (KEY_PREFIX, 3)]


@dataclass
class _Row:
    """A puller's link as pinning sees it (see `_puller.dataplane.RowHolder`)."""

    index_row: int
    index_ticket: int
    info: PeerInfo = field(default_factory=lambda: PeerInfo(9, 2, os.getpid(), 1))
    broken: str | None = None

    def fail(self, reason: str) -> None:
        self.broken = reason

    def check_peer_alive(self) -> None:
        return None


@dataclass
class _Puller:
    conn: object
    link: _Row
    index: Index
    pinned: tuple[int, int, tuple[int, ...]] | None = None  # cache id, slot, tensors it pinned
    # The req key the pin names (its pull consumes), what it reserved of it and the tensors it pulls.
    consumed: tuple[tuple[int, int], frozenset[int], frozenset[int]] | None = None
    alive: bool = True  # the process the row was handed to lives (its pins outlive its connection)
    dropped: bool = False  # the owner ended its connection; it may still unpin, then it reconnects
    fresh: bytes | None = None  # the kernel's plan of the pin held now, if the kernel took it


@dataclass
class _MCache:
    cache_id: int
    fill: int
    external: bool = True
    keys: set[tuple[int, int]] = field(default_factory=set)


class IndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = CacheTable(
            {1: Pool(capacity_nbytes=1 << 20)},
            oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY,
            lock_timeout_s=0.01,
        )
        self.leases = Leases(self.table)
        self.pullers: list[_Puller] = []
        self.stalled: Index | None = None  # another process's description of the index, holding its lock
        self.connections = 0
        for i in range(2):
            self.pullers.append(self._connect(i))
        self.caches: dict[int, _MCache] = {}
        self.pushing = 0  # transfer_cache_async jobs into the pullers' cluster (9) running
        # key -> cache, slot, unclaimed tensors (neither reserved nor pulled), pulled tensors
        self.keys: dict[tuple[int, int], tuple[int, int, set[int], set[int]]] = {}
        self.fills = 0

    def _connect(self, i: int) -> _Puller:
        conn = object()
        # Every other connection's process is "dead" by the time it ends (a start time that is not ours).
        self.connections += 1
        alive = self.connections % 2 == 0
        holder = Holder.of(os.getpid()) if alive else Holder(os.getpid(), -2)
        row, ticket = self.leases.assign_row(conn, 100 + i, holder)
        assert row >= 0
        index = Index.attach(self.table.index.name, pid=os.getpid(), incarnation=0)
        return _Puller(conn, _Row(row, ticket), index, alive=alive)

    # ------------------------------------------------------------------ owner

    @precondition(lambda self: self.stalled is None)
    @rule(slot_keys=st.lists(st.sampled_from([None, *KEYS]), min_size=0, max_size=BATCH))
    def alloc(self, slot_keys: list[tuple[int, int] | None]) -> None:
        wire = [None if k is None else (k[0], k[1], 0) for k in slot_keys]
        bound = [k for k in slot_keys if k is not None and k in self.keys]
        duplicate = len([k for k in slot_keys if k is not None]) != len(
            {k for k in slot_keys if k is not None}
        )
        try:
            record = self.table.allocate(
                num_tensors=NUM_TENSORS, tensor_nbytes=TENSOR_NBYTES, batch_size=BATCH, keys=wire
            )
        except StatusError as exc:
            assert bound, f"allocate refused: {exc}"
            assert exc.code == LLMStatusCode.LLM_PARAM_INVALID
            return
        assert not bound, f"allocate bound {bound} twice"
        self.fills += 1
        fill = self.fills
        block = record.pool_block
        block.segment.array[block.offset : block.offset + record.pitch_nbytes * NUM_TENSORS] = fill % 251
        cache = _MCache(record.cache_id, fill % 251)
        self.caches[record.cache_id] = cache
        for slot, key in enumerate(slot_keys):
            if key is None:
                continue
            if duplicate:  # v1: the last slot wins
                slot = max(i for i, k in enumerate(slot_keys) if k == key)
            self.keys[key] = (record.cache_id, slot, set(range(NUM_TENSORS)), set())
            cache.keys.add(key)

    @precondition(lambda self: self.caches)
    @rule(pick=st.integers(0, 2**16))
    def dealloc(self, pick: int) -> None:
        cache = self.caches[sorted(self.caches)[pick % len(self.caches)]]
        if self.stalled is not None:
            self._refused(lambda: self.table.deallocate(cache.cache_id))
            return
        self.table.deallocate(cache.cache_id)
        cache.external = False
        self._maybe_gone(cache)

    @precondition(lambda self: self.keys)
    @rule(pick=st.integers(0, 2**16))
    def remove_key(self, pick: int) -> None:
        key = sorted(self.keys)[pick % len(self.keys)]
        if self.stalled is not None:
            self._refused(lambda: self.table.remove_key((key[0], key[1], 0)))
            return
        self.table.remove_key((key[0], key[1], 0))
        self._unbind(key)

    @precondition(lambda self: self.stalled is None)
    @rule()
    def push_starts(self) -> None:
        """transfer_cache_async into the pullers' cluster: refused while one of them pins (a pull is in
        flight); once started, their pulls get LLM_LINK_BUSY until it ends."""
        busy = self.leases.start_push({9}, lambda cluster_id: [p.conn for p in self.pullers if not p.dropped])
        # A pin whose connection the owner ended belongs to no link of that cluster any more.
        if any(p.pinned is not None and not p.dropped for p in self.pullers):
            assert busy == 9
        else:
            assert busy is None
            self.pushing += 1

    @precondition(lambda self: self.pushing and self.stalled is None)
    @rule()
    def push_ends(self) -> None:
        self.leases.end_push({9})
        self.pushing -= 1

    @precondition(lambda self: self.stalled is None)
    @rule(p=st.integers(0, 1), pick=st.integers(0, 2**16))
    def write_pin(self, p: int, pick: int) -> None:
        """A v2 push into a cache by id pins it for writing: only a cache its user still holds."""
        puller = self.pullers[p]
        if puller.pinned is not None or puller.dropped:
            return
        cache_ids = [*sorted(self.caches), 99]
        cache_id = cache_ids[pick % len(cache_ids)]
        cache = self.caches.get(cache_id)
        request = SourceRef(KEY_CACHE_ID, cache_id, 0, 0, 0, NUM_TENSORS, True, for_write=True, rules=V2)
        try:
            pinned = pin(
                puller.link,
                puller.index,
                request,
                cluster_id=9,
                deadline=1e18,
                timeout_code=LLMStatusCode.LLM_TIMEOUT,
            )
        except StatusError as exc:
            assert cache is None or not cache.external, f"write pin of a held cache refused: {exc}"
            assert exc.code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, exc
            return
        assert cache is not None and cache.external, "pinned for writing what its user let go"
        assert pinned is not None and pinned.cache.cache_id == cache_id
        puller.pinned = (cache_id, 0, tuple(range(NUM_TENSORS)))

    # ------------------------------------------------------------------ pullers

    @precondition(lambda self: self.stalled is None)
    @rule(
        p=st.integers(0, 1),
        pick=st.integers(0, 2**16),
        by_id=st.booleans(),
        layer=st.sampled_from([None, 0, 1]),
        consume=st.booleans(),
    )
    def pull_pin(self, p: int, pick: int, by_id: bool, layer: int | None, consume: bool) -> None:
        """A pull pins what it names (`_pull`)."""
        tensors = (0, NUM_TENSORS) if layer is None else (layer, 1)
        if by_id:
            cache_id = [*sorted(self.caches), 99][pick % (len(self.caches) + 1)]
            request = SourceRef(
                KEY_CACHE_ID, cache_id, 0, pick % BATCH, *tensors, layer is None, 1, 0, consume
            )
        else:
            key = [*KEYS, (KEY_REQ, 77)][pick % (len(KEYS) + 1)]
            request = SourceRef(key[0], key[1], 0, 0, *tensors, layer is None, 1, 0, consume)
        self._pull(self.pullers[p], request)

    def _pull(self, puller: _Puller, request: SourceRef) -> None:
        """Pin the full way."""
        if puller.pinned is not None or puller.dropped:
            return
        tensors = tuple(range(request.tensor_start, request.tensor_start + request.tensor_count))
        cache_id, slot, consume = request.key_id, request.batch_index, request.consume
        if request.key_kind == KEY_CACHE_ID:
            key = next(
                (k for k, (c, s, *_) in self.keys.items() if c == cache_id and s == slot and k[0] == KEY_REQ),
                None,
            )
            # By id, a cache is found while its user holds it or a key names it (not once only a pin does).
            live = cache_id in self.caches and (
                self.caches[cache_id].external or bool(self.caches[cache_id].keys)
            )
        else:
            key = (request.key_kind, request.key_id)
            # A req key whose every tensor is reserved or pulled is found by no pull (it may stay bound).
            live = key in self.keys and not (key[0] == KEY_REQ and not self.keys[key][2])
            if live:
                cache_id, slot, *_ = self.keys[key]
        try:
            pinned = pin(
                puller.link,
                puller.index,
                request,
                cluster_id=9,
                deadline=1e18,
                timeout_code=LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT,
            )
        except StatusError as exc:
            if self.pushing:
                assert exc.code == LLMStatusCode.LLM_LINK_BUSY, exc
                return
            assert not live, f"pin of a live {request} refused: {exc}"
            assert exc.code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, exc
            return
        assert not self.pushing, "a pull pinned during a push into its cluster"
        assert live, "pinned what is gone"
        assert pinned is not None
        assert pinned.cache.cache_id == cache_id and pinned.batch_slot == slot
        puller.pinned = (cache_id, slot, tensors)
        if consume and key is not None and key[0] == KEY_REQ and key in self.keys:
            bound_cache, bound_slot, unclaimed, _ = self.keys[key]
            if (bound_cache, bound_slot) == (cache_id, slot):
                taken = frozenset(unclaimed & set(tensors))
                unclaimed -= taken
                puller.consumed = (key, taken, frozenset(tensors))

    @precondition(lambda self: any(p.pinned for p in self.pullers))
    @rule(p=st.integers(0, 1))
    def pinned_bytes_are_intact(self, p: int) -> None:
        puller = self.pullers[p]
        if puller.pinned is None:
            return
        cache_id, slot, tensors = puller.pinned
        record = self.table.get(cache_id)
        assert record is not None, f"cache {cache_id} left the table under a pin"
        block = record.pool_block
        for t in tensors:
            start = record.tensor_offset(t) + slot * SLOT_NBYTES
            got = block.segment.array[start : start + SLOT_NBYTES]
            assert np.all(got == self.caches[cache_id].fill), f"cache {cache_id} was reused under a pin"

    @precondition(lambda self: self.stalled is None)
    @rule(p=st.integers(0, 1), ok=st.booleans())
    def pull_unpin(self, p: int, ok: bool) -> None:
        puller = self.pullers[p]
        if puller.pinned is None:
            return
        unpin(puller.link, puller.index, ok=ok)
        self._ended(puller, ok)
        if puller.dropped:  # its connection is gone: it links again for its next pull
            self.table.sync()  # housekeeping frees the orphaned row its holder let go of
            puller.index.close()
            self.pullers[p] = self._connect(p)

    @precondition(lambda self: self.stalled is None)
    @rule(p=st.integers(0, 1))
    def puller_disconnects(self, p: int) -> None:
        """The connection ends with its process (the puller died): the owner clears its row, giving back
        what its pin consumed."""
        puller = self.pullers[p]
        if puller.dropped or puller.alive:
            return
        self.leases.connection_ended(puller.conn)
        puller.index.close()
        self._ended(puller, False)
        self.pullers[p] = self._connect(p)

    @rule(p=st.integers(0, 1))
    def owner_drops(self, p: int) -> None:
        """The owner ends a connection (an unlink from the serving side, a drop, its finalize) while the
        puller may pin: a live holder's pin stays until it unpins; a dead holder's is cleared. During a
        stall the end waits for the lock and is done once it is back."""
        puller = self.pullers[p]
        if puller.dropped:
            return
        self.leases.connection_ended(puller.conn)
        if puller.alive and puller.pinned is not None:
            puller.dropped = True
            return
        self.ended_in_stall = getattr(self, "ended_in_stall", 0) + (self.stalled is not None)
        puller.index.close()
        self._ended(puller, False)
        self.pullers[p] = self._connect(p) if self.stalled is None else self._connect_later(p)

    def _connect_later(self, p: int) -> _Puller:
        """During a stall no row can be assigned: a puller with no connection yet (it pins nothing)."""
        puller = _Puller(object(), _Row(-1, 0), self.pullers[p].index, dropped=True)
        puller.index = Index.attach(self.table.index.name, pid=os.getpid(), incarnation=0)
        return puller

    @precondition(lambda self: self.stalled is None)
    @rule()
    def lock_holder_stops(self) -> None:
        self.stalled = Index.attach(self.table.index.name, pid=os.getpid(), incarnation=0)
        self.stalled.lock(1.0)

    @precondition(lambda self: self.stalled is not None)
    @rule()
    def lock_holder_dies(self) -> None:
        """The kernel drops a dead holder's lock; the owner's housekeeping does what waited for it."""
        assert self.stalled is not None
        self.stalled.close()
        self.stalled = None
        self.table.sync()
        for p, puller in enumerate(self.pullers):
            if puller.link.index_row < 0:  # it could not connect during the stall
                puller.index.close()
                self.pullers[p] = self._connect(p)

    def _refused(self, call: object) -> None:
        """An owner's call during a stall: LLM_TIMEOUT, and nothing changed (the model stays)."""
        try:
            call()  # type: ignore[operator]
        except StatusError as exc:
            assert exc.code == LLMStatusCode.LLM_TIMEOUT, exc
            return
        raise AssertionError("an owner's call succeeded without the index lock")

    def _ended(self, puller: _Puller, ok: bool) -> None:
        named = puller.consumed
        cache_id, slot = puller.pinned[:2] if puller.pinned else (None, None)
        puller.pinned = None
        puller.consumed = None
        puller.fresh = None
        if named is not None and self.keys.get(named[0], (None, None))[:2] == (cache_id, slot):
            key, taken, tensors = named
            _, _, unclaimed, pulled = self.keys[key]
            if ok:  # what it copied counts, whoever reserved it
                pulled |= tensors
                unclaimed -= tensors
            else:  # what it reserved goes back, but for what others copied meanwhile
                unclaimed |= taken - pulled
            # Consumed once nothing is unclaimed, and unbound once no pull in flight names it.
            if not unclaimed and not self._consumed_and_pinned(key):
                assert pulled == set(range(NUM_TENSORS)), f"key {key} unbound with {pulled} pulled"
                self._unbind(key)
        if cache_id in self.caches:
            self._maybe_gone(self.caches[cache_id])

    # ------------------------------------------------------------------ the model's bookkeeping

    def _unbind(self, key: tuple[int, int]) -> None:
        binding = self.keys.pop(key, None)
        if binding is None:
            return
        cache = self.caches[binding[0]]
        cache.keys.discard(key)
        self._maybe_gone(cache)

    def _pinned(self, cache_id: int) -> bool:
        return any(p.pinned is not None and p.pinned[0] == cache_id for p in self.pullers)

    def _consumed_and_pinned(self, key: tuple[int, int]) -> bool:
        """A pull in flight names the key (its row keeps the owner from unbinding it)."""
        return any(p.consumed is not None and p.consumed[0] == key for p in self.pullers)

    def _maybe_gone(self, cache: _MCache) -> None:
        if not cache.external and not cache.keys and not self._pinned(cache.cache_id):
            del self.caches[cache.cache_id]

    @invariant()
    def owner_counters_match_the_model(self) -> None:
        if self.stalled is not None:
            return  # the owner cannot look now; it catches up when the lock is back
        stats = self.leases.stats()
        pins = sum(p.pinned is not None for p in self.pullers)
        # A key a pin emptied stays bound at the owner until that pin ends.
        keys = len(self.keys)
        assert stats["keys"] == keys, (stats, self.keys)
        assert stats["caches"] == len(self.caches), (stats, sorted(self.caches))
        assert stats["pins"] == pins and stats["leases"] == 0
        assert (stats["pool_used_nbytes"] == 0) == (not self.caches)

    def teardown(self) -> None:
        if self.stalled is not None:
            self.stalled.close()
        for _ in range(self.pushing):
            self.leases.end_push({9})
        for puller in self.pullers:
            puller.index.close()
        self.table.close()


IndexMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_index_protocol = IndexMachine.TestCase


class FreshMachine(IndexMachine):
    """The same machine with pulls of keys looked up afresh by the C kernel (`_puller.fresh`): one hold of the
    index lock that checks, copies and consumes; or a pin through the row like the full way's, with the
    copy and the kernel's unpin in the same call, or the unpin later. Each takes what the full way would,
    or nothing (then the caller pins the full way), and what it consumes follows the same rules: the
    model's checks hold over every path mixed."""

    @precondition(lambda self: self.stalled is None and _kernel is not None)
    @rule(
        p=st.integers(0, 1),
        pick=st.integers(0, 2**16),
        layer=st.sampled_from([None, 0, 1]),
        consume=st.booleans(),
        how=st.sampled_from(["hold", "pin", "pin and copy"]),
        by_id=st.booleans(),
    )
    def fresh_pull(self, p: int, pick: int, layer: int | None, consume: bool, how: str, by_id: bool) -> None:
        puller = self.pullers[p]
        if puller.pinned is not None or puller.dropped:
            return
        tensors = (0, NUM_TENSORS) if layer is None else (layer, 1)
        wanted = set(range(tensors[0], tensors[0] + tensors[1]))
        key: tuple[int, int] | None
        if by_id:
            cache_id, slot = [*sorted(self.caches), 99][pick % (len(self.caches) + 1)], pick // 7 % BATCH
            request = SourceRef(
                KEY_CACHE_ID, cache_id, 0, slot, *tensors, layer is None, SLOT_NBYTES, 0, consume
            )
            # The slot's req key is what the pull consumes.
            key = next(
                (k for k, (c, s, *_) in self.keys.items() if (c, s) == (cache_id, slot) and k[0] == KEY_REQ),
                None,
            )
            cache = self.caches.get(cache_id)
            live = cache is not None and (cache.external or bool(cache.keys))
            consumes = consume and key is not None
        else:
            bound = sorted(self.keys)
            # Mostly keys that are bound (most draws of the others are refused before any pin).
            key = bound[pick % len(bound)] if bound and pick % 4 else [*KEYS, (KEY_REQ, 77)][pick % 4]
            request = SourceRef(key[0], key[1], 0, 0, *tensors, layer is None, SLOT_NBYTES, 0, consume)
            live = key in self.keys and not (key[0] == KEY_REQ and not self.keys[key][2])
            consumes = consume and key[0] == KEY_REQ
            cache_id, slot = self.keys[key][:2] if key in self.keys else (min(self.caches, default=0), 0)
        # Found by the kernel as by the full way's pin, unless another pull reserved or pulled some of what
        # this one would consume (then the full way credits it) or a push into the cluster runs.
        expected = live and not self.pushing and not (consumes and not wanted <= self.keys[key][2])  # type: ignore[index]
        record = self.table.get(cache_id)
        segment = record.pool_block.segment if record is not None else self.table.index  # any other name
        name = segment.name.encode("ascii")
        address = record.pool_block.segment.address if record is not None else 0
        nbytes = record.pool_block.segment.nbytes if record is not None else 0
        index = puller.index
        plan = pack_plan(
            index.row_offset(puller.link.index_row),
            puller.link.index_ticket,
            index.regions(),
            request,
            0,
            True,
        )
        dst = np.zeros((tensors[1], SLOT_NBYTES), dtype=np.uint8)
        addrs = np.array([dst[i].ctypes.data for i in range(tensors[1])], dtype=np.uint64).tobytes()
        hold, copy = how == "hold", how == "pin and copy"
        sources = None if hold else bytearray(8 * tensors[1])
        fd, mapping = index.handle
        table = segment_table([(name, address, nbytes)])
        outcome = _kernel.index_pull_key(mapping, fd, plan, addrs, table, sources, 5 if copy else 0)
        if not expected:
            assert outcome == FRESH_STALE, f"the kernel took {request}, which the full way would not"
            return
        assert outcome == (FRESH_DONE if hold or copy else FRESH_PINNED), outcome
        puller.pinned = (cache_id, slot, tuple(sorted(wanted)))
        taken = frozenset(wanted) if consumes else frozenset()
        if consumes:
            self.keys[key][2].difference_update(wanted)
            puller.consumed = (key, taken, frozenset(wanted))
        if hold or copy:  # copied (and unpinned): the bytes are the slot's, and the pull ended well
            assert np.all(dst == self.caches[cache_id].fill), "a fresh pull copied other bytes"
            self._ended(puller, True)
            return
        source = np.frombuffer(sources, dtype=np.uint64)
        for i, t in enumerate(sorted(wanted)):
            assert int(source[i]) == address + record.tensor_offset(t) + slot * SLOT_NBYTES
        puller.fresh = plan

    @initialize()
    def keys_bound(self) -> None:
        self.alloc([(KEY_REQ, 1), (KEY_REQ, 2)])

    @precondition(lambda self: self.stalled is None)
    @rule(p=st.integers(0, 1), ok=st.booleans())
    def pull_unpin(self, p: int, ok: bool) -> None:  # type: ignore[override]
        """A pin the kernel took ends by the kernel's unpin after a copy that went well (or, when it
        reports anything else, by the full way's), and by the full way's after a failed one."""
        puller = self.pullers[p]
        plan = puller.fresh
        if plan is None or puller.pinned is None:
            super().pull_unpin(p, ok)
            return
        if ok:
            fd, mapping = puller.index.handle
            if _kernel.index_unpin_key(mapping, fd, plan) != FRESH_DONE:
                assert puller.dropped, "the kernel could not unpin its own pin"
                unpin(puller.link, puller.index, ok=True)
        else:
            unpin(puller.link, puller.index, ok=False)
        self._ended(puller, ok)
        if puller.dropped:
            self.table.sync()
            puller.index.close()
            self.pullers[p] = self._connect(p)


FreshMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_fresh_pulls = FreshMachine.TestCase

"""Local pins (`_owner.pins.LocalPins`): the references this process's own transfers hold on its caches.
A pin and its end take no lock while the cache's user holds it, so what keeps a pinned cache from being
freed is an order (the pin adds its hold, then looks at `external`; deallocate and unregister clear
`external`, then count the holds). A model-based test runs every order of pins, ends, holds, deallocations
and unregistrations one step at a time against a model; threads then race pins against a deallocation
and an unregistration, many times over. Everything is the shipped table, pool and pins in one process.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llm_datadist._errors import StatusError
from llm_datadist._owner.pins import LocalPins
from llm_datadist._owner.records import CacheRecord
from llm_datadist._owner.table import CacheTable
from llm_datadist._shm.pool import Pool
from llm_datadist.status import LLMStatusCode

TENSOR_NBYTES = 4096


def _table() -> CacheTable:
    return CacheTable({1: Pool(capacity_nbytes=1 << 20)}, oom_code=LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY)


def _allocate(table: CacheTable) -> CacheRecord:
    return table.allocate(num_tensors=1, tensor_nbytes=TENSOR_NBYTES, batch_size=1, keys=[None])


def _register(table: CacheTable, memory: np.ndarray) -> CacheRecord:
    return table.register(
        num_tensors=1,
        tensor_nbytes=memory.nbytes,
        batch_size=1,
        addrs=[memory.ctypes.data],
        keys=[None],
        is_blocks=False,
        placement=0,
        remote_accessible=True,
    )


class LocalPinsModel(RuleBasedStateMachine):
    """Caches pinned and let go in any order, their users' references dropped in between; the model: how
    many pins each cache has, and whether its user still holds it. A cache stays in the table (its memory
    not freed) while its user holds it or a pin does, and goes with the last of them."""

    @initialize()
    def start(self) -> None:
        self.table = _table()
        self.pins = LocalPins(self.table)
        self.memory = [np.zeros(TENSOR_NBYTES, dtype=np.uint8) for _ in range(3)]
        self.records: list[CacheRecord] = []
        self.held: list[CacheRecord] = []  # one entry per pin (or hold) this test still has
        # holds (`LocalPins.hold`) not released
        self.releases: list[tuple[CacheRecord, Callable[[], None]]] = []
        self.users: set[int] = set()  # cache ids whose user still holds them
        self.unused_memory = list(range(len(self.memory)))

    def teardown(self) -> None:
        self.table.close()

    @precondition(lambda self: len(self.records) < 6)
    @rule(registered=st.booleans())
    def make(self, registered: bool) -> None:
        if registered and self.unused_memory:
            record = _register(self.table, self.memory[self.unused_memory.pop()])
        else:
            record = _allocate(self.table)
        self.records.append(record)
        self.users.add(record.cache_id)

    @precondition(lambda self: self.records)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        record = data.draw(st.sampled_from(self.records))
        if record.cache_id in self.users:
            assert self.pins.enter(record.cache_id) is record
            self.held.append(record)
        else:
            with pytest.raises(StatusError) as failed:
                self.pins.enter(record.cache_id)
            assert failed.value.code == LLMStatusCode.LLM_PARAM_INVALID

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def hold(self, data: st.DataObject) -> None:
        """An engine's transfer that outlives its call: a second pin, let go by its release."""
        record = data.draw(st.sampled_from(self.held))
        self.releases.append((record, self.pins.hold(record)))

    @precondition(lambda self: self.releases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        _, release = self.releases.pop(data.draw(st.integers(0, len(self.releases) - 1)))
        release()
        release()  # a second call does nothing

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        record = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.pins.leave(record, None)

    @precondition(lambda self: self.users)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        """The user deallocates (a pool cache) or unregisters (registered memory, with a timeout of 0 while
        a pin remains: the unregistration fails and the cache is the user's again)."""
        cache_id = data.draw(st.sampled_from(sorted(self.users)))
        record = self.table.caches[cache_id]
        if not record.registered:
            self.table.deallocate(cache_id)
            self.users.discard(cache_id)
            return
        pinned = any(held is record for held in self.held) or any(r is record for r, _ in self.releases)
        if pinned:
            with pytest.raises(StatusError) as failed:
                self.table.unregister(cache_id, timeout_s=0.0)
            assert failed.value.code == LLMStatusCode.LLM_TIMEOUT
        else:
            assert self.table.unregister(cache_id, timeout_s=1.0)
            self.users.discard(cache_id)

    @invariant()
    def pinned_caches_stay_and_the_rest_go(self) -> None:
        if not hasattr(self, "table"):
            return
        for record in self.records:
            pins = sum(held is record for held in self.held) + sum(r is record for r, _ in self.releases)
            assert record.pins == pins
            alive = record.cache_id in self.users or pins > 0
            assert (self.table.caches.get(record.cache_id) is record) == alive, (record, pins)
            assert record.external == (record.cache_id in self.users)
        pool = self.table.pools()[0]
        assert pool.used_nbytes == sum(
            r.pool_block.nbytes for r in self.table.caches.values() if not r.registered
        )


TestLocalPinsModel = LocalPinsModel.TestCase
TestLocalPinsModel.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


class _Racers:
    """Two threads that pin `record` and let go of it until `stop`; while one holds a pin, the cache must be
    in the table and `ended` (set by the test once the user's reference ended) must not be set yet: what
    went wrong is in `wrong`."""

    def __init__(self, table: CacheTable, pins: LocalPins, record: CacheRecord) -> None:
        self.wrong: list[str] = []
        self.ended = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(table, pins, record)) for _ in range(2)]
        for thread in self._threads:
            thread.start()

    def _loop(self, table: CacheTable, pins: LocalPins, record: CacheRecord) -> None:
        while not self._stop.is_set():
            try:
                pinned = pins.enter(record.cache_id)
            except StatusError as exc:
                if exc.code != LLMStatusCode.LLM_PARAM_INVALID:
                    self.wrong.append(f"a pin failed with {exc.code}")
                continue
            if table.caches.get(record.cache_id) is not pinned:
                self.wrong.append("a pinned cache left the table")
            if self.ended.is_set():
                self.wrong.append("a pin held after the user's reference ended")
            pins.leave(pinned, None)

    def stop(self) -> list[str]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
            assert not thread.is_alive()
        return self.wrong


@pytest.fixture(autouse=True)
def _switch_often() -> Iterator[None]:
    """Threads switch every microsecond instead of every 5 ms: the races below land between any two
    steps of a pin, not only where the interpreter would switch anyway."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def test_a_deallocation_racing_pins_frees_the_cache_once_no_pin_holds_it() -> None:
    """Pins and their ends on two threads, while the user deallocates: no pin ever holds a cache that left
    the table, none taken after the deallocation returned succeeds, and once the last pin ended the memory
    is back in the pool, every round."""
    table = _table()
    pins = LocalPins(table)
    pool = table.pools()[0]
    try:
        for round_ in range(200):
            record = _allocate(table)
            racers = _Racers(table, pins, record)
            for _ in range(round_ % 7 * 50):  # let them run a while first, a different while each round
                pass
            table.deallocate(record.cache_id)
            with pytest.raises(StatusError):
                pins.pin(record.cache_id)
            assert not racers.stop()
            assert record.pins == 0 and record.cache_id not in table.caches
            assert pool.used_nbytes == 0, f"round {round_}: the deallocated cache was not freed"
    finally:
        table.close()


def test_an_unregistration_racing_pins_returns_only_once_no_pin_holds_the_memory() -> None:
    """Pins and their ends on two threads, while the user unregisters the memory: the unregistration
    returns only once no pin holds it, and no pin holds it after (one that lands later fails), every
    round."""
    table = _table()
    pins = LocalPins(table)
    memory = np.zeros(TENSOR_NBYTES, dtype=np.uint8)
    try:
        for round_ in range(200):
            record = _register(table, memory)
            racers = _Racers(table, pins, record)
            for _ in range(round_ % 7 * 50):
                pass
            assert table.unregister(record.cache_id, timeout_s=10.0)
            racers.ended.set()
            assert record.cache_id not in table.caches
            assert not racers.stop()
            assert record.pins == 0
    finally:
        table.close()

"""shm.repin: a repeat pin against what a full lookup would find, whatever the owner changed meanwhile, for
the pure-Python twins and the C kernel's alike (one index file; an owner and a puller descriptor)."""

from __future__ import annotations

import fcntl
import os
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from llm_datadist._shm import repin as repin_module
from llm_datadist._shm.index import (
    _WRLCK,
    CACHE_PENDING,
    KIND_BLOCKS,
    KIND_PREFIX,
    KIND_REQ,
    STATE_CLOSED,
    STATE_OPEN,
    CacheEntry,
    Index,
    IndexCorrupt,
)
from llm_datadist._shm.index_owner import OwnerIndex
from llm_datadist._shm.repin import BUSY, DONE, STALE, RepinPlan, repin_python, unpin_python

_PID = os.getpid()
_INCARNATION = 41
_TICKET = 0x5EED
_ROW = 2
_SLOTS = 3
_KEYS = [(KIND_PREFIX, 7, 0), (KIND_PREFIX, 8, 1), (KIND_BLOCKS, 0, 3), (KIND_REQ, 9, 0)]

kernel = repin_module.kernel
TWINS = ["python"] + (["c"] if kernel is not None else [])


def _entry(slot: int, generation: int) -> CacheEntry:
    return CacheEntry(
        slot, generation, 100 + slot, 0, 2, 4096, 8192, 4096, 2, f"/llmdd.0.1.{slot}.ab", 1 << 16
    )


def _repin(twin: str, puller: Index, plan: RepinPlan) -> int:
    fd, mm = puller.handle
    if twin == "c":
        return int(kernel.index_repin(mm, fd, plan.plan))
    return repin_python(fd, mm, plan)


def _unpin(twin: str, puller: Index, plan: RepinPlan) -> int:
    fd, mm = puller.handle
    if twin == "c":
        return int(kernel.index_unpin(mm, fd, plan.row_offset, plan.ticket, plan.cache_offset))
    return unpin_python(fd, mm, plan)


class Repins(RuleBasedStateMachine):
    """The owner binds, unbinds, retargets and replaces caches, takes the row back, pushes, closes; the
    puller makes a plan from a full lookup and later repins with it. A repin pins exactly when a full pin
    would pin the same cache generation and batch slot through the same name entry (another entry for the
    same key may only make it stale), and the twins leave the same bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.owner = OwnerIndex.create(_PID, _INCARNATION, rows=4, caches=_SLOTS + 1, names=8)
        self.puller = Index.attach(self.owner.name, pid=_PID, incarnation=_INCARNATION)
        self.generation = 10
        self.live: dict[int, int] = {}  # cache slot -> generation
        self.names: dict[tuple[int, int, int], int] = {}  # key -> name entry
        self.plans: list[tuple[tuple[int, int, int], RepinPlan, tuple[int, int, int]]] = []
        with self.owner.locked(1.0):
            self.owner.assign_row(_ROW, _TICKET, _INCARNATION)

    def teardown(self) -> None:
        self.puller.close()
        self.owner.close()

    @initialize()
    def every_key_bound_and_planned(self) -> None:
        for slot in range(1, _SLOTS + 1):
            self.put_cache(slot, pending=False)
        for number, key in enumerate(_KEYS):
            self.bind(key, 1 + number % _SLOTS, number % 2)
            self.make_plan(key, check_busy=bool(number % 2))

    # ------------------------------------------------------------------ the owner

    @rule(slot=st.integers(1, _SLOTS), pending=st.booleans())
    def put_cache(self, slot: int, pending: bool) -> None:
        self.generation += 1
        with self.owner.locked(1.0):
            self.owner.put_cache(_entry(slot, self.generation))
            if pending:
                self.owner.set_cache_flags(slot, CACHE_PENDING)
        self.live[slot] = self.generation

    @rule(slot=st.integers(1, _SLOTS))
    def clear_cache(self, slot: int) -> None:
        with self.owner.locked(1.0):
            self.owner.clear_cache(slot)
        self.live.pop(slot, None)

    @rule(key=st.sampled_from(_KEYS), slot=st.integers(1, _SLOTS), batch=st.integers(0, 1))
    def bind(self, key: tuple[int, int, int], slot: int, batch: int) -> None:
        if key in self.names or slot not in self.live:
            return
        number = next(n for n in range(8) if n not in self.names.values())
        with self.owner.locked(1.0):
            self.owner.insert_name(number, *key, slot, batch, self.live[slot], num_tensors=2)
        self.names[key] = number

    @rule(key=st.sampled_from(_KEYS))
    def unbind(self, key: tuple[int, int, int]) -> None:
        number = self.names.pop(key, None)
        if number is not None:
            with self.owner.locked(1.0):
                self.owner.remove_name(number)

    @rule(key=st.sampled_from(_KEYS), slot=st.integers(1, _SLOTS))
    def retarget(self, key: tuple[int, int, int], slot: int) -> None:
        if key in self.names and slot in self.live:
            with self.owner.locked(1.0):
                self.owner.retarget_name(self.names[key], slot, self.live[slot])

    @rule(delta=st.sampled_from([1, -1]))
    def push(self, delta: int) -> None:
        with self.owner.locked(1.0):
            if delta > 0 or self.owner.busy(5):
                self.owner.set_busy(5, delta)

    @rule(back=st.booleans())
    def take_row_back(self, back: bool) -> None:
        with self.owner.locked(1.0):
            self.owner.assign_row(_ROW, 0 if back else _TICKET, 0 if back else _INCARNATION)

    @rule(state=st.sampled_from([STATE_OPEN, STATE_CLOSED]))
    def open_or_close(self, state: int) -> None:
        with self.owner.locked(1.0):
            self.owner._pack(repin_module._U32, 12, state)

    @rule(slot=st.integers(1, _SLOTS), value=st.sampled_from([0, 4096, 1 << 50]))
    def scribble(self, slot: int, value: int) -> None:
        """A stray write into a cache entry's offset field, by anyone who maps the index."""
        offset = self.puller.cache_offset(slot) + 24
        self.puller.handle[1][offset : offset + 8] = value.to_bytes(8, "little")

    # ------------------------------------------------------------------ the puller

    def _entry_bytes(self, slot: int) -> bytes:
        offset = self.puller.cache_offset(slot)
        entry = bytearray(self.puller.handle[1][offset : offset + 128])
        entry[16:20] = bytes(4)
        return bytes(entry)

    def _full_pin(self, key: tuple[int, int, int], check_busy: bool) -> tuple[Any, Any] | None:
        """What a full pin finds (under the lock): the name and the cache, or None if it would not pin."""
        puller = self.puller
        with puller.locked(1.0):
            state, _ = puller.header()
            if state != STATE_OPEN or (check_busy and puller.busy(5)):
                return None
            if puller.row_state(_ROW) != (_TICKET, 0):
                return None
            name = puller.lookup(*key)
            if name is None or self.live.get(name.cache_slot) != name.generation:
                return None  # not found, or it names a slot the owner cleared or filled again
            try:
                return name, puller.cache(name.cache_slot)
            except IndexCorrupt:
                return None  # a stray write made the entry absurd: the full way refuses it

    @rule(key=st.sampled_from(_KEYS), check_busy=st.booleans())
    def make_plan(self, key: tuple[int, int, int], check_busy: bool) -> None:
        found = self._full_pin(key, check_busy)
        if found is None:
            return
        name, cache = found
        plan = RepinPlan.make(self.puller, _ROW, _TICKET, name, cache, check_busy=check_busy)
        self.plans.append((key, plan, (name.cache_slot, name.batch_slot, name.generation)))

    @precondition(lambda self: bool(self.plans))
    @rule(data=st.data())
    def repin(self, data: st.DataObject) -> None:
        key, plan, pinned = data.draw(st.sampled_from(self.plans))
        check_busy = bool(plan.plan[68])
        found = self._full_pin(key, check_busy)
        same = (
            found is not None
            and (found[0].cache_slot, found[0].batch_slot, found[0].generation) == pinned
            and plan.plan[16:24] == self.puller.name_offset(found[0].number).to_bytes(8, "little")
            and self._entry_bytes(found[0].cache_slot) == plan.plan[72:]
        )
        results = []
        for twin in TWINS:
            before = bytes(self.puller.handle[1])
            got = _repin(twin, self.puller, plan)
            after = bytes(self.puller.handle[1])
            results.append((got, after))
            if got == DONE:
                with self.puller.locked(1.0):
                    assert self.puller.row(_ROW)[:6] == (_TICKET, 1, pinned[0], pinned[2], -1, 0)
                assert _unpin(twin, self.puller, plan) == DONE
                assert _unpin(twin, self.puller, plan) == STALE  # nothing pinned any more
                with self.puller.locked(1.0):
                    assert self.puller.row_state(_ROW) == (_TICKET, 0)
            else:
                assert got == STALE and after == before  # nothing written
        event("repinned" if same else "stale")
        assert {got for got, _ in results} == {DONE if same else STALE}
        # The twins wrote the same bytes (the epoch aside: the first twin's unpin may have moved it).
        assert len({after[:48] + after[56:] for _, after in results}) == 1

    @invariant()
    def the_lock_is_free(self) -> None:
        fd, _ = self.owner.handle
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _WRLCK)  # raises if a repin left it held
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, repin_module._UNLCK)


Repins.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_repins = Repins.TestCase


@pytest.fixture
def pinned_once() -> Any:
    owner = OwnerIndex.create(_PID, _INCARNATION, rows=4, caches=4, names=8)
    puller = Index.attach(owner.name, pid=_PID, incarnation=_INCARNATION)
    with owner.locked(1.0):
        owner.assign_row(_ROW, _TICKET, _INCARNATION)
        owner.put_cache(_entry(1, 11))
        owner.insert_name(0, KIND_PREFIX, 7, 0, 1, 0, 11)
    with puller.locked(1.0):
        name = puller.lookup(KIND_PREFIX, 7, 0)
        assert name is not None
        plan = RepinPlan.make(puller, _ROW, _TICKET, name, puller.cache(1), check_busy=True)
    yield owner, puller, plan
    puller.close()
    owner.close()


@pytest.mark.parametrize("twin", TWINS)
def test_a_held_lock_is_busy_and_nothing_is_done(pinned_once: Any, twin: str) -> None:
    owner, puller, plan = pinned_once
    with owner.locked(1.0):
        before = bytes(puller.handle[1])
        assert _repin(twin, puller, plan) == BUSY
        assert _unpin(twin, puller, plan) == BUSY
        assert bytes(puller.handle[1]) == before


@pytest.mark.parametrize("twin", TWINS)
def test_unpinning_a_cache_its_owner_wants_to_free_moves_the_epoch(pinned_once: Any, twin: str) -> None:
    owner, puller, plan = pinned_once
    assert _repin(twin, puller, plan) == DONE
    with owner.locked(1.0):
        owner.set_cache_flags(1, CACHE_PENDING)
    epoch = puller.epoch
    assert _unpin(twin, puller, plan) == DONE
    assert puller.epoch == epoch + 1  # the owner frees it at its next look


@pytest.mark.skipif(kernel is None, reason="the optional C kernel was not built")
@pytest.mark.parametrize("unit", [8, 48 << 10])  # 24 B: copied under the lock; 144 KiB: through the pin
def test_index_pull_pins_copies_and_unpins_in_one_call(pinned_once: Any, unit: int) -> None:
    owner, puller, plan = pinned_once
    fd, mm = puller.handle
    src = (np.arange(8 * unit) % 251).astype(np.uint8)
    dst = np.zeros(8 * unit, dtype=np.uint8)
    runs = [(unit, 0, 2 * unit), (5 * unit, 2 * unit, unit)]
    columns = [np.array(column, dtype=np.uint64) for column in zip(*runs, strict=True)]
    args = (src.ctypes.data, dst.ctypes.data, *columns, False)
    assert kernel.index_pull(mm, fd, plan.plan, *args) == (DONE, False, DONE)
    np.testing.assert_array_equal(dst[: 2 * unit], src[unit : 3 * unit])
    np.testing.assert_array_equal(dst[2 * unit : 3 * unit], src[5 * unit : 6 * unit])
    assert not dst[3 * unit :].any()
    with puller.locked(1.0):
        assert puller.row_state(_ROW) == (_TICKET, 0)
    dst[:] = 0
    with owner.locked(1.0):
        assert kernel.index_pull(mm, fd, plan.plan, *args) == (BUSY, False, 0)
    with owner.locked(1.0):
        owner.remove_name(0)
    assert kernel.index_pull(mm, fd, plan.plan, *args) == (STALE, False, 0)
    assert not dst.any()  # nothing copied without the checks
    with pytest.raises(ValueError, match="200 bytes"):
        kernel.index_pull(mm, fd, plan.plan[:-1], *args)
    with pytest.raises(ValueError, match="past the end"):
        kernel.index_pull(mm, fd, b"\xff" * 200, *args)

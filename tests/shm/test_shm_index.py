"""shm.index: the published index's layout, hashing, lock and checks, in one process (two open file
descriptions of one index stand for the owner and a puller)."""

from __future__ import annotations

import os
import struct
import threading
import time

import hypothesis
import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from llm_datadist._shm.index import Index, IndexCorrupt, IndexLockTimeout
from llm_datadist._shm.index_layout import (
    KIND_BLOCKS,
    KIND_PREFIX,
    KIND_REQ,
    NAME_CONSUMED,
    NAME_LIVE,
    CacheEntry,
)
from llm_datadist._shm.index_owner import OwnerIndex

_PID = os.getpid()


@pytest.fixture
def owner() -> OwnerIndex:
    index = OwnerIndex.create(_PID, 77, rows=8, caches=16, names=32)
    yield index
    index.close()


def _entry(slot: int = 1, generation: int = 5) -> CacheEntry:
    return CacheEntry(slot, generation, 3, 0, 2, 4096, 8192, 6666, 3, "/llmdd.0.1.2.ab", 4096 + 3 * 8192)


def test_a_puller_reads_what_the_owner_published(owner: Index) -> None:
    puller = Index.attach(owner.name, pid=_PID, incarnation=77)
    try:
        with owner.locked(1.0):
            owner.put_cache(_entry())
            owner.insert_name(0, KIND_REQ, 2**64 - 1, 9, 1, 1, 5, num_tensors=3)
        with puller.locked(1.0):
            name = puller.lookup(KIND_REQ, 2**64 - 1, 9)
            assert name is not None and (name.cache_slot, name.batch_slot, name.mask) == (1, 1, 0b111)
            assert puller.cache(1) == _entry()
            assert puller.lookup(KIND_PREFIX, 2**64 - 1, 9) is None
            assert puller.consume(0, 0b101) == 0b101
            assert puller.consume(0, 0b111) == 0b010  # only what was left
            assert puller.name_entry(0).state == NAME_CONSUMED
            assert puller.lookup(KIND_REQ, 2**64 - 1, 9) is None  # a consumed key is not found
            puller.restore(0, 0b010, 1, 5)
            assert puller.lookup(KIND_REQ, 2**64 - 1, 9) is not None
            puller.restore(0, 0b001, 1, 6)  # another generation of that slot: nothing given back
            assert puller.name_entry(0).mask == 0b010
        with owner.locked(1.0):
            assert owner.consumed_names() == []
    finally:
        puller.close()


def test_a_key_is_consumed_by_what_pulls_copied_not_by_what_they_reserved(owner: OwnerIndex) -> None:
    """Two sets per req key: a failed pull gives back only what no pull that ended well copied, and a
    pull that ended well counts whatever it copied, reserved by it or not (reference §9.4)."""
    puller = Index.attach(owner.name, pid=_PID, incarnation=77)
    try:
        with owner.locked(1.0):
            owner.put_cache(_entry())
            owner.insert_name(0, KIND_REQ, 7, 0, 1, 1, 5, num_tensors=3)
        with puller.locked(1.0):
            assert puller.consume(0, 0b111) == 0b111  # puller A reserves everything
            assert puller.lookup(KIND_REQ, 7, 0) is None  # claimed: no new pull by key finds it
            puller.credit(0, 0b011, 1, 5)  # puller B (by cache id and slot) copied tensors 0 and 1
            puller.restore(0, 0b111, 1, 5)  # A failed: only tensor 2 goes back
            entry = puller.name_entry(0)
            assert (entry.state, entry.mask, entry.pulled) == (NAME_LIVE, 0b100, 0b011)
            assert puller.consume(0, 0b111) == 0b100  # a pull by key takes what is left
            puller.credit(0, 0b100, 1, 5)
            entry = puller.name_entry(0)
            assert (entry.state, entry.mask, entry.pulled) == (NAME_CONSUMED, 0, 0b111)
            puller.restore(0, 0b100, 1, 5)  # a late failure gives back nothing another pull copied
            assert puller.name_entry(0).state == NAME_CONSUMED
            puller.credit(0, 0b111, 1, 6)  # another generation of that slot: nothing credited
        with owner.locked(1.0):
            assert owner.consumed_names() == [0]
            owner.remove_name(0)
            owner.insert_name(0, KIND_REQ, 7, 0, 1, 1, 5, num_tensors=3)  # a new binding starts afresh
            entry = owner.name_entry(0)
            assert (entry.state, entry.mask, entry.pulled) == (NAME_LIVE, 0b111, 0)
    finally:
        puller.close()


def test_attach_checks_the_owner_and_the_layout(owner: Index) -> None:
    with pytest.raises(IndexCorrupt, match="belongs to"):
        Index.attach(owner.name, pid=_PID, incarnation=78)
    with pytest.raises(IndexCorrupt, match="not an index name"):
        Index.attach("/../etc/passwd", pid=_PID, incarnation=77)
    path = f"/dev/shm/{owner.name[1:]}"
    with open(path, "r+b") as raw:
        raw.seek(32)
        raw.write(struct.pack("<I", 1 << 20))  # rows: far more than the file holds
    with pytest.raises(IndexCorrupt, match="capacities"):
        Index.attach(owner.name, pid=_PID, incarnation=77)


def test_a_hostile_cache_entry_is_refused(owner: Index) -> None:
    with owner.locked(1.0):
        owner.put_cache(_entry())
        with pytest.raises(IndexCorrupt):
            owner.cache(2)  # a free slot
        with pytest.raises(IndexCorrupt):
            owner.cache(16)  # past the end
        bad = _entry()
        owner.put_cache(CacheEntry(1, 5, 3, 0, 2, 1 << 40, 8192, 6666, 3, bad.segment, bad.segment_nbytes))
        with pytest.raises(IndexCorrupt):
            owner.cache(1)  # tensors past the segment
        with pytest.raises(IndexCorrupt):
            owner.name_entry(32)


def test_the_lock_excludes_another_open_file_description_and_times_out(owner: Index) -> None:
    puller = Index.attach(owner.name, pid=_PID, incarnation=77)
    try:
        with owner.locked(1.0):
            started = time.monotonic()
            with pytest.raises(IndexLockTimeout):
                puller.lock(0.05)
            assert time.monotonic() - started < 2.0

        # Released: the puller gets it; a waiter gets it as soon as it is let go.
        def release_soon() -> None:
            time.sleep(0.05)
            puller.unlock()

        puller.lock(1.0)
        thread = threading.Thread(target=release_soon)
        thread.start()
        with owner.locked(2.0):
            pass
        thread.join(5)
    finally:
        puller.close()


def test_busy_clusters_are_counted(owner: Index) -> None:
    with owner.locked(1.0):
        assert not owner.busy(5)
        owner.set_busy(5, 1)
        owner.set_busy(5, 1)
        owner.set_busy(6, 1)
        assert owner.busy(5) and owner.busy(6) and not owner.busy(7)
        owner.set_busy(5, -1)
        assert owner.busy(5)
        owner.set_busy(5, -1)
        owner.set_busy(6, -1)
        assert not owner.busy(5) and not owner.busy(6)


def test_rows_pin_and_clear(owner: Index) -> None:
    with owner.locked(1.0):
        owner.assign_row(3, 1234, 99)
        assert owner.row_state(3) == (1234, 0) and owner.row_incarnation(3) == 99
        owner.set_row(3, 1234, 1, 5, 0, 0b11, range(0, 3))
        assert owner.pinned(range(8)) == {3: (1, 5)}
        assert owner.row(3) == (1234, 1, 1, 5, 0, 0b11, 0b111)
        owner.clear_row(3, 1234)
        assert owner.pinned(range(8)) == {}
        assert owner.row_incarnation(3) == 99  # a pin and its end leave the puller's incarnation
        with pytest.raises(IndexCorrupt):
            owner.row(8)


_KEYS = st.tuples(st.sampled_from([KIND_REQ, KIND_PREFIX, KIND_BLOCKS]), st.integers(0, 4), st.integers(0, 2))


class NameTable(RuleBasedStateMachine):
    """The open-addressing hash (linear probing, backward-shift deletion) against a dict: whatever the
    order of inserts and removals, every live key is found and no removed one is."""

    names = Bundle("names")

    def __init__(self) -> None:
        super().__init__()
        # A small table: long probe chains, wrap-around and deletions inside clusters all happen.
        self.index = OwnerIndex.create(_PID, 1, rows=1, caches=4, names=12)
        self.model: dict[tuple[int, int, int], int] = {}
        self.free = list(range(12))

    @rule(target=names, key=_KEYS)
    def insert(self, key: tuple[int, int, int]) -> tuple[int, int, int]:
        if key in self.model or not self.free:
            return key
        entry = self.free.pop()
        with self.index.locked(1.0):
            self.index.insert_name(entry, *key, 1, 0, 7, num_tensors=2)
        self.model[key] = entry
        return key

    @rule(key=consumes(names))
    def remove(self, key: tuple[int, int, int]) -> None:
        entry = self.model.pop(key, None)
        if entry is None:
            return
        with self.index.locked(1.0):
            self.index.remove_name(entry)
        self.free.append(entry)

    @invariant()
    def every_key_is_found_where_it_was_put(self) -> None:
        with self.index.locked(1.0):
            for kind in (KIND_REQ, KIND_PREFIX, KIND_BLOCKS):
                for key_id in range(5):
                    for model_id in range(3):
                        found = self.index.lookup(kind, key_id, model_id)
                        expected = self.model.get((kind, key_id, model_id))
                        assert (found.number if found else None) == expected

    def teardown(self) -> None:
        self.index.close()


NameTable.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_name_table = NameTable.TestCase


def test_an_owner_that_never_closes_still_unlinks_its_index_at_exit() -> None:
    import subprocess
    import sys

    code = (
        "import os; from llm_datadist._shm.index_owner import OwnerIndex; "
        "print(OwnerIndex.create(os.getpid(), 1).name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    name = done.stdout.strip()
    assert name.startswith("/llmdd.") and not os.path.exists(f"/dev/shm/{name[1:]}")


# ----------------------------------------------------------------------------------- stray writes


def _published(owner: OwnerIndex) -> list[tuple[int, tuple[int, int, int]]]:
    """An owner with a few caches and names, some of them partly consumed by a puller: (name, key)."""
    names = []
    with owner.locked(1.0):
        for slot in range(4):
            owner.put_cache(_entry(slot, 10 + slot))
            for n in range(3):
                number = slot * 3 + n
                key = (KIND_REQ if n < 2 else KIND_PREFIX, slot, n)
                owner.insert_name(number, *key, slot, 0, 10 + slot, num_tensors=3)
                names.append((number, key))
        owner.consume(0, 0b001)  # partly pulled: the mask the repair must keep
    return names


def _masks_hit(index: Index, number: int, hit: list[range]) -> bool:
    """Whether a write in `hit` touched name `number`'s masks: what pullers write, so a repair keeps it (a
    stray write there reads as pulls; one that marks a req key pulled whole makes it consumed)."""
    masks = set(range(index.name_offset(number) + 64, index.name_offset(number) + 192))
    return any(masks & set(written) for written in hit)


@settings(max_examples=80, deadline=None)
@hypothesis.given(
    writes=st.lists(
        st.tuples(st.integers(0, 1 << 20), st.binary(min_size=1, max_size=16)), min_size=1, max_size=8
    )
)
def test_a_repair_puts_back_what_the_owner_wrote_and_keeps_what_pullers_did(
    writes: list[tuple[int, bytes]],
) -> None:
    owner = OwnerIndex.create(_PID, 77, rows=8, caches=16, names=32)
    try:
        names = _published(owner)
        path = f"/dev/shm/{owner.name[1:]}"
        size = os.path.getsize(path)
        hit: list[range] = []
        with open(path, "r+b") as raw:
            for offset, data in writes:
                at = offset % (size - len(data))
                raw.seek(at)
                raw.write(data)
                hit.append(range(at, at + len(data)))
        # The owner's own reads never fail, whatever the file holds.
        with owner.locked(1.0):
            owner.consumed_names()
            owner.pinned(range(8))
            for number, _ in names:
                owner.name_entry(number)
            owner.repair()
        assert not owner.audit()
        puller = Index.attach(owner.name, pid=_PID, incarnation=77)
        try:
            with puller.locked(1.0):
                for number, key in names:
                    found = puller.lookup(*key)
                    if found is None and key[0] == KIND_REQ and _masks_hit(puller, number, hit):
                        continue  # a stray write into its masks read as pulls of all of it: consumed
                    assert found is not None and found.number == number
                    assert puller.cache(found.cache_slot).generation == 10 + key[1]
                    # What the puller consumed stays consumed, unless a stray write hit that very mask.
                    assert found.mask & ~(0b111 if key[0] == KIND_REQ else 0) == 0
            with owner.locked(1.0):
                owner.remove_name(0)
            with puller.locked(1.0):
                assert puller.lookup(*names[0][1]) is None
                assert all(
                    puller.lookup(*key) is not None
                    for number, key in names[1:]
                    if not (key[0] == KIND_REQ and _masks_hit(puller, number, hit))
                )
        finally:
            puller.close()
    finally:
        owner.close()


def test_an_audit_of_a_clean_index_finds_nothing_and_costs_no_repair(owner: OwnerIndex) -> None:
    _published(owner)
    puller = Index.attach(owner.name, pid=_PID, incarnation=77)
    try:
        with owner.locked(1.0):
            owner.assign_row(2, 555, 9)
        with puller.locked(1.0):
            name = puller.lookup(KIND_REQ, 1, 0)
            assert name is not None
            taken = puller.consume(name.number, 0b11)
            puller.set_row(2, 555, name.cache_slot, name.generation, name.number, taken, range(2))
        assert owner.audit() == []
        with owner.locked(1.0):
            assert not owner.repair()
            assert owner.pinned(range(8)) == {2: (1, 11)}
        with open(f"/dev/shm/{owner.name[1:]}", "r+b") as raw:
            raw.seek(4096 + 2 * 128 + 8)  # row 2's state: a value no holder writes
            raw.write(struct.pack("<I", 7))
        assert owner.audit() == ["rows"]
        with owner.locked(1.0):
            assert owner.pinned(range(8)) == {}  # not a pin the owner honours
            assert owner.repair() and owner.repairs == 1
        assert owner.audit() == []
    finally:
        puller.close()

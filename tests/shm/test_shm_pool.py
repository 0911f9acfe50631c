"""Pool allocation over real shared memory: capacity, growth, alignment, coalescing, misuse, random use."""

from __future__ import annotations

import itertools
import os
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_datadist._shm.errors import OutOfPoolMemory, ShmError
from llm_datadist._shm.pool import Block, Pool
from llm_datadist._shm.segment import PAGE_NBYTES, Segment

MiB = 1 << 20


def _smaps_nbytes(address: int, field: str = "Rss") -> int:
    """A field (in bytes) of this process's mapping that starts at `address`, from /proc/self/smaps:
    `Rss`, its resident bytes; `ShmemPmdMapped`, those of them mapped as huge pages."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                inside = int(head.split("-")[0], 16) == address
            elif inside and head == f"{field}:":
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping at 0x{address:x}")


def _exists(segment: Segment) -> bool:
    return os.path.exists("/dev/shm/" + segment.name[1:])


def test_fixed_capacity_is_lazy_and_exhausts() -> None:
    pool = Pool(capacity_nbytes=10 * PAGE_NBYTES + 1)
    try:
        assert pool.segments == [] and pool.capacity_nbytes == 11 * PAGE_NBYTES
        blocks = [pool.allocate(3333) for _ in range(11)]
        assert len(pool.segments) == 1 and pool.segments[0].nbytes == 11 * PAGE_NBYTES
        assert pool.used_nbytes == 11 * PAGE_NBYTES
        with pytest.raises(OutOfPoolMemory):
            pool.allocate(1)
        pool.free(blocks[3])
        with pytest.raises(OutOfPoolMemory):
            pool.allocate(PAGE_NBYTES + 1)
        assert pool.allocate(PAGE_NBYTES).offset == blocks[3].offset
        assert len(pool.segments) == 1
    finally:
        pool.close()


def test_fixed_capacity_smaller_than_request() -> None:
    pool = Pool(capacity_nbytes=PAGE_NBYTES)
    try:
        with pytest.raises(OutOfPoolMemory):
            pool.allocate(PAGE_NBYTES + 1)
        assert pool.allocate(PAGE_NBYTES).nbytes == PAGE_NBYTES
    finally:
        pool.close()


def test_growth_and_release_of_empty_segments() -> None:
    pool = Pool(chunk_nbytes=MiB)
    try:
        first = [pool.allocate(256 << 10) for _ in range(4)]
        assert len(pool.segments) == 1
        second = pool.allocate(3333)
        assert len(pool.segments) == 2 and second.segment is not first[0].segment
        big = pool.allocate(3 * MiB + 1)  # larger than a chunk: a segment sized to the request
        assert big.segment.nbytes == 3 * MiB + PAGE_NBYTES
        assert len(pool.segments) == 3
        old = first[0].segment
        for block in first:
            pool.free(block)
        assert old not in pool.segments and not _exists(old)
        pool.free(big)  # the most recent segment stays, empty, to avoid churn
        assert big.segment in pool.segments and _exists(big.segment)
        assert pool.used_nbytes == PAGE_NBYTES
        pool.free(second)
        assert pool.used_nbytes == 0
        assert pool.segments == [big.segment] and not _exists(second.segment)
        # The empty newest segment is too small for this request; it is dropped for the new one.
        huge = pool.allocate(4 * MiB)
        assert pool.segments == [huge.segment] and not _exists(big.segment)
    finally:
        pool.close()
    assert not _exists(huge.segment)


@pytest.mark.parametrize("alignment", [1, 64, PAGE_NBYTES, 4 * PAGE_NBYTES, 1 << 20])
def test_alignment(alignment: int) -> None:
    pool = Pool(chunk_nbytes=MiB, alignment=alignment)
    try:
        rng = random.Random(alignment)
        blocks = [pool.allocate(rng.randrange(1, 20000)) for _ in range(20)]
        for block in blocks:
            assert block.address % alignment == 0
            assert block.address == block.segment.address + block.offset
            assert block.array().nbytes == block.nbytes
        _assert_disjoint(blocks)
    finally:
        pool.close()


def test_bad_arguments() -> None:
    for kwargs in ({"alignment": 0}, {"alignment": 3000}, {"capacity_nbytes": 0}, {"chunk_nbytes": 0}):
        with pytest.raises(ValueError):
            Pool(**kwargs)
    pool = Pool(capacity_nbytes=PAGE_NBYTES)
    try:
        for nbytes in (0, -1):
            with pytest.raises(ValueError):
                pool.allocate(nbytes)
    finally:
        pool.close()


def test_coalescing_after_random_frees(seed: int) -> None:
    rng = random.Random(seed)
    capacity_nbytes = 256 * PAGE_NBYTES
    pool = Pool(capacity_nbytes=capacity_nbytes)
    try:
        for _ in range(3):
            blocks = []
            while True:
                try:
                    blocks.append(pool.allocate(rng.randrange(1, 6 * PAGE_NBYTES)))
                except OutOfPoolMemory:
                    break
            _assert_disjoint(blocks)
            rng.shuffle(blocks)
            for block in blocks:
                pool.free(block)
            assert pool.used_nbytes == 0
            whole = pool.allocate(capacity_nbytes)
            assert whole.offset == 0
            pool.free(whole)
    finally:
        pool.close()


def test_double_and_foreign_free() -> None:
    pool = Pool(capacity_nbytes=16 * PAGE_NBYTES)
    other = Pool(capacity_nbytes=16 * PAGE_NBYTES)
    try:
        block = pool.allocate(100)
        kept = pool.allocate(100)
        pool.free(block)
        with pytest.raises(ShmError):
            pool.free(block)
        with pytest.raises(ShmError):
            pool.free(other.allocate(100))
        with pytest.raises(ShmError):
            pool.free(Block(kept.segment, kept.offset, kept.nbytes + 1))
        with pytest.raises(ShmError):
            pool.free(Block(kept.segment, kept.offset + 64, 10))
        pool.free(Block(kept.segment, kept.offset, kept.nbytes))  # an equal handle is the same block
        assert pool.used_nbytes == 0
    finally:
        pool.close()
        other.close()


def test_blocks_are_shared_prefaulted_memory() -> None:
    pool = Pool(chunk_nbytes=4 * MiB)
    try:
        block = pool.allocate(MiB + 1)
        # Only the reserved range is populated, not the whole chunk: its pages, 4 KiB, or 2 MiB where the
        # /dev/shm mount gives huge pages (`huge=`).
        address = block.segment.address
        grain = 2 * MiB if _smaps_nbytes(address, "ShmemPmdMapped") else PAGE_NBYTES
        assert _smaps_nbytes(address) == -(-(MiB + 1) // grain) * grain < 4 * MiB
        block.array()[:] = 42
        with Segment.attach(block.segment.name, min_nbytes=block.offset + block.nbytes) as reader:
            assert int(reader.view(block.offset, block.nbytes).sum()) == 42 * block.nbytes
    finally:
        pool.close()


def test_close_is_final_and_idempotent() -> None:
    pool = Pool(chunk_nbytes=MiB)
    block = pool.allocate(100)
    view = block.array()
    segment = block.segment
    pool.close()
    pool.close()
    assert pool.segments == [] and not _exists(segment) and segment.closed
    pool.free(block)  # everything was released by close already
    with pytest.raises(ShmError):
        pool.allocate(100)
    view[:] = 1  # a view the user kept stays mapped until it goes
    del view


def _assert_disjoint(blocks: list[Block]) -> None:
    by_segment: dict[int, list[Block]] = {}
    for block in blocks:
        assert block.offset >= 0 and block.offset + block.nbytes <= block.segment.nbytes
        by_segment.setdefault(id(block.segment), []).append(block)
    for group in by_segment.values():
        group.sort(key=lambda b: b.offset)
        for left, right in itertools.pairwise(group):
            assert left.offset + left.nbytes <= right.offset


_ops = st.lists(
    st.one_of(
        st.tuples(st.just("alloc"), st.integers(1, 3 * PAGE_NBYTES + 1)),
        st.tuples(st.just("free"), st.integers(0, 1 << 30)),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_ops, fixed=st.booleans(), alignment=st.sampled_from([1, 256, PAGE_NBYTES, 2 * PAGE_NBYTES]))
def test_random_sequences_never_overlap(ops: list[tuple[str, int]], fixed: bool, alignment: int) -> None:
    pool = (
        Pool(capacity_nbytes=12 * PAGE_NBYTES, alignment=alignment)
        if fixed
        else Pool(chunk_nbytes=8 * PAGE_NBYTES, alignment=alignment)
    )
    try:
        live: list[tuple[Block, int]] = []  # (block, the byte value stamped all over it)
        for step, (op, value) in enumerate(ops):
            if op == "alloc":
                try:
                    block = pool.allocate(value)
                except OutOfPoolMemory:
                    assert fixed
                    continue
                assert block.address % alignment == 0 and block.nbytes == value
                assert any(block.segment is segment for segment in pool.segments)
                # Overlapping blocks would overwrite each other's stamps.
                block.array()[:] = step % 256
                live.append((block, step % 256))
            elif live:
                pool.free(live.pop(value % len(live))[0])
            _assert_disjoint([block for block, _ in live])
            for block, stamp in live:
                assert np.all(block.array() == stamp)
            if fixed:
                assert len(pool.segments) <= 1
        for block, _ in live:
            pool.free(block)
        assert pool.used_nbytes == 0
        assert len(pool.segments) <= 1
    finally:
        pool.close()

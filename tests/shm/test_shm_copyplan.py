"""Copy plans against numpy references computed independently (fancy indexing), on plain and shared memory."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_datadist._shm.copyplan import (
    Run,
    check_runs,
    execute,
    merge_runs,
    plan_block_copy,
    plan_tensor_copy,
    split_runs,
)
from llm_datadist._shm.errors import InvalidRange
from llm_datadist._shm.segment import Segment

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _byte_map(runs: list[Run]) -> list[tuple[int, int]]:
    """Each run expanded to its (src byte, dst byte) pairs, in copy order."""
    return [(run.src_offset + i, run.dst_offset + i) for run in runs for i in range(run.nbytes)]


def _random_bytes(nbytes: int, seed: int) -> npt.NDArray[np.uint8]:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


runs_strategy = st.lists(
    st.builds(Run, st.integers(0, 60), st.integers(0, 60), st.integers(0, 6)),
    max_size=30,
)


@SETTINGS
@given(runs=runs_strategy)
def test_merge_preserves_the_byte_mapping(runs: list[Run]) -> None:
    merged = merge_runs(runs)
    assert _byte_map(merged) == _byte_map(runs)
    assert all(run.nbytes > 0 for run in merged)
    for left, right in itertools.pairwise(merged):
        contiguous = left.src_offset + left.nbytes == right.src_offset
        assert not (contiguous and left.dst_offset + left.nbytes == right.dst_offset)


def test_merge_examples() -> None:
    assert merge_runs(
        [Run(0, 100, 10), Run(10, 110, 5), Run(15, 200, 5), Run(20, 205, 0), Run(20, 205, 1)]
    ) == [
        Run(0, 100, 15),
        Run(15, 200, 6),
    ]
    assert merge_runs([Run(10, 10, 5), Run(0, 0, 10)]) == [Run(10, 10, 5), Run(0, 0, 10)]  # order is kept
    assert merge_runs([]) == []


@st.composite
def tensor_case(draw: st.DrawFn) -> tuple[list[int], list[int], int, int, int]:
    nbytes = draw(st.integers(0, 40))
    count = draw(st.integers(0, 8))
    src_nbytes = draw(st.integers(nbytes, 400))
    src_offsets = [draw(st.integers(0, src_nbytes - nbytes)) for _ in range(count)]
    # Destinations must not overlap (else the result depends on copy order): distinct slots, maybe adjacent.
    slots = draw(st.permutations(range(count + 2)))[:count]
    gap = draw(st.sampled_from([0, 0, 3]))
    dst_offsets = [slot * (nbytes + gap) for slot in slots]
    dst_nbytes = (count + 2) * (nbytes + gap)
    return src_offsets, dst_offsets, nbytes, src_nbytes, dst_nbytes


@SETTINGS
@given(case=tensor_case(), seed=st.integers(0, 2**32 - 1))
def test_tensor_copy_matches_reference(case: tuple[list[int], list[int], int, int, int], seed: int) -> None:
    src_offsets, dst_offsets, nbytes, src_nbytes, dst_nbytes = case
    src = _random_bytes(src_nbytes, seed)
    dst = _random_bytes(dst_nbytes, seed + 1)
    expected = dst.copy()
    if src_offsets:
        within = np.arange(nbytes)
        expected[(np.array(dst_offsets)[:, None] + within).ravel()] = src[
            (np.array(src_offsets)[:, None] + within).ravel()
        ]
    runs = plan_tensor_copy(src_offsets, dst_offsets, nbytes)
    assert sum(run.nbytes for run in runs) == len(src_offsets) * nbytes
    execute(runs, src, dst)
    np.testing.assert_array_equal(dst, expected)


def test_tensor_copy_merges_contiguous_tensors() -> None:
    assert plan_tensor_copy([0, 64, 128], [1000, 1064, 1128], 64) == [Run(0, 1000, 192)]
    assert plan_tensor_copy([0, 64, 200], [0, 64, 128], 64) == [Run(0, 0, 128), Run(200, 128, 64)]
    with pytest.raises(ValueError):
        plan_tensor_copy([0, 1], [0], 4)


class BlockCase(NamedTuple):
    src_tensor_offsets: list[int]
    dst_tensor_offsets: list[int]
    src_blocks: list[int]
    dst_blocks: list[int]
    src_block_nbytes: int
    dst_block_nbytes: int
    nbytes: int
    src_nbytes: int
    dst_nbytes: int


@st.composite
def block_case(draw: st.DrawFn) -> BlockCase:
    tensors = draw(st.integers(0, 4))
    src_block_nbytes = draw(st.integers(1, 24))
    dst_block_nbytes = draw(st.integers(1, 24))
    nbytes = draw(st.integers(0, min(src_block_nbytes, dst_block_nbytes)))
    src_pool_blocks = draw(st.integers(1, 10))
    dst_pool_blocks = draw(st.integers(1, 10))
    count = draw(st.integers(0, min(src_pool_blocks, dst_pool_blocks)))
    # Source blocks may repeat; destination blocks are distinct so the result does not depend on order.
    src_blocks = draw(st.lists(st.integers(0, src_pool_blocks - 1), min_size=count, max_size=count))
    dst_blocks = draw(st.permutations(range(dst_pool_blocks)))[:count]
    dst_tensor_nbytes = dst_pool_blocks * dst_block_nbytes
    # Source tensors anywhere (even overlapping); destination tensors in distinct slots, maybe adjacent.
    src_tensor_offsets = draw(st.lists(st.integers(0, 50), min_size=tensors, max_size=tensors))
    dst_slots = draw(st.permutations(range(tensors + 1)))[:tensors]
    return BlockCase(
        src_tensor_offsets=src_tensor_offsets,
        dst_tensor_offsets=[slot * dst_tensor_nbytes for slot in dst_slots],
        src_blocks=src_blocks,
        dst_blocks=list(dst_blocks),
        src_block_nbytes=src_block_nbytes,
        dst_block_nbytes=dst_block_nbytes,
        nbytes=nbytes,
        src_nbytes=50 + src_pool_blocks * src_block_nbytes,
        dst_nbytes=(tensors + 1) * dst_tensor_nbytes,
    )


@SETTINGS
@given(case=block_case(), seed=st.integers(0, 2**32 - 1))
def test_block_copy_matches_reference(case: BlockCase, seed: int) -> None:
    src = _random_bytes(case.src_nbytes, seed)
    dst = _random_bytes(case.dst_nbytes, seed + 1)
    expected = dst.copy()
    tensor_src = np.array(case.src_tensor_offsets, dtype=np.int64)
    tensor_dst = np.array(case.dst_tensor_offsets, dtype=np.int64)
    block_src = np.array(case.src_blocks, dtype=np.int64)
    block_dst = np.array(case.dst_blocks, dtype=np.int64)
    within = np.arange(case.nbytes)
    src_index = tensor_src[:, None, None] + block_src[None, :, None] * case.src_block_nbytes + within
    dst_index = tensor_dst[:, None, None] + block_dst[None, :, None] * case.dst_block_nbytes + within
    expected[dst_index.ravel()] = src[src_index.ravel()]

    runs = plan_block_copy(
        case.src_tensor_offsets,
        case.dst_tensor_offsets,
        case.src_blocks,
        case.dst_blocks,
        case.src_block_nbytes,
        case.dst_block_nbytes,
        case.nbytes,
    )
    # Consecutive runs are merged as far as possible, and nothing else is reordered.
    unmerged = [
        Run(int(s), int(d), case.nbytes)
        for s, d in zip(
            (tensor_src[:, None] + block_src[None, :] * case.src_block_nbytes).ravel(),
            (tensor_dst[:, None] + block_dst[None, :] * case.dst_block_nbytes).ravel(),
            strict=True,
        )
    ]
    assert runs == merge_runs(unmerged)
    execute(runs, src, dst)
    np.testing.assert_array_equal(dst, expected)


def test_block_copy_examples_and_errors() -> None:
    # Consecutive blocks of one tensor merge; a new tensor starts a new run unless it also continues.
    assert plan_block_copy([0], [1000], [2, 3, 4, 7], [0, 1, 2, 3], 16, 16, 16) == [
        Run(32, 1000, 48),
        Run(112, 1048, 16),
    ]
    assert plan_block_copy([0, 64], [0, 64], [0, 1, 2, 3], [0, 1, 2, 3], 16, 16, 16) == [Run(0, 0, 128)]
    # Partial blocks never merge.
    assert len(plan_block_copy([0], [0], [0, 1], [0, 1], 16, 16, 8)) == 2
    assert plan_block_copy([0], [0], [], [], 16, 16, 8) == []
    assert plan_block_copy([], [], [1], [1], 16, 16, 8) == []
    for args in (
        ([0, 1], [0], [0], [0], 16, 16, 8),
        ([0], [0], [0, 1], [0], 16, 16, 8),
        ([0], [0], [0], [0], 16, 8, 16),
        ([0], [0], [-1], [0], 16, 16, 8),
        ([0], [0], [0], [0], 16, 16, -1),
    ):
        with pytest.raises(ValueError):
            plan_block_copy(*args)


@SETTINGS
@given(
    runs=st.lists(
        st.builds(Run, st.integers(0, 1000), st.integers(0, 1000), st.integers(0, 300)), max_size=20
    ),
    parts=st.integers(1, 5),
    min_part_nbytes=st.integers(1, 200),
)
def test_split_covers_every_byte_once(runs: list[Run], parts: int, min_part_nbytes: int) -> None:
    split = split_runs(runs, parts, min_part_nbytes=min_part_nbytes)
    total_nbytes = sum(run.nbytes for run in runs)
    assert 1 <= len(split) <= parts
    # In order, the parts together make exactly the same byte mapping.
    assert _byte_map([run for part in split for run in part]) == _byte_map(runs)
    if total_nbytes < 2 * min_part_nbytes:
        assert split == [runs]
    elif len(split) > 1:
        sizes = [sum(run.nbytes for run in part) for part in split]
        assert min(sizes) >= min_part_nbytes
        assert max(sizes) - min(sizes) <= 1


def test_split_examples() -> None:
    runs = [Run(0, 0, 10 << 20), Run(100 << 20, 50 << 20, 6 << 20)]
    assert split_runs(runs, 1) == [runs]
    assert split_runs(runs, 2) == [[Run(0, 0, 8 << 20)], [Run(8 << 20, 8 << 20, 2 << 20), runs[1]]]
    assert len(split_runs(runs, 8)) == 4  # never below min_part_nbytes (4 MiB) a part
    assert split_runs([Run(0, 0, (8 << 20) - 1)], 2) == [[Run(0, 0, (8 << 20) - 1)]]
    assert split_runs([], 4) == [[]]
    with pytest.raises(ValueError):
        split_runs(runs, 0)


def test_check_runs_rejects_out_of_range() -> None:
    check_runs([Run(0, 0, 10), Run(90, 40, 10), Run(100, 50, 0)], 100, 50)
    for bad in (Run(-1, 0, 1), Run(0, -1, 1), Run(0, 0, -1), Run(91, 0, 10), Run(0, 41, 10), Run(101, 0, 0)):
        with pytest.raises(InvalidRange):
            check_runs([Run(0, 0, 1), bad], 100, 50)
    src = np.zeros(100, np.uint8)
    dst = np.ones(50, np.uint8)
    with pytest.raises(InvalidRange):
        execute([Run(0, 0, 10), Run(0, 45, 10)], src, dst)
    assert dst.all()  # checked before the first copy
    with pytest.raises(ValueError):
        execute([], src.reshape(10, 10), dst)
    with pytest.raises(ValueError):
        execute([], src.view(np.int8), dst)


def test_execute_between_segments() -> None:
    data = _random_bytes(3 * 4096 + 1, 7)
    with Segment.create(data.nbytes) as source, Segment.create(5000) as target:
        source.array[:] = data
        with Segment.attach(source.name) as mapped:
            runs = plan_block_copy([1, 4097], [0, 2500], [2, 0], [1, 0], 1000, 1000, 1000)
            execute(runs, mapped.array, target.array)
            np.testing.assert_array_equal(target.view(1000, 1000), data[2001:3001])
            np.testing.assert_array_equal(target.view(0, 1000), data[1:1001])
            np.testing.assert_array_equal(target.view(3500, 1000), data[6097:7097])
            np.testing.assert_array_equal(target.view(2500, 1000), data[4097:5097])
            with pytest.raises(ValueError):
                execute([Run(0, 0, 1)], target.array, mapped.array)  # read-only destination

"""BlockPlan and its executors (gather+scatter `execute_blocks`, one-pass `execute_block_runs`) against an
independent per-block numpy reference, the merged runs of `block_runs`, and the bounds checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist._shm.copyplan import BlockPlan, block_runs, execute_block_runs, execute_blocks
from llm_datadist._shm.errors import InvalidRange


@st.composite
def block_cases(draw: st.DrawFn) -> tuple[BlockPlan, int, int]:
    tensors = draw(st.integers(1, 4))
    src_unit = draw(st.integers(1, 97))
    dst_unit = draw(st.integers(1, 97))
    nbytes = draw(st.integers(1, min(src_unit, dst_unit)))
    src_units_total = draw(st.integers(1, 9))
    dst_units_total = draw(st.integers(1, 9))
    pairs = draw(st.integers(0, min(src_units_total, dst_units_total)))
    src_units = draw(st.permutations(range(src_units_total)))[:pairs]
    dst_units = draw(st.permutations(range(dst_units_total)))[:pairs]
    if draw(st.booleans()):  # ascending units on both sides: consecutive ones merge into longer runs
        src_units, dst_units = sorted(src_units), sorted(dst_units)
    src_span, dst_span = src_units_total * src_unit, dst_units_total * dst_unit
    src_offsets = [t * src_span + draw(st.integers(0, 3)) for t in range(tensors)]
    dst_offsets = [t * dst_span + draw(st.integers(0, 3)) for t in range(tensors)]
    plan = BlockPlan.make(src_offsets, dst_offsets, src_units, dst_units, src_unit, dst_unit, nbytes)
    return plan, tensors * src_span + 3, tensors * dst_span + 3


def reference_blocks(plan: BlockPlan, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """What `dst` must hold after the plan: one slice assignment per unit per tensor, in order."""
    want = dst.copy()
    for src_base, dst_base in zip(plan.src_tensor_offsets, plan.dst_tensor_offsets, strict=True):
        for s, d in zip(plan.src_units.tolist(), plan.dst_units.tolist(), strict=True):
            s0, d0 = src_base + s * plan.src_unit_nbytes, dst_base + d * plan.dst_unit_nbytes
            want[d0 : d0 + plan.nbytes] = src[s0 : s0 + plan.nbytes]
    return want


@settings(max_examples=60, deadline=None)
@given(block_cases(), st.integers(0, 2**32 - 1), st.sampled_from([execute_blocks, execute_block_runs]))
def test_block_executors_match_a_per_block_reference(
    case: tuple[BlockPlan, int, int], seed: int, execute: Any
) -> None:
    plan, src_nbytes, dst_nbytes = case
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, src_nbytes, dtype=np.uint8)
    dst = rng.integers(0, 256, dst_nbytes, dtype=np.uint8)
    want = reference_blocks(plan, src, dst)
    execute(plan, src, dst)
    np.testing.assert_array_equal(dst, want)


def test_block_runs_merge_units_that_continue_on_both_sides() -> None:
    # Units 3,4,5 -> 0,1,2 continue on both sides; 7 -> 3 continues the destination only; 8 -> 9 neither.
    plan = BlockPlan.make([0], [0], [3, 4, 5, 7, 8], [0, 1, 2, 3, 9], 10, 10, 10)
    src, dst, lengths = block_runs(plan)
    assert src.tolist() == [30, 70, 80]
    assert dst.tolist() == [0, 30, 90]
    assert lengths.tolist() == [30, 10, 10]
    # Part of each unit only: never merged, since the bytes between units are not part of the plan.
    partial = BlockPlan.make([0], [0], [0, 1], [0, 1], 10, 10, 6)
    assert block_runs(partial)[2].tolist() == [6, 6]


def test_bounds_are_checked_before_any_byte_moves() -> None:
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, dtype=np.uint8)
    with pytest.raises(InvalidRange):
        execute_blocks(
            BlockPlan.make([0], [0], [0], [9], 10, 10, 10), src, dst[:95]
        )  # dst unit 9 ends at 100
    with pytest.raises(InvalidRange):
        execute_blocks(BlockPlan.make([0], [0], [10], [0], 10, 10, 10), src, dst)
    with pytest.raises(InvalidRange):
        execute_block_runs(BlockPlan.make([0], [0], [10], [0], 10, 10, 10), src, dst)
    assert not dst.any()
    with pytest.raises(ValueError):
        BlockPlan.make([0], [0], [-1], [0], 10, 10, 10)
    with pytest.raises(ValueError):
        BlockPlan.make([0], [0], [0], [0], 10, 10, 11)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(1, 50),
    st.integers(0, 20),
    st.integers(0, 20),
    st.integers(0, 5),
    st.integers(0, 5),
    st.integers(0, 2**32 - 1),
)
def test_strided_copy_matches_runs(
    rows: int, nbytes: int, src_gap: int, dst_gap: int, src0: int, dst0: int, seed: int
) -> None:
    from llm_datadist._shm.copyplan import StridedCopy, execute_strided

    src_offsets = [src0 + i * (nbytes + src_gap) for i in range(rows)]
    dst_offsets = [dst0 + i * (nbytes + dst_gap) for i in range(rows)]
    copy = StridedCopy.from_offsets(src_offsets, dst_offsets, nbytes)
    assert copy is not None
    rng = np.random.default_rng(seed)
    src = rng.integers(0, 256, src_offsets[-1] + nbytes + 3, dtype=np.uint8)
    dst = rng.integers(0, 256, dst_offsets[-1] + nbytes + 3, dtype=np.uint8)
    want = dst.copy()
    for s, d in zip(src_offsets, dst_offsets, strict=True):
        want[d : d + nbytes] = src[s : s + nbytes]
    execute_strided(copy, src, dst)
    np.testing.assert_array_equal(dst, want)
    with pytest.raises(InvalidRange):
        execute_strided(copy, src, dst[: dst_offsets[-1] + nbytes - 1])


def test_uneven_or_overlapping_offsets_have_no_strided_form() -> None:
    from llm_datadist._shm.copyplan import StridedCopy

    assert StridedCopy.from_offsets([0, 10, 25], [0, 10, 20], 5) is None
    assert StridedCopy.from_offsets([0, 4], [0, 10], 5) is None  # source rows would overlap
    assert StridedCopy.from_offsets([7], [9], 5) == StridedCopy(7, 5, 9, 5, 1, 5)


def test_generation_words_change_before_a_slot_is_reused() -> None:
    from llm_datadist._shm.generations import GenerationTable, read_generation
    from llm_datadist._shm.segment import Segment

    table = GenerationTable(capacity=4)
    try:
        reader = Segment.attach(table.name)
        try:
            assert read_generation(reader, 0) == table.version == 1  # word 0: the table's version
            table.bump_version()
            assert read_generation(reader, 0) == 2
            slot, generation = table.acquire()
            assert slot != 0 and read_generation(reader, slot) == generation > 0
            table.retire(slot)
            assert read_generation(reader, slot) == 0
            again, newer = table.acquire()
            assert again == slot and newer != generation  # same word, a generation never seen before
            with pytest.raises(Exception, match="outside"):
                read_generation(reader, 4)
        finally:
            reader.close()
    finally:
        table.close()

"""The Copier's paged paths (kernel scatter-gather, one numpy call per unit, gather+scatter), on one thread
and split over threads, against the per-block reference; and that each path is the one actually taken."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_datadist import _copy
from llm_datadist._copy import Copier
from llm_datadist._shm.copyplan import BlockPlan
from llm_datadist._shm.errors import InvalidRange
from tests.shm.test_shm_blockplan import reference_blocks


def _plan(
    rng: np.random.Generator, tensors: int, pool: int, table: int, unit: int, *, runs: bool
) -> BlockPlan:
    if runs:  # ascending on both sides, so neighbouring units merge into longer runs
        src_units = sorted(rng.choice(pool, table, replace=False).tolist())
        dst_units = sorted(rng.choice(pool, table, replace=False).tolist())
    else:
        src_units = rng.permutation(pool)[:table].tolist()
        dst_units = rng.permutation(pool)[:table].tolist()
    span = pool * unit
    return BlockPlan.make(
        [t * span for t in range(tensors)],
        [t * span for t in range(tensors)],
        src_units,
        dst_units,
        unit,
        unit,
        unit,
    )


@pytest.fixture
def copier() -> Any:
    copier = Copier(threads=2)
    yield copier
    copier.close()


@pytest.mark.parametrize(
    ("unit", "tensors", "table"),
    [
        (16 << 10, 4, 8),  # small: one thread
        (16 << 10, 8, 96),  # 12 MiB: split over both threads
        (256 << 10, 2, 4),  # per-unit numpy copies, one thread
        (256 << 10, 4, 12),  # per-unit numpy copies, two threads
    ],
)
@pytest.mark.parametrize("runs", [False, True])
@pytest.mark.parametrize("kernel", [True, False])
def test_paged_copies_match_the_reference(
    copier: Copier, unit: int, tensors: int, table: int, runs: bool, kernel: bool
) -> None:
    rng = np.random.default_rng(unit + tensors + table)
    plan = _plan(rng, tensors, 2 * table, table, unit, runs=runs)
    src = rng.integers(0, 256, tensors * 2 * table * unit, dtype=np.uint8)
    dst = rng.integers(0, 256, src.size, dtype=np.uint8)
    want = reference_blocks(plan, src, dst)
    copier._kernel_copies = kernel
    copier.run_blocks(plan, src, dst)
    np.testing.assert_array_equal(dst, want)
    assert copier._kernel_copies is kernel  # the kernel accepted every copy it was asked for


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 40), st.integers(1, 4096), st.booleans(), st.integers(0, 2**32 - 1))
def test_any_small_paged_plan_through_the_kernel_matches(
    tensors: int, table: int, unit: int, runs: bool, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    plan = _plan(rng, tensors, table + 3, table, unit, runs=runs)
    src = rng.integers(0, 256, tensors * (table + 3) * unit, dtype=np.uint8)
    dst = rng.integers(0, 256, src.size, dtype=np.uint8)
    want = reference_blocks(plan, src, dst)
    copier = Copier(threads=1)
    copier.run_blocks(plan, src, dst)
    np.testing.assert_array_equal(dst, want)
    assert copier._kernel_copies


def test_each_path_is_the_one_taken(copier: Copier, monkeypatch: pytest.MonkeyPatch) -> None:
    taken: list[str] = []
    monkeypatch.setattr(_copy, "read_from_arrays", _spy(taken, "kernel", _copy.read_from_arrays))
    monkeypatch.setattr(_copy, "execute_block_runs", _spy(taken, "per-unit", _copy.execute_block_runs))
    monkeypatch.setattr(_copy, "execute_blocks", _spy(taken, "gather", _copy.execute_blocks))
    rng = np.random.default_rng(0)
    src = np.zeros(8 << 20, dtype=np.uint8)
    dst = np.zeros(8 << 20, dtype=np.uint8)

    def path(plan: BlockPlan, into: np.ndarray) -> set[str]:
        taken.clear()
        copier.run_blocks(plan, src, into)
        return set(taken)

    assert path(_plan(rng, 1, 16, 4, 64 << 10, runs=False), dst) == {"kernel"}
    assert path(_plan(rng, 1, 16, 4, 256 << 10, runs=False), dst) == {"per-unit"}
    # Source and destination in one array: units could overlap, so gather everything first.
    assert path(_plan(rng, 1, 8, 4, 64 << 10, runs=False), src[: 4 << 20]) == {"gather"}
    copier._kernel_copies = False  # as after the kernel refused a copy
    assert path(_plan(rng, 1, 16, 4, 64 << 10, runs=False), dst) == {"gather"}


def test_a_plan_past_the_arrays_moves_nothing(copier: Copier) -> None:
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, dtype=np.uint8)
    with pytest.raises(InvalidRange):
        copier.run_blocks(BlockPlan.make([0], [0], [0, 1], [0, 9], 10, 10, 10), src, dst[:95])
    assert not dst.any()


def _spy(taken: list[str], label: str, function: Any) -> Any:
    def spy(*args: Any, **kwargs: Any) -> Any:
        taken.append(label)
        return function(*args, **kwargs)

    return spy


def test_memory_vanishing_under_a_mapping_is_an_error_not_a_crash(copier: Copier) -> None:
    """A segment its owner truncates after we mapped it: a numpy copy of the lost pages would die of
    SIGBUS; the kernel path reports EFAULT, which becomes a ShmError (LLM_FAILED at the API)."""
    import os

    import posix_ipc

    from llm_datadist._shm.errors import ShmError
    from llm_datadist._shm.segment import Segment

    segment = Segment.create(1 << 20)
    try:
        dst = np.zeros(1 << 20, dtype=np.uint8)
        shm = posix_ipc.SharedMemory(segment.name)
        os.ftruncate(shm.fd, 4096)
        shm.close_fd()
        plan = BlockPlan.make([0], [0], [8], [8], 16 << 10, 16 << 10, 16 << 10)  # 128 KiB in: gone now
        with pytest.raises(ShmError, match="copying blocks"):
            copier.run_blocks(plan, segment.array, dst)
        assert copier._kernel_copies  # a lost page is not the kernel refusing the call
    finally:
        segment.close()
